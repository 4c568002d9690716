"""Lossless FP4 -> FP8 block re-quantization: ``cast_back(result) == cast_back(input)`` bit for bit.

Input: ``x = (data, sf)``, ``data`` packed e2m1 int8 ``(T, H/2)`` (contiguous), ``sf`` power-of-two
scales for blocks ``x_block_size = (bm_in, bk_in)`` in any SF layout (row-major fp32, TMA-aligned
column-major fp32, packed UE8M0 int32). Output: float8_e4m3fn ``(T, H)`` and power-of-two scales for
``out_block_size = (bm_out, bk_out)`` in the layout of the output flags.

Math, for each output block ``B`` (the input blocks it covers that hold elements):

- ``e_i`` = biased exponent of input scale ``i`` (0..255; an fp32 scale must be ``+2**(e-127)`` or
  ``+0.0``; a UE8M0 byte is the exponent itself);
- ``E = max e_i``; ``e_out = max(E - 6, 1)``: the output scale is ``2**(e_out - 127)``, never the
  UE8M0 byte 0 (which decodes to 0.0; §15.7 of the spec);
- ``out = e4m3(fp4 * 2**(e_i - e_out))`` (``+-0`` for a zero scale). This is exact when
  ``d_i = e_i - e_out`` is in ``[-8, 6]``: ``6 * 2**6 = 384 <= 448`` and the smallest fp4 step
  ``0.5 * 2**-8 = 2**-9`` is the e4m3 subnormal step, so the admissible spread of the input scales of
  one output block is ``2**14`` (1.0.0 allowed only ``2**11``).

Inadmissible input (a scale that is not a non-negative power of two or zero, an inf/NaN scale or the
UE8M0 byte 255, or ``d_i < -8``) is counted per 32-column row segment: each CTA writes its count to its
own int32 slot (no counter to zero, so the cast is one launch). The wrapper raises ``ValueError`` when the
slots sum to more than zero (``check=True``, the default: one host sync; the slots are then zeroed pinned host
memory that only CTAs with a nonzero count write, ``tk_core.hostmem``, so no device-to-host copy is needed).
``check=False`` never synchronises (use it under CUDA graphs / ``torch.compile``); pass your own zeroed
``error_count`` (int32 ``(1,)``) to have the count added to it on the device. Offending segments are written
deterministically but not losslessly.

``round_sf`` must be True (the output scales are powers of two by construction; False is rejected).
Constraints: ``fmt == 'e4m3'``; logical ``H % 32 == 0``; ``bk_in`` and ``bk_out`` powers of two with
``32 <= bk_in <= bk_out <= 1024``; ``bm_in, bm_out`` powers of two, ``bm_out % bm_in == 0``,
``bm_out <= 128``.

Kernel: 256 threads; each thread turns 8 bytes of fp4 (16 values of one row) into one 16-byte e4m3 store (1,024-column
blocks: 32 values and two stores, ``row_seg``) per pass, for P consecutive rows (the lanes of a warp store contiguous
bytes): an 8-entry byte LUT per row (two integer multiply-adds when every value of the row stays a normal
e4m3 number, ``d_i >= LUT_D_MIN``; else the exact hardware fp32->e4m3 conversion, two values per F2FP) and two byte
permutes per 4 values (magnitude from the LUT, sign bit moved into place). The block maximum of exponents is taken
in-thread over the rows, then with warp shuffles (``bm_out == 1``: one warp per 512-column (1,024) row segment;
lanes that share an input scale skip their step), and through shared memory (one partial per warp, one barrier per
tile) only for blocks taller than a warp's rows. A persistent grid (SMs x 1-6 CTAs, ``default_min_blocks``) walks
the tiles and prefetches the next tile (the next two for 1-row output blocks; data and raw input scales) into
register buffers while the current one is converted and stored. Index math is int32 per tile. The token count and
the input SF strides are runtime arguments.
"""

import tilelang.language as T
import torch

from tk_core import checks, config, hostmem
from tk_core.jit import kernel
from tk_core.layout import align, ceil_div, is_power_of_two
from tk_core.library import device_op

