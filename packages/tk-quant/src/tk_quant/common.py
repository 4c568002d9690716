"""Helpers shared by the tk-quant ops: formats, QuantTensor inputs, scale-factor (SF) outputs.

API (import from ``tk_quant.common``):

- ``QuantTensor``: the alias ``tuple[torch.Tensor, torch.Tensor]`` = ``(data, sf)``.
- ``FMT_DTYPE`` / ``FMT_MAX``: storage dtype and largest finite value of each cast output format
  (``"e4m3"`` float8_e4m3fn, ``"e2m1"`` int8 with two codes per byte, ``"e5m6"`` uint8 words).
- ``data_fmt(data)``: ``"e4m3"`` / ``"e2m1"`` / ``"e5m6"`` from a data tensor's dtype.
- ``logical_hidden(data)`` / ``physical_hidden(fmt, h)``: FP4 data has ``h/2`` bytes per row, E5M6 ``3h/2``.
- ``amax_clamp(fmt, use_e4m3_sf)``: the amax floor (``tk_core.config``) of an output format.
- ``sf_out_layout(op, col, packed, round_sf, use_e4m3_sf)``: the flags (Python bools) -> ``"row"|"col"|"packed"``,
  rejecting packed without col-major or without ``round_sf`` and e4m3 scales with ``round_sf`` or packing.
- ``stochastic_seed(op, fmt, stochastic_rounding, seed)``: the checked 32-bit seed of a cast with stochastic
  rounding (``None`` without it; the flag a Python bool); ``seed=None`` draws one from torch's default CPU generator.
- ``check_block_pair(op, arg, block)``: ``block`` as a pair of ints ``(bm, bk)`` (not bools), else ``TypeError``.
- ``alloc_data(fmt, t, h, device)``: the contiguous data output of a cast; ``data_out(op, out, fmt, t, h,
  device)``: that, or the caller's preallocated ``out`` once checked (dtype, shape, contiguous, 16-byte aligned,
  device); ``data_from_reference(op, out, data, fmt, t, h, device)``: the reference's data, or ``out`` holding it.
- ``alloc_sf_out(nm, nk, layout, device, e4m3_sf=False)``: the SF output (``tk_core.layout.alloc_sf``; with
  ``e4m3_sf`` a float8_e4m3fn ``(nm, nk)``, row-major, or column-major with 16-byte aligned columns).
- ``sf_kind(sf)``: ``"fp32"`` (any strides), ``"packed"`` (int32 UE8M0) or ``"e4m3"`` (float8_e4m3fn scales).
- ``decode_sf(sf, nm, nk)``: any SF -> contiguous float32 ``(nm, nk)`` (UE8M0 byte ``e`` -> ``2**(e-127)``).
- ``sf_kernel_args(sf)``: ``(flat, s0, s1)`` for kernels: a contiguous 1-D view of the SF storage and the
  element strides of the logical ``(nm, nk)`` SF; for packed SF ``flat`` is bytes and the byte of block
  ``(m, k)`` is at ``4*(m*s0 + (k//4)*s1) + k%4``.
- ``check_quant_input(op, x, x_block_size)``: validates a QuantTensor ``(data, sf)`` against its block size and
  returns a ``QuantInput`` (fmt, logical T and H, block, SF kind). Column-major SF means
  ``stride(0) == 1 and stride(1) != 1`` (``tk_core.layout.sf_layout_of``), so a row-major ``(N, 1)`` is row-major.
- ``dequantize(q)``: the float32 values ``decode(data) * sf`` of a ``QuantInput`` (reference use).
- ``unpack_from_e2m1fn_x2(x, out_dtype=torch.float32)``: public FP4 decoder, ``(..., K)`` bytes -> ``(..., 2K)``
  of a floating dtype in ``UNPACK_DTYPES``.
- ``scratch(device, dtype, n=16)``: a cached tensor for a kernel argument whose contents nobody reads.
"""

from dataclasses import dataclass

import torch

