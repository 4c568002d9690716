"""Transpose of the last two dimensions: ``transpose`` (2-D) and ``batched_transpose`` (3-D).

Math: ``out[b, j, i] = x[b, i, j]`` for ``x`` of shape ``(B, M, N)``; ``out`` is a new contiguous
``(B, N, M)`` tensor (or ``out=``), bit-exact: the kernel moves raw bits, so every 1-, 2- and 4-byte
dtype of ``SUPPORTED_DTYPES`` works and NaN payloads and signed zeros are preserved.

Shapes and layouts: any ``B, M, N >= 0`` (edge tiles are handled); any batch stride and row stride;
the last dimension must have unit stride. Empty inputs return an empty output without a launch.

Kernel: a thread moves a ``v x v`` block, ``v`` elements being 16 bytes: ``v`` vector loads of input
rows (two lanes cover a 32-byte sector), a register transpose, ``v`` vector stores of output rows
(sixteen lanes write 256 contiguous bytes). No shared memory, no barrier. The grid is one-dimensional
over ``B x ceil(M/bm) x ceil(N/bn)`` tiles, so no grid dimension limits the sizes. When the row or batch
stride or the input address is not 16-byte aligned, the accesses are scalar; when only ``M`` (the
output row stride) or the output address is, the loads stay vectors and the stores are scalar.

Errors: ``TypeError`` for a non-tensor or an unsupported dtype; ``ValueError`` for the wrong number of
dimensions, a non-unit last stride, a CPU/CUDA mix, or a bad ``out``.
"""

import tilelang.language as T
import torch

from tk_core import checks
from tk_core.jit import kernel
from tk_core.library import device_op

from . import reference

SUPPORTED_DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.uint8,
    torch.int8,
)
# The kernel moves raw bits: each dtype is viewed as the unsigned integer of its width.
_BITS_VIEW = {1: torch.uint8, 2: torch.uint16, 4: torch.int32}
_KERNEL_DTYPE = {8: "uint8", 16: "uint16", 32: "int32"}
_LANES_R, _LANES_C, _WARPS = 16, 2, 8


