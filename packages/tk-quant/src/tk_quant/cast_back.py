"""Cast back (dequantization): ``out[t, j] = round_out(decode(data[t, j]) * s[t // bm, j // bk])``.

Inputs: a QuantTensor ``x = (data, sf)`` with block ``x_block_size = (bm, bk)`` (any positive sizes):
data e4m3 ``(T, H)``, packed e2m1 int8 ``(T, H/2)`` (element ``2j`` in the low nibble of byte ``j``) or, with
``x_special_fmt='e5m6'``, packed E5M6 uint8 ``(T, 3H/2)``; rows may be strided (unit inner stride). ``sf`` has
logical shape ``(ceil(T/bm), ceil(H/bk))`` as float32 (row- or column-major, any strides), float8_e4m3fn
scales, or packed UE8M0 int32 ``(ceil(T/bm), ceil(ceil(H/bk)/4))`` (byte ``e`` -> ``2**(e-127)``).
``fmt`` is ``'bf16'`` or ``'fp32'``: the product is computed in fp32 (one multiply), then rounded to bf16
with RNE (identity for fp32). Needs ``H % 16 == 0``. ``T == 0`` returns an empty tensor without a launch.

Errors: TypeError for wrong types/dtypes, ValueError for bad ``fmt``/``x_special_fmt``, block sizes,
shapes, an ``out`` that overlaps ``x`` in memory. CPU tensors run ``tk_quant.reference.cast_back`` /
``cast_back_from_e5m6``.

Kernel: registers only. A thread handles ``units`` 16-byte output vectors (4 fp32 / 8 bf16 values) with lane
``l`` of a warp on vector ``32*k + l``, so each warp store writes 512 contiguous bytes (coalesced); it issues
all its loads (2-8 bytes per vector; e5m6: two or three words) before decoding; threads whose vectors are all
in range run a copy without bound checks, which keeps those loads together. Token count and strides are
runtime values.
"""

import tilelang.language as T
import torch

from tk_core.checks import check_disjoint, check_positive_int, fail
from tk_core.jit import kernel
from tk_core.layout import vector_aligned
from tk_core.library import device_op

from . import reference
from .common import OUT_DTYPES, check_quant_input, sf_kernel_args, sf_kind
from .per_token_cast import _decode_e2m1, _load_sf

_PASS = {"tl.disable_safe_memory_legalize": True}
_SF_DTYPE = {"fp32": "float32", "packed": "uint8", "e4m3": "float8_e4m3fn"}
_DATA_DTYPE = {"e4m3": "float8_e4m3fn", "e2m1": "int8", "e5m6": "int32"}


def _e5m6_code(xr, j: int, i: int):
    """Code ``i`` (0..7) of the ``j``-th group of three little-endian words in ``xr`` (uint32 expression)."""
    w0, w1, w2 = (T.reinterpret(xr[j * 3 + n], "uint32") for n in range(3))
    if i == 0:
        return T.shift_right(w0, 20)
    if i == 1:
        return T.bitwise_and(T.shift_right(w0, 8), T.uint32(0xFFF))
    if i == 2:
        return T.bitwise_or(T.shift_left(T.bitwise_and(w0, T.uint32(0xFF)), 4), T.shift_right(w1, 28))
    if i == 3:
        return T.bitwise_and(T.shift_right(w1, 16), T.uint32(0xFFF))
    if i == 4:
        return T.bitwise_and(T.shift_right(w1, 4), T.uint32(0xFFF))
    if i == 5:
        return T.bitwise_or(T.shift_left(T.bitwise_and(w1, T.uint32(0xF)), 8), T.shift_right(w2, 24))
    if i == 6:
        return T.bitwise_and(T.shift_right(w2, 12), T.uint32(0xFFF))
    return T.bitwise_and(w2, T.uint32(0xFFF))


def _e5m6_half_codes(wa, w1, h):
    """The 4 codes of half ``h`` (0 or 1) of a 3-word group, from word ``2h`` (``wa``) and word 1 (``w1``).

    Codes run most-significant first through the 96 bits ``w0 w1 w2``, so either half is a 48-bit run
    ``hi:lo16`` (half 0: ``w0 : w1[31:16]``, half 1: ``w1[15:0] w2[31:16] : w2[15:0]``), selected without a branch."""
    hi = T.if_then_else(h == 1, T.bitwise_or(T.shift_left(w1, 16), T.shift_right(wa, 16)), wa)
    lo = T.if_then_else(h == 1, T.bitwise_and(wa, T.uint32(0xFFFF)), T.shift_right(w1, 16))
    return (
        T.shift_right(hi, 20),
        T.bitwise_and(T.shift_right(hi, 8), T.uint32(0xFFF)),
        T.bitwise_or(T.shift_left(T.bitwise_and(hi, T.uint32(0xFF)), 4), T.shift_right(lo, 12)),
        T.bitwise_and(lo, T.uint32(0xFFF)),
    )