from tk_core import config
from tk_core.checks import check_bool, check_dtype, check_ndim, fail
from tk_core.formats import FORMAT_MAX, SR_FORMATS, decode_e2m1, unpack_e2m1
from tk_core.layout import align, alloc_sf, ceil_div, sf_layout, sf_layout_of, sf_to_row_major

QuantTensor = tuple[torch.Tensor, torch.Tensor]

FMT_DTYPE = {"e4m3": torch.float8_e4m3fn, "e2m1": torch.int8, "e5m6": torch.uint8}
FMT_MAX = dict(FORMAT_MAX)
OUT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
UNPACK_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # hold every e2m1 value exactly
_DATA_FMT = {torch.float8_e4m3fn: "e4m3", torch.int8: "e2m1", torch.uint8: "e5m6"}


def data_fmt(data: torch.Tensor) -> str:
    return _DATA_FMT[data.dtype]


def physical_hidden(fmt: str, h: int) -> int:
    if fmt == "e2m1":
        return h // 2
    if fmt == "e5m6":
        return h * 3 // 2
    return h


def logical_hidden(data: torch.Tensor) -> int:
    n = data.shape[-1]
    if data.dtype == torch.int8:
        return 2 * n
    if data.dtype == torch.uint8:
        return n * 2 // 3
    return n


def amax_clamp(fmt: str, use_e4m3_sf: bool = False) -> float:
    return config.get_amax_clamp(f"{fmt}_e4m3sf" if use_e4m3_sf else fmt)


def sf_out_layout(op: str, col: bool, packed: bool, round_sf: bool, use_e4m3_sf: bool = False) -> str:
    check_bool(op, "use_tma_aligned_col_major_sf", col)
    check_bool(op, "use_packed_ue8m0", packed)
    check_bool(op, "round_sf", round_sf)
    check_bool(op, "use_e4m3_sf", use_e4m3_sf)
    if use_e4m3_sf:
        if round_sf:
            fail(op, "round_sf", "False when use_e4m3_sf=True (e4m3 scales are not powers of two)", True)
        if packed:
            fail(op, "use_packed_ue8m0", "False when use_e4m3_sf=True", True)
    return sf_layout(op, col, packed, round_sf)


def stochastic_seed(op: str, fmt: str, stochastic_rounding: bool, seed) -> int | None:
    check_bool(op, "stochastic_rounding", stochastic_rounding)
    if not stochastic_rounding:
        if seed is not None:
            fail(op, "seed", "None unless stochastic_rounding=True", seed)
        return None
    if fmt not in SR_FORMATS:
        fail(op, "fmt", f"one of {SR_FORMATS} with stochastic_rounding=True", repr(fmt))
    if seed is None:  # a fresh seed per call that follows torch.manual_seed (a host draw, no device sync)
        return int(torch.randint(0, 2**32, (), dtype=torch.int64))
    if not isinstance(seed, int) or isinstance(seed, bool):
        fail(op, "seed", "an int or None", type(seed).__name__, TypeError)
    if not 0 <= seed < 2**32:
        fail(op, "seed", "in [0, 2**32)", seed)
    return seed


def alloc_data(fmt: str, t: int, h: int, device) -> torch.Tensor:
    return torch.empty((t, physical_hidden(fmt, h)), dtype=FMT_DTYPE[fmt], device=device)


def data_out(op: str, out, fmt: str, t: int, h: int, device) -> torch.Tensor:
    if out is None:
        return alloc_data(fmt, t, h, device)
    shape = (t, physical_hidden(fmt, h))
    if not isinstance(out, torch.Tensor):
        fail(op, "out", "a torch.Tensor or None", type(out).__name__, TypeError)
    check_dtype(op, "out", out, FMT_DTYPE[fmt])
    if tuple(out.shape) != shape or not out.is_contiguous() or out.device != device or out.data_ptr() % 16:
        fail(op, "out", f"a contiguous 16-byte aligned tensor of shape {shape} on {device}",
             f"shape {tuple(out.shape)}, strides {tuple(out.stride())} on {out.device}")
    return out