@kernel
def transpose_kernel(elem_bits: int, mode: str):
    """``out[b, j, i] = x[b, i, j]`` on raw ``elem_bits``-wide words.

    ``mode`` says which accesses may be 16-byte vectors: ``"vector"`` (loads and stores), ``"vector_load"``
    (the output row stride ``M`` is unaligned) or ``"scalar"`` (the input strides are unaligned).
    """
    dtype = _KERNEL_DTYPE[elem_bits]
    v = 128 // elem_bits
    block_m, block_n = _LANES_R * v, _LANES_C * v * _WARPS
    B, M, N = T.dynamic("B M N")
    sb, sm = T.dynamic("sb sm", "int64")

    @T.prim_func
    def main(x: T.StridedTensor((B, M, N), (sb, sm, 1), dtype), out: T.Tensor((B, N, M), dtype)):
        tiles_m = T.ceildiv(M, block_m)
        tiles_n = T.ceildiv(N, block_n)
        with T.Kernel(B * tiles_m * tiles_n, threads=_LANES_R * _LANES_C * _WARPS) as tile_id:
            if mode != "scalar":  # the host picks the variant only when these hold
                T.assume(sm % v == 0)
                T.assume(sb % v == 0)
            if mode == "vector":
                T.assume(M % v == 0)
            # Truncating division: every operand is non-negative, and it lowers to plain 32-bit / and %.
            tx = T.get_thread_binding()
            b = T.truncdiv(tile_id, tiles_m * tiles_n)
            r0 = T.truncdiv(T.truncmod(tile_id, tiles_m * tiles_n), tiles_n) * block_m + (tx % _LANES_R) * v
            c0 = T.truncmod(tile_id, tiles_n) * block_n + (tx // _LANES_R) * v
            block = T.alloc_local((v, v), dtype)
            block_t = T.alloc_local((v, v), dtype)
            if mode != "scalar" and r0 + v <= M and c0 + v <= N:
                for i in T.unroll(v):
                    for j in T.vectorized(v):
                        block[i, j] = x[b, r0 + i, c0 + j]
                if mode == "vector":
                    for j in T.unroll(v):
                        for i in T.unroll(v):
                            block_t[j, i] = block[i, j]
                    for j in T.unroll(v):
                        for i in T.vectorized(v):
                            out[b, c0 + j, r0 + i] = block_t[j, i]
                else:
                    for j in T.unroll(v):
                        for i in T.unroll(v):
                            out[b, c0 + j, r0 + i] = block[i, j]
            else:
                for i in T.unroll(v):
                    for j in T.unroll(v):
                        if r0 + i < M and c0 + j < N:
                            out[b, c0 + j, r0 + i] = x[b, r0 + i, c0 + j]

    return main


def _access_mode(x: torch.Tensor, out: torch.Tensor) -> str:
    """Which accesses can be 16-byte vectors: input rows need aligned strides and base address, output
    rows (stride ``M``) an aligned ``M`` and base address."""
    v = 16 // x.element_size()
    if x.stride(0) % v or x.stride(1) % v or x.data_ptr() % 16:
        return "scalar"
    if x.shape[1] % v or out.data_ptr() % 16:
        return "vector_load"
    return "vector"


@device_op("tk_transpose::batched_transpose_", mutates_args=("out",))
def _batched_transpose_op(x: torch.Tensor, out: torch.Tensor) -> None:
    bits = _BITS_VIEW[x.element_size()]
    xb, ob = x.view(bits), out.view(bits)
    # A size-1 last dimension may carry any stride; the kernel's signature wants 1.
    xb = xb.as_strided(xb.shape, (xb.stride(0), xb.stride(1), 1))
    k = transpose_kernel.get(x.device, elem_bits=8 * x.element_size(), mode=_access_mode(xb, ob))
    k(xb, ob)


def _check(op: str, x, ndim: int, out) -> tuple[int, ...]:
    checks.check_dtype(op, "x", x, SUPPORTED_DTYPES)
    checks.check_ndim(op, "x", x, ndim)
    checks.check_inner_contiguous(op, "x", x)
    shape = (*x.shape[:-2], x.shape[-1], x.shape[-2])
    if out is not None:
        checks.check_dtype(op, "out", out, x.dtype)
        checks.check_shape(op, "out", out, shape)
        checks.check_same_device(op, "out", out, x.device)
        checks.check_contiguous(op, "out", out)
    return shape


def batched_transpose(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Swaps the last two dimensions of a 3-D tensor into a new contiguous tensor.

    Args:
        x: ``(B, M, N)`` tensor of a dtype in ``SUPPORTED_DTYPES`` (fp32, bf16, fp16, fp8 e4m3/e5m2,
            raw 8-bit codes); any batch and row strides, unit stride in the last dimension.
        out: optional contiguous ``(B, N, M)`` tensor of ``x``'s dtype and device to write into.

    Returns:
        ``out``, or a new ``(B, N, M)`` tensor on ``x``'s device, with ``out[b, j, i] == x[b, i, j]``
        bit for bit. CUDA tensors run the TileLang kernel, CPU tensors the reference.

    Raises:
        TypeError: ``x`` is not a tensor or its dtype is unsupported; ``out`` has another dtype.
        ValueError: ``x`` is not 3-D or not unit-stride in its last dimension; ``out`` has the wrong
            shape or device or is not contiguous.
    """
    shape = _check("batched_transpose", x, 3, out)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if x.is_cuda:
        _batched_transpose_op(x, out)
    else:
        out.copy_(reference.batched_transpose(x))
    return out


def transpose(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Transposes a 2-D tensor ``(M, N)`` into a new contiguous ``(N, M)`` tensor (or ``out``).

    Same dtypes, layouts, semantics and errors as ``batched_transpose`` with one batch; the row stride
    may exceed ``N``.
    """
    _check("transpose", x, 2, out)
    result = batched_transpose(x.unsqueeze(0), out=None if out is None else out.unsqueeze(0))
    return result.squeeze(0)
