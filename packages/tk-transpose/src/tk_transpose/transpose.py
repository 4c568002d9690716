"""Transpose of the last two dimensions: ``transpose`` (2-D) and ``batched_transpose`` (3-D).

Math: ``out[b, j, i] = x[b, i, j]`` for ``x`` of shape ``(B, M, N)``; ``out`` is a new contiguous
``(B, N, M)`` tensor (or ``out=``), bit-exact: the kernel moves raw bits, so every 1-, 2- and 4-byte
dtype of ``SUPPORTED_DTYPES`` works and NaN payloads and signed zeros are preserved.

Shapes and layouts: any ``B, M, N >= 0`` (edge tiles are handled); any batch stride and row stride;
the last dimension must have unit stride. Empty inputs return an empty output without a launch.

Kernels: inputs whose row and batch strides and address are 16-byte aligned go through shared memory
(``transpose_shared_kernel``): cp.async copies of the tile in, a register transpose of 16-byte square units with
byte permutes, 16-byte stores out; a warp reads and writes runs of at least 128 contiguous bytes. When the output
rows are not 16-byte aligned (``M`` not a multiple of ``16 / element size``, or a misaligned ``out``), the kernel
shifts each row's chunks onto the output's 16-byte grid by shuffles (``shifted_stores``). 32-bit elements with
aligned output rows, and inputs with unaligned strides or address, use ``transpose_kernel``, which has no shared
memory and no barrier: each thread moves one square ``v x v`` unit (``v`` elements of 16 bytes) with ``v``
16-byte row loads, the register transpose and ``v`` 16-byte column stores, lanes arranged so that both sides are
coalesced (4 lanes down the rows fill 64 contiguous bytes of an output row, 8 along the columns 128 of an input
row); unaligned inputs get an element-wise copy. Both grids are one-dimensional over ``B x ceil(M/bm) x
ceil(N/bn)`` tiles, rows first, so no grid dimension limits the sizes.

Errors: ``TypeError`` for a non-tensor or an unsupported dtype; ``ValueError`` for the wrong number of
dimensions, a non-unit last stride, a CPU/CUDA mix, or a bad ``out``.
"""

import tilelang.language as T
import torch

from tk_core import checks
from tk_core.jit import kernel
from tk_core.library import device_op
from tk_core.ptx import CP_ASYNC, ST_GLOBAL_V4, cp_async16, cp_async_wait_all, st_global_v4

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


# Register kernel (32-bit elements, and every width when the output rows are unaligned), tuned on the H200 at
# the anchor shapes 8064 x 7168 and 8 x 8064 x 7168: lanes down the rows of a warp, the warps of a CTA along rows
# and columns, the CTAs per SM the registers must allow, the load width.
_TUNING = {
    8: dict(lanes_m=4, warps_m=2, warps_n=2, min_blocks=4, load_bytes=16),
    16: dict(lanes_m=4, warps_m=2, warps_n=2, min_blocks=6, load_bytes=16),
    32: dict(lanes_m=4, warps_m=2, warps_n=4, min_blocks=4, load_bytes=16),
}
# Shared-memory kernel (8- and 16-bit elements, aligned rows), tuned on the same shapes: the tile, the threads
# and the CTAs per SM (enforced through the shared-memory size). bf16 128 x 128 at 3 CTAs: 3,962 / 4,173 GB/s;
# e4m3 128 x 256 at 5: 3,728 / 4,023 (the register kernel: 3,824 / 4,023 and 3,618 / 3,989).
_SHARED_TUNING = {
    8: dict(block_m=128, block_n=256, threads=128, ctas_per_sm=5),
    16: dict(block_m=128, block_n=128, threads=256, ctas_per_sm=3),
}
# The same kernel with shifted stores (output rows not 16-byte aligned), tuned at 8001 x 7168 and 8 x 8001 x 7168
# (`sweep_transpose.py` shifted,...). Row pieces of 32 chunks (a warp per output row piece) halve the ends per
# byte against 16: bf16 256 x 64 3,586 / 3,835 GB/s against 3,069 / 3,215 at 128 x 128. e4m3 keeps 16 chunks
# (256 x 256 at 2 CTAs, 122 registers: 2,432 / 2,957; 512 x 128 1,998 / 2,898; 128 x 256 at 4 1,700 / 1,913).
# fp32 128 x 64: 3,898 / 4,017.
_SHIFTED_TUNING = {
    8: dict(block_m=256, block_n=256, threads=256, ctas_per_sm=2),
    16: dict(block_m=256, block_n=64, threads=256, ctas_per_sm=3),
    32: dict(block_m=128, block_n=64, threads=256, ctas_per_sm=3),
}
_SHARED_KB_PER_SM = 228  # sm_90 and sm_100; the driver reserves 1 KB per CTA