from . import _tl
from .common import check_block_pair, check_quant_input, scratch, sf_out_layout
from .per_block_cast import alloc_sf_storage

OP = "per_block_cast_lossless"
THREADS = 256
# Logical fp4 values per thread and row: 16 (an 8-byte load, one 16-byte store), so the lanes of a warp store
# contiguous bytes; with 32 (a 16-byte load, two 16-byte stores 32 bytes apart) each store instruction fills only
# half of every 32-byte sector it touches. On the H200, 16 values x 4 rows measured 3,456 / 3,397 / 3,378 / 3,393
# GB/s on the anchor lines (1 x 128, 32 x 32, 128 x 128, 1 x 128 packed) against 3,464 / 2,632 / 2,602 / 3,128 with
# 32 values x 2 rows (sweeps/sweep_lossless_s4.log).
SEG = 16
ERR_SEG = 32  # columns per counted error: the unit of the spec's error count (and the smallest input block)
# Consecutive rows per thread (at least; raised so that a tile holds a whole output block row: 4 for 128 x 128).
# 2 rows at 5-6 CTAs per SM measured 1.3-2.0 % faster than 4 rows at 3 on the 1 x 128 and 32 x 32 lines once the
# byte LUT came from integer arithmetic (H200, ``sweep_lossless.py default p2mb5 p2mb6``; PERF-NOTES session 19);
# before it, 2 rows had been 1-2 % slower on the 2-D blocks. 8 rows per thread at 32 values lost 10-14 % (fewer warps).
PASSES = 2


def default_bufs(bm_out: int) -> int:
    """Tile buffers per thread (``bufs - 1`` tiles in flight while one is converted): 3 for one-row output blocks,
    2 otherwise. A third buffer measured +0.8-0.9 % on the 1 x 128 lines and -0.9 / -1.9 % on 32 x 32 / 128 x 128
    (4 rows per thread at 3 CTAs per SM; H200, two alternating runs; PERF-NOTES session 18), and at 2 rows and 6
    CTAs per SM +2.6 / +2.9 % on the 1 x 128 lines (session 19); a fourth at 2 CTAs per SM lost on three lines."""
    return 3 if bm_out == 1 else 2


def default_min_blocks(rows: int, bm_out: int, bk_out: int, in_kind: str, seg: int = SEG) -> int:
    """CTAs per SM for ``rows`` rows of ``seg`` values per thread. The tuned tiles (``SEG`` values; H200, PERF-NOTES
    session 19): 2 rows at 6 CTAs for one-row output blocks from fp32 input scales up to 512 columns (39-40 registers
    on sm_90a with three tile buffers; 32 x 32 blocks lost 5 % there; UE8M0 input spills at 40) and 5 otherwise
    (42-48); 4 rows (128 x 128 blocks) 3 (64-68; 5 lost 5 %); 8 rows (64 x 512) 2 (90-104). Else by the 16-value pieces
    a tile buffer holds per thread, the most CTAs whose register cap holds both buffers without spills on sm_90a and
    sm_100a: up to 4 pieces 4 CTAs (32 values x 2 rows, the 1,024-column blocks' ``row_seg`` tile: 55-64 registers),
    8 pieces 3 (32 x 4: 32 x 1,024 blocks spilled 16 bytes at 4, 77-80 at 3), 16 pieces in at most 8 rows 2 (64 x
    1,024 blocks: 119-128), else 1 (16 rows, 128 x 512 and 128 x 1,024 blocks: 128 x 512 spilled 16-36 bytes at 2).
    """
    if seg == SEG and rows == 2:
        return 6 if bm_out == 1 and in_kind == "fp32" and bk_out <= 512 else 5
    if seg == SEG and rows in (4, 8):
        return 3 if rows == 4 else 2
    pieces = rows * seg // 16  # 16-value (8-byte) pieces per row buffer
    return 4 if pieces <= 4 else 3 if pieces <= 8 else 2 if pieces <= 16 and rows <= 8 else 1


