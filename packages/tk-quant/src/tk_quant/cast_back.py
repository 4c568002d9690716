"""Cast back (dequantization): ``out[t, j] = round_out(decode(data[t, j]) * s[t // bm, j // bk])``.

Inputs: a QuantTensor ``x = (data, sf)`` with block ``x_block_size = (bm, bk)`` (any positive sizes):
data e4m3 ``(T, H)``, packed e2m1 int8 ``(T, H/2)`` (element ``2j`` in the low nibble of byte ``j``) or, with
``x_special_fmt='e5m6'``, packed E5M6 uint8 ``(T, 3H/2)``; rows may be strided (unit inner stride). ``sf`` has
logical shape ``(ceil(T/bm), ceil(H/bk))`` as float32 (row- or column-major, any strides), float8_e4m3fn
scales, or packed UE8M0 int32 ``(ceil(T/bm), ceil(ceil(H/bk)/4))`` (byte ``e`` -> ``2**(e-127)``).
``fmt`` is ``'bf16'`` or ``'fp32'``: the product is computed in fp32 (one multiply), then rounded to bf16
with RNE (identity for fp32). Needs ``H % 16 == 0``. ``T == 0`` returns an empty tensor without a launch.

Errors: TypeError for wrong types/dtypes, ValueError for bad ``fmt``/``x_special_fmt``, block sizes,
shapes. CPU tensors run ``tk_quant.reference.cast_back`` / ``cast_back_from_e5m6``.

Kernel: registers only. Each thread decodes 16 (e4m3, e5m6) or 32 (e2m1) consecutive elements from one
16-byte (e5m6: 24-byte) load, reads its scale once when ``bk`` is a multiple of that width (else one per
element) and writes 16-byte vectors. Token count and strides are runtime values.
"""

import tilelang.language as T
import torch

from tk_core.checks import fail
from tk_core.jit import kernel
from tk_core.layout import vector_aligned
from tk_core.library import device_op

from . import reference
from .common import OUT_DTYPES, check_quant_input, sf_kernel_args, sf_kind
from .per_token_cast import _decode_e2m1, _load_sf

_PASS = {"tl.disable_safe_memory_legalize": True}
_SF_DTYPE = {"fp32": "float32", "packed": "uint8", "e4m3": "float8_e4m3fn"}
_DATA_DTYPE = {"e4m3": "float8_e4m3fn", "e2m1": "int8", "e5m6": "int32"}


def _vec(fmt: str, hidden: int) -> int:
    return 32 if fmt == "e2m1" and hidden % 32 == 0 else 16


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


def _e5m6_value(xr, j: int, i: int):
    """The exact float32 value of code ``i``: the code is the top 12 bits of an fp16."""
    h = T.cast(T.shift_left(_e5m6_code(xr, j, i), 4), "uint16")
    return T.cast(T.call_extern("float16", "__ushort_as_half", h), "float32")


