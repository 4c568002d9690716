"""Engram decode step (TileOPs ``EngramDecodeFwdOp`` contract, with an in-place ring cache).

Per batch row b, with e_t (B, d_mem), h_t (B, d), W_K, W_V (d_mem, d) ("x @ W" layout, no bias):

    k = round_T(e_t @ W_K), v = round_T(e_t @ W_V)     (float32 accumulation, rounded like a prefill's GEMM)
    the gate of ``gate_conv`` on (h_t, k, v): alpha, vhat = alpha v (float32), r_v, n = round_T(vhat w_v r_v)
    u = conv_w[w-1] n + sum_{q=1..w-1} conv_w[w-1-q] * cache[b, (pos_b - q*dilation) mod L]
    y = round_T(SiLU(u) + vhat);     cache[b, pos_b mod L] = n        (in place)

The cache ``conv_state`` (B, L, d), L >= dilation*(w-1), is a ring: slot (tau mod L) holds n of the token at
position tau; ``cache_pos`` (B,) int32 holds each row's current position (the caller advances it; the op
object does ``cache_pos += 1`` by default). A zero cache with cache_pos = 0 is an empty history; the
``conv_state`` returned by ``engram_gate_conv_fwd`` for T prompt tokens continues at cache_pos = T, so a
prefill followed by N decode steps reproduces the prefill of all T + N tokens. Only the w-1 lagged slots are
read and one slot written per step (no shift copy).

Kernels (``decode_plan`` picks one path per shape; every sum has a fixed order, no float atomics, so results
are identical run to run):
- up to ``GEMV_MAX_BATCH`` rows, one launch of ``decode_gemv_kernel``: one CTA per 64-column panel of W_K or
  W_V over all of d_mem, through a per-warp TMA ring in shared memory (W's copies under the L2 evict-first hint)
  where the panels are whole and the grid is resident at once, else straight into registers for mma.sync (no
  split-K); the V CTAs wait for all K CTAs' row sums, then do the gate, convolution and cache update. Measured
  8-13 % faster than the fused kernel at B = 1 / 8 on the H200 (its docstring). With the ring at one CTA per SM
  (d <= 4224, d_mem a multiple of 256; from 33 rows of 512) the same launch takes up to ``GEMV_RING_MAX_BATCH`` rows,
  all in one CTA per panel (from 33 rows two warps per ring slot).
- more rows (at d <= 4096 without the ring: 17 to 31 rows), one launch of ``decode_fused_kernel``: a tensor-core
  projection for both weights (W read once for up to 64 rows per 64-column panel; d_mem split into float32
  partials so that the grid fills the GPU) whose last CTA per panel (an arrival counter) sums the partials in a
  fixed order, publishes the panel's row sums and, after a barrier among the panel finishers, does the gate,
  convolution and cache update for its columns.
- 32 rows or more at d <= 4096 (measured faster there than the fused kernel, ``TWO_LAUNCH_MIN_BATCH``; without the
  ring, or more than ``GEMV_RING_MAX_BATCH`` rows), and whenever there are too
  many waiting CTAs for the SMs, two launches: ``decode_proj_kernel``, then a cluster of ``STEP_CLUSTER`` CTAs per
  row (``decode_step_kernel``).
Runtime: batch, L, positions, eps. The sigmoid of the gate and the SiLU come from the hardware's approximate exp2
and reciprocal (``SILU_APPROX``, as in the GateConv kernels): the IEEE division's slow-path branches serialised the
one-warp epilogue that every V CTA runs after its wait (1.73 -> 1.25 us per CTA on the H200, PERF-NOTES session 27).

Roofline bytes (e = element size; the benchmark's ``bytes``):
    2*d_mem*d*e (W_K, W_V) + B*d_mem*e (e_t) + B*d*e (h_t) + B*d*e (y) + B*w*d*e (w-1 cache reads + 1 write)
    + (2 + w)*d*e (weights) + 4*B (positions)
The float32 partials of k and v of the fused and two-launch paths (splits*2*B*d*4, written and read once, mostly
in L2) and the row sums are not counted.
"""

import math

import tilelang.language as T
import torch
from tilelang import layout as tl_layout
from tvm import tirx

from tk_core import checks, config
from tk_core.jit import MAX_SMEM_PER_BLOCK, kernel
from tk_core.layout import ceil_div
from tk_core.library import device_op

from . import reference
from ._gate_conv_kernels import _CLUSTER, SILU_APPROX, VEC, add_row_sums, cluster_sync
from .gate_conv import (
    _CPU_DTYPES,
    _TL_DTYPES,
    _aligned,
    _check_dilation,
    _check_params,
    _check_taps,
    _check_target,
    _use_reference,
)

# CTAs per batch row in the step kernel (a thread block cluster): 8 SMs instead of 1 load a row at small batch.
STEP_CLUSTER = 8
_SMS = 132  # H100 / H200 SXM; the grid heuristics below only need the order of magnitude


def gate_of(part, i: int, d: int, eps):
    """(a, r_v) of a row from its sums ``part[i..i+4)`` = (h.h, k.k, (h w_h).(k w_h), v.v): r_h, r_k the reciprocal
    RMS of h and k, a = sigmoid(r_h r_k (h w_h).(k w_h) / sqrt(d)), r_v the reciprocal RMS of a v."""
    r_h = T.rsqrt(part[i] * (1.0 / d) + eps)
    r_k = T.rsqrt(part[i + 1] * (1.0 / d) + eps)
    a = T.call_extern("float32", "tk_sigmoid_approx", r_h * r_k * part[i + 2] * (1.0 / math.sqrt(d)))
    return a, T.rsqrt(a * a * (part[i + 3] * (1.0 / d)) + eps)


@T.macro
def write_step(vf, wv, cw, st, vo, wo, co, so, a, r_v, no, uu, yo, Y, state, row, slot, c0, taps: int, dtype: str):
    """The end of a decode step for the 16-byte column vector ``c0`` of batch row ``row``, given the gate ``a`` and
    ``r_v``: n = round(a v w_v r_v), the dilated causal conv u over n and the ``taps - 1`` lagged cache slots, y =
    round(SiLU(u) + a v); writes y and n (into cache slot ``slot``). Operands start at these offsets: v (float32,
    already rounded) ``vf[vo]``, w_v ``wv[wo]``, the taps ``cw[co + p * VEC]``, lag q + 1 ``st[so + q * VEC]``."""
    R = taps - 1
    for e in T.unroll(VEC):
        no[e] = T.cast(a * vf[vo + e] * T.cast(wv[wo + e], "float32") * r_v, dtype)
        uu[e] = T.cast(cw[co + (taps - 1) * VEC + e], "float32") * T.cast(no[e], "float32")
    for q in T.unroll(R):
        for e in T.unroll(VEC):
            uu[e] += T.cast(cw[co + (taps - 2 - q) * VEC + e], "float32") * T.cast(st[so + q * VEC + e], "float32")
    for e in T.unroll(VEC):
        vh = a * vf[vo + e]
        yo[e] = T.cast(T.call_extern("float32", "tk_silu_approx", uu[e]) + vh, dtype)
    for e in T.vectorized(VEC):
        Y[row, c0 + e] = yo[e]
    if R > 0:
        for e in T.vectorized(VEC):
            state[row, slot, c0 + e] = no[e]


@T.macro
def gate_and_step(S, part, tv, vf, wv, cw, st, rpl, no, uu, yo, Y, state, eps, B, row0, tx, c0, rows: int,
                  items: int, nv: int, rstep: int, panels: int, d: int, taps: int, dtype: str):
    """The end of a one-launch decode step once every column panel has published its four per-row sums in
    ``S[b, panel, :]``: each row's totals (lane ``cv`` of the row's ``nv`` lanes adds panels cv, cv + nv, ... in
    order, then xor butterflies: the same fixed order in every lane), the gate and ``write_step``. Thread ``tx``
    owns rows ``row0 + tx // nv + i * rstep`` (i < items, below ``rows`` and ``B``), column vector ``c0``; the
    operands of ``write_step`` for item i start at ``vf[i * VEC]`` and ``st[i * (taps - 1) * VEC]``. ``S`` was
    written by other CTAs in this launch: it is read through L2 (``tk_ldcg_f32x4``)."""
    R = taps - 1
    cv = tx % nv
    for i in T.unroll(items):
        r = tx // nv + i * rstep
        for q in T.unroll(4):
            part[i * 4 + q] = T.float32(0)
        if r < rows and row0 + r < B:
            for p in T.unroll(ceil_div(panels, nv)):
                if p * nv + cv < panels:
                    T.call_extern("handle", "tk_ldcg_f32x4", T.address_of(tv[0]), T.address_of(S[row0 + r, p * nv + cv, 0]))
                    for q in T.unroll(4):
                        part[i * 4 + q] += tv[q]
    for i in T.unroll(items):
        for q in T.unroll(4):
            for m in T.unroll(nv.bit_length() - 1):
                part[i * 4 + q] += T.shfl_xor(part[i * 4 + q], 1 << m)
    for i in T.unroll(items):
        r = tx // nv + i * rstep
        if r < rows and row0 + r < B and c0 < d:
            a, r_v = gate_of(part, i * 4, d, eps)
            write_step(vf, wv, cw, st, i * VEC, 0, 0, i * R * VEC, a, r_v, no, uu, yo, Y, state, row0 + r, rpl[i],
                       c0, taps, dtype)


def step_layout(d: int, cluster: int = 1) -> tuple[int, int, int]:
    """(vectors per CTA, slots, threads) of the step kernel with ``cluster`` CTAs per row: CTA r of a row
    owns the 8-column vectors r * vpc + s * threads + tx (s < slots, s * threads + tx < vpc); threads a
    multiple of 32, at most 1024."""
    vpc = ceil_div(ceil_div(d, VEC), cluster)
    slots = ceil_div(vpc, 1024)
    return vpc, slots, ceil_div(ceil_div(vpc, slots), 32) * 32


def proj_config(B: int, d_mem: int, d: int) -> dict:
    """Projection tiling for a batch of B rows (H200 sweep, d_mem 2048, d 4096/7168).

    Up to 16 rows: block_m 16 (mma.sync, 40 KiB of shared memory), d_mem split so that each CTA streams
    8 block_k tiles (512 rows of W; fewer leave the pipeline prologue/epilogue exposed, more leave SMs idle
    at d = 7168: splits 4 beat 2 there although the grid is then 1.7 waves). More rows: block_m 64 with
    block_k 128 and 3 stages (96 KiB, 2 CTAs/SM: twice the W bytes in flight per CTA of block_k 64, which
    took 24 % longer at d = 7168 with the same grid), d_mem split as far as the grid still fits one wave."""
    if B <= 16:
        nk = ceil_div(d_mem, 64)
        splits = 1
        for s in (2, 4, 8):
            if nk % s == 0 and nk // s >= 8:
                splits = s
        return dict(block_m=16, block_n=64, block_k=64, stages=4, splits=splits, min_blocks=4)
    nk = ceil_div(d_mem, 128)
    panels = ceil_div(d, 64) * 2 * ceil_div(B, 64)
    splits = 1
    for s in (2, 4, 8):
        if nk % s == 0 and panels * s <= 2 * _SMS:
            splits = s
    return dict(block_m=64, block_n=64, block_k=128, stages=3, splits=splits, min_blocks=3)