def data_from_reference(op: str, out, data: torch.Tensor, fmt: str, t: int, h: int, device) -> torch.Tensor:
    """The CPU path of a cast with ``out=``: the reference's ``data``, or ``out`` (checked as by ``data_out``)
    holding it."""
    return data if out is None else data_out(op, out, fmt, t, h, device).copy_(data)


def alloc_sf_out(nm: int, nk: int, layout: str, device, e4m3_sf: bool = False) -> torch.Tensor:
    if not e4m3_sf:
        return alloc_sf(nm, nk, layout, device)
    if layout == "row":
        return torch.empty((nm, nk), dtype=torch.float8_e4m3fn, device=device)
    return torch.empty((nk, align(nm, 16)), dtype=torch.float8_e4m3fn, device=device)[:, :nm].t()


def sf_kind(sf: torch.Tensor) -> str:
    if sf.dtype == torch.int32:
        return "packed"
    if sf.dtype == torch.float8_e4m3fn:
        return "e4m3"
    return "fp32"


def decode_sf(sf: torch.Tensor, nm: int, nk: int) -> torch.Tensor:
    """Any SF (fp32 row/col, packed UE8M0, e4m3) -> contiguous float32 ``(nm, nk)``."""
    if sf.dtype == torch.int32 and sf_layout_of(sf) == "packed":
        return sf_to_row_major(sf, nk)[:nm]
    return sf.float().contiguous()[:nm, :nk]


def sf_kernel_args(sf: torch.Tensor):
    """``(flat, s0, s1)``: a contiguous 1-D view of the SF's storage and its element strides."""
    s0, s1 = sf.stride()
    extent = 1 + sum((n - 1) * s for n, s in zip(sf.shape, sf.stride()) if n > 0)
    flat = sf.as_strided((extent,), (1,))
    if sf.dtype == torch.int32:
        flat = flat.view(torch.uint8)
    return flat, s0, s1


@dataclass
class QuantInput:
    data: torch.Tensor
    sf: torch.Tensor
    fmt: str  # "e4m3" | "e2m1" | "e5m6"
    t: int
    h: int  # logical hidden
    block: tuple[int, int]
    kind: str  # sf_kind

    @property
    def nm(self) -> int:
        return ceil_div(self.t, self.block[0])

    @property
    def nk(self) -> int:
        return ceil_div(self.h, self.block[1])


def check_block_pair(op: str, arg: str, block) -> tuple[int, int]:
    """``block`` as ``(bm, bk)``: a tuple or list of two ints (not bools; a float or a string is not truncated
    or parsed), else ``TypeError``. The values are the caller's to check."""
    if (
        not isinstance(block, (tuple, list))
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) for b in block)
    ):
        fail(op, arg, "a pair of ints (bm, bk)", repr(block), TypeError)
    bm, bk = block
    return bm, bk


def check_quant_input(op: str, x, x_block_size, data_fmts=("e4m3", "e2m1")) -> QuantInput:
    """Validates ``x = (data, sf)`` with block ``x_block_size = (bm, bk)``; returns a ``QuantInput``."""
    if not (isinstance(x, (tuple, list)) and len(x) == 2):
        fail(op, "x", "a QuantTensor (data, sf)", type(x).__name__, TypeError)
    data, sf = x
    allowed = tuple(FMT_DTYPE[f] for f in data_fmts)
    check_dtype(op, "x[0] (data)", data, allowed)
    check_ndim(op, "x[0] (data)", data, 2)
    if data.dtype == torch.uint8 and data.shape[1] % 3:  # before any shape derived from the logical hidden size
        fail(op, "x[0] (data)", "of width 3*H/2 (packed E5M6)", f"shape {tuple(data.shape)}")
    check_dtype(op, "x[1] (sf)", sf, (torch.float32, torch.int32, torch.float8_e4m3fn))
    check_ndim(op, "x[1] (sf)", sf, 2)
    if x_block_size is None:
        fail(op, "x_block_size", "a (bm, bk) tuple for a QuantTensor input", None)
    bm, bk = check_block_pair(op, "x_block_size", x_block_size)
    if bm <= 0 or bk <= 0:
        fail(op, "x_block_size", "a tuple of two positive ints", repr(x_block_size))
    if data.shape[-1] and data.stride(-1) != 1:
        fail(op, "x[0] (data)", "unit-stride in its last dimension", f"strides {tuple(data.stride())}")
    if sf.device != data.device:
        fail(op, "x[1] (sf)", f"on device {data.device}", f"device {sf.device}")
    fmt = data_fmt(data)
    t, h = data.shape[0], logical_hidden(data)
    nm, nk = ceil_div(t, bm), ceil_div(h, bk)
    kind = sf_kind(sf)
    want = (nm, ceil_div(nk, 4)) if kind == "packed" else (nm, nk)
    if tuple(sf.shape) != want:
        fail(op, "x[1] (sf)", f"of shape {want} for {t} x {h} data and block {(bm, bk)}", f"shape {tuple(sf.shape)}")
    return QuantInput(data, sf, fmt, t, h, (bm, bk), kind)