def row_seg(bk_out: int, seg: int = SEG) -> int:
    """Values per thread and row: ``seg``, or for output blocks wider than a warp's ``32 * seg`` columns (1,024)
    ``bk_out / 32``, so that a block's row is one warp's: with 16 values a 1 x 1,024 block spanned two warps, each
    taking the maximum of its own 512 columns, and taller 1,024-column blocks left no whole row to a warp at all
    (zero rows per warp: the kernel could not be built)."""
    return max(seg, bk_out // 32)


def _tile(bm_out: int, bk_out: int, passes: int = PASSES, seg: int = SEG,
          threads: int = THREADS) -> tuple[int, int, int]:
    """(BK, TPR, P): BK columns per tile, TPR threads per row (``row_seg`` columns each), P consecutive rows per
    thread. ``bm_out == 1``: one warp per row segment (BK = 32 * seg), so the output scales a warp writes for one
    row are a contiguous run. A tile holds whole output block rows."""
    seg = row_seg(bk_out, seg)
    BK = 32 * seg if bm_out == 1 else max(bk_out, 128)
    TPR = BK // seg
    return BK, TPR, max(passes, bm_out * TPR // threads)


def num_ctas(t: int, h: int, bm_out: int, bk_out: int, in_kind: str, sms: int) -> int:
    """CTAs (and error slots) the op launches for ``t`` tokens of ``h`` values: SMs x CTAs per SM, or one per
    tile when there are fewer tiles."""
    bk, tpr, p = _tile(bm_out, bk_out)
    rows = THREADS // tpr * p  # rows per tile
    return min(ceil_div(h, bk) * ceil_div(t, rows),
               sms * default_min_blocks(p, bm_out, bk_out, in_kind, row_seg(bk_out)))


_FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of the e2m1 codes 0..7


def _pack_bytes(b) -> int:
    return b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24


# The byte LUT by integer arithmetic: for ``LUT_D_MIN <= d <= 6`` every ``code * 2**d`` is a normal e4m3 value
# (or zero), so its byte is the byte at ``d = 0`` plus ``8 * d`` (the exponent field) for every nonzero code: one
# IMAD per LUT word instead of seven multiplications and four conversions. ``d <= 6`` always holds (``e_out >= E -
# 6``); below ``LUT_D_MIN`` (0.5 * 2**d under 2**-6, subnormal) and for zero scales the float path builds the LUT.
_E4M3_AT_D0 = torch.tensor(_FP4).to(torch.float8_e4m3fn).view(torch.uint8).tolist()
LUT_D_MIN = -5
LUT_BASE = (_pack_bytes(_E4M3_AT_D0[:4]), _pack_bytes(_E4M3_AT_D0[4:]))
LUT_STEP = tuple(_pack_bytes([8 if b else 0 for b in half]) for half in (_E4M3_AT_D0[:4], _E4M3_AT_D0[4:]))

# Device helpers (exact; bit-identical to a per-value ``(float8_e4m3fn)(code * scale)`` plus the sign bit):
# - tk_e4m3x4: the 4 e4m3 bytes of 4 floats, two hardware RN/satfinite conversions (F2FP pairs);
# - tk_fp4x4_lo/hi: the e4m3 bytes of the fp4 codes in nibbles 0-3 / 4-7 of a word. The magnitude byte comes
#   from the 8-entry LUT (l0, l1) by a byte permute on the codes & 7; the sign (bit 3 of each nibble) lands in
#   bit 7 of each byte by a second byte permute of v and v << 4 (odd nibbles: bit 7 of a byte of v; even
#   nibbles: bit 7 of a byte of v << 4), masked into the LUT byte by one LOP3. About 10 SASS per 8 values.
_PRELUDE = r"""
__device__ __forceinline__ unsigned tk_e4m3x4(float a, float b, float c, float d) {
  unsigned short lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
  return (unsigned)lo | ((unsigned)hi << 16);
}
__device__ __forceinline__ unsigned tk_fp4x4_lo(int w, unsigned l0, unsigned l1) {
  unsigned v = (unsigned)w;
  return __byte_perm(l0, l1, v & 0x7777u) | (__byte_perm(v, v << 4, 0x1504u) & 0x80808080u);
}
__device__ __forceinline__ unsigned tk_fp4x4_hi(int w, unsigned l0, unsigned l1) {
  unsigned v = (unsigned)w;
  return __byte_perm(l0, l1, (v >> 16) & 0x7777u) | (__byte_perm(v, v << 4, 0x3726u) & 0x80808080u);
}
"""


# The bounds of every access are already guarded by the row/column tests: the legalizer's extra checks would
# load the input scale twice. TileLang puts the error count's words on the block-maximum partials (ordered by the
# barrier that starts ``_tl.store_cta_count``).
@kernel(pass_configs={"tl.disable_safe_memory_legalize": True}, shared_aliases=[("part", "warp_err")])
def per_block_cast_lossless_kernel(
    hidden: int,
    bm_in: int,
    bk_in: int,
    in_kind: str,
    bm_out: int,
    bk_out: int,
    layout: str,
    passes: int = 0,
    min_blocks: int = 0,
    seg: int = SEG,
    zero_counts: bool = True,
    bufs: int = 0,
    int_lut: bool = True,
    threads: int = THREADS,
):
    """``in_kind``: ``"fp32"`` (any strides) or ``"packed"`` (UE8M0 bytes); ``layout``: output SF layout;
    ``passes``: consecutive rows per thread (a power of two; 0: ``PASSES``; raised so that a tile
    holds a whole output block row); ``bufs``: tile buffers (0: ``default_bufs``); ``int_lut`` False: every row's
    byte LUT by the float conversions (the sweep's reference point for the integer path); ``threads``: CTA size
    (``THREADS``; 512 gives 128 x 128 blocks a 2-row tile: a sweep variant, slower on every line).

    Persistent: one CTA per slot of ``err`` (the op launches ``num_ctas``: at most SMs x ``min_blocks``;
    ``min_blocks`` 0: ``default_min_blocks``) loop over the tiles, and each loads the tile ``bufs - 1`` ahead (data
    and raw input scales) into the register buffer the previous tile freed (the loop is unrolled by ``bufs``: no
    copies between them) before it converts and stores the current one, so loads stay in flight across the
    conversion and the stores.

    Block maximum: in-thread over a thread's rows, then xor-shuffles over the lanes of the block; only blocks
    taller than a warp's rows (128 x bk) go through shared memory: one partial per warp (one buffer per tile
    buffer), one barrier per tile.

    Each CTA writes its count of inadmissible 32-column row segments to its slot of ``err``, zero or not, so
    no counter has to be zeroed by another launch; with ``zero_counts`` False only a nonzero count is written
    (the slots are zeroed host memory that the check reads, ``tk_core.hostmem``: nothing crosses the bus when
    the input is clean)."""
    seg = row_seg(bk_out, seg)
    BK, TPR, P = _tile(bm_out, bk_out, passes or PASSES, seg, threads)
    min_blocks = min_blocks or default_min_blocks(P, bm_out, bk_out, in_kind, seg)
    bufs = bufs or default_bufs(bm_out)
    num_tokens = T.dynamic("num_tokens")
    sf_in_len = T.dynamic("sf_in_len")
    sf_len = T.dynamic("sf_len")
    num_ctas = T.dynamic("num_ctas")
    WR = 32 // TPR * P  # rows per warp
    BM = threads // 32 * WR
    NBC = BK // bk_out  # output block columns per tile
    G = max(P // bm_out, 1)  # block maxima per thread (one per group of bm_out rows)
    WPB = max(bm_out // WR, 1)  # warps per block (> 1: shared memory)
    NBR = BM // (WR * WPB)  # block rows (of warps) per tile
    NXT = ceil_div(hidden, BK)  # column tiles
    nk = ceil_div(hidden, bk_out)
    in_dtype = "uint8" if in_kind == "packed" else "int32"
    sf_dtype = "uint8" if layout == "packed" else "float32"
    # lane distances of the block maximum's butterfly; a step that pairs lanes of one input block (the same scale:
    # columns within bk_in, rows within bm_in) changes nothing and is left out
    offsets = [1 << i for i in range(5) if bk_in // seg <= (1 << i) < bk_out // seg]
    offsets += [TPR << i for i in range(5) if (TPR << i) < 32 and bm_in <= (P << i) < bm_out]

    @T.macro
    def load(x, sf_in, s0, s1, xb, sw, lr, lc, tile, tx):
        """Data and raw input scale words of ``tile`` (zeros outside the tensor: exponent 0, admissible)."""
        # int32 row and column (in seg-value units: the vector accesses stay provably aligned); as expressions
        # they are widened to int64 (64-bit div/mod by NXT)
        lc[0] = T.truncmod(tile, NXT) * TPR + tx % TPR
        lr[0] = T.truncdiv(tile, NXT) * BM + (tx // TPR) * P
        for p in T.unroll(P):
            row = lr[0] + p
            if row < num_tokens and lc[0] < hidden // seg:
                for v in T.vectorized(seg // 8):
                    xb[p, v] = x[row, lc[0] * (seg // 8) + v]
                if in_kind == "packed":
                    m_in = row // bm_in
                    k_in = lc[0] // (bk_in // seg)
                    sw[p] = T.cast(sf_in[4 * (m_in * s0 + (k_in // 4) * s1) + k_in % 4], "int32")
                else:
                    sw[p] = sf_in[(row // bm_in) * s0 + (lc[0] // (bk_in // seg)) * s1]
            else:
                sw[p] = 0

    @T.macro
    def convert(out, sf, nerr, part, xin, sw, lr, lc, par, tx, nm):
        """Block maxima, output scales and e4m3 bytes of the tile held in ``xin``/``sw``."""
        ex = T.alloc_local((P,), "int32")
        bad = T.alloc_local((P,), "int32")
        em = T.alloc_local((G,), "int32")
        ow = T.alloc_local((seg // 4,), "uint32")
        lut = T.alloc_local((2,), "uint32")
        scl = T.alloc_local((1,), "float32")
        cb = (tx % TPR) * seg // bk_out  # output block column inside the tile
        for p in T.unroll(P):
            if in_kind == "packed":
                ex[p] = sw[p]
                bad[p] = T.if_then_else(ex[p] == 255, 1, 0)
            else:
                ex[p] = T.bitwise_and(T.shift_right(sw[p], 23), 0xFF)
                bad[p] = T.if_then_else(T.bitwise_and(sw[p], T.int32(-0x7F800001)) != 0 or ex[p] == 255, 1, 0)
        for g in T.unroll(G):
            em[g] = ex[g * (P // G)]
            for q in range(1, P // G):
                em[g] = T.max(em[g], ex[g * (P // G) + q])
            for off in offsets:
                em[g] = T.max(em[g], T.shfl_xor(em[g], off))
        if WPB > 1:
            # one partial per warp and block column; consecutive tiles use different buffers, so a fast warp writing
            # the next tile's partials never overwrites ones a slow warp still reads
            w = tx // 32
            if (tx % 32) % TPR % (bk_out // seg) == 0 and (tx % 32) < TPR:
                part[((par * NBR + w // WPB) * NBC + cb) * WPB + w % WPB] = em[0]
            T.sync_threads()
            for q in T.unroll(WPB):
                em[0] = T.max(em[0], part[((par * NBR + w // WPB) * NBC + cb) * WPB + q])
        for p in T.unroll(P):
            row = lr[0] + p
            e_out = T.max(em[p // (P // G)] - 6, 1)
            if row < num_tokens and lc[0] < hidden // seg:
                d = ex[p] - e_out
                # one count per 32-column segment: its threads share the input scale (bk_in >= 32)
                if (bad[p] != 0 or (ex[p] != 0 and d < -8)) and lc[0] % (ERR_SEG // seg) == 0:
                    nerr[0] += 1
                if int_lut and ex[p] != 0 and d >= LUT_D_MIN:
                    lut[0] = T.uint32(LUT_BASE[0]) + T.cast(d, "uint32") * T.uint32(LUT_STEP[0])
                    lut[1] = T.uint32(LUT_BASE[1]) + T.cast(d, "uint32") * T.uint32(LUT_STEP[1])
                else:
                    scl[0] = T.if_then_else(ex[p] == 0, T.float32(0), _tl.pow2(T.max(d, -126)))
                    s = scl[0]
                    lut[0] = T.call_extern("uint32", "tk_e4m3x4", T.float32(0), T.float32(_FP4[1]) * s, s,
                                           T.float32(_FP4[3]) * s)
                    lut[1] = T.call_extern("uint32", "tk_e4m3x4", T.float32(_FP4[4]) * s, T.float32(_FP4[5]) * s,
                                           T.float32(_FP4[6]) * s, T.float32(_FP4[7]) * s)
                for i in T.unroll(seg // 8):
                    ow[2 * i] = T.call_extern("uint32", "tk_fp4x4_lo", xin[p, i], lut[0], lut[1])
                    ow[2 * i + 1] = T.call_extern("uint32", "tk_fp4x4_hi", xin[p, i], lut[0], lut[1])
                for j in T.vectorized(seg // 4):
                    out[row, lc[0] * (seg // 4) + j] = ow[j]
                if row % bm_out == 0 and lc[0] % (bk_out // seg) == 0:
                    m = row // bm_out
                    k = lc[0] // (bk_out // seg)
                    if layout == "packed":
                        sf[_tl.sf_offset(layout, m, k, nm, nk)] = T.cast(e_out, "uint8")
                        if k == nk - 1:
                            for z in T.serial(align(nk, 4) - nk):
                                sf[_tl.sf_offset(layout, m, nk + z, nm, nk)] = T.uint8(0)
                    else:
                        sf[_tl.sf_offset(layout, m, k, nm, nk)] = T.reinterpret(T.shift_left(e_out, 23), "float32")

    @T.macro
    def step(x, sf_in, s0, s1, out, sf, nerr, part, xc, swc, rc, cc, xn, swn, rn, cn, it, niter, nctas, bid, tx, nm,
             par):
        """Tile ``it``: load tile ``it + bufs - 1`` into the buffer freed by tile ``it - 1``, then convert this one."""
        if it < niter:
            if it + bufs - 1 < niter:
                load(x, sf_in, s0, s1, xn, swn, rn, cn, bid + (it + bufs - 1) * nctas, tx)
            convert(out, sf, nerr, part, xc, swc, rc, cc, par, tx, nm)

    @T.prim_func
    def main(
        x: T.Tensor((num_tokens, hidden // 8), "int32"),
        sf_in: T.Tensor((sf_in_len,), in_dtype),
        out: T.Tensor((num_tokens, hidden // 4), "uint32"),
        sf: T.Tensor((sf_len,), sf_dtype),
        err: T.Tensor((num_ctas,), "int32"),
        s0: T.int32,
        s1: T.int32,
    ):
        ntiles = NXT * T.ceildiv(num_tokens, BM)
        with T.Kernel(num_ctas, threads=threads, prelude=_PRELUDE) as bid:
            if min_blocks > 1:
                T.annotate_min_blocks_per_sm(min_blocks)
            tx = T.get_thread_binding()
            # tile buffers: data, raw input scale words, first row, column
            buf = [(T.alloc_local((P, seg // 8), "int32"), T.alloc_local((P,), "int32"), T.alloc_local((1,), "int32"),
                    T.alloc_local((1,), "int32")) for _ in range(bufs)]
            part = T.alloc_shared((bufs * NBR * NBC * WPB,), "int32")
            nerr = T.alloc_local((1,), "int32")
            warp_err = T.alloc_shared((threads // 32,), "int32")
            nerr[0] = 0
            nm = T.ceildiv(num_tokens, bm_out)
            niter = T.truncdiv(ntiles - bid + num_ctas - 1, num_ctas)

            load(x, sf_in, s0, s1, *buf[0], bid, tx)
            for b in tuple(range(1, bufs - 1)):  # a tuple: the builder turns a plain range into a TIR loop
                if b < niter:
                    load(x, sf_in, s0, s1, *buf[b], bid + b * num_ctas, tx)
            for itb in T.serial(T.truncdiv(niter + bufs - 1, bufs)):
                # bufs tiles per step, one per buffer (no copies between them)
                for b in tuple(range(bufs)):
                    step(x, sf_in, s0, s1, out, sf, nerr, part, *buf[b], *buf[(b + bufs - 1) % bufs], itb * bufs + b, niter,
                         num_ctas, bid, tx, nm, b)
            # this CTA's error count, written whether or not it is zero: no counter to zero before the launch
            _tl.store_cta_count(err, bid, nerr, warp_err, tx, threads // 32, zero_counts)

    return main


# --- device op ------------------------------------------------------------------------------------


@device_op("tk_quant::per_block_cast_lossless_", mutates_args=("out", "sf_flat", "error_slots"))
def per_block_cast_lossless_(
    data: torch.Tensor,
    sf_in_flat: torch.Tensor,
    s0: int,
    s1: int,
    out: torch.Tensor,
    sf_flat: torch.Tensor,
    error_slots: torch.Tensor | None,
    bm_in: int,
    bk_in: int,
    bm_out: int,
    bk_out: int,
    layout: str,
    zero_counts: bool = True,
) -> None:
    """One CTA per slot of ``error_slots`` (``num_ctas``), each writing its error count there (only a nonzero
    one without ``zero_counts``: the caller zeroed the slots); None: ``num_ctas`` slots of scratch, which nobody
    reads."""
    in_kind = "packed" if sf_in_flat.dtype == torch.uint8 else "fp32"
    # (rows per thread and CTAs per SM: the kernel's defaults, the rule ``num_ctas`` sizes the slots by)
    k = per_block_cast_lossless_kernel.get(
        data.device, hidden=out.shape[1], bm_in=bm_in, bk_in=bk_in, in_kind=in_kind, bm_out=bm_out, bk_out=bk_out, layout=layout,
        zero_counts=zero_counts,
    )
    if error_slots is None:
        n = num_ctas(out.shape[0], out.shape[1], bm_out, bk_out, in_kind, config.get_num_sms(data.device.index))
        error_slots = scratch(data.device, torch.int32, n)[:n]
    k(data.view(torch.int32), sf_in_flat, out.view(torch.uint32), sf_flat, error_slots, s0, s1)


# --- public function ------------------------------------------------------------------------------


def _check_block(op: str, arg: str, block) -> tuple[int, int]:
    bm, bk = check_block_pair(op, arg, block)
    if not (is_power_of_two(bm) and is_power_of_two(bk)):
        checks.fail(op, arg, "powers of two", repr(tuple(block)))
    return bm, bk


def _sf_flat(sf: torch.Tensor):
    """(flat storage, s0, s1) of an input SF; packed int32 -> bytes with word strides."""
    s0, s1 = sf.stride()
    extent = 1 + sum((n - 1) * s for n, s in zip(sf.shape, sf.stride()) if n > 0)
    flat = sf.as_strided((extent,), (1,))
    if sf.dtype == torch.int32:
        return flat.view(torch.uint8), s0, s1
    return flat.view(torch.int32), s0, s1


def per_block_cast_lossless(
    x: tuple[torch.Tensor, torch.Tensor],
    fmt: str,
    x_block_size: tuple[int, int],
    out_block_size: tuple[int, int],
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = True,
    use_packed_ue8m0: bool = False,
    check: bool = True,
    error_count: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-quantizes FP4 data with power-of-two block scales to e4m3 with coarser power-of-two scales,
    losslessly (see the module docstring for the math and the admissible range).

    ``x = (data int8 (T, H/2), sf)`` with input blocks ``x_block_size``; returns ``(out e4m3 (T, H),
    sf_out)`` with blocks ``out_block_size`` in the layout of the flags. ``check=True`` synchronises
    once and raises ``ValueError`` if any input scale of this call is inadmissible; ``check=False`` does not
    synchronise (CUDA graphs); the count of offending 32-column row segments is added to ``error_count``
    (int32 ``(1,)``, zeroed by the caller) when it is given.
    """
    if fmt != "e4m3":
        checks.fail(OP, "fmt", "'e4m3'", repr(fmt))
    checks.check_bool(OP, "round_sf", round_sf)
    checks.check_bool(OP, "check", check)
    if not round_sf:
        checks.fail(OP, "round_sf", "True (lossless output scales are always powers of two)", round_sf)
    q = check_quant_input(OP, x, x_block_size, data_fmts=("e2m1",))
    data, sf_in = x
    checks.check_contiguous(OP, "x[0] (data)", data)
    bm_in, bk_in = _check_block(OP, "x_block_size", x_block_size)
    bm_out, bk_out = _check_block(OP, "out_block_size", out_block_size)
    t, h = q.t, q.h
    checks.check_divisible(OP, "hidden (logical)", h, ERR_SEG)
    if not 32 <= bk_in <= bk_out <= 1024:
        checks.fail(OP, "x_block_size[1] and out_block_size[1]", "powers of two with 32 <= bk_in <= bk_out <= 1024", (bk_in, bk_out))
    if bm_out % bm_in or bm_out > 128:
        checks.fail(OP, "out_block_size[0]", f"a multiple of x_block_size[0]={bm_in} and at most 128", bm_out)
    if sf_in.dtype not in (torch.float32, torch.int32):
        checks.fail(OP, "x[1] (sf)", "float32 or packed UE8M0 int32 power-of-two scales", sf_in.dtype, TypeError)
    checks.check_same_device(OP, "x[1] (sf)", sf_in, data.device)
    layout = sf_out_layout(OP, use_tma_aligned_col_major_sf, use_packed_ue8m0, True)
    if error_count is not None:
        checks.check_dtype(OP, "error_count", error_count, torch.int32)
        checks.check_shape(OP, "error_count", error_count, (1,))
        checks.check_same_device(OP, "error_count", error_count, data.device)
    if data.device.type != "cuda":
        from . import reference

        out, sf, n_err = reference.per_block_cast_lossless(
            x, fmt, (bm_in, bk_in), (bm_out, bk_out), use_tma_aligned_col_major_sf, True, use_packed_ue8m0
        )
        if error_count is not None:
            error_count += n_err
    else:
        out, sf, n_err = _cast_on_device(data, sf_in, t, h, bm_in, bk_in, bm_out, bk_out, layout, check, error_count)
    if check and n_err:
        checks.fail(OP, "x", "FP4 data with power-of-two scales whose spread per output block is at most 2**14",
                    f"{n_err} inadmissible 32-column row segments")
    return out, sf


def _cast_on_device(data: torch.Tensor, sf_in: torch.Tensor, t: int, h: int, bm_in: int, bk_in: int, bm_out: int,
                    bk_out: int, layout: str, check: bool, error_count: torch.Tensor | None):
    """(out, sf, inadmissible segments counted: 0 unless ``check``) of the kernel on ``data``'s CUDA device; the
    count is added to ``error_count`` on the device."""
    out = torch.empty((t, h), dtype=torch.float8_e4m3fn, device=data.device)
    flat, sf = alloc_sf_storage(ceil_div(t, bm_out), ceil_div(h, bk_out), layout, data.device)
    n_err = 0
    if t:
        counts = slots = None  # None: nobody reads the counts, the op writes them to scratch
        if check or error_count is not None:
            in_kind = "packed" if sf_in.dtype == torch.int32 else "fp32"
            n_slots = num_ctas(t, h, bm_out, bk_out, in_kind, config.get_num_sms(data.device.index))
            # check=True: the slots are zeroed pinned host memory that the kernel writes only with a nonzero count,
            # so the check costs a stream sync and no device-to-host copy (else a copy of the slots to the host)
            counts = hostmem.host_counts(n_slots, data.device) if check else None
            if counts is not None:
                slots = counts.zeroed(n_slots)
            else:
                slots = torch.empty(n_slots, dtype=torch.int32, device=data.device)
        sf_in_flat, s0, s1 = _sf_flat(sf_in)
        per_block_cast_lossless_(data, sf_in_flat, s0, s1, out, flat, slots, bm_in, bk_in, bm_out, bk_out, layout,
                                 counts is None)
        if counts is not None:
            n_err = counts.collect(n_slots)
            if error_count is not None:
                error_count += n_err
        else:
            if error_count is not None:
                error_count += slots.sum(dtype=torch.int32)
            n_err = int(slots.cpu().sum()) if check else 0
    return out, sf, n_err