@kernel(pass_configs={"tl.disable_warp_specialized": True})
def decode_proj_kernel(dtype: str, d_mem: int, d: int, block_m: int = 16, block_n: int = 64, block_k: int = 64,
                       stages: int = 4, splits: int = 1, min_blocks: int = 4):
    """Float32 partial products P[s, j] = e @ W_j over the s-th of ``splits`` equal slices of d_mem (W_0 = W_K,
    W_1 = W_V). One launch for both weights; grid (d / block_n, 2 * splits, batch / block_m): each CTA
    streams a (d_mem / splits) x block_n slice of one weight through a ``stages``-deep cp.async pipeline
    (no warp specialisation, so several CTAs per SM keep 100+ KiB of W in flight), so W is read once for up
    to block_m rows. block_n = 64 makes every W row segment 128 contiguous bytes. ``min_blocks``
    caps the registers (ptxas takes 180+ otherwise) so that that many CTAs fit on an SM."""
    B = T.dynamic("batch")
    f32 = "float32"
    nk = (d_mem + block_k - 1) // block_k
    assert nk % splits == 0, "splits must divide the number of block_k tiles"
    kper = nk // splits

    @T.prim_func
    def main(
        E: T.Tensor((B, d_mem), dtype),
        WK: T.Tensor((d_mem, d), dtype),
        WV: T.Tensor((d_mem, d), dtype),
        P: T.Tensor((splits, 2, B, d), f32),
    ):
        with T.Kernel(T.ceildiv(d, block_n), 2 * splits, T.ceildiv(B, block_m), threads=128) as (bx, bw, by):
            A_s = T.alloc_shared((block_m, block_k), dtype)
            W_s = T.alloc_shared((block_k, block_n), dtype)
            C = T.alloc_fragment((block_m, block_n), f32)
            T.annotate_min_blocks_per_sm(min_blocks)
            sp = bw // 2
            T.clear(C)
            for kk in T.Pipelined(kper, num_stages=stages):
                k0 = (sp * kper + kk) * block_k
                T.copy(E[by * block_m, k0], A_s)
                if bw % 2 == 0:
                    T.copy(WK[k0, bx * block_n], W_s)
                else:
                    T.copy(WV[k0, bx * block_n], W_s)
                T.gemm(A_s, W_s, C)
            for i, j in T.Parallel(block_m, block_n):
                if by * block_m + i < B and bx * block_n + j < d:
                    P[sp, bw % 2, by * block_m + i, bx * block_n + j] = C[i, j]

    return main


@kernel(pass_configs={"tl.disable_safe_memory_legalize": True})
def decode_step_kernel(dtype: str, d: int, taps: int, dilation: int, splits: int = 1, cluster: int = 1):
    """One decode step per batch row: k, v = round(sum of the ``splits`` float32 partials, in split order), the
    gate of (h, k, v) as in the prefill, n, the dilated causal convolution over the ring cache, y; writes n
    into the cache slot pos mod L in place.

    Every load a thread needs is issued before the first use, the pos-dependent cache loads last (a warp
    stalls in order at the first instruction that needs pos), so the CTA makes one round trip to memory.
    The row sums are a fixed-order butterfly per warp, then every warp sums the warps' partials in the same
    fixed order (one barrier). With ``cluster`` > 1 a row is split over that many CTAs of one thread block
    cluster (one CTA per row reads the whole row through one SM: latency x bytes bound at small batch): each
    CTA publishes its 4 partial sums in ``S`` (row b, slot r; 128-byte rows so that no L1 line holds another
    row's slots), a cluster barrier (release/acquire) orders them, and every CTA adds the slots in rank
    order (same totals in all CTAs, run to run)."""
    vpc, slots, threads = step_layout(d, cluster)
    nwarps = threads // 32
    R = taps - 1
    B = T.dynamic("batch")
    LC = T.dynamic("cache_len")
    f32 = "float32"
    assert cluster <= 8, "S holds 8 slots per row (portable cluster size)"

    @T.prim_func
    def main(
        Hx: T.Tensor((B, d), dtype),
        P: T.Tensor((splits, 2, B, d), f32),
        w_h: T.Tensor((d,), dtype),
        w_v: T.Tensor((d,), dtype),
        conv_w: T.Tensor((taps, d), dtype),
        state: T.Tensor((B, LC, d), dtype),
        pos: T.Tensor((B,), "int32"),
        Y: T.Tensor((B, d), dtype),
        S: T.Tensor((B, 8, 4), f32),
        eps: T.float32,
    ):
        with T.Kernel(cluster, B, threads=threads, cluster_dims=(cluster, 1, 1) if cluster > 1 else None,
                      prelude=SILU_APPROX) as (
            br,
            bb,
        ):
            tx = T.get_thread_binding()
            lane = tx % 32
            warp = tx // 32
            red = T.alloc_shared((4, 32), f32)
            part = T.alloc_local((4,), f32)
            sv = T.alloc_local((4,), f32)
            rpl = T.alloc_local((1,), "int32")
            pp = T.alloc_local((slots * splits * 2 * VEC,), f32)
            xh = T.alloc_local((slots * VEC,), dtype)
            wl = T.alloc_local((slots * VEC,), dtype)
            wv = T.alloc_local((slots * VEC,), dtype)
            cw = T.alloc_local((slots * taps * VEC,), dtype)
            st = T.alloc_local((slots * max(R, 1) * VEC,), dtype)
            kf = T.alloc_local((slots * VEC,), f32)
            vf = T.alloc_local((slots * VEC,), f32)
            no = T.alloc_local((VEC,), dtype)
            yo = T.alloc_local((VEC,), dtype)
            uu = T.alloc_local((VEC,), f32)
            p0 = pos[bb]
            for s in T.unroll(slots):
                c0 = (br * vpc + s * threads + tx) * VEC
                if s * threads + tx < vpc and c0 < d:
                    for j in T.unroll(splits):
                        for w in T.unroll(2):
                            for e in T.vectorized(VEC):
                                pp[((s * splits + j) * 2 + w) * VEC + e] = P[j, w, bb, c0 + e]
                    for e in T.vectorized(VEC):
                        xh[s * VEC + e] = Hx[bb, c0 + e]
                    for e in T.vectorized(VEC):
                        wl[s * VEC + e] = w_h[c0 + e]
                    for e in T.vectorized(VEC):
                        wv[s * VEC + e] = w_v[c0 + e]
                    for p in T.unroll(taps):
                        for e in T.vectorized(VEC):
                            cw[(s * taps + p) * VEC + e] = conv_w[p, c0 + e]
            # cache_pos >= 0 and L >= dilation * R: one 32-bit remainder (kept in a register: inlined into
            # the 64-bit index it would become a 64-bit division per use), then lag q+1 wraps at most once.
            rpl[0] = T.truncmod(p0, LC)
            rp = rpl[0]
            for s in T.unroll(slots):
                c0 = (br * vpc + s * threads + tx) * VEC
                if s * threads + tx < vpc and c0 < d:
                    for q in T.unroll(R):
                        sl = rp - (q + 1) * dilation
                        for e in T.vectorized(VEC):
                            st[(s * R + q) * VEC + e] = state[bb, T.if_then_else(sl < 0, sl + LC, sl), c0 + e]
            for q in T.unroll(4):
                part[q] = T.float32(0)
            for s in T.unroll(slots):
                c0 = (br * vpc + s * threads + tx) * VEC
                if s * threads + tx < vpc and c0 < d:
                    for e in T.unroll(VEC):
                        kf[s * VEC + e] = pp[(s * splits * 2) * VEC + e]
                        vf[s * VEC + e] = pp[(s * splits * 2 + 1) * VEC + e]
                    for j in T.unroll(1, splits):
                        for e in T.unroll(VEC):
                            kf[s * VEC + e] += pp[((s * splits + j) * 2) * VEC + e]
                            vf[s * VEC + e] += pp[((s * splits + j) * 2 + 1) * VEC + e]
                    for e in T.unroll(VEC):
                        hv = T.cast(xh[s * VEC + e], f32)
                        kv = T.cast(T.cast(kf[s * VEC + e], dtype), f32)
                        vv = T.cast(T.cast(vf[s * VEC + e], dtype), f32)
                        wh = T.cast(wl[s * VEC + e], f32)
                        kf[s * VEC + e] = kv
                        vf[s * VEC + e] = vv
                        add_row_sums(part, hv, kv, vv, wh)
            for q in T.unroll(4):
                part[q] = T.warp_reduce_sum(part[q])
            if lane == 0:
                for q in T.unroll(4):
                    red[q, warp] = part[q]
            T.sync_threads()
            # Every warp sums the warps' partials (lane w holds warp w's, zero past nwarps) in the same order.
            for q in T.unroll(4):
                part[q] = T.warp_reduce_sum(T.if_then_else(lane < nwarps, red[q, lane], T.float32(0)))
            if cluster > 1:
                if tx == 0:
                    for q in T.vectorized(4):
                        S[bb, br, q] = part[q]
                    T.evaluate(T.call_extern("handle", "__threadfence"))
                cluster_sync()
                for q in T.unroll(4):
                    part[q] = T.float32(0)
                for r in T.unroll(cluster):
                    for q in T.vectorized(4):
                        sv[q] = S[bb, r, q]
                    for q in T.unroll(4):
                        part[q] += sv[q]
            a, r_v = gate_of(part, 0, d, eps)
            for s in T.unroll(slots):
                c0 = (br * vpc + s * threads + tx) * VEC
                if s * threads + tx < vpc and c0 < d:
                    write_step(vf, wv, cw, st, s * VEC, s * VEC, s * taps * VEC, s * R * VEC, a, r_v, no, uu, yo,
                               Y, state, bb, rp, c0, taps, dtype)

    return main


# Inter-CTA synchronisation of the fused kernel. Ctr (int32, zero when first used) holds the grid barrier
# (arrive count, generation) then one arrival counter per (row tile, column panel); every counter is reset by its
# last user, so the next launch finds zeros. The waiters are at most one CTA per panel, fewer than the SMs, so the
# CTAs they wait for always find a free slot (no co-residency requirement beyond that).
# Data other CTAs wrote during this launch: read through L2 (L1 is not coherent).
LDCG_F32X4 = r"""
__device__ __forceinline__ void tk_ldcg_f32x4(float* dst, const float* src) {
  *reinterpret_cast<float4*>(dst) = __ldcg(reinterpret_cast<const float4*>(src));
}
"""
FUSED_PRELUDE = SILU_APPROX + r"""
__device__ __forceinline__ int tk_arrive_last(int* cnt, int n) {
  __threadfence();
  int last = atomicAdd(cnt, 1) == n - 1;
  if (last) atomicExch(cnt, 0);
  __threadfence();
  return last;
}
__device__ __forceinline__ void tk_grid_wait(int* bar, int n) {
  __threadfence();
  int gen = atomicAdd(bar + 1, 0);  // read before arriving: it cannot move until this CTA has arrived
  if (atomicAdd(bar, 1) == n - 1) {
    atomicExch(bar, 0);
    __threadfence();
    atomicAdd(bar + 1, 1);
  } else {
    // A finisher that cannot get an SM (e.g. an MPS SM limit) would hang the GPU: trap after seconds instead.
    for (long long i = 0; *reinterpret_cast<volatile int*>(bar + 1) == gen; ++i) {
      if (i > (1ll << 23)) __trap();
      __nanosleep(20);
    }
  }
  __threadfence();
}
""" + LDCG_F32X4
FUSED_PANEL = 64  # columns per CTA panel: 128-byte W row segments, 8 threads x 8 columns per batch row
_CTR_LEN = 4096  # int32 words of the per-device counter workspace