def expand_sf(sf_rows: torch.Tensor, t: int, h: int, bm: int, bk: int) -> torch.Tensor:
    """Row-major ``(nm, nk)`` scales -> ``(t, h)``, each scale repeated over its block and cropped."""
    return sf_rows.repeat_interleave(bm, dim=0)[:t].repeat_interleave(bk, dim=1)[:, :h]


def decode_data(data: torch.Tensor) -> torch.Tensor:
    """e4m3 or packed e2m1 data -> float32 (exact)."""
    if data.dtype == torch.int8:
        return decode_e2m1(unpack_e2m1(data))
    return data.float()


def dequantize(q: QuantInput) -> torch.Tensor:
    """``decode(data) * s_in`` in float32, shape ``(t, h)``."""
    s = expand_sf(decode_sf(q.sf, q.nm, q.nk), q.t, q.h, *q.block)
    return decode_data(q.data) * s


def unpack_from_e2m1fn_x2(x: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decodes packed FP4 (e2m1) bytes ``(..., K)`` (int8 or uint8) into ``(..., 2K)`` values of ``out_dtype``.

    Output element ``2j`` comes from the low nibble of byte ``j`` and ``2j+1`` from the high nibble; a nibble
    ``s e1 e0 m`` decodes to ``(-1)^s * 0.5 * m`` when ``e == 0``, else ``(-1)^s * 2^(e-1) * (1 + m/2)``.
    ``out_dtype`` is one of ``UNPACK_DTYPES`` (float32, bfloat16, float16, float64: each holds every value exactly).
    Raises TypeError for other dtypes of ``x`` or ``out_dtype`` and ValueError for a 0-d tensor.
    """
    op = "unpack_from_e2m1fn_x2"
    check_dtype(op, "x", x, (torch.int8, torch.uint8))
    if not isinstance(out_dtype, torch.dtype) or out_dtype not in UNPACK_DTYPES:
        fail(op, "out_dtype", f"one of {UNPACK_DTYPES}", repr(out_dtype), TypeError)
    if x.dim() == 0:
        fail(op, "x", "at least 1-D", "a 0-d tensor")
    return decode_e2m1(unpack_e2m1(x)).to(out_dtype)


_scratch: dict = {}  # (device, dtype) -> the largest scratch tensor handed out
_retired: list = []  # the ones a larger request replaced


def scratch(device, dtype: torch.dtype, n: int = 16) -> torch.Tensor:
    """A cached 1-D tensor of at least ``n`` elements for a kernel argument whose contents nobody reads: an input
    or output the launch's mode does not touch, error counts no caller asked for. ``torch.empty`` costs ~9 us of
    host time per call on the H200's host (``shared/benchmarks/probe_host_time.py``). Launches on any stream may
    write it at the same time (nobody reads it), so it is never freed: one that a larger request replaces stays
    alive. Call it from a device op's implementation, which ``torch.compile`` does not trace."""
    key = (device, dtype)
    buf = _scratch.get(key)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _retired.append(buf)
        buf = _scratch[key] = torch.empty(max(n, 16), dtype=dtype, device=device)
    return buf