def _e5m6_to_float(code):
    """The exact float32 value of a 12-bit code: the code is the top 12 bits of an fp16."""
    h = T.cast(T.shift_left(code, 4), "uint16")
    return T.cast(T.call_extern("float16", "__ushort_as_half", h), "float32")


@kernel(pass_configs=_PASS)
def cast_back_kernel(fmt: str, out_dtype: str, hidden: int, bm: int, bk: int, sf: str = "fp32", threads: int = 128,
                     units: int = 2, split: bool = True, min_blocks: int = 0):
    """A unit is one 16-byte output vector (4 fp32 / 8 bf16 values). Unit ``(bx*units + j)*threads + tx`` is
    thread ``tx``'s ``j``-th, so each warp store covers 512 contiguous bytes; all loads are issued first.
    ``split``: a copy without bound checks for threads whose units are all in range. ``min_blocks``: CTAs per
    SM the registers must allow (0: a full SM, 2048 threads, for ``units <= 2``; 1: no cap)."""
    t = T.dynamic("num_tokens")
    xs = T.dynamic("x_stride")
    nsf, ny = T.dynamic("nsf"), T.dynamic("ny")
    ow = 4 if out_dtype == "float32" else 8
    nu = hidden // ow  # units per row (even: hidden % 16 == 0)
    hp = {"e4m3": hidden, "e2m1": hidden // 2, "e5m6": hidden * 3 // 8}[fmt]
    # input elements per unit: e5m6 -> bf16 reads a whole 3-word group, -> fp32 two of its words
    vin = {"e4m3": ow, "e2m1": ow // 2, "e5m6": 3 if ow == 8 else 2}[fmt]
    lw = 1 if fmt == "e5m6" else vin  # one vector load per unit (e5m6: word loads, 12-byte lane stride)
    one_scale = bk % ow == 0
    lanes = list(range(ow))  # a Python list: the loop over a vector's values unrolls while tracing (int indices)

    @T.prim_func
    def main(
        X: T.StridedTensor((t, hp), (xs, 1), _DATA_DTYPE[fmt]),
        SF: T.Tensor((nsf,), _SF_DTYPE[sf]),
        Y: T.Tensor((ny,), out_dtype),
        s0: T.int32,
        s1: T.int32,
    ):
        with T.Kernel(T.ceildiv(t * nu, threads * units), threads=threads) as bx:
            T.assume(xs % lw == 0)
            if (min_blocks or (2048 // threads if units <= 2 else 1)) > 1:
                # the split copy of 2 units takes up to 40 registers alone (6 CTAs of 256 threads); 32 keep 64 warps
                T.annotate_min_blocks_per_sm(min_blocks or 2048 // threads)
            tx = T.get_thread_binding()
            # int32 row / column of each unit: as expressions they would be widened to int64 (slow 64-bit div/mod)
            rows = T.alloc_local((units,), "int32")
            qs = T.alloc_local((units,), "int32")
            xr = T.alloc_local((units * vin,), _DATA_DTYPE[fmt])
            yv = T.alloc_local((units * ow,), out_dtype)
            # Threads whose units are all in range run a copy without per-unit checks: with them nvcc sinks each
            # unit's loads into its guarded decode block, so a thread has one unit's loads in flight at a time.
            last = (bx * units + units - 1) * threads + tx
            for tail in (False, True) if split else (True,):  # a Python loop: one traced copy per case
                if not split or (last >= t * nu if tail else last < t * nu):
                    for j in T.unroll(units):
                        u = (bx * units + j) * threads + tx
                        rows[j] = T.truncdiv(u, nu)
                        qs[j] = u - rows[j] * nu
                        row = rows[j]
                        q = qs[j]
                        if not tail or u < t * nu:
                            if fmt == "e5m6" and ow == 4:
                                g3 = T.shift_right(q, 1) * 3
                                xr[j * 2] = X[row, g3 + T.bitwise_and(q, 1) * 2]
                                xr[j * 2 + 1] = X[row, g3 + 1]
                            elif fmt == "e5m6":
                                for n in T.unroll(3):
                                    xr[j * 3 + n] = X[row, q * 3 + n]
                            else:
                                for i in T.vectorized(vin):
                                    xr[j * vin + i] = X[row, q * vin + i]
                    for j in T.unroll(units):
                        u = (bx * units + j) * threads + tx
                        row = rows[j]
                        q = qs[j]
                        col = q * ow
                        if not tail or u < t * nu:
                            if one_scale:
                                s = _load_sf(sf, SF, T.truncdiv(row, bm), T.truncdiv(col, bk), s0, s1)
                            if fmt == "e5m6" and ow == 4:
                                codes = _e5m6_half_codes(T.reinterpret(xr[j * 2], "uint32"),
                                                         T.reinterpret(xr[j * 2 + 1], "uint32"), T.bitwise_and(q, 1))
                            for i in lanes:
                                if fmt == "e4m3":
                                    xv = T.cast(xr[j * vin + i], "float32")
                                elif fmt == "e2m1":
                                    xv = _decode_e2m1(T.cast(xr[j * vin + i // 2], "int32"), i % 2)
                                elif ow == 4:
                                    xv = _e5m6_to_float(codes[i])
                                else:
                                    xv = _e5m6_to_float(_e5m6_code(xr, j, i))
                                if not one_scale:
                                    s = _load_sf(sf, SF, T.truncdiv(row, bm), T.truncdiv(col + i, bk), s0, s1)
                                yv[j * ow + i] = T.cast(xv * s, out_dtype)
                            for i in T.vectorized(ow):
                                Y[u * ow + i] = yv[j * ow + i]

    return main


@device_op("tk_quant::cast_back", mutates_args=("out",))
def _cast_back_op(data: torch.Tensor, sf: torch.Tensor, out: torch.Tensor, bm: int, bk: int, special: str) -> None:
    fmt = "e5m6" if special == "e5m6" else ("e2m1" if data.dtype == torch.int8 else "e4m3")
    if fmt == "e5m6":
        data = vector_aligned(data, 8).view(torch.int32)
    else:
        data = vector_aligned(data, 8 if data.dtype == torch.int8 else 16)
    hidden = out.shape[1]
    out_dtype = "float32" if out.dtype == torch.float32 else "bfloat16"
    k = cast_back_kernel.get(data.device, fmt=fmt, out_dtype=out_dtype, hidden=hidden, bm=bm, bk=bk, sf=sf_kind(sf))
    flat, s0, s1 = sf_kernel_args(sf)
    k(data, flat, out.view(-1), s0, s1)


def cast_back(x, fmt: str, x_block_size, x_special_fmt: str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantizes ``x = (data, sf)`` with scale block ``x_block_size`` to ``fmt`` ('bf16' or 'fp32').

    ``x_special_fmt='e5m6'`` reads packed E5M6 data. ``out`` (optional) is a preallocated contiguous
    ``(T, H)`` output. See the module docstring for the math, layouts and errors.
    """
    op = "cast_back"
    if not isinstance(fmt, str):  # (before the dict lookup: an unhashable value would fail there)
        fail(op, "fmt", "a str, one of ('bf16', 'fp32')", f"{fmt!r} ({type(fmt).__name__})", TypeError)
    if fmt not in OUT_DTYPES:
        fail(op, "fmt", "one of ('bf16', 'fp32')", repr(fmt))
    if x_special_fmt not in (None, "e5m6"):
        fail(op, "x_special_fmt", "None or 'e5m6'", repr(x_special_fmt))
    data_fmts = ("e5m6",) if x_special_fmt == "e5m6" else ("e4m3", "e2m1")
    q = check_quant_input(op, x, x_block_size, data_fmts=data_fmts)
    if q.h % 16:
        fail(op, "hidden", "a multiple of 16", q.h)
    dtype = OUT_DTYPES[fmt]
    if out is not None:
        if not isinstance(out, torch.Tensor):
            fail(op, "out", "a torch.Tensor or None", type(out).__name__, TypeError)
        if out.dtype != dtype or tuple(out.shape) != (q.t, q.h) or not out.is_contiguous() or out.device != q.data.device:
            fail(op, "out", f"a contiguous {dtype} tensor of shape {(q.t, q.h)} on {q.data.device}",
                 f"{out.dtype} of shape {tuple(out.shape)} on {out.device}")
        check_disjoint(op, "out", out, "x's data", q.data)
        check_disjoint(op, "out", out, "x's sf", q.sf)
    if q.data.device.type != "cuda":
        if x_special_fmt == "e5m6":
            res = reference.cast_back_from_e5m6(x, fmt, x_block_size)
        else:
            res = reference.cast_back(x, fmt, x_block_size)
        return res if out is None else out.copy_(res)
    if out is None:
        out = torch.empty((q.t, q.h), dtype=dtype, device=q.data.device)
    if q.t:
        _cast_back_op(q.data, q.sf, out, q.block[0], q.block[1], x_special_fmt or "")
    return out


def per_token_cast_back(x, fmt: str, num_per_channels: int, x_special_fmt: str | None = None,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """``cast_back(x, fmt, (1, num_per_channels), x_special_fmt)``."""
    check_positive_int("per_token_cast_back", "num_per_channels", num_per_channels)
    return cast_back(x, fmt, (1, num_per_channels), x_special_fmt, out=out)


def cast_back_e5m6(x, fmt: str, x_block_size, out: torch.Tensor | None = None) -> torch.Tensor:
    """E5M6 cast back: ``cast_back(x, fmt, x_block_size, x_special_fmt='e5m6')``."""
    return cast_back(x, fmt, x_block_size, "e5m6", out=out)