@kernel(pass_configs=_PASS)
def cast_back_kernel(fmt: str, out_dtype: str, hidden: int, bm: int, bk: int, sf: str = "fp32", threads: int = 256):
    t = T.dynamic("num_tokens")
    xs = T.dynamic("x_stride")
    nsf, ny = T.dynamic("nsf"), T.dynamic("ny")
    v = _vec(fmt, hidden)
    nv = hidden // v
    vin = {"e4m3": v, "e2m1": v // 2, "e5m6": v * 3 // 8}[fmt]  # physical input elements per thread
    hp = hidden * vin // v
    lw = {"e4m3": 16, "e2m1": 16, "e5m6": 2}[fmt]
    ow = 4 if out_dtype == "float32" else 8
    one_scale = bk % v == 0

    @T.prim_func
    def main(
        X: T.StridedTensor((t, hp), (xs, 1), _DATA_DTYPE[fmt]),
        SF: T.Tensor((nsf,), _SF_DTYPE[sf]),
        Y: T.Tensor((ny,), out_dtype),
        s0: T.int32,
        s1: T.int32,
    ):
        with T.Kernel(T.ceildiv(t * nv, threads), threads=threads) as bx:
            T.assume(xs % lw == 0)
            tx = T.get_thread_binding()
            xr = T.alloc_local((vin,), _DATA_DTYPE[fmt])
            xv = T.alloc_local((v,), "float32")
            yv = T.alloc_local((v,), out_dtype)
            g = bx * threads + tx
            row = g // nv
            col = (g % nv) * v
            if row < t:
                for j in T.unroll(vin // lw):
                    for i in T.vectorized(lw):
                        xr[j * lw + i] = X[row, col * vin // v + j * lw + i]
                if fmt == "e4m3":
                    for i in T.unroll(v):
                        xv[i] = T.cast(xr[i], "float32")
                elif fmt == "e2m1":
                    for i in T.unroll(v):
                        xv[i] = _decode_e2m1(T.cast(xr[i // 2], "int32"), i % 2)
                else:
                    for j in T.unroll(2):
                        xv[j * 8 + 0] = _e5m6_value(xr, j, 0)
                        xv[j * 8 + 1] = _e5m6_value(xr, j, 1)
                        xv[j * 8 + 2] = _e5m6_value(xr, j, 2)
                        xv[j * 8 + 3] = _e5m6_value(xr, j, 3)
                        xv[j * 8 + 4] = _e5m6_value(xr, j, 4)
                        xv[j * 8 + 5] = _e5m6_value(xr, j, 5)
                        xv[j * 8 + 6] = _e5m6_value(xr, j, 6)
                        xv[j * 8 + 7] = _e5m6_value(xr, j, 7)
                if one_scale:
                    s = _load_sf(sf, SF, row // bm, col // bk, s0, s1)
                    for i in T.unroll(v):
                        yv[i] = T.cast(xv[i] * s, out_dtype)
                else:
                    for i in T.unroll(v):
                        yv[i] = T.cast(xv[i] * _load_sf(sf, SF, row // bm, (col + i) // bk, s0, s1), out_dtype)
                for j in T.unroll(v // ow):
                    for i in T.vectorized(ow):
                        Y[row * hidden + col + j * ow + i] = yv[j * ow + i]

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
    if fmt not in OUT_DTYPES:
        fail(op, "fmt", "one of ('bf16', 'fp32')", repr(fmt))
    if x_special_fmt not in (None, "e5m6"):
        fail(op, "x_special_fmt", "None or 'e5m6'", repr(x_special_fmt))
    data_fmts = ("e5m6",) if x_special_fmt == "e5m6" else ("e4m3", "e2m1")
    q = check_quant_input(op, x, x_block_size, data_fmts=data_fmts)
    if q.h % 16:
        fail(op, "hidden", "a multiple of 16", q.h)
    if x_special_fmt == "e5m6" and q.data.shape[1] % 3:
        fail(op, "x[0] (data)", "of width 3*H/2 (packed E5M6)", f"shape {tuple(q.data.shape)}")
    dtype = OUT_DTYPES[fmt]
    if out is not None:
        if not isinstance(out, torch.Tensor):
            fail(op, "out", "a torch.Tensor or None", type(out).__name__, TypeError)
        if out.dtype != dtype or tuple(out.shape) != (q.t, q.h) or not out.is_contiguous() or out.device != q.data.device:
            fail(op, "out", f"a contiguous {dtype} tensor of shape {(q.t, q.h)} on {q.data.device}",
                 f"{out.dtype} of shape {tuple(out.shape)} on {out.device}")
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
    return cast_back(x, fmt, (1, num_per_channels), x_special_fmt, out=out)


def cast_back_e5m6(x, fmt: str, x_block_size, out: torch.Tensor | None = None) -> torch.Tensor:
    """E5M6 cast back: ``cast_back(x, fmt, x_block_size, x_special_fmt='e5m6')``."""
    return cast_back(x, fmt, x_block_size, "e5m6", out=out)