# Stores of output rows that do not start on a 16-byte boundary (``M`` not a multiple of ``16 / element size``),
# interior tiles: the ``seg`` lanes of a segment hold the 16-byte chunks 0 .. seg-1 of one output row piece
# (``row``: 16 seg bytes, element-aligned); ``u`` bytes come before the row's first 16-byte boundary. Lane ``k``
# takes chunk ``k - 1`` (lane 0: chunk seg-1) by a shuffle; bytes u .. u+15 of the two chunks are the aligned
# 16 bytes at ``row + u - 16 + 16 k``, one vector store for ``k > 0``. Lane 0's are the piece's last ``16 - u``
# bytes followed by its first ``u``: it stores them as naturally aligned 1/2/4/8-byte pieces. All lanes of the
# warp must call it (shuffles). Needs ``ST_GLOBAL_V4`` before it in the prelude.
SHIFTED_ROW_STORE = r"""
__device__ __forceinline__ unsigned tk_word_at(unsigned r0, unsigned r1, unsigned r2, unsigned r3, int w) {
  return (w & 2) ? ((w & 1) ? r3 : r2) : ((w & 1) ? r1 : r0);
}
// Bytes [o, o + size) of the 16 bytes d (o a multiple of size) to dst + o.
__device__ __forceinline__ void tk_store_piece(char* dst, const unsigned* d, int o, int size) {
  const unsigned w = tk_word_at(d[0], d[1], d[2], d[3], o >> 2);
  if (size == 8) {
    *reinterpret_cast<uint2*>(dst + o) = (o & 8) ? make_uint2(d[2], d[3]) : make_uint2(d[0], d[1]);
  } else if (size == 4) {
    *reinterpret_cast<unsigned*>(dst + o) = w;
  } else if (size == 2) {
    *reinterpret_cast<unsigned short*>(dst + o) = static_cast<unsigned short>(w >> ((o & 2) * 8));
  } else {
    *reinterpret_cast<unsigned char*>(dst + o) = static_cast<unsigned char>(w >> ((o & 3) * 8));
  }
}
__device__ __forceinline__ void tk_store_shifted_row_chunk(void* row_ptr, int seg, int es, unsigned a0, unsigned a1,
                                                           unsigned a2, unsigned a3) {
  char* row = static_cast<char*>(row_ptr);
  const int lane = threadIdx.x & 31;
  const int k = lane % seg;
  const int u = (16 - static_cast<int>(reinterpret_cast<size_t>(row) & 15)) & 15;
  const int src = lane + (k == 0 ? seg - 1 : -1);
  const unsigned c[8] = {__shfl_sync(0xffffffffu, a0, src), __shfl_sync(0xffffffffu, a1, src),
                         __shfl_sync(0xffffffffu, a2, src), __shfl_sync(0xffffffffu, a3, src), a0, a1, a2, a3};
  unsigned t[6], s[5], d[4];  // d: bytes u .. u+15 of c
#pragma unroll
  for (int i = 0; i < 6; ++i) t[i] = (u & 8) ? c[i + 2] : c[i];
#pragma unroll
  for (int i = 0; i < 5; ++i) s[i] = (u & 4) ? t[i + 1] : t[i];
#pragma unroll
  for (int i = 0; i < 4; ++i) d[i] = __funnelshift_r(s[i], s[i + 1], (u & 3) * 8);
  // d's first 16 - u bytes are the piece's last ones (at the aligned row + 16 seg - 16 + u), its last u bytes the
  // piece's first ones (row + u - 16 + [16 - u, 16)): from the low end, pieces of decreasing size, then increasing.
  char* tail = row + 16 * seg - 16 + u;
  if (k > 0 || u == 0) {  // u == 0: lane 0 holds the whole last chunk
    tk_st_global_v4(k > 0 ? row + u - 16 + 16 * k : tail, d[0], d[1], d[2], d[3]);
    return;
  }
  int o = 0;
#pragma unroll
  for (int size = 8; size >= es; size /= 2) {
    if ((16 - u) & size) {
      tk_store_piece(tail, d, o, size);
      o += size;
    }
  }
#pragma unroll
  for (int size = es; size <= 8; size *= 2) {
    if (u & size) {
      tk_store_piece(row + u - 16, d, o, size);
      o += size;
    }
  }
}
"""