def fused_config(B: int, d_mem: int, d: int, sms: int = _SMS) -> dict:
    """Tiling of ``decode_fused_kernel`` (untimed first guess, see benchmarks/sweep_decode.py).

    Up to 16 rows (no longer launched by the op, which takes ``decode_gemv_kernel`` there; the benchmark's
    previous path): block_m 16, 4 stages of 18 KiB (3 CTAs/SM, 64 KiB of W in flight per CTA); d_mem split so
    that the CTAs spread evenly over the SMs (the busiest SM sets the time), preferring 2+ CTAs per SM.
    More rows: block_m 64, 3 stages; the float32 partials then cost 2 * 64 * d * 4 bytes per split, so the
    split is the smallest one that keeps 80 % of the SMs busy."""
    nk = ceil_div(d_mem, 64)
    panels = ceil_div(d, FUSED_PANEL) * ceil_div(B, 16 if B <= 16 else 64)
    cands = [s for s in (1, 2, 4, 8) if nk % s == 0 and (nk // s >= 4 or s == 1)]
    if B <= 16:
        # even spread first (busiest SM / mean), then more CTAs per SM, within 3 per SM
        def score(s):
            u = panels * s
            return (u / (sms * ceil_div(u, sms)) if u <= 3 * sms else 0.0, min(ceil_div(u, sms), 3))
        splits = max(cands, key=score)
        return dict(block_m=16, block_k=64, stages=4, splits=splits, min_blocks=3, threads=128)
    splits = next((s for s in cands if panels * s >= 0.8 * sms), cands[-1])
    return dict(block_m=64, block_k=64, stages=3, splits=splits, min_blocks=2, threads=256)


# TileLang puts the accumulators' staging (KO, VO) on the pipeline's tiles, after the barrier its planner places
# behind the last gemm, and the arrival flag on KO, after the barrier behind the partials' stores (KO is not read
# after them).
@kernel(pass_configs={"tl.disable_warp_specialized": True, "tl.disable_safe_memory_legalize": True},
        shared_aliases=[("K_s", "KO"), ("K_s", "VO"), ("A_s", "VO"), ("K_s", "flag"), ("KO", "flag")])
def decode_fused_kernel(dtype: str, d_mem: int, d: int, taps: int, dilation: int, block_m: int = 16,
                        block_k: int = 64, stages: int = 4, splits: int = 4, min_blocks: int = 2,
                        threads: int = 128):
    """The whole decode step in one launch. Grid (panels, splits, batch / block_m): each CTA streams a
    (d_mem / splits) x 64 slice of both W_K and W_V through a cp.async pipeline (tensor cores, float32
    accumulators) and, with splits > 1, writes its float32 partials P and arrives at its panel's counter.
    The last CTA of a panel (the only one that goes on) sums the partials in split order, rounds k and v,
    and publishes the panel's four per-row gate sums in ``S``; all panel finishers then meet at a grid barrier,
    add the panels' sums in a fixed order (identical totals in every CTA, run to run) and do the gate,
    convolution, y and cache update for their 64 columns. Everything a finisher needs besides the sums
    (h, weights, the lagged cache slots) is loaded before the barrier.

    Thread tx owns columns 8 * (tx % 8) .. + 8 of the panel in rows tx / 8 + i * threads / 8 (i < items), so
    the 8 lanes of a row reduce its sums with 3 butterflies."""
    B = T.dynamic("batch")
    LC = T.dynamic("cache_len")
    f32 = "float32"
    bn = FUSED_PANEL
    nv = bn // VEC
    assert (block_m * nv) % threads == 0 and threads % nv == 0
    items = block_m * nv // threads
    rstep = threads // nv
    nk = ceil_div(d_mem, block_k)
    assert nk % splits == 0, "splits must divide the number of block_k tiles"
    kper = nk // splits
    panels = ceil_div(d, bn)
    R = taps - 1

    @T.macro
    def finish(Hx, w_h, w_v, conv_w, state, pos, Y, P, S, Ctr, KO, VO, eps, B, LC, bx, by, tx, cv, c0):
        part = T.alloc_local((items * 4,), f32)
        tv = T.alloc_local((4,), f32)
        pp = T.alloc_local((2 * VEC,), f32)
        rpl = T.alloc_local((items,), "int32")
        xh = T.alloc_local((items * VEC,), dtype)
        st = T.alloc_local((items * max(R, 1) * VEC,), dtype)
        kf = T.alloc_local((items * VEC,), f32)
        vf = T.alloc_local((items * VEC,), f32)
        wl = T.alloc_local((VEC,), dtype)
        wv = T.alloc_local((VEC,), dtype)
        cw = T.alloc_local((taps * VEC,), dtype)
        no = T.alloc_local((VEC,), dtype)
        yo = T.alloc_local((VEC,), dtype)
        uu = T.alloc_local((VEC,), f32)
        if c0 < d:
            for e in T.vectorized(VEC):
                wl[e] = w_h[c0 + e]
            for e in T.vectorized(VEC):
                wv[e] = w_v[c0 + e]
            for p in T.unroll(taps):
                for e in T.vectorized(VEC):
                    cw[p * VEC + e] = conv_w[p, c0 + e]
        for i in T.unroll(items):
            b = by * block_m + tx // nv + i * rstep
            if b < B and c0 < d:
                for e in T.vectorized(VEC):
                    xh[i * VEC + e] = Hx[b, c0 + e]
                # cache_pos >= 0 and L >= dilation * R: lag q+1 wraps at most once.
                rpl[i] = T.truncmod(pos[b], LC)
                for q in T.unroll(R):
                    sl = rpl[i] - (q + 1) * dilation
                    for e in T.vectorized(VEC):
                        st[(i * R + q) * VEC + e] = state[b, T.if_then_else(sl < 0, sl + LC, sl), c0 + e]
        for i in T.unroll(items):
            for q in T.unroll(4):
                tv[q] = T.float32(0)
            r = tx // nv + i * rstep
            b = by * block_m + r
            if b < B and c0 < d:
                if splits > 1:
                    for e in T.unroll(VEC):
                        kf[i * VEC + e] = T.float32(0)
                        vf[i * VEC + e] = T.float32(0)
                    for j in T.unroll(splits):
                        for w in T.unroll(2):
                            for h2 in T.unroll(2):
                                T.call_extern("handle", "tk_ldcg_f32x4", T.address_of(pp[w * VEC + h2 * 4]),
                                              T.address_of(P[j, w, b, c0 + h2 * 4]))
                        for e in T.unroll(VEC):
                            kf[i * VEC + e] += pp[e]
                            vf[i * VEC + e] += pp[VEC + e]
                else:
                    for e in T.unroll(VEC):
                        kf[i * VEC + e] = KO[r, cv * VEC + e]
                        vf[i * VEC + e] = VO[r, cv * VEC + e]
                for e in T.unroll(VEC):
                    kv = T.cast(T.cast(kf[i * VEC + e], dtype), f32)
                    vv = T.cast(T.cast(vf[i * VEC + e], dtype), f32)
                    kf[i * VEC + e] = kv
                    vf[i * VEC + e] = vv
                    add_row_sums(tv, T.cast(xh[i * VEC + e], f32), kv, vv, T.cast(wl[e], f32))
            for q in T.unroll(4):
                part[i * 4 + q] = tv[q]
        # The 8 lanes of a row hold its column vectors: butterflies give every lane the same sum.
        for i in T.unroll(items):
            for q in T.unroll(4):
                for m in T.unroll(3):
                    part[i * 4 + q] += T.shfl_xor(part[i * 4 + q], 1 << m)
            b = by * block_m + tx // nv + i * rstep
            if cv == 0 and b < B:
                for q in T.vectorized(4):
                    S[b, bx, q] = part[i * 4 + q]
        T.sync_threads()
        if tx == 0:
            T.call_extern("handle", "tk_grid_wait", T.address_of(Ctr[0]), panels * T.ceildiv(B, block_m))
        T.sync_threads()
        gate_and_step(S, part, tv, vf, wv, cw, st, rpl, no, uu, yo, Y, state, eps, B, by * block_m, tx, c0, block_m,
                      items, nv, rstep, panels, d, taps, dtype)


    @T.prim_func
    def main(
        E: T.Tensor((B, d_mem), dtype),
        WK: T.Tensor((d_mem, d), dtype),
        WV: T.Tensor((d_mem, d), dtype),
        Hx: T.Tensor((B, d), dtype),
        w_h: T.Tensor((d,), dtype),
        w_v: T.Tensor((d,), dtype),
        conv_w: T.Tensor((taps, d), dtype),
        state: T.Tensor((B, LC, d), dtype),
        pos: T.Tensor((B,), "int32"),
        Y: T.Tensor((B, d), dtype),
        P: T.Tensor((splits, 2, B, d), f32),
        S: T.Tensor((B, panels, 4), f32),
        Ctr: T.Tensor((_CTR_LEN,), "int32"),
        eps: T.float32,
    ):
        with T.Kernel(panels, splits, T.ceildiv(B, block_m), threads=threads, prelude=FUSED_PRELUDE) as (
            bx,
            bs,
            by,
        ):
            A_s = T.alloc_shared((block_m, block_k), dtype)
            K_s = T.alloc_shared((block_k, bn), dtype)
            V_s = T.alloc_shared((block_k, bn), dtype)
            CK = T.alloc_fragment((block_m, bn), f32)
            CV = T.alloc_fragment((block_m, bn), f32)
            KO = T.alloc_shared((block_m, bn), f32)
            VO = T.alloc_shared((block_m, bn), f32)
            flag = T.alloc_shared((1,), "int32")
            T.annotate_min_blocks_per_sm(min_blocks)
            tx = T.get_thread_binding()
            T.clear(CK)
            T.clear(CV)
            for kk in T.Pipelined(kper, num_stages=stages):
                k0 = (bs * kper + kk) * block_k
                T.copy(E[by * block_m, k0], A_s)
                T.copy(WK[k0, bx * bn], K_s)
                T.copy(WV[k0, bx * bn], V_s)
                T.gemm(A_s, K_s, CK)
                T.gemm(A_s, V_s, CV)
            T.copy(CK, KO)
            T.copy(CV, VO)
            T.sync_threads()
            cv = tx % nv
            c0 = bx * bn + cv * VEC
            if splits > 1:
                for i in T.unroll(items):
                    b = by * block_m + tx // nv + i * rstep
                    if b < B and c0 < d:
                        for e in T.vectorized(VEC):
                            P[bs, 0, b, c0 + e] = KO[tx // nv + i * rstep, cv * VEC + e]
                        for e in T.vectorized(VEC):
                            P[bs, 1, b, c0 + e] = VO[tx // nv + i * rstep, cv * VEC + e]
                T.sync_threads()
                if tx == 0:
                    flag[0] = T.call_extern("int32", "tk_arrive_last", T.address_of(Ctr[2 + by * panels + bx]),
                                            splits)
                T.sync_threads()
                if flag[0] == 1:
                    finish(Hx, w_h, w_v, conv_w, state, pos, Y, P, S, Ctr, KO, VO, eps, B, LC, bx, by, tx, cv, c0)
            else:
                finish(Hx, w_h, w_v, conv_w, state, pos, Y, P, S, Ctr, KO, VO, eps, B, LC, bx, by, tx, cv, c0)

    return main


# Small batches: the GEMV (``decode_gemv_kernel``). Its counters are two words per row tile from _GEMV_CTR on (the
# fused kernel's lie below); the last V CTA of a row tile to leave zeroes both.
GEMV_MAX_BATCH = 16  # one m-tile per CTA
# With the W ring (one CTA per SM), all rows in one row tile (H200, d_mem 2048, d=4096, dirty L2): 2 m-tiles (session
# 29) B = 17 / 32 18.0 / 18.3 us against 20.5 (fused) / 21.0 (two launches); 4 m-tiles from 33 rows, where two warps
# share each ring slot (GEMV_RING_MW, 2 m-tiles each) and the V CTAs copy their cache slots after the first chunk
# (session 30): B = 48 / 64 20.1 / 20.4 us against the two launches' 21.3 / 21.8. One warp per slot at 4 m-tiles (228
# registers) ran its loop 16.3 us instead of 12.1 (22.0 us in all at B=64); two warps per slot at 2 m-tiles lost
# 9-11 % at B = 17 / 32.
GEMV_RING_MAX_BATCH = 64
GEMV_RING_MW = 2  # warps per ring slot from 33 rows (4 m-tiles)
GEMV_PANEL = 64  # columns per CTA: a W row segment is 8 lanes x 16 B
_GEMV_CTR = _CTR_LEN // 2
TIMELINE_STAMPS = 7  # per CTA of ``decode_gemv_kernel(timeline=True)``


def gemv_config(B: int, d_mem: int, d: int) -> dict:
    """Tuning of ``decode_gemv_kernel`` (H200 sweep, session 4, d_mem 2048, d 4096 / 7168, B 1 / 8): 16 rows per
    CTA, 4 warps with 8 k16 steps of W in flight each (8 KiB per warp), 2 CTAs per SM. 8 warps at depth 8
    (1 CTA/SM at d=4096) or depth 4 (2 CTAs/SM at d=7168) took 5-20 % longer, 16 warps at depth 3 longer still.
    ``ring``: ``GEMV_RING`` slots per warp where ``ring_ok`` (``decode_plan`` drops it where it measured slower or
    does not fit). More than 16 rows (up to ``GEMV_RING_MAX_BATCH``) take one CTA per panel for all rows (``mt``
    m-tiles, 1 CTA per SM): ceil(B / 16) up to 32 rows, 4 from 33 rows, where ``mw`` = ``GEMV_RING_MW`` warps
    share each ring slot, each warp taking ``mt / mw`` m-tiles; ``decode_plan`` takes that only with the ring."""
    mt = 1 if B <= GEMV_MAX_BATCH else ceil_div(B, 16) if B <= 32 else 4
    mw = GEMV_RING_MW if mt > 2 else 1
    ring = GEMV_RING if ring_ok(mt, 4, d_mem, d, mw) else 0
    return dict(mt=mt, nw=4, depth=8, min_blocks=2 if mt == 1 else 1, ring=ring, mw=mw)


RING_STEPS = 4  # k16 steps per W ring slot: one TMA copy of 64 W rows (8 KB), one of 16 mt e rows x 128 B
_RING_W, _RING_E = RING_STEPS * 16 * GEMV_PANEL * 2, RING_STEPS * 16 * 16 * 2  # bytes of a slot's W, e per m-tile
GEMV_RING = 2  # W ring slots per warp: 4 to 8 k16 steps in flight
GEMV_RING_SMEM = 110 * 1024  # the most shared memory per CTA with the ring at 2 CTAs per SM (228 KB, 1 KB each kept)


def ring_ok(mt: int, nw: int, d_mem: int, d: int, mw: int = 1, slots: int = GEMV_RING) -> bool:
    """Whether ``decode_gemv_kernel`` can take the W ring: up to 4 m-tiles per warp (the registers of 128
    accumulators), split evenly over the ``mw`` warps of a slot, the same whole k16 steps for every slot, whole
    64-column panels (the TMA boxes need no bounds beyond the batch rows, which TMA fills with zeros), and room for
    one m-tile of every warp's reduction tile in the W bytes of ``slots`` slots per owner (at ``GEMV_RING``, d_mem >=
    512 for 2 warps per slot)."""
    chunks = d_mem // (16 * RING_STEPS * nw)  # per slot owner
    return (mt % mw == 0 and mt // mw <= 4 and d_mem % (16 * RING_STEPS * nw) == 0 and d % GEMV_PANEL == 0
            and mw * 16 * (GEMV_PANEL + 4) * 4 <= min(slots, chunks) * _RING_W)


def _gemv_epilogue(mt: int, nw: int, taps: int, ring: int = 0, mw: int = 1) -> tuple[int, int, int]:
    """(items, EPW, shared bytes) of ``decode_gemv_kernel``: (row, 16-byte column vector) items per thread, the
    epilogue operands per thread in elements (h, w_h / w_v, the taps, the lagged cache slots), and the shared memory
    of the reduction tile (float32), the 16-bit epilogue operands and ``ring`` W ring slots per slot owner."""
    threads, nv = 32 * nw * mw, GEMV_PANEL // VEC
    items = ceil_div(16 * mt * nv, threads)
    epw = VEC * max(1 + items, 1 + taps + items * (taps - 1))
    red = nw * mw * 16 * (1 if ring else mt) * (GEMV_PANEL + 4) * 4  # with the ring: a warp's m-tile in the W bytes
    return items, epw, max(red, nw * ring * _RING_W) + nw * ring * mt * _RING_E + threads * epw * 2


def _static(n: int) -> tuple:
    """A loop unrolled while the kernel is built (plain ``range`` would become a TIR loop)."""
    return tuple(range(n))


# The ring's slots shared by several warps: a named barrier (ids from 1; 0 is __syncthreads) of those warps.
_BAR_SYNC = r"""
__device__ __forceinline__ void tkd_bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(threads) : "memory");
}
"""


def _gemv_prelude(mt: int, dtype: str, shared_slots: bool = False) -> str:
    """CUDA helpers of ``decode_gemv_kernel``: one k16 step of mma for ``mt`` m-tiles (a warp's), the W load, the
    counter; ``shared_slots``: the named barrier of the warps that share a ring slot."""
    ab = "bf16" if dtype == "bfloat16" else "f16"
    return SILU_APPROX + _CLUSTER + (_BAR_SYNC if shared_slots else "") + rf"""
// c += a b: mma.m16n8k16, float32 accumulation.
__device__ __forceinline__ void tkd_mma(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                        unsigned b1) {{
  asm("mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32 {{%0,%1,%2,%3}}, {{%4,%5,%6,%7}}, {{%8,%9}}, "
      "{{%0,%1,%2,%3}};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}}
// One k16 step: W rows 4t..4t+3 (4 x 16 B, columns 8g..8g+7) in w, e rows g / g+8 (8 B each, per m-tile) in e.
__device__ __forceinline__ void tkd_step(float* acc, const void* wp, const void* ep) {{
  const unsigned* w = reinterpret_cast<const unsigned*>(wp);
  const unsigned* e = reinterpret_cast<const unsigned*>(ep);
#pragma unroll
  for (int j = 0; j < 8; ++j) {{
    // B register = (row 4t (+2), row 4t+1 (+3)) of column 8g + j: element j of each 16-byte row.
    const unsigned sel = (j & 1) ? 0x7632u : 0x5410u;
    const unsigned b0 = __byte_perm(w[j / 2], w[4 + j / 2], sel);
    const unsigned b1 = __byte_perm(w[8 + j / 2], w[12 + j / 2], sel);
#pragma unroll
    for (int m = 0; m < {mt}; ++m)
      tkd_mma(acc + (m * 8 + j) * 4, e[m * 4 + 0], e[m * 4 + 2], e[m * 4 + 1], e[m * 4 + 3], b0, b1);
  }}
}}
// W is read once: no L1 allocation (plain LDG measured 5-11 % slower).
__device__ __forceinline__ void tkd_ldw(void* dst, const void* src) {{
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {{%0,%1,%2,%3}}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(src));
  *reinterpret_cast<uint4*>(dst) = v;
}}
// The W ring (``ring`` > 0): slots of RING_STEPS k16 steps, TMA's 128-byte swizzle (the 16-byte chunk c of row r at
// r * 128 + (c ^ (r & 7)) * 16): the W rows (16 per step, 128 B each: step q at ``wslot``) and the e rows (16 per
// m-tile, 128 B each, step q in chunks 2q, 2q + 1), read with ldmatrix into the standard mma fragments (k in order):
// acc[4 (8 m + j) + 2 h + q] is row 16 m + g + 8 h, column 8 j + 2 t + q.
__device__ __forceinline__ void tkd_ring_step(float* acc, const void* wslot, const void* eslot, int q, int lane) {{
  const unsigned ws = tk_smem(wslot), es = tk_smem(eslot);
  const int r = (lane & 7) + ((lane >> 3) & 1) * 8;  // the row whose address this lane gives ldmatrix
  unsigned a[{mt}][4];
#pragma unroll
  for (int m = 0; m < {mt}; ++m)  // row 16 m + r swizzles as row r
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{%0,%1,%2,%3}}, [%4];"
                 : "=r"(a[m][0]), "=r"(a[m][1]), "=r"(a[m][2]), "=r"(a[m][3])
                 : "r"(es + (16 * m + r) * 128 + (((2 * q + (lane >> 4)) ^ (r & 7)) << 4)));
#pragma unroll
  for (int j = 0; j < 8; j += 2) {{
    unsigned b[4];
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{%0,%1,%2,%3}}, [%4];"
                 : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])
                 : "r"(ws + r * 128 + (((j + (lane >> 4)) ^ (r & 7)) << 4)));
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int m = 0; m < {mt}; ++m)
        tkd_mma(acc + (8 * m + j + n) * 4, a[m][0], a[m][1], a[m][2], a[m][3], b[2 * n], b[2 * n + 1]);
  }}
}}
__device__ __forceinline__ void tkd_st_f32(void* base, int i, float v) {{ static_cast<float*>(base)[i] = v; }}
__device__ __forceinline__ float tkd_ld_f32(const void* base, int i) {{ return static_cast<const float*>(base)[i]; }}
__device__ __forceinline__ void tkd_cp16(void* smem, const void* gmem) {{
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"((unsigned)__cvta_generic_to_shared(smem)), "l"(gmem));
}}
__device__ __forceinline__ void tkd_cp_wait() {{ asm volatile("cp.async.wait_all;" ::: "memory"); }}
// Arrivals are fire-and-forget release adds on the count (w); V CTAs poll it (acquire) and register their
// leaving on w + 1; the last to leave resets both (nobody reads them again in this launch).
__device__ __forceinline__ void tkd_release_add(int* w) {{
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(w) : "memory");
}}
__device__ __forceinline__ void tkd_poll(int* w, unsigned n) {{
  unsigned v;
  for (long long i = 0;; ++i) {{
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(w) : "memory");
    if (v >= n) break;
    if (i > (1ll << 24)) __trap();  // a CTA that never gets an SM would hang the GPU
    __nanosleep(20);
  }}
}}
// The probe's timeline: the low 32 bits of the global nanosecond timer (comparable across SMs), read once ``dep``
// is computed.
__device__ __forceinline__ void tkd_stamp(int* p, float dep) {{
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) : "f"(dep) : "memory");
  *p = static_cast<int>(t);
}}
__device__ __forceinline__ unsigned tkd_leave(int* w) {{ return atomicAdd(reinterpret_cast<unsigned*>(w) + 1, 1u); }}
__device__ __forceinline__ void tkd_leave_done(int* w, unsigned old, unsigned nv) {{
  if (old == nv - 1) {{
    atomicExch(w, 0);
    atomicExch(w + 1, 0);
  }}
}}
""" + LDCG_F32X4


# TileLang's sync planner is off: it cannot see that each warp's ring slots are its own (ordered by the slot's
# mbarriers and __syncwarp, or a named barrier of the slot's warps) and put two CTA barriers in every k16 step; the
# kernel's own barriers order the rest.
@kernel(pass_configs={"tl.disable_safe_memory_legalize": True, "tl.disable_thread_storage_sync": True})
def decode_gemv_kernel(dtype: str, d_mem: int, d: int, taps: int, dilation: int, mt: int = 1, nw: int = 4,
                       depth: int = 8, min_blocks: int = 2, timeline: bool = False, ring: int = 0, mw: int = 1,
                       late_cache: bool = True, v_first: bool = True, w_evict_first: bool = True):
    """The whole decode step in one launch for small batches: a register-direct tensor-core GEMV, no split-K.

    Why (H200, CUPTI, L2 flushed, d_mem 2048, session 4): at d=4096 B=1 / 8 16.4 / 17.1 us against the fused
    kernel's 18.5 / 19.6, at d=7168 23.7 / 23.9 against 25.8 / 26.6; at B=64 (4 m-tiles) 25.4-66 us against
    26.2 / 33.2, so the op uses it up to ``GEMV_MAX_BATCH`` rows only.

    - Grid (2 NP, batch / (16 mt)), NP = ceil(d / 64): CTA x < NP owns column panel x of W_K, CTA x >= NP panel
      x - NP of W_V, over all d_mem rows (no float32 partials, no per-panel counter); with the ring and ``v_first``
      (its default) the other way round (block x < NP takes panel x of W_V), so that the V CTAs, which finish the
      step, start first: their loop had ended 1.0-1.9 us after the K CTAs' (H200, d=4096: B=1 17.10 -> 16.70 us,
      B=64 21.35 -> 20.51; on the register path at d=7168, two CTAs per SM, it measured 2 % slower, so that path
      keeps the K CTAs first; False is the sweep's reference point). At B <= 16 that is 128 CTAs
      (d=4096) or 224 (d=7168), all co-resident at 2 per SM.
    - W goes from global memory straight into registers: 16-byte ``ld.global.nc.L1::no_allocate``, ``depth`` k16
      steps ahead, fully unrolled (no shared memory, no barrier in the loop). Warp w streams rows
      [w SPW 16, (w + 1) SPW 16) of the panel. In a k16 step lane (g = lane / 4, t = lane % 4) loads rows
      4t..4t+3, columns 8g..8g+7 (a row is 8 lanes x 16 B = 128 contiguous bytes). mma.m16n8k16 (float32
      accumulation) takes W as its B operand: n-tile j is column 8g + j in n-slot g, and logical k {2t, 2t+1,
      2t+8, 2t+9} = physical rows {4t..4t+3} (the same k permutation applies to e, so the sum runs over the same
      products); one PRMT per B register pairs two rows. The A operand is e (batch rows as m, 16 per m-tile),
      one 8-byte load per row. The accumulators of n-tile j hold columns 16t + j and 16t + 8 + j of rows g, g + 8.
    - Or, with ``ring`` (slots per warp), W and e go through shared memory: each warp's ring slot holds
      ``RING_STEPS`` k16 steps, filled by two TMA copies (64 W rows x 128 B, 128-byte swizzle; e's 64 columns of
      the 16 mt batch rows, zeros past the batch) that one mbarrier per slot counts; the warp refills a slot once it
      has read the chunk before (``__syncwarp``) and reads its operands with ldmatrix (standard fragments: n-tile j
      holds columns 8j + 2t, + 1; each W fragment feeds all ``mt`` m-tiles). No scoreboard drains the loads in
      flight (the register path's limit, PERF-NOTES session 27). The reduction tile then reuses the ring's bytes,
      one m-tile at a time. H200, d=4096 B=1 (128 CTAs): 14.4 -> 13.0 us from a clean L2, 16.05 -> 16.2 after the
      benchmarks' dirty flush; at d=7168 (224 CTAs, 2 per SM) 20.2 -> 19.9 clean but 22.7 -> 25.2 dirty (session
      28) until the W copies took the evict-first hint below; with it the ring is faster there as well (B = 1 / 8
      22.86 / 23.39 -> 22.10 / 22.36 us dirty; B=1 20.26 -> 19.42 clean), so ``decode_plan`` takes it wherever the whole
      grid is resident at once.
    - ``w_evict_first`` (the ring's default): the W copies carry TMA's L2 evict-first hint. W is read once per step,
      so its lines are the ones to replace, not what the L2 held before the step; after the benchmarks' flush
      (dirty lines that must be written back when evicted) that is 8-9 % of the step (H200, d=4096: B = 1 / 8 / 32
      / 64 16.44 / 16.49 / 17.78 / 21.10 -> 14.86 / 15.02 / 16.31 / 19.30 us), from a clean L2 it is within 1 %
      either way (12.81 / 13.17 / 14.54 / 17.97 -> 12.84 / 13.22 / 14.67 / 18.00). The register path's loads with
      the same hint (``ld.global...L2::cache_hint``) measured equal at d=7168, so they stay plain. False is the
      sweep's reference point.
    - With ``mw`` > 1, ``mw`` warps share each ring slot (``nw`` slot owners, ``nw mw`` warps): warp w reads its k
      rows as owner w % nw and takes m-tiles [(w // nw) mt / mw, ...) of the slot's e rows; the owner's first warp
      issues the copies once all of the slot's warps have read the chunk before (a named barrier of the ``mw`` warps
      instead of ``__syncwarp``), so each W fragment feeds mt / mw m-tiles per warp.
    - ``late_cache`` (the ring's default): the epilogue operands' copies follow the second chunk's TMA copies, and a
      V CTA loads the positions there but copies its cache slots (whose addresses need them) only after its first
      chunk, so that no warp waits for a position while it has one chunk asked for (B=64: 22.3 -> 20.4 us; B = 1 /
      8: -0.6 %). False (the copies before the second chunk's) is the sweep's reference point.
    - The warps' tiles are summed in shared memory in warp order (deterministic, like every sum below).
    - K CTAs round k, write the per-row sums h.h, k.k, (h w_h).(k w_h) of their panel to S[b, panel, 0..2],
      arrive (release add) and exit. V CTAs round v, write v.v to S[b, panel, 3], arrive, poll the row tile's
      count until all 2 NP arrived, add the panels' sums in a fixed order and do the gate, conv, y and cache
      update for their columns. The epilogue operands (h, w_h / w_v, conv_w, the lagged cache slots) are
      cp.async'ed into shared memory right after the first W loads, so they arrive while the loop runs.
    - Counters: words ``_GEMV_CTR + 2 by`` (count) and ``+ 1`` (V CTAs that left); the last V CTA to leave zeroes
      both, so every launch finds zeros (CUDA graph replays). The NP waiters of each row tile must fit on the
      GPU next to the CTAs they wait for (``decode_plan``).

    Thread tx owns columns 8 (tx % 8) .. + 8 of the panel in rows tx / 8 + i (threads / 8) (i < items), so the 8
    lanes of a row reduce its sums with 3 butterflies. Runtime: batch, cache length, positions, eps.

    ``timeline`` (for ``benchmarks/probe_l2_flush.py``, one row tile): thread 0 of CTA c (K panels first, then V
    panels, in either block order) also writes the global timer's low 32 bits (ns) to ``Ctr[TIMELINE_STAMPS c +
    i]`` (words the GEMV's counters do not use) at the CTA's start (i = 0), after its loop and tile reduction (1),
    once its row sums are stored (2), after its arrival (3) and, in a V CTA, after its wait (4), once its stores are
    issued (5) and at its end (6)."""
    B = T.dynamic("batch")
    LC = T.dynamic("cache_len")
    f32 = "float32"
    threads = 32 * nw * mw
    MTW = mt // mw  # m-tiles per warp
    NP = ceil_div(d, GEMV_PANEL)
    KS = ceil_div(d_mem, 16)  # k16 steps
    SPW = ceil_div(KS, nw)  # steps per warp
    P = min(depth, SPW)
    rows_pred = SPW * nw * 16 != d_mem
    cols_pred = d % GEMV_PANEL != 0
    MR = 16 * mt  # batch rows per CTA
    nv = GEMV_PANEL // VEC
    items, EPW, _ = _gemv_epilogue(mt, nw, taps, mw=mw)  # (row, 16-byte column vector) items per thread; operands
    rstep = threads // nv
    R = taps - 1
    RS = GEMV_PANEL + 4  # padded row stride of the reduction tile (floats)
    assert not timeline or 2 * NP * TIMELINE_STAMPS <= _GEMV_CTR, "the timeline's words would reach the counters"
    assert not ring or ring_ok(mt, nw, d_mem, d, mw, ring), (
        "the W ring needs <= 4 m-tiles a warp, whole steps and panels, room for the reduction tile")
    assert mw == 1 or ring, "warps share W only through the ring's slots"
    NC = SPW // RING_STEPS  # ring chunks per warp (RING_STEPS k16 steps each)
    NS = min(ring, NC)  # ring slots per warp
    prelude = _gemv_prelude(MTW, dtype, mw > 1)

    def valid_w(row, col):
        """The W vector (row, col..col+7) is in bounds (only tested where the shape can leave it out)."""
        conds = ([row < d_mem] if rows_pred else []) + ([col < d] if cols_pred else [])
        return tirx.all(*conds) if conds else True

    def valid_e(row):
        return row < d_mem if rows_pred else True

    @T.macro
    def load(E, W, wb, eb, warp, t, g, c0, by, B, s: int):
        """Step s of this warp into pipeline slot s % P: W rows 4t..4t+3 at column c0, e rows g, g + 8 (per m-tile)."""
        row0 = (warp * SPW + s) * 16 + 4 * t
        slot = s % P
        for r in _static(4):
            if valid_w(row0 + r, c0):
                T.call_extern("handle", "tkd_ldw", T.address_of(wb[(slot * 4 + r) * VEC]),
                              T.address_of(W[row0 + r, c0]))
            else:
                for e in T.vectorized(VEC):
                    wb[(slot * 4 + r) * VEC + e] = T.cast(0, dtype)
        for m in _static(mt):
            for h in _static(2):
                if valid_e(row0):
                    for e in T.vectorized(4):  # rows >= B only feed discarded rows of the product
                        eb[((slot * mt + m) * 2 + h) * 4 + e] = E[T.min(by * MR + m * 16 + h * 8 + g, B - 1), row0 + e]
                else:
                    for e in T.vectorized(4):
                        eb[((slot * mt + m) * 2 + h) * 4 + e] = T.cast(0, dtype)

    @T.macro
    def early_k(Hx, w_h, tx, c0, by, B, ep):
        """cp.async of this thread's epilogue operands into its row of ``ep``: w_h, then h of each item."""
        if c0 < d:
            T.call_extern("handle", "tkd_cp16", T.address_of(ep[tx, 0]), T.address_of(w_h[c0]))
        for i in _static(items):
            b = by * MR + tx // nv + i * rstep
            if tx // nv + i * rstep < MR and b < B and c0 < d:
                T.call_extern("handle", "tkd_cp16", T.address_of(ep[tx, (1 + i) * VEC]), T.address_of(Hx[b, c0]))

    @T.macro
    def early_v(w_v, conv_w, state, pos, tx, c0, by, B, LC, ep, rpl, part: str = "all"):
        """cp.async of w_v, the taps and each item's lagged cache slots into this thread's row of ``ep``; ``part``
        "issue" copies w_v and the taps and loads each item's position into ``rpl``, "cache" then copies the cache
        slots (so that no warp waits for the positions while its first W chunks are not yet asked for)."""
        if part != "cache" and c0 < d:
            T.call_extern("handle", "tkd_cp16", T.address_of(ep[tx, 0]), T.address_of(w_v[c0]))
            for p in _static(taps):
                T.call_extern("handle", "tkd_cp16", T.address_of(ep[tx, (1 + p) * VEC]), T.address_of(conv_w[p, c0]))
        for i in _static(items):
            b = by * MR + tx // nv + i * rstep
            if tx // nv + i * rstep < MR and b < B and c0 < d:
                # cache_pos >= 0 and L >= dilation * R: lag q+1 wraps at most once.
                if part == "all":
                    rpl[i] = T.truncmod(pos[b], LC)
                elif part == "issue":
                    rpl[i] = pos[b]
                else:
                    rpl[i] = T.truncmod(rpl[i], LC)
                for q in _static(R if part != "issue" else 0):
                    sl = rpl[i] - (q + 1) * dilation
                    T.call_extern("handle", "tkd_cp16", T.address_of(ep[tx, (1 + taps + i * R + q) * VEC]),
                                  T.address_of(state[b, T.if_then_else(sl < 0, sl + LC, sl), c0]))

    @T.macro
    def fill(E, W, wr, er, bars, owner, lead, panel, by, c: int):
        """TMA copies of chunk c of slot owner ``owner`` (RING_STEPS k16 steps: its W rows of the panel, the row
        tile's e columns; e rows past the batch arrive as zeros) into ring slot c % NS, once every lane of the
        slot's warps has read the slot's previous chunk; the copies are issued by the warp where ``lead`` holds."""
        KR = 16 * RING_STEPS
        row0 = (owner * NC + c) * KR
        slot = owner * NS + c % NS
        if mw == 1:
            T.call_extern("handle", "__syncwarp")
        else:
            T.call_extern("handle", "tkd_bar_sync", 1 + owner, 32 * mw)
        if lead:
            T.tma_copy(W[row0:row0 + KR, panel * GEMV_PANEL:(panel + 1) * GEMV_PANEL],
                       wr[slot * KR:slot * KR + KR, :], barrier=bars[slot], leader_scope_threads=32,
                       eviction_policy="evict_first" if w_evict_first else None)
            T.tma_copy(E[by * MR:by * MR + MR, row0:row0 + KR], er[slot * MR:slot * MR + MR, :], barrier=bars[slot],
                       leader_scope_threads=32)
            T.barrier_arrive(bars[slot])

    @T.macro
    def mainloop(E, W, acc, wb, eb, wr, er, bars, tx, panel, by, B, Hx, w_h, w_v, conv_w, state, pos, LC, ep, rpl,
                 is_v: bool):
        """acc += this warp's rows of e @ W[:, panel]; the epilogue operands are copied to shared memory
        asynchronously right after the first W loads (the cache slots wait for pos, as the first mma waits for W;
        with ``late_cache`` after the first chunk). With ``ring``, each step's W and e come from the warp's ring
        slot, refilled ``NS - 1`` chunks ahead (the slot the chunk before freed)."""
        warp = tx // 32
        lane = tx % 32
        g = lane // 4
        t = lane % 4
        c0 = panel * GEMV_PANEL + g * VEC
        ce = panel * GEMV_PANEL + (tx % nv) * VEC
        owner = warp if mw == 1 else warp % nw  # the ring slots (and k rows) this warp reads
        lead = True if mw == 1 else warp < nw
        erow = 0 if mw == 1 else warp // nw * MTW * 16  # its first e row in a slot
        for i in T.unroll(MTW * 32):
            acc[i] = T.float32(0)
        if ring:
            for c in _static(NS - 1):
                fill(E, W, wr, er, bars, owner, lead, panel, by, c)
        else:
            for s in _static(P):
                load(E, W, wb, eb, warp, t, g, c0, by, B, s)
        late = ring and late_cache
        for s in _static(SPW):
            if s == 0 and not late:
                if is_v:
                    early_v(w_v, conv_w, state, pos, tx, ce, by, B, LC, ep, rpl)
                else:
                    early_k(Hx, w_h, tx, ce, by, B, ep)
            if ring:
                c, q = divmod(s, RING_STEPS)
                slot = owner * NS + c % NS
                if q == 0:
                    if c + NS - 1 < NC:
                        fill(E, W, wr, er, bars, owner, lead, panel, by, c + NS - 1)
                    if s == 0 and late:
                        if is_v:
                            early_v(w_v, conv_w, state, pos, tx, ce, by, B, LC, ep, rpl, "issue")
                        else:
                            early_k(Hx, w_h, tx, ce, by, B, ep)
                    T.mbarrier_wait_parity(bars[slot], (c // NS) % 2)
                T.call_extern("handle", "tkd_ring_step", T.address_of(acc[0]),
                              T.address_of(wr[(slot * RING_STEPS + q) * 16, 0]),
                              T.address_of(er[slot * MR + erow, 0]), q, lane)
                if s == RING_STEPS - 1 and late and is_v:
                    early_v(w_v, conv_w, state, pos, tx, ce, by, B, LC, ep, rpl, "cache")
            else:
                T.call_extern("handle", "tkd_step", T.address_of(acc[0]), T.address_of(wb[(s % P) * 4 * VEC]),
                              T.address_of(eb[(s % P) * mt * 8]))
                if s + P < SPW:
                    load(E, W, wb, eb, warp, t, g, c0, by, B, s + P)

    @T.macro
    def stamp(Ctr, tx, stamps, i: int, dep=0.0):
        if timeline:
            if tx == 0:
                T.call_extern("handle", "tkd_stamp", T.address_of(Ctr[stamps + i]), T.cast(dep, f32))

    @T.macro
    def reduce_tile(acc, red, out, tx):
        """out[i * VEC + e] = sum over warps (in order) of the tile at (row tx / 8 + i * rstep, vector tx % 8).
        ``red`` (float32, nw mw x TR x RS) is addressed by raw offsets: with the ring it lies in the ring's bytes,
        whose swizzled layout TileLang would otherwise apply to it, and holds one m-tile of each warp at a time (TR =
        16 rows; else TR = MR, all m-tiles at once). With ``mw`` > 1 a row's tiles are those of the ``nw`` warps
        that took its m-tile."""
        rb = T.address_of(red[0, 0]) if ring else T.address_of(red[0])
        warp = tx // 32
        lane = tx % 32
        g = lane // 4
        t = lane % 4
        cv = tx % nv
        tr = 16 if ring else MR  # rows of a warp's tile in red
        for pas in _static(MTW if ring else 1):
            if ring:
                T.sync_threads()  # red lies in the W ring: every warp has read its last slot (and m-tile pas - 1)
            for m in (pas,) if ring else _static(MTW):
                row = warp * tr + (0 if ring else m * 16) + g
                for h in T.unroll(2):
                    for half in T.unroll(2):
                        for j in T.unroll(VEC):
                            if ring:  # standard fragments: column 8 j + 2 t + half
                                T.call_extern("handle", "tkd_st_f32", rb,
                                              (row + h * 8) * RS + j * 8 + 2 * t + half,
                                              acc[(m * 8 + j) * 4 + h * 2 + half])
                            else:
                                T.call_extern("handle", "tkd_st_f32", rb,
                                              (row + h * 8) * RS + t * 16 + half * VEC + j,
                                              acc[(m * 8 + j) * 4 + h * 2 + half])
            T.sync_threads()
            for i in T.unroll(items):
                r = tx // nv + i * rstep
                gm = r // 16  # the row's m-tile, the warp's m-tile (pass) it is in, the rows of its first warp
                lm, rr = (gm, r % 16 if ring else r) if mw == 1 else (gm % MTW, gm // MTW * nw * 16 + r % 16)
                if tirx.all(r < MR, lm == pas) if ring else r < MR:
                    for e in T.unroll(VEC):
                        out[i * VEC + e] = T.call_extern(f32, "tkd_ld_f32", rb, rr * RS + cv * VEC + e)
                    for w in T.unroll(1, nw):
                        for e in T.unroll(VEC):
                            out[i * VEC + e] += T.call_extern(f32, "tkd_ld_f32", rb, (w * tr + rr) * RS + cv * VEC + e)

    @T.prim_func
    def main(
        E: T.Tensor((B, d_mem), dtype),
        WK: T.Tensor((d_mem, d), dtype),
        WV: T.Tensor((d_mem, d), dtype),
        Hx: T.Tensor((B, d), dtype),
        w_h: T.Tensor((d,), dtype),
        w_v: T.Tensor((d,), dtype),
        conv_w: T.Tensor((taps, d), dtype),
        state: T.Tensor((B, LC, d), dtype),
        pos: T.Tensor((B,), "int32"),
        Y: T.Tensor((B, d), dtype),
        S: T.Tensor((B, NP, 4), f32),
        Ctr: T.Tensor((_CTR_LEN,), "int32"),
        eps: T.float32,
    ):
        with T.Kernel(2 * NP, T.ceildiv(B, MR), threads=threads, prelude=prelude) as (bx, by):
            ep = T.alloc_shared((threads, EPW), dtype)
            if ring:
                wr = T.alloc_shared((nw * NS * 16 * RING_STEPS, GEMV_PANEL), dtype)
                er = T.alloc_shared((nw * NS * MR, 16 * RING_STEPS), dtype)
                bars = T.alloc_barrier([32] * (nw * NS))
                T.annotate_layout({wr: tl_layout.make_swizzled_layout(wr), er: tl_layout.make_swizzled_layout(er)})
                red = wr  # the reduction tile lies in the W ring's bytes, once every warp has left its loop
            else:
                wr = er = bars = None
                red = T.alloc_shared((nw * MR * RS,), f32)
            lv = T.alloc_local((1,), "uint32")
            acc = T.alloc_local((MTW * 32,), f32)
            # the register path's W and e pipeline (the ring has its own in shared memory)
            wb = None if ring else T.alloc_local((P * 4 * VEC,), dtype)
            eb = None if ring else T.alloc_local((P * mt * 8,), dtype)
            out = T.alloc_local((items * VEC,), f32)
            part = T.alloc_local((items * 4,), f32)
            tv = T.alloc_local((4,), f32)
            xh = T.alloc_local((items * VEC,), dtype)
            wl = T.alloc_local((VEC,), dtype)
            cw = T.alloc_local((taps * VEC,), dtype)
            st = T.alloc_local((items * max(R, 1) * VEC,), dtype)
            rpl = T.alloc_local((items,), "int32")
            no = T.alloc_local((VEC,), dtype)
            yo = T.alloc_local((VEC,), dtype)
            uu = T.alloc_local((VEC,), f32)
            T.annotate_min_blocks_per_sm(min_blocks)
            tx = T.get_thread_binding()
            cv = tx % nv
            ctr = _GEMV_CTR + 2 * by
            # the CTA's role: a K panel below NP, else a V panel; with the ring and ``v_first`` the V CTAs take the
            # first block indices (the lower ones start first)
            cta = (bx + NP) % (2 * NP) if ring and v_first else bx
            stamps = (by * 2 * NP + cta) * TIMELINE_STAMPS
            stamp(Ctr, tx, stamps, 0)
            if cta < NP:
                c0 = cta * GEMV_PANEL + cv * VEC
                mainloop(E, WK, acc, wb, eb, wr, er, bars, tx, cta, by, B, Hx, w_h, w_v, conv_w, state, pos, LC, ep,
                         rpl, False)
                reduce_tile(acc, red, out, tx)
                stamp(Ctr, tx, stamps, 1)
                T.call_extern("handle", "tkd_cp_wait")
                for e in T.vectorized(VEC):
                    wl[e] = ep[tx, e]
                for i in T.unroll(items):
                    for e in T.vectorized(VEC):
                        xh[i * VEC + e] = ep[tx, (1 + i) * VEC + e]
                for i in T.unroll(items):
                    for q in T.unroll(4):
                        part[i * 4 + q] = T.float32(0)
                    b = by * MR + tx // nv + i * rstep
                    if tx // nv + i * rstep < MR and b < B and c0 < d:
                        for e in T.unroll(VEC):
                            hv = T.cast(xh[i * VEC + e], f32)
                            kv = T.cast(T.cast(out[i * VEC + e], dtype), f32)
                            wh = T.cast(wl[e], f32)
                            part[i * 4] += hv * hv
                            part[i * 4 + 1] += kv * kv
                            part[i * 4 + 2] += hv * kv * (wh * wh)
                for i in T.unroll(items):
                    for q in T.unroll(3):
                        for m in T.unroll(3):
                            part[i * 4 + q] += T.shfl_xor(part[i * 4 + q], 1 << m)
                    b = by * MR + tx // nv + i * rstep
                    if cv == 0 and tx // nv + i * rstep < MR and b < B:
                        for q in T.unroll(3):
                            S[b, cta, q] = part[i * 4 + q]
                stamp(Ctr, tx, stamps, 2, part[0])
                T.sync_threads()
                if tx == 0:
                    T.call_extern("handle", "tkd_release_add", T.address_of(Ctr[ctr]))
                stamp(Ctr, tx, stamps, 3)
            else:
                panel = cta - NP
                c0 = panel * GEMV_PANEL + cv * VEC
                mainloop(E, WV, acc, wb, eb, wr, er, bars, tx, panel, by, B, Hx, w_h, w_v, conv_w, state, pos, LC, ep,
                         rpl, True)
                reduce_tile(acc, red, out, tx)
                stamp(Ctr, tx, stamps, 1)
                for i in T.unroll(items):
                    part[i * 4] = T.float32(0)
                    b = by * MR + tx // nv + i * rstep
                    if tx // nv + i * rstep < MR and b < B and c0 < d:
                        for e in T.unroll(VEC):
                            vv = T.cast(T.cast(out[i * VEC + e], dtype), f32)
                            out[i * VEC + e] = vv
                            part[i * 4] += vv * vv
                for i in T.unroll(items):
                    for m in T.unroll(3):
                        part[i * 4] += T.shfl_xor(part[i * 4], 1 << m)
                    b = by * MR + tx // nv + i * rstep
                    if cv == 0 and tx // nv + i * rstep < MR and b < B:
                        S[b, panel, 3] = part[i * 4]
                stamp(Ctr, tx, stamps, 2, part[0])
                T.sync_threads()
                if tx == 0:
                    T.call_extern("handle", "tkd_release_add", T.address_of(Ctr[ctr]))
                stamp(Ctr, tx, stamps, 3)
                if tx == 0:
                    T.call_extern("handle", "tkd_poll", T.address_of(Ctr[ctr]), 2 * NP)
                    # its result is needed only at the very end: the atomic overlaps the epilogue
                    lv[0] = T.call_extern("uint32", "tkd_leave", T.address_of(Ctr[ctr]))
                stamp(Ctr, tx, stamps, 4)
                T.sync_threads()
                T.call_extern("handle", "tkd_cp_wait")
                for e in T.vectorized(VEC):
                    wl[e] = ep[tx, e]
                for p in T.unroll(taps):
                    for e in T.vectorized(VEC):
                        cw[p * VEC + e] = ep[tx, (1 + p) * VEC + e]
                for i in T.unroll(items):
                    for q in T.unroll(R):
                        for e in T.vectorized(VEC):
                            st[(i * R + q) * VEC + e] = ep[tx, (1 + taps + i * R + q) * VEC + e]
                gate_and_step(S, part, tv, out, wl, cw, st, rpl, no, uu, yo, Y, state, eps, B, by * MR, tx, c0, MR,
                              items, nv, rstep, NP, d, taps, dtype)
                stamp(Ctr, tx, stamps, 5, yo[0])
                if tx == 0:
                    T.call_extern("handle", "tkd_leave_done", T.address_of(Ctr[ctr]), lv[0], NP)
                stamp(Ctr, tx, stamps, 6)

    return main


def decode_roofline_bytes(B: int, d_mem: int, d: int, taps: int, elem: int = 2) -> int:
    """Bytes one decode step must move (module docstring); 2*d_mem*d*elem of them are W_K and W_V."""
    return (2 * d_mem * d + B * d_mem + 2 * B * d + B * taps * d + (2 + taps) * d) * elem + 4 * B


def init_decode_state(batch: int, d: int, conv_kernel_size: int = 4, dilation: int = 1, *,
                      dtype=torch.bfloat16, device=None):
    """An empty decode history: (zero cache (batch, dilation*(w-1), d), cache_pos zeros (batch,) int32)."""
    op = "init_decode_state"
    checks.check_int(op, "batch", batch, 0, "a non-negative int")
    checks.check_int(op, "d", d, 0, "a non-negative int")
    checks.check_positive_int(op, "conv_kernel_size", conv_kernel_size)
    checks.check_positive_int(op, "dilation", dilation)
    hist = dilation * (conv_kernel_size - 1)
    return (torch.zeros((batch, hist, d), dtype=dtype, device=device),
            torch.zeros((batch,), dtype=torch.int32, device=device))


_COUNTERS: dict = {}


def _counters(device) -> torch.Tensor:
    """The one-launch kernels' per-device counter workspace (zeros; every launch leaves its counts at zero). Decode
    steps on one device must therefore not run concurrently on two streams."""
    ctr = _COUNTERS.get(device)
    if ctr is None:
        ctr = _COUNTERS[device] = torch.zeros(_CTR_LEN, dtype=torch.int32, device=device)
    return ctr


def _waiters(B: int, d: int, rows: int) -> int:
    """CTAs of a one-launch kernel that wait for other CTAs: one per 64-column panel (both kernels' width) and
    tile of ``rows`` batch rows."""
    return ceil_div(d, 64) * ceil_div(B, rows)


# From TWO_LAUNCH_MIN_BATCH rows on, rows of at most TWO_LAUNCH_MAX_D columns take the two launches: per step in a
# CUDA graph (launch gaps included; H200, session 7, d_mem 2048) at d=4096 B = 32 / 64 they took 22.9 / 23.3 us
# against the fused kernel's 23.6 / 25.9 (B=17: 22.2 both); at d=7168 B=64 the fused kernel is faster (33.2 against
# 39.0 us).
TWO_LAUNCH_MIN_BATCH = 32
TWO_LAUNCH_MAX_D = 4096


def decode_plan(B: int, d_mem: int, d: int, sms: int = _SMS, taps: int = 4) -> tuple[str, dict]:
    """(path, tuning) of a decode step with ``taps`` conv taps: ("gemv", ``gemv_config``) up to ``GEMV_MAX_BATCH``
    rows while its epilogue operands fit in shared memory (up to 52 taps), and up to ``GEMV_RING_MAX_BATCH`` rows
    where the W ring applies with two or four m-tiles (one CTA per SM: d <= 4,224 on 132 SMs; up to 22 / 8 taps);
    ("two_launch", ``proj_config``) from ``TWO_LAUNCH_MIN_BATCH`` rows at d <= ``TWO_LAUNCH_MAX_D``; else ("fused",
    ``fused_config``), or the two launches when the fused kernel's waiting CTAs would not leave at least one of
    ``sms`` SMs free for the CTAs they wait for (the GEMV kernel's likewise). ``_decode_dev`` plans again with the
    actual GPU's SMs (shape logic only here: it also runs under torch.compile)."""
    if B <= GEMV_RING_MAX_BATCH:
        cfg = gemv_config(B, d_mem, d)
        tiles = ceil_div(B, 16 * cfg["mt"])
        # the W ring only where the whole grid is resident at once (``min_blocks`` CTAs per SM) and its slots fit
        # beside the epilogue's operands (at 2 CTAs per SM for one m-tile)
        smem = GEMV_RING_SMEM if cfg["min_blocks"] == 2 else MAX_SMEM_PER_BLOCK
        if cfg["ring"] and (2 * ceil_div(d, GEMV_PANEL) * tiles > sms * cfg["min_blocks"]
                            or _gemv_epilogue(cfg["mt"], cfg["nw"], taps, cfg["ring"], cfg["mw"])[2] > smem):
            cfg.update(ring=0, mw=1)  # (more than one m-tile then takes another path)
        fits = _gemv_epilogue(cfg["mt"], cfg["nw"], taps, cfg["ring"], cfg["mw"])[2] <= MAX_SMEM_PER_BLOCK
        if ((cfg["mt"] == 1 or cfg["ring"]) and fits and _waiters(B, d, 16 * cfg["mt"]) < sms
                and _GEMV_CTR + 2 * tiles <= _CTR_LEN):
            return "gemv", cfg
    if B >= TWO_LAUNCH_MIN_BATCH and d <= TWO_LAUNCH_MAX_D:
        return "two_launch", proj_config(B, d_mem, d)
    cfg = fused_config(B, d_mem, d)
    if _waiters(B, d, cfg["block_m"]) < sms and 2 + _waiters(B, d, cfg["block_m"]) <= _GEMV_CTR:
        return "fused", cfg
    return "two_launch", proj_config(B, d_mem, d)


def device_plan(B: int, d_mem: int, d: int, device: torch.device, taps: int = 4) -> tuple[str, dict]:
    """``decode_plan`` with the SMs of ``device`` (``tk_core.config.get_num_sms``, so a ``set_num_sms`` limit
    counts): what ``_decode_dev`` launches there."""
    return decode_plan(B, d_mem, d, min(_SMS, config.get_num_sms(device.index)), taps)


def decode_scratch(B: int, d_mem: int, d: int, device, path: str | None = None, taps: int = 4):
    """The float32 partials (none for the GEMV kernel) and row-sum scratch (contents irrelevant) that
    ``_decode_dev`` needs on ``path`` (default: ``decode_plan``'s for ``taps``)."""
    if path is None:
        path = decode_plan(B, d_mem, d, taps=taps)[0]
    if path == "gemv":
        parts, sums = (0,), (B, ceil_div(d, GEMV_PANEL), 4)
    elif path == "fused":
        parts, sums = (fused_config(B, d_mem, d)["splits"], 2, B, d), (B, ceil_div(d, FUSED_PANEL), 4)
    else:
        parts, sums = (proj_config(B, d_mem, d)["splits"], 2, B, d), (B, 8, 4)
    f32 = torch.float32
    return torch.empty(parts, dtype=f32, device=device), torch.empty(sums, dtype=f32, device=device)


@device_op("tk_engram::decode_step", mutates_args=("conv_state", "part", "sums", "y"))
def _decode_dev(
    e_t: torch.Tensor, h_t: torch.Tensor, conv_state: torch.Tensor, cache_pos: torch.Tensor, W_K: torch.Tensor,
    W_V: torch.Tensor, rms_w_h: torch.Tensor, rms_w_v: torch.Tensor, conv_w: torch.Tensor, part: torch.Tensor,
    sums: torch.Tensor, y: torch.Tensor, dilation: int, eps: float,
) -> None:
    dt = _TL_DTYPES[h_t.dtype]
    (B, d), d_mem = h_t.shape, e_t.shape[1]
    taps = conv_w.shape[0]
    path, cfg = device_plan(B, d_mem, d, h_t.device, taps)
    if path != decode_plan(B, d_mem, d, taps=taps)[0]:  # a smaller GPU: another path, with its own scratch
        part, sums = decode_scratch(B, d_mem, d, h_t.device, path)
    if path == "gemv":
        gemv = decode_gemv_kernel.get(h_t.device, dtype=dt, d_mem=d_mem, d=d, taps=taps, dilation=dilation, **cfg)
        gemv(e_t, W_K, W_V, h_t, rms_w_h, rms_w_v, conv_w, conv_state, cache_pos, y, sums, _counters(h_t.device),
             eps)
    elif path == "fused":
        fused = decode_fused_kernel.get(h_t.device, dtype=dt, d_mem=d_mem, d=d, taps=taps, dilation=dilation, **cfg)
        fused(e_t, W_K, W_V, h_t, rms_w_h, rms_w_v, conv_w, conv_state, cache_pos, y, part, sums,
              _counters(h_t.device), eps)
    else:
        proj = decode_proj_kernel.get(h_t.device, dtype=dt, d_mem=d_mem, d=d, **cfg)
        proj(e_t, W_K, W_V, part)
        step = decode_step_kernel.get(h_t.device, dtype=dt, d=d, taps=taps, dilation=dilation,
                                      splits=cfg["splits"], cluster=STEP_CLUSTER)
        step(h_t, part, rms_w_h, rms_w_v, conv_w, conv_state, cache_pos, y, sums, eps)


def engram_decode_step(e_t, h_t, conv_state, cache_pos, W_K, W_V, rms_w_h, rms_w_v, conv_w, *,
                       dilation: int = 1, eps: float = 1e-6, use_reference: bool = False):
    """One fused Engram decode step (module docstring): returns y (B, d) and writes n into ``conv_state``.

    e_t (B, d_mem), h_t (B, d) with d >= 1, W_K/W_V (d_mem, d), rms_w_* (d,), conv_w (w, d), conv_state (B, L, d)
    with L >= dilation*(w-1), contiguous (it is updated in place), all of one dtype (fp16/bf16; CPU also
    fp32/fp64); cache_pos (B,) int32 >= 0. On CUDA d and d_mem must be multiples of 8 and conv_state 16-byte
    aligned. ``use_reference`` runs the reference on any device (with the CPU's dtype rules; the op object's
    target='torch').
    Limit: the one-launch kernels synchronise their CTAs through a counter workspace per device, so decode steps
    on one device must not run concurrently on two CUDA streams (one after another on any streams is fine).
    """
    op = "engram_decode_step"
    checks.check_bool(op, "use_reference", use_reference)
    _check_dilation(op, dilation)
    eps = checks.check_float(op, "eps", eps)
    checks.check_tensor(op, "h_t", h_t)
    kernel = h_t.is_cuda and not use_reference
    allowed = tuple(_TL_DTYPES) if kernel else _CPU_DTYPES
    checks.check_dtype(op, "h_t", h_t, allowed)
    checks.check_ndim(op, "h_t", h_t, 2)
    B, d = h_t.shape
    if d == 0:  # the RMS statistics would divide by zero
        checks.fail(op, "h_t", "of shape (B, d) with d >= 1", f"shape {tuple(h_t.shape)}")
    checks.check_grid_extent(op, "h_t", B, "rows (dimension 0)", f"shape {tuple(h_t.shape)}")
    checks.check_dtype(op, "e_t", e_t, (h_t.dtype,))
    checks.check_ndim(op, "e_t", e_t, 2)
    checks.check_shape(op, "e_t", e_t, (B, None))
    d_mem = e_t.shape[1]
    for name, x, shape in (("W_K", W_K, (d_mem, d)), ("W_V", W_V, (d_mem, d)), ("rms_w_h", rms_w_h, (d,)),
                           ("rms_w_v", rms_w_v, (d,)), ("conv_w", conv_w, (None, d))):
        checks.check_dtype(op, name, x, (h_t.dtype,))
        checks.check_shape(op, name, x, shape)
    taps = conv_w.shape[0]
    if taps < 1:
        checks.fail(op, "conv_w", "of shape (w >= 1, d)", f"shape {tuple(conv_w.shape)}")
    hist = dilation * (taps - 1)
    checks.check_dtype(op, "conv_state", conv_state, (h_t.dtype,))
    checks.check_ndim(op, "conv_state", conv_state, 3)
    checks.check_shape(op, "conv_state", conv_state, (B, None, d))
    if conv_state.shape[1] < hist:
        checks.fail(op, "conv_state", f"of length >= dilation*(w-1) = {hist}", f"shape {tuple(conv_state.shape)}")
    checks.check_dtype(op, "cache_pos", cache_pos, (torch.int32,))
    checks.check_shape(op, "cache_pos", cache_pos, (B,))
    for name, x in (("e_t", e_t), ("W_K", W_K), ("W_V", W_V), ("rms_w_h", rms_w_h), ("rms_w_v", rms_w_v),
                    ("conv_w", conv_w), ("conv_state", conv_state), ("cache_pos", cache_pos)):
        checks.check_same_device(op, name, x, h_t.device)
    # updated in place on every path: the rows of an overlapping (e.g. expanded) state would overwrite each other
    checks.check_contiguous(op, "conv_state", conv_state)
    if not kernel:
        return reference.decode_step_ref(e_t, h_t, conv_state, cache_pos, W_K, W_V, rms_w_h, rms_w_v, conv_w,
                                         dilation, eps)
    checks.check_divisible(op, "d (the last dimension of h_t)", d, 8)
    checks.check_divisible(op, "d_mem (the last dimension of e_t)", d_mem, 8)
    if not torch.compiler.is_compiling() and conv_state.data_ptr() % 16:  # the kernels' 16-byte vectors
        checks.fail(op, "conv_state", "16-byte aligned", f"address {conv_state.data_ptr():#x}")
    y = torch.empty((B, d), dtype=h_t.dtype, device=h_t.device)
    if B == 0:
        return y
    part, sums = decode_scratch(B, d_mem, d, h_t.device, taps=conv_w.shape[0])
    _decode_dev(_aligned(e_t), _aligned(h_t), conv_state, _aligned(cache_pos), _aligned(W_K), _aligned(W_V),
                _aligned(rms_w_h), _aligned(rms_w_v), _aligned(conv_w), part, sums, y, dilation, eps)
    return y


class EngramDecodeFwdOp:
    """``EngramDecodeFwdOp(conv_kernel_size=4, dilation=1, eps=1e-6, target=None)(e_t, h_t, conv_state,
    cache_pos, W_K, W_V, rms_w_h, rms_w_v, conv_w, advance=True) -> y``; updates ``conv_state`` in place and,
    with ``advance``, increments ``cache_pos``. target as for ``EngramGateConvFwdOp``."""

    def __init__(self, conv_kernel_size: int = 4, dilation: int = 1, eps: float = 1e-6, *, target=None):
        op = type(self).__name__
        eps = _check_params(op, conv_kernel_size, dilation, eps)
        _check_target(op, target)
        self.conv_kernel_size, self.dilation, self.eps, self.target = conv_kernel_size, dilation, eps, target

    def init_state(self, batch: int, d: int, *, dtype=torch.bfloat16, device=None):
        return init_decode_state(batch, d, self.conv_kernel_size, self.dilation, dtype=dtype, device=device)

    def __call__(self, e_t, h_t, conv_state, cache_pos, W_K, W_V, rms_w_h, rms_w_v, conv_w, advance: bool = True):
        op = type(self).__name__
        checks.check_bool(op, "advance", advance)
        _check_taps(op, conv_w, self.conv_kernel_size)
        y = engram_decode_step(e_t, h_t, conv_state, cache_pos, W_K, W_V, rms_w_h, rms_w_v, conv_w,
                               dilation=self.dilation, eps=self.eps,
                               use_reference=_use_reference(op, self.target, "h_t", h_t))
        if advance:
            cache_pos.add_(1)
        return y
