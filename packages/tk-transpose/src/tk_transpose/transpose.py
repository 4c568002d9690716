"""Transpose of the last two dimensions: ``transpose`` (2-D) and ``batched_transpose`` (3-D).

Math: ``out[b, j, i] = x[b, i, j]`` for ``x`` of shape ``(B, M, N)``; ``out`` is a new contiguous
``(B, N, M)`` tensor (or ``out=``), bit-exact: the kernel moves raw bits, so every 1-, 2- and 4-byte
dtype of ``SUPPORTED_DTYPES`` works and NaN payloads and signed zeros are preserved.

Shapes and layouts: any ``B, M, N >= 0`` (edge tiles are handled); any batch stride and row stride;
the last dimension must have unit stride. Empty inputs return an empty output without a launch.

Kernel: fully coalesced 16-byte loads and stores on both sides, a register transpose of each thread's
16-byte chunks of 4 / 2 / 1 consecutive rows into 4-byte column words, and a bank-conflict-free
swizzled shared-memory stage (see ``transpose_kernel``). The grid is one-dimensional
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


# Tuned on the H200 (the anchor shapes 8064 x 7168 and 8 x 8064 x 7168): tile bytes per output row
# segment and per input row segment, and the CTAs per SM the registers must allow in mode "vector"
# (47 / 40 / 40 registers on sm_90a, no spills).
_TUNING = {
    8: dict(out_bytes=128, in_bytes=128, min_blocks=5),
    16: dict(out_bytes=128, in_bytes=256, min_blocks=6),
    32: dict(out_bytes=128, in_bytes=256, min_blocks=6),
}


@kernel
def transpose_kernel(
    elem_bits: int,
    mode: str,
    out_bytes: int | None = None,
    in_bytes: int | None = None,
    threads: int = 256,
    min_blocks: int | None = None,
):
    """``out[b, j, i] = x[b, i, j]`` on raw ``elem_bits``-wide words.

    ``mode`` says which accesses may be 16-byte vectors: ``"vector"`` (loads and stores), ``"vector_load"``
    (the output row stride ``M`` is unaligned: scalar stores) or ``"scalar"`` (the input strides are
    unaligned: a plain element-wise copy per tile). The tuning parameters default to ``_TUNING``.

    A CTA moves a ``block_m x block_n`` tile: ``block_m`` input rows of ``in_bytes`` bytes, i.e. ``block_n``
    output row segments of ``out_bytes`` bytes. A thread's unit of work is ``p`` input rows times one
    16-byte chunk, ``p`` being the number of elements in a 4-byte word (4 for 8-bit, 2 for 16-bit, 1 for
    32-bit): eight lanes read 128 contiguous bytes of a row, four lanes go down the row groups. All of a
    thread's loads of the tile are issued first; then each unit is transposed in registers into ``v``
    4-byte words (one per column: ``p`` elements of consecutive rows), stored into shared memory laid out
    output-major with the word index XOR-swizzled by the column's chunk, so that neither the 4-byte
    stores nor the 16-byte loads of the other side have bank conflicts. After the barrier, the lanes
    write each output row segment with 16-byte stores. Small per-thread state (a 16 KiB tile, 64 bytes
    a thread) and ``__launch_bounds__(threads, min_blocks)`` keep 5-6 CTAs on an SM, so that some are
    always loading while others store.
    """
    tuning = _TUNING[elem_bits]
    out_bytes = out_bytes or tuning["out_bytes"]
    in_bytes = in_bytes or tuning["in_bytes"]
    # The scalar paths (unaligned strides or M) need more registers: they get a looser bound.
    min_blocks = min_blocks or (tuning["min_blocks"] if mode == "vector" else 4)
    dtype = _KERNEL_DTYPE[elem_bits]
    v = 128 // elem_bits  # elements per 16-byte chunk
    p = 32 // elem_bits  # elements per 4-byte word
    eb = elem_bits // 8
    block_m = out_bytes // eb  # input rows of a tile
    block_n = in_bytes // eb  # input columns of a tile
    in_chunks = in_bytes // 16  # 16-byte chunks per input row segment
    out_chunks = out_bytes // 16  # 16-byte chunks per output row segment
    per_thread = (block_m // p) * in_chunks // threads  # load units per thread
    # The swizzle needs >= 32 words per staged row and 8 lanes along an input row segment.
    assert out_bytes >= 128 and in_bytes >= 128 and threads % 32 == 0
    assert per_thread * threads == (block_m // p) * in_chunks and (block_n * out_chunks) % threads == 0
    B, M, N = T.dynamic("B M N")
    sb, sm = T.dynamic("sb sm", "int64")

    @T.prim_func
    def main(x: T.StridedTensor((B, M, N), (sb, sm, 1), dtype), out: T.Tensor((B, N, M), dtype)):
        tiles_m = T.ceildiv(M, block_m)
        tiles_n = T.ceildiv(N, block_n)
        with T.Kernel(B * tiles_m * tiles_n, threads=threads) as tile_id:
            if min_blocks > 1:
                T.annotate_min_blocks_per_sm(min_blocks)
            if mode != "scalar":  # the host picks the variant only when these hold
                T.assume(sm % v == 0)
                T.assume(sb % v == 0)
            if mode == "vector":
                T.assume(M % v == 0)
            # Truncating division: every operand is non-negative, and it lowers to plain 32-bit / and %.
            tx = T.get_thread_binding()
            b = T.truncdiv(tile_id, tiles_m * tiles_n)
            m0 = T.truncdiv(T.truncmod(tile_id, tiles_m * tiles_n), tiles_n) * block_m
            n0 = T.truncmod(tile_id, tiles_n) * block_n
            if mode == "scalar":
                for k in T.serial(block_m * block_n // threads):
                    i = T.truncdiv(k * threads + tx, block_n)
                    j = T.truncmod(k * threads + tx, block_n)
                    if m0 + i < M and n0 + j < N:
                        out[b, n0 + j, m0 + i] = x[b, m0 + i, n0 + j]
            else:
                staged = T.alloc_shared((block_n, block_m), dtype)
                block = T.alloc_local((per_thread, p, v), dtype)
                block_t = T.alloc_local((v, p), dtype)
                for k in T.unroll(per_thread):  # every load of the tile in flight (zeros outside)
                    u = k * threads + tx
                    c = ((u // 32) % (in_chunks // 8)) * 8 + u % 8  # chunk of the input row segment
                    g = ((u // 32) // (in_chunks // 8)) * 4 + (u // 8) % 4  # row group (p rows)
                    r = m0 + g * p
                    col = n0 + c * v
                    if r + p <= M and col + v <= N:
                        for i in T.unroll(p):
                            for j in T.vectorized(v):
                                block[k, i, j] = x[b, r + i, col + j]
                    else:
                        for i in T.unroll(p):
                            for j in T.unroll(v):
                                block[k, i, j] = T.if_then_else(r + i < M and col + j < N, x[b, r + i, col + j], 0)
                for k in T.unroll(per_thread):  # v words per unit into the swizzled output-major stage
                    u = k * threads + tx
                    c = ((u // 32) % (in_chunks // 8)) * 8 + u % 8
                    g = ((u // 32) // (in_chunks // 8)) * 4 + (u // 8) % 4
                    for j in T.unroll(v):
                        for i in T.unroll(p):
                            block_t[j, i] = block[k, i, j]
                    for j in T.unroll(v):
                        for i in T.vectorized(p):
                            staged[c * v + j, (g ^ ((c % 8) * 4)) * p + i] = block_t[j, i]
                T.sync_threads()
                for k in T.unroll(block_n * out_chunks // threads):
                    u = k * threads + tx
                    row = u // out_chunks
                    q = u % out_chunks  # 16-byte chunk of the output row segment
                    col = m0 + q * v
                    src = (q ^ ((row // v) % 8)) * v
                    if mode == "vector" and n0 + row < N and col + v <= M:
                        for i in T.vectorized(v):
                            out[b, n0 + row, col + i] = staged[row, src + i]
                    else:
                        for i in T.unroll(v):
                            if n0 + row < N and col + i < M:
                                out[b, n0 + row, col + i] = staged[row, src + i]

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