def _byte_perm(a, b, selector: int):
    return T.call_extern("uint32", "__byte_perm", a, b, T.uint32(selector))


@T.macro
def _transpose_words(rows, k, g, p: int, cols):
    """Output words ``cols[t, g]`` (``t < p``): the ``p`` elements of input column ``k * p + t`` in input rows
    ``g * p .. g * p + p - 1``, from word ``k`` of those rows (``rows[i, k]``)."""
    if p == 4:  # 4 x 4 bytes: interleave row pairs, then pairs of pairs
        lo01 = _byte_perm(rows[4 * g, k], rows[4 * g + 1, k], 0x5140)
        hi01 = _byte_perm(rows[4 * g, k], rows[4 * g + 1, k], 0x7362)
        lo23 = _byte_perm(rows[4 * g + 2, k], rows[4 * g + 3, k], 0x5140)
        hi23 = _byte_perm(rows[4 * g + 2, k], rows[4 * g + 3, k], 0x7362)
        cols[0, g] = _byte_perm(lo01, lo23, 0x5410)
        cols[1, g] = _byte_perm(lo01, lo23, 0x7632)
        cols[2, g] = _byte_perm(hi01, hi23, 0x5410)
        cols[3, g] = _byte_perm(hi01, hi23, 0x7632)
    elif p == 2:  # 2 x 2 halves
        cols[0, g] = _byte_perm(rows[2 * g, k], rows[2 * g + 1, k], 0x5410)
        cols[1, g] = _byte_perm(rows[2 * g, k], rows[2 * g + 1, k], 0x7632)
    else:
        cols[0, g] = rows[g, k]


def _tile_origin(tile_id, tiles_m, tiles_n, block_m: int, block_n: int, as_vars: bool = True):
    """The batch and the first input row and column of a tile. Tiles go down the rows first: the CTAs running
    together then write long runs of each output row (2-5 % faster than along the columns).

    ``as_vars``: 32-bit variables, which keep these divisions out of a 64-bit index (where they become 64-bit
    division calls); inline expressions instead let TileLang prove the alignment of ``T.vectorized`` loads."""
    b = T.truncdiv(tile_id, tiles_m * tiles_n)
    m0 = T.truncmod(tile_id, tiles_m) * block_m
    n0 = T.truncmod(T.truncdiv(tile_id, tiles_m), tiles_n) * block_n
    if not as_vars:
        return b, m0, n0
    return T.alloc_var("int32", init=b), T.alloc_var("int32", init=m0), T.alloc_var("int32", init=n0)


