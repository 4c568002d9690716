"""Element-wise narrowing cast with optional stochastic rounding (TileKernels 2.1.0's ``quant.cast``).

``cast(x, dtype, stochastic_rounding=False, seed=None)``: ``x`` float32 or bfloat16 of any shape (non-contiguous
inputs are read in their logical row-major order); ``dtype`` bfloat16 (from float32) or float8_e4m3fn (from
float32 or bfloat16). No scaling. Returns a contiguous tensor of ``x``'s shape.

- Round to nearest even (default): bf16 as ``x.to(torch.bfloat16)`` (overflow to inf), e4m3 as
  ``tk_core.formats.encode_e4m3`` (saturating to +-448, NaN stays NaN).
- ``stochastic_rounding``: ``tk_core.formats.round_stochastic`` onto the output's grid, then the same
  conversion (exact but for e4m3's saturation and bf16's overflow). The 16 random bits of element ``i`` of the
  flattened tensor are ``tk_core.formats.stochastic_bits(seed, i >> 32, i % 2**32)``; ``seed`` as in
  ``per_token_cast`` (an int in ``[0, 2**32)``, or ``None`` for a fresh one from torch's default CPU generator).

Errors: TypeError for a non-tensor or an unsupported dtype pair, ValueError for a bad seed. CPU tensors run
``tk_quant.reference.elementwise_cast``.

Kernel: 256 threads, 8 elements each (16- or 32-byte loads, 8- or 16-byte stores; the last partial vector
element by element), one hash per column pair; launches of at most 2**30 elements (int32 indices).
"""

import tilelang.language as T
import torch

from tk_core.checks import fail
from tk_core.formats import int32_bits
from tk_core.jit import kernel
from tk_core.layout import vector_aligned
from tk_core.library import device_op

from . import _tl, reference
from .common import stochastic_seed

THREADS = 256
VEC = 8  # elements per thread
CHUNK = 1 << 30  # elements per launch: int32 indices, and a chunk never crosses a multiple of 2**32
_PAIRS = {(torch.float32, torch.bfloat16): "bf16", (torch.float32, torch.float8_e4m3fn): "e4m3",
          (torch.bfloat16, torch.float8_e4m3fn): "e4m3"}
_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float8_e4m3fn: "float8_e4m3fn"}


@kernel(pass_configs={"tl.disable_safe_memory_legalize": True})
def cast_kernel(in_dtype: str, out_dtype: str, stochastic: bool):
    """``y[i] = convert(x[i])``, or ``convert(round_stochastic(x[i]))`` with the bits of position
    ``(row, col0 + i)``; ``row`` and ``col0`` (the chunk's first column, even) are runtime scalars."""
    fmt = "bf16" if out_dtype == "bfloat16" else "e4m3"
    n = T.dynamic("n")

    @T.prim_func
    def main(x: T.Tensor((n,), in_dtype), y: T.Tensor((n,), out_dtype), seed: T.int32, row: T.int32, col0: T.int32):
        with T.Kernel(T.ceildiv(n, THREADS * VEC), threads=THREADS,
                      prelude=_tl.ROUND_STOCHASTIC if stochastic else None) as bx:
            tx = T.get_thread_binding()
            i0 = (bx * THREADS + tx) * VEC
            xl = T.alloc_local((VEC,), in_dtype)
            yl = T.alloc_local((VEC,), out_dtype)
            pb = T.alloc_local((VEC // 2,), "uint32")
            if i0 + VEC <= n:
                for k in T.vectorized(VEC):
                    xl[k] = x[i0 + k]
            else:
                for k in T.unroll(VEC):
                    xl[k] = T.if_then_else(i0 + k < n, x[T.min(i0 + k, n - 1)], T.cast(0, in_dtype))
            if stochastic:
                key = _tl.row_key(row, seed)
                for j in T.unroll(VEC // 2):
                    pb[j] = _tl.pair_bits(key, T.shift_right(T.reinterpret(col0, "uint32") + T.cast(i0, "uint32"), 1) + j)
            for k in T.unroll(VEC):
                v = T.cast(xl[k], "float32")
                if stochastic:
                    v = _tl.round_stochastic(v, fmt, _tl.element_bits(pb, k))
                yl[k] = T.cast(v, out_dtype)
            if i0 + VEC <= n:
                for k in T.vectorized(VEC):
                    y[i0 + k] = yl[k]
            else:
                for k in T.unroll(VEC):
                    if i0 + k < n:
                        y[i0 + k] = yl[k]

    return main


@device_op("tk_quant::cast_", mutates_args=("out",))
def cast_(x: torch.Tensor, out: torch.Tensor, stochastic: bool, seed: int) -> None:
    """``x`` and ``out`` flat and contiguous, ``x`` 16-byte aligned."""
    k = cast_kernel.get(x.device, in_dtype=_NAMES[x.dtype], out_dtype=_NAMES[out.dtype], stochastic=stochastic)
    for start in range(0, x.numel(), CHUNK):
        stop = min(start + CHUNK, x.numel())
        k(x[start:stop], out[start:stop], int32_bits(seed), start >> 32, int32_bits(start & 0xFFFFFFFF))


def cast(x: torch.Tensor, dtype: torch.dtype, stochastic_rounding: bool = False, seed: int | None = None) -> torch.Tensor:
    """Element-wise narrowing cast (see the module docstring): float32 -> bfloat16, float32 or bfloat16 ->
    float8_e4m3fn, round to nearest even or (``stochastic_rounding``) stochastically with position-hashed bits."""
    op = "cast"
    if not isinstance(x, torch.Tensor):
        fail(op, "x", "a torch.Tensor", type(x).__name__, TypeError)
    if not isinstance(dtype, torch.dtype):  # (before the dict lookup: an unhashable value would fail there)
        fail(op, "dtype", "a torch.dtype", f"{dtype!r} ({type(dtype).__name__})", TypeError)
    if (x.dtype, dtype) not in _PAIRS:
        pairs = ", ".join(f"{_NAMES[a]} -> {_NAMES[b]}" for a, b in _PAIRS)
        fail(op, "(x.dtype, dtype)", f"one of {pairs}", f"{x.dtype} -> {dtype}", TypeError)
    seed = stochastic_seed(op, _PAIRS[(x.dtype, dtype)], stochastic_rounding, seed)
    if x.device.type != "cuda":
        # the reference keeps x's strides; the result is contiguous on every device, like the kernel's
        return reference.elementwise_cast(x, dtype, stochastic_seed=seed).contiguous()
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    if x.numel():
        cast_(vector_aligned(x.reshape(-1)), out.view(-1), seed is not None, seed or 0)
    return out