@kernel(pass_configs={"tl.disable_safe_memory_legalize": True})  # every access is guarded explicitly
def transpose_kernel(
    elem_bits: int,
    mode: str,
    lanes_m: int | None = None,
    warps_m: int | None = None,
    warps_n: int | None = None,
    min_blocks: int | None = None,
    load_bytes: int | None = None,
):
    """``out[b, j, i] = x[b, i, j]`` on raw ``elem_bits``-wide words.

    ``mode``: ``"vector"`` (16-byte loads and stores: the input strides and ``M`` are multiples of 16 bytes) or
    ``"scalar"`` (a plain element-wise copy). The tuning parameters default to ``_TUNING``.

    A thread owns a unit of ``v`` rows (``v = 128 / elem_bits``, 16 bytes of an output row) by ``load_bytes``
    (16 or 8) bytes of columns: it loads its ``v`` row pieces as vectors, all in flight at once, turns each
    4-byte word of ``p = 32 / elem_bits`` elements into ``p`` column words with ``__byte_perm`` (8 permutes
    per 4 x 4 bytes, 2 per 2 x 2 halves, none for 32-bit), and writes one 16-byte store per column. ``lanes_m`` lanes of a warp go down the
    unit rows (so a warp's store covers ``lanes_m x 16`` contiguous bytes of ``32 / lanes_m`` output rows)
    and the others along the columns; ``warps_m x warps_n`` warps make the CTA tile. Units on the right
    edge (``N``) copy element by element.
    """
    tuning = _TUNING[elem_bits]
    lanes_m = lanes_m or tuning["lanes_m"]
    warps_m = warps_m or tuning["warps_m"]
    warps_n = warps_n or tuning["warps_n"]
    # The scalar paths need more registers: they get a looser bound.
    min_blocks = min_blocks or (tuning["min_blocks"] if mode == "vector" else 2)
    load_bytes = load_bytes or tuning["load_bytes"]
    dtype = _KERNEL_DTYPE[elem_bits]
    v = 128 // elem_bits  # elements per 16-byte chunk
    p = 32 // elem_bits  # elements per 4-byte word
    words = load_bytes // 4  # 4-byte words per loaded row piece
    uc = words * p  # columns of a unit
    lanes_n = 32 // lanes_m
    threads = 32 * warps_m * warps_n
    block_m = warps_m * lanes_m * v  # input rows of a tile
    block_n = warps_n * lanes_n * uc  # input columns of a tile
    assert lanes_m * lanes_n == 32
    B, M, N = T.dynamic("B M N")
    sb, sm = T.dynamic("sb sm", "int64")

    @T.prim_func
    def main(x: T.StridedTensor((B, M, N), (sb, sm, 1), dtype), out: T.Tensor((B, N, M), dtype)):
        tiles_m = T.ceildiv(M, block_m)
        tiles_n = T.ceildiv(N, block_n)
        with T.Kernel(B * tiles_m * tiles_n, threads=threads, prelude=ST_GLOBAL_V4) as tile_id:
            if min_blocks > 1:
                T.annotate_min_blocks_per_sm(min_blocks)
            if mode == "vector":  # the host picks the variant only when these hold
                T.assume(sm % v == 0)
                T.assume(sb % v == 0)
                T.assume(M % v == 0)
            # Truncating division: every operand is non-negative, and it lowers to plain 32-bit / and %.
            tx = T.get_thread_binding()
            lane = tx % 32
            warp = tx // 32
            b, m0, n0 = _tile_origin(tile_id, tiles_m, tiles_n, block_m, block_n, as_vars=False)
            r0 = m0 + ((warp // warps_n) * lanes_m + lane % lanes_m) * v  # the unit's first row
            c0 = n0 + ((warp % warps_n) * lanes_n + lane // lanes_m) * uc  # and first column
            block = T.alloc_local((v, uc), dtype)
            rows = T.view(block, (v, words), "uint32")  # each row piece as words
            cols = T.alloc_local((p, 4), "uint32")  # the 4 words of p output row segments
            if mode == "vector" and r0 + v <= M and c0 + uc <= N:
                for i in T.unroll(v):
                    for j in T.vectorized(uc):
                        block[i, j] = x[b, r0 + i, c0 + j]
                for k in T.unroll(words):
                    for g in T.unroll(4):
                        _transpose_words(rows, k, g, p, cols)
                    for t in T.unroll(p):
                        st_global_v4(T.address_of(out[b, c0 + k * p + t, r0]), cols[t, 0], cols[t, 1], cols[t, 2], cols[t, 3])
            elif r0 < M and c0 < N:
                for j in T.serial(T.min(N - c0, uc)):
                    for i in T.unroll(v):
                        if r0 + i < M:
                            out[b, c0 + j, r0 + i] = x[b, r0 + i, c0 + j]

    return main


# Every access is guarded explicitly, and the one barrier is placed by hand (the automatic pass cannot see
# through the cp.async calls, and it would add a barrier per load of an edge tile).
@kernel(pass_configs={"tl.disable_safe_memory_legalize": True, "tl.disable_thread_storage_sync": True})
def transpose_shared_kernel(
    elem_bits: int,
    block_m: int | None = None,
    block_n: int | None = None,
    threads: int | None = None,
    ctas_per_sm: int | None = None,
    shifted_stores: bool = False,
):
    """``out[b, j, i] = x[b, i, j]`` on raw words whose input rows and batches are 16-byte aligned, through
    shared memory: 8- and 16-bit elements whose output rows are 16-byte aligned too (32-bit ones take
    ``transpose_kernel`` there), and every width with ``shifted_stores`` where they are not.

    A CTA moves a ``block_m x block_n`` tile. Its 16-byte input chunks go to shared memory by cp.async,
    consecutive lanes on consecutive chunks of a row, so a warp reads at least 128 contiguous bytes and holds
    no register while the tile is in flight. After one barrier, each thread reads a unit of ``v`` rows by one
    chunk (``v = 128 / elem_bits``), transposes it in registers with ``__byte_perm`` and writes ``v`` 16-byte
    output chunks; consecutive lanes take consecutive units down the rows, so a warp store also covers at
    least 128 contiguous bytes of an output row (the register kernel reaches 64). Chunk ``c`` of tile row
    ``r`` lives at chunk ``c ^ (r / v % 8)`` of its shared row: the 8 lanes of each phase of a 16-byte shared
    access hit distinct bank groups on both sides. Edge tiles predicate each chunk (a partial input chunk
    is copied element by element); interior tiles run without a test. The shared allocation is padded so
    that ``ctas_per_sm`` CTAs fit on an SM. Parameters default to ``_SHARED_TUNING`` (``_SHIFTED_TUNING``).

    ``shifted_stores``: the lanes of a unit column (``block_m / v`` consecutive lanes) hold the chunks of the same
    output rows, in order; on interior tiles ``SHIFTED_ROW_STORE`` shifts each row's chunks by a shuffle onto the
    16-byte grid of the output, so the stores stay 16-byte vectors but for one lane's 8/4/2/1-byte pieces at the
    row piece's two ends. Edge tiles store element by element.
    """
    tuning = (_SHIFTED_TUNING if shifted_stores else _SHARED_TUNING).get(elem_bits, {})
    block_m = block_m or tuning["block_m"]
    block_n = block_n or tuning["block_n"]
    threads = threads or tuning["threads"]
    ctas_per_sm = ctas_per_sm or tuning["ctas_per_sm"]
    dtype = _KERNEL_DTYPE[elem_bits]
    v = 128 // elem_bits  # elements per 16-byte chunk
    p = 32 // elem_bits  # elements per 4-byte word
    row_chunks = block_n // v  # input chunks per tile row = units across the tile
    col_chunks = block_m // v  # output chunks per tile column = units down the tile
    loads = block_m * row_chunks // threads
    units = row_chunks * col_chunks // threads
    assert row_chunks % 8 == 0 and col_chunks % 8 == 0, "the swizzle needs 8 chunks both ways"
    assert not shifted_stores or 32 % col_chunks == 0, "a unit column's lanes must lie in one warp"
    assert loads * threads == block_m * row_chunks and units * threads == row_chunks * col_chunks
    smem = max(block_m * block_n, (_SHARED_KB_PER_SM // ctas_per_sm - 2) * 1024 * 8 // elem_bits)
    B, M, N = T.dynamic("B M N")
    sb, sm = T.dynamic("sb sm", "int64")

    def chunk_index(row, chunk):
        return (row * row_chunks + (chunk ^ ((row // v) % 8))) * v

    @T.macro
    def load_tile(x, S, b, m0, n0, tx, edge: bool):
        for q in T.unroll(loads):
            c = tx + q * threads
            row = c // row_chunks
            col = n0 + (c % row_chunks) * v
            dst = chunk_index(row, c % row_chunks)
            if not edge:
                cp_async16(T.address_of(S[dst]), T.address_of(x[b, m0 + row, col]))
            elif m0 + row < M:
                if col + v <= N:
                    cp_async16(T.address_of(S[dst]), T.address_of(x[b, m0 + row, col]))
                else:  # what is left of the row; the rest of the chunk is never stored
                    for e in T.serial(N - col):
                        S[dst + e] = x[b, m0 + row, col + e]

    @T.macro
    def store_tile(out, S, b, m0, n0, tx, block, rows, cols, col_elems, edge: bool):
        for q in T.unroll(units):
            w = tx + q * threads
            unit_row = w % col_chunks
            unit_col = w // col_chunks
            r0 = m0 + unit_row * v  # the unit's first input row
            c0 = n0 + unit_col * v
            if not edge or r0 < M:
                for i in T.unroll(v):
                    for j in T.vectorized(v):
                        block[i, j] = S[chunk_index(unit_row * v + i, unit_col) + j]
                for k in T.unroll(4):
                    for g in T.unroll(4):
                        _transpose_words(rows, k, g, p, cols)
                    for t in T.unroll(p):
                        c = c0 + k * p + t
                        if shifted_stores and not edge:
                            T.call_extern(
                                "handle",
                                "tk_store_shifted_row_chunk",
                                T.address_of(out[b, c, m0]),
                                col_chunks,
                                elem_bits // 8,
                                cols[t, 0],
                                cols[t, 1],
                                cols[t, 2],
                                cols[t, 3],
                            )
                        elif shifted_stores:  # edge tiles (few): element by element
                            for e in T.unroll(v):
                                if c < N and r0 + e < M:
                                    out[b, c, r0 + e] = col_elems[t, e]
                        elif not edge or c < N:
                            st_global_v4(T.address_of(out[b, c, r0]), cols[t, 0], cols[t, 1], cols[t, 2], cols[t, 3])

    @T.prim_func
    def main(x: T.StridedTensor((B, M, N), (sb, sm, 1), dtype), out: T.Tensor((B, N, M), dtype)):
        tiles_m = T.ceildiv(M, block_m)
        tiles_n = T.ceildiv(N, block_n)
        prelude = CP_ASYNC + ST_GLOBAL_V4 + (SHIFTED_ROW_STORE if shifted_stores else "")
        with T.Kernel(B * tiles_m * tiles_n, threads=threads, prelude=prelude) as tile_id:
            T.annotate_min_blocks_per_sm(ctas_per_sm)
            T.assume(sm % v == 0)
            T.assume(sb % v == 0)
            if not shifted_stores:
                T.assume(M % v == 0)
            tx = T.get_thread_binding()
            b, m0, n0 = _tile_origin(tile_id, tiles_m, tiles_n, block_m, block_n)
            S = T.alloc_shared((smem,), dtype)
            block = T.alloc_local((v, v), dtype)
            rows = T.view(block, (v, 4), "uint32")  # each unit row as words
            cols = T.alloc_local((p, 4), "uint32")  # the 4 words of p output chunks
            col_elems = T.view(cols, (p, v), dtype)
            if m0 + block_m <= M and n0 + block_n <= N:
                load_tile(x, S, b, m0, n0, tx, False)
                cp_async_wait_all()
                T.sync_threads()
                store_tile(out, S, b, m0, n0, tx, block, rows, cols, col_elems, False)
            else:
                load_tile(x, S, b, m0, n0, tx, True)
                cp_async_wait_all()
                T.sync_threads()
                store_tile(out, S, b, m0, n0, tx, block, rows, cols, col_elems, True)

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
    bits, mode = 8 * x.element_size(), _access_mode(xb, ob)
    if mode == "vector_load" or (mode == "vector" and bits < 32):  # "vector_load": output rows unaligned
        k = transpose_shared_kernel.get(x.device, elem_bits=bits, shifted_stores=mode == "vector_load")
    else:
        k = transpose_kernel.get(x.device, elem_bits=bits, mode=mode)
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
        checks.check_disjoint(op, "out", out, "x", x)
    return shape


def _transpose_into(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[b] = x[b].T`` for a checked 3-D ``x`` and its checked (or fresh) ``out``; returns ``out``."""
    if out.numel():
        if x.is_cuda:
            _batched_transpose_op(x, out)
        else:
            out.copy_(reference.batched_transpose(x))
    return out


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
            shape or device, is not contiguous or overlaps ``x`` in memory.
    """
    shape = _check("batched_transpose", x, 3, out)
    return _transpose_into(x, torch.empty(shape, dtype=x.dtype, device=x.device) if out is None else out)


def transpose(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Transposes a 2-D tensor ``(M, N)`` into a new contiguous ``(N, M)`` tensor (or ``out``).

    Same dtypes, layouts, semantics and errors as ``batched_transpose`` with one batch; the row stride
    may exceed ``N``.
    """
    shape = _check("transpose", x, 2, out)
    if out is None:
        return _transpose_into(x.unsqueeze(0), torch.empty((1, *shape), dtype=x.dtype, device=x.device)).squeeze(0)
    _transpose_into(x.unsqueeze(0), out.unsqueeze(0))
    return out
