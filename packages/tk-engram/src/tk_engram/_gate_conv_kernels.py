"""TileLang kernels of GateConv forward and backward (see ``gate_conv.py`` for the math; the decode kernels
live in ``decode.py``). Shared layout: one CTA owns whole d-rows; thread ``tx`` owns the 8-element column vectors
``(s * threads + tx) * 8 .. + 8`` for ``s < slots``, so every global access is a 16-byte vector and every
per-column state (the convolution history rings in shared memory, the weight-gradient accumulators in
registers) is private to one thread: only the per-token row reductions synchronise the CTA.

The causal convolution couples token t only with tokens t - q*dilation, so the tokens of one residue class
modulo the dilation form an independent chain. A CTA walks ``chunk`` consecutive tokens of one chain of one
sequence, recomputing a halo of ``taps - 1`` chain tokens before (and, in the backward, after) its chunk.
"""

import math

import tilelang.language as T
from tvm import tirx

from tk_core.jit import MAX_SMEM_PER_BLOCK, kernel
from tk_core.layout import ceil_div
from tk_core.ptx import RCP_FAST, RCP_FAST_BITS, rcp_fast

VEC = 8  # elements per 16-byte access (float16 / bfloat16)

# Element helpers of the GateConv kernels. bf16 -> float32 is exact: the low half of a packed pair is widened by one
# shift, the high half by one mask (nvcc emits PRMT + SHF for the high half of a cast). Rounding goes in pairs (one
# cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32, round-to-nearest-even like the single conversion). fp16 keeps the cast (one
# HADD2.F32 already).
_BF16 = r"""
#include <cuda_bf16.h>
__device__ __forceinline__ float tk_gc_lo(const void* p) {
  return __uint_as_float(*reinterpret_cast<const unsigned*>(p) << 16);
}
__device__ __forceinline__ float tk_gc_hi(const void* p) {
  return __uint_as_float(*reinterpret_cast<const unsigned*>(p) & 0xffff0000u);
}
__device__ __forceinline__ void tk_gc_pack(void* p, float lo, float hi) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(lo, hi);
}
"""
_FP16 = r"""
#include <cuda_fp16.h>
__device__ __forceinline__ void tk_gc_pack(void* p, float lo, float hi) {
  *reinterpret_cast<__half2*>(p) = __floats2half2_rn(lo, hi);
}
"""


# Sigmoid and SiLU from the hardware's approximate exp2 and reciprocal: rcp(1 + ex2(-u * log2e)), four instructions
# (SiLU: five) against about 17 for expf and the (fast-path) IEEE division. Relative error: a few float32 ulps plus
# |u| * 2**-24 from the rounded exponent argument, under 2**-17 for |u| < 64, far below the 2**-9 (bf16) / 2**-12
# (fp16) step of the results it feeds. Large |u| as the IEEE form: u < -88 gives -0 for SiLU and 0 for the sigmoid
# (ex2 overflows to inf, rcp to 0), u > 88 gives u and 1; NaN stays NaN. Not bit for bit the reference's expf and
# division: the GateConv outputs match it to the tests' tolerances (the Engram contract is not bitwise).
SILU_APPROX = r"""
__device__ __forceinline__ float tk_sigmoid_approx(float u) {
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(u * -1.4426950408889634f));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + e));
  return r;
}
__device__ __forceinline__ float tk_silu_approx(float u) { return u * tk_sigmoid_approx(u); }
"""
# rsqrtf without its subnormal-input scaling: for every normal x (the forward's mean + eps with eps >= 2**-126)
# rsqrtf(x) is this very MUFU.RSQ, so the bits are the same; three instructions fewer per call.
RSQRT_NORMAL = r"""
__device__ __forceinline__ float tk_rsqrt_normal(float x) {
  float r;
  asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
"""


def elementwise(dtype: str):
    """(prelude, widen, pack) of the GateConv kernels. ``widen(buf, i, j)``: element i + j (i even; j 0 or 1, a
    Python int or the variable of an explicitly unrolled loop, so the choice folds) of a 16-bit buffer as float32,
    by ``tk_gc_lo/hi`` for bfloat16. ``pack(buf, i, a, b)``: rounds a pair into buf[i], buf[i + 1]."""
    bf = dtype == "bfloat16"
    f32 = "float32"

    def widen(buf, i, j):
        if not bf:
            return T.cast(buf[i + j], f32)
        p = T.address_of(buf[i])
        if isinstance(j, int):
            return T.call_extern(f32, "tk_gc_hi" if j else "tk_gc_lo", p)
        return T.if_then_else(j == 0, T.call_extern(f32, "tk_gc_lo", p), T.call_extern(f32, "tk_gc_hi", p))

    def pack(buf, i, a, b):
        return T.evaluate(T.call_extern("handle", "tk_gc_pack", T.address_of(buf[i]), a, b))

    return _BF16 if bf else _FP16, widen, pack


@T.macro
def reduce_scatter_row_sums(sc, v, lane):
    """Per warp, a reduce-scatter of the 4 quantities v[0..4): lane bit 4 picks (v0, v1) or (v2, v3), bit 3 one
    of the pair; each add is the v_l + v_(l^m) of tl::warp_reduce_sum's butterfly (offsets 16 .. 1), so every sum
    has its addition tree (6 shuffles instead of 20). Lane 8q ends with sum q in sc[2]."""
    b4 = T.bitwise_and(lane, 16) != 0
    b3 = T.bitwise_and(lane, 8) != 0
    sc[0] = T.if_then_else(b4, v[2], v[0]) + T.shfl_xor(T.if_then_else(b4, v[0], v[2]), 16)
    sc[1] = T.if_then_else(b4, v[3], v[1]) + T.shfl_xor(T.if_then_else(b4, v[1], v[3]), 16)
    sc[2] = T.if_then_else(b3, sc[1], sc[0]) + T.shfl_xor(T.if_then_else(b3, sc[0], sc[1]), 8)
    sc[2] = sc[2] + T.shfl_xor(sc[2], 4)
    sc[2] = sc[2] + T.shfl_xor(sc[2], 2)
    sc[2] = sc[2] + T.shfl_xor(sc[2], 1)


@T.macro
def add_row_sums(part, hv, kv, vv, wh):
    """The gate's four per-row sums (float32): h.h, k.k, (h w_h).(k w_h) and v.v."""
    part[0] += hv * hv
    part[1] += kv * kv
    part[2] += hv * kv * (wh * wh)
    part[3] += vv * vv


# 16-byte row vectors and float32 statistics addressed by an int32 element offset from the tensor's base (``idx32``
# of ``load_row``, ``store_row`` and ``load_stat``; the caller's tensors hold fewer than 2**31 elements): TileLang
# widens every buffer index of a dynamic shape to int64, whose products and carries ptxas rematerialises per token
# at the register cap; an index built from an int32 local is widened too, and then not vectorised.
_IDX32 = r"""
__device__ __forceinline__ void tk_ld16(void* dst, const void* base, int off) {
  *reinterpret_cast<uint4*>(dst) = __ldg(reinterpret_cast<const uint4*>(reinterpret_cast<const unsigned short*>(base) + off));
}
__device__ __forceinline__ void tk_st16(void* base, int off, const void* src) {
  *reinterpret_cast<uint4*>(reinterpret_cast<unsigned short*>(base) + off) = *reinterpret_cast<const uint4*>(src);
}
__device__ __forceinline__ float tk_ldf(const void* base, int off) {
  return __ldg(reinterpret_cast<const float*>(base) + off);
}
"""


def _row_offset(buf, m, t, c):
    """int32 element offset of ``buf[m, t, c]`` (``idx32``)."""
    return (m * buf.shape[1] + t) * buf.shape[2] + c


@T.macro
def load_row(dst, src, m, t, tx, slots: int, threads: int, d: int, cb=0, idx32: bool = False):
    """This thread's ``slots`` 16-byte column vectors of the row ``src[m, t, cb:cb + d]`` into ``dst``."""
    for s in T.unroll(slots):
        c0 = (s * threads + tx) * VEC
        if c0 < d:
            if idx32:
                T.evaluate(T.call_extern("handle", "tk_ld16", T.address_of(dst[s * VEC]), T.address_of(src[0, 0, 0]),
                                         _row_offset(src, m, t, cb + c0)))
            else:
                for e in T.vectorized(VEC):
                    dst[s * VEC + e] = src[m, t, cb + c0 + e]


@T.macro
def store_row(dst, src, m, t, c, idx32: bool = False):
    """The 16-byte vector ``src`` into ``dst[m, t, c:c + VEC]``."""
    if idx32:
        T.evaluate(T.call_extern("handle", "tk_st16", T.address_of(dst[0, 0, 0]), _row_offset(dst, m, t, c),
                                 T.address_of(src[0])))
    else:
        for e in T.vectorized(VEC):
            dst[m, t, c + e] = src[e]


def load_stat(buf, m, t, idx32: bool = False):
    """``buf[m, t]`` of a float32 (M, T) statistic."""
    if idx32:
        return T.call_extern("float32", "tk_ldf", T.address_of(buf[0, 0]), m * buf.shape[1] + t)
    return buf[m, t]


def f32_rows(width: int, planes: bool):
    """``(col, load, store)`` for float32 rows of ``width`` columns in shared memory, each thread's 8-vector at the
    column ``c0`` of its first element. ``planes``: the vectors are split into two planes (elements 0-3 of every
    vector, then elements 4-7), so that a warp's 16-byte accesses cover 512 contiguous bytes; with the vectors
    contiguous (a 32-byte stride per thread) every access is a 2-way bank conflict. ``col(c0, e)``: where element
    ``e`` lives; ``load(dst, buf, row, c0)`` / ``store(buf, row, c0, src)`` move a vector as two 16-byte halves."""
    half = width // 2

    def col(c0, e):
        return (e // 4) * half + c0 // 2 + e % 4 if planes else c0 + e

    @T.macro
    def load(dst, buf, row, c0):
        for h in T.unroll(2):
            for e in T.vectorized(4):
                dst[h * 4 + e] = buf[row, col(c0, 4 * h) + e]

    @T.macro
    def store(buf, row, c0, src):
        for h in T.unroll(2):
            for e in T.vectorized(4):
                buf[row, col(c0, 4 * h) + e] = src[h * 4 + e]

    return col, load, store


def row_layout(d: int) -> tuple[int, int]:
    """(slots, threads) for a d-row: slots * threads * 8 >= d, threads a multiple of 32, at most 1024."""
    nvec = ceil_div(d, VEC)
    slots = ceil_div(nvec, 1024)
    threads = ceil_div(ceil_div(nvec, slots), 32) * 32
    return slots, threads


def fwd_layout(d: int, vecs: int) -> tuple[int, int]:
    """(slots, threads) of the forward: ``vecs`` 16-byte vectors per thread (more if 1024 threads would not
    cover d), so that the per-token overhead (two-level reduction, gate scalars) spreads over 8*vecs elements."""
    nvec = ceil_div(d, VEC)
    slots = max(vecs, ceil_div(nvec, 1024))
    return slots, ceil_div(ceil_div(nvec, slots), 32) * 32


# Shared memory the forward's plan may fill with its n ring and float32 weight rows (``fwd_smem_plan``).
FWD_SMEM_BUDGET = 74 * 1024


def fwd_smem_plan(d: int, taps: int, vecs: int = 2, budget: int = FWD_SMEM_BUDGET) -> tuple[int, bool]:
    """(weight rows kept as float32 in shared memory, whether the n ring is float32) of the forward within
    ``budget`` bytes of shared memory, greedily by instructions saved per byte: w_h**2 (about 1.9 per element
    for 4 bytes), the float32 ring (about 0.9 per tap and element for 2 more bytes per tap), then w_v and the
    conv taps (about 1 each for 4 bytes). Rows are taken in the order w_h**2, w_v, conv tap taps-1, taps-2, ...
    The default budget keeps two CTAs per SM and leaves L1 room for the weights read from global memory
    (d=4096: w_h**2 and the float32 ring, 65 KB per CTA; d=7168: w_h**2, 71 KB)."""
    slots, threads = fwd_layout(d, vecs)
    dp = slots * threads * VEC
    R = max(taps - 1, 1)
    used = R * dp * 2 + 1024
    fw, ring32 = 0, False
    if used + dp * 4 <= budget:
        fw, used = 1, used + dp * 4
    if used + R * dp * 2 <= budget:
        ring32, used = True, used + R * dp * 2
    while fw < 2 + taps and used + dp * 4 <= budget:
        fw, used = fw + 1, used + dp * 4
    return fw, ring32


def fwd_shared_bytes(d: int, taps: int, vecs: int = 2, budget: int = FWD_SMEM_BUDGET) -> int:
    """Shared memory of the forward: the n ring (taps-1 rows, bf16 or float32 by ``fwd_smem_plan``), the float32
    weight rows of the plan (none: the unused buffer is dropped) and the reduction scratch (1 KB)."""
    slots, threads = fwd_layout(d, vecs)
    DP = slots * threads * VEC
    NF, ring32 = fwd_smem_plan(d, taps, vecs, budget)
    return max(taps - 1, 1) * DP * (4 if ring32 else 2) + NF * DP * 4 + 1024


def fwd_fits(d: int, taps: int, vecs: int = 2, budget: int = FWD_SMEM_BUDGET) -> bool:
    """Whether the forward's n ring and weight rows fit in a CTA's shared memory: at 4 taps up to d = 38,400 (the
    plan's optional rows shrink to none; the ring does not). Wider rows or more taps run the reference on the GPU."""
    return fwd_shared_bytes(d, taps, vecs, budget) <= MAX_SMEM_PER_BLOCK


@kernel(pass_configs={"tl.disable_safe_memory_legalize": True})
def gate_conv_fwd_kernel(dtype: str, d: int, taps: int, dilation: int, chunk: int, vecs: int = 2,
                         min_blocks: int = 2, budget: int = FWD_SMEM_BUDGET, planes: bool = True):
    """Forward walk. Each thread owns ``slots`` column vectors (2 by default: 256 threads at d=4096, 448 at
    d=7168) and several CTAs share an SM, so the fixed per-token cost is amortised and other CTAs' loads
    overlap a CTA's barrier. Per token: one barrier (``red`` is double-buffered), a two-level shuffle
    reduction (below), the next token's H and k already in flight in registers (its v is issued after the
    barrier, when this token's H and k are dead: the register peak stays under the cap of ``min_blocks``), and
    the n history as 16-byte vectors in shared memory.

    Each element takes few instructions (the kernel was issue-bound until the approximate SiLU; ncu now finds it
    waiting on memory, PERF-NOTES session 10): the bf16 helpers above; w_h**2 (the product
    the row sum needs) and, as ``budget`` bytes of shared memory allow, the n ring (n is already rounded, so its
    float32 value is exact), w_v and the conv taps as float32 in shared memory (``fwd_smem_plan``), filled once per
    CTA: each thread reads back only the columns it wrote, so no barrier is needed; SiLU by ``SILU_APPROX`` (five
    instructions per element against about 17 for expf and the IEEE division: 0.73-0.77 -> 0.80-0.83 of copy on
    the H200) and the reciprocal square roots by ``RSQRT_NORMAL``. None of the layout choices changes a bit: the
    widening and float32 copies are exact and every rounding, product and sum keeps its operands and order.

    The ``taps - 1`` halo tokens a CTA walks before its chunk (they belong to the previous chunk) only feed the n
    ring: they compute the row sums, the gate and n, but skip the convolution, SiLU and every store (about 55 % of
    a token's work, on 3 of 35 tokens at chunk 32 and 4 taps). ``planes``: the float32 rows of shared memory (the
    weights, the float32 n ring) in two planes (``f32_rows``: no bank conflicts)."""
    slots, threads = fwd_layout(d, vecs)
    nwarps = threads // 32
    R = taps - 1
    RS = max(R, 1)
    hist = dilation * R
    HS = max(hist, 1)
    DP = slots * threads * VEC
    EV = slots * VEC
    NF, ring32 = fwd_smem_plan(d, taps, vecs, budget)
    rdt = "float32" if ring32 else dtype
    col, load32, store32 = f32_rows(DP, planes)
    # cross-warp sum: lane groups of G lanes (a power of two >= nwarps), QP of the 4 quantities per group
    G = 8
    while G < nwarps:
        G *= 2
    QP = max(1, 4 * G // 32)
    g_offs = [G >> i for i in range(1, G.bit_length())]  # G/2, ..., 1
    inv_d = 1.0 / d
    inv_sqrt_d = 1.0 / math.sqrt(d)
    M = T.dynamic("M")
    L = T.dynamic("seq_len")
    f32 = "float32"
    prelude, widen, pack = elementwise(dtype)
    prelude += RSQRT_NORMAL + SILU_APPROX

    def rsqrt(x):
        return T.call_extern(f32, "tk_rsqrt_normal", x)

    def lo(buf, i):  # element i (even) of a packed pair as float32
        return widen(buf, i, 0)

    def hi(buf, i):  # element i + 1
        return widen(buf, i, 1)

    def silu(u):
        return T.call_extern(f32, "tk_silu_approx", u)

    @T.prim_func
    def main(
        H: T.Tensor((M, L, d), dtype),
        K: T.Tensor((M, L, d), dtype),
        V: T.Tensor((M, L, d), dtype),
        w_h: T.Tensor((d,), dtype),
        w_v: T.Tensor((d,), dtype),
        conv_w: T.Tensor((taps, d), dtype),
        Y: T.Tensor((M, L, d), dtype),
        VH: T.Tensor((M, L, d), dtype),
        alpha: T.Tensor((M, L), f32),
        rr_h: T.Tensor((M, L), f32),
        rr_k: T.Tensor((M, L), f32),
        rr_v: T.Tensor((M, L), f32),
        state: T.Tensor((M, HS, d), dtype),
        eps: T.float32,
    ):
        with T.Kernel(T.ceildiv(L, dilation * chunk), dilation, M, threads=threads, prelude=prelude) as (bc, br, bm):
            T.annotate_min_blocks_per_sm(min_blocks)
            tx = T.get_thread_binding()
            lane = tx % 32
            warp = tx // 32
            ring = T.alloc_shared((RS, DP), rdt)
            red = T.alloc_shared((2, 4, 32), f32)
            wsm = T.alloc_shared((max(NF, 1), DP), f32)
            tot = T.alloc_local((4,), f32)
            part = T.alloc_local((4,), f32)
            sc4 = T.alloc_local((4,), f32)
            uu = T.alloc_local((VEC,), f32)
            nf = T.alloc_local((VEC,), f32)
            vf = T.alloc_local((VEC,), f32)
            wf = T.alloc_local((VEC,), f32)
            wl = T.alloc_local((VEC,), dtype)
            rg = T.alloc_local((VEC,), rdt)
            xh = T.alloc_local((EV,), dtype)
            xk = T.alloc_local((EV,), dtype)
            xv = T.alloc_local((EV,), dtype)
            nh = T.alloc_local((EV,), dtype)
            nk = T.alloc_local((EV,), dtype)
            nv = T.alloc_local((EV,), dtype)
            yo = T.alloc_local((VEC,), dtype)
            vo = T.alloc_local((VEC,), dtype)
            no = T.alloc_local((VEC,), dtype)
            base = br + dilation * chunk * bc
            # the float32 weight rows (w_h**2, w_v, tap taps-1, taps-2, ...), once per CTA
            for s in T.unroll(slots):
                c0 = (s * threads + tx) * VEC
                if c0 < d:
                    for p in T.unroll(NF, explicit=True):
                        if p == 0:
                            for e in T.vectorized(VEC):
                                wl[e] = w_h[c0 + e]
                            for e in T.unroll(VEC):
                                wsm[p, col(c0, e)] = T.cast(wl[e], f32) * T.cast(wl[e], f32)
                        elif p == 1:
                            for e in T.vectorized(VEC):
                                wl[e] = w_v[c0 + e]
                            for e in T.unroll(VEC):
                                wsm[p, col(c0, e)] = T.cast(wl[e], f32)
                        else:
                            for e in T.vectorized(VEC):
                                wl[e] = conv_w[taps + 1 - p, c0 + e]
                            for e in T.unroll(VEC):
                                wsm[p, col(c0, e)] = T.cast(wl[e], f32)
            # the first token of the walk
            t0 = base - dilation * R
            if t0 >= 0 and t0 < L:
                for s in T.unroll(slots):
                    c0 = (s * threads + tx) * VEC
                    if c0 < d:
                        for e in T.vectorized(VEC):
                            nh[s * VEC + e] = H[bm, t0, c0 + e]
                        for e in T.vectorized(VEC):
                            nk[s * VEC + e] = K[bm, t0, c0 + e]
                        for e in T.vectorized(VEC):
                            nv[s * VEC + e] = V[bm, t0, c0 + e]
            for it in T.serial(R + chunk):
                t = base + dilation * (it - R)
                slot = T.truncmod(it, RS)
                rb = T.truncmod(it, 2)
                for e in T.unroll(EV):
                    xh[e] = nh[e]
                    xk[e] = nk[e]
                    xv[e] = nv[e]
                tn = t + dilation
                pre = it + 1 < R + chunk and tn >= 0 and tn < L
                if pre:
                    for s in T.unroll(slots):
                        c0 = (s * threads + tx) * VEC
                        if c0 < d:
                            for e in T.vectorized(VEC):
                                nh[s * VEC + e] = H[bm, tn, c0 + e]
                            for e in T.vectorized(VEC):
                                nk[s * VEC + e] = K[bm, tn, c0 + e]
                if t < 0:
                    if pre:
                        load_row(nv, V, bm, tn, tx, slots, threads, d)
                    for s in T.unroll(slots):
                        c0 = (s * threads + tx) * VEC
                        if ring32:
                            for e in T.unroll(VEC):
                                ring[slot, col(c0, e)] = T.cast(0, rdt)
                        else:
                            for e in T.vectorized(VEC):
                                ring[slot, c0 + e] = T.cast(0, rdt)
                        if hist > 0:
                            if t >= L - hist and c0 < d:
                                for e in T.vectorized(VEC):
                                    state[bm, T.floormod(t, HS), c0 + e] = T.cast(0, dtype)
                elif t < L:
                    for q in T.unroll(4):
                        part[q] = T.float32(0)
                    for s in T.unroll(slots):
                        c0 = (s * threads + tx) * VEC
                        if c0 < d:
                            if NF > 0:
                                load32(wf, wsm, 0, c0)
                            else:
                                for e in T.vectorized(VEC):
                                    wl[e] = w_h[c0 + e]
                                for e in T.unroll(VEC):
                                    wf[e] = T.cast(wl[e], f32) * T.cast(wl[e], f32)
                            for k in T.unroll(VEC // 2):
                                for j in T.unroll(2, explicit=True):
                                    i = s * VEC + 2 * k
                                    hv = lo(xh, i) if j == 0 else hi(xh, i)
                                    kv = lo(xk, i) if j == 0 else hi(xk, i)
                                    vv = lo(xv, i) if j == 0 else hi(xv, i)
                                    part[0] += hv * hv
                                    part[1] += kv * kv
                                    part[2] += hv * kv * wf[2 * k + j]
                                    part[3] += vv * vv
                    reduce_scatter_row_sums(sc4, part, lane)  # lanes 0, 8, 16, 24 hold the four sums
                    if T.truncmod(lane, 8) == 0:
                        red[rb, T.truncdiv(lane, 8), warp] = sc4[2]
                    T.sync_threads()
                    if pre:
                        load_row(nv, V, bm, tn, tx, slots, threads, d)
                    # Across warps: lane group g (G lanes) sums quantities g*QP .. g*QP+QP-1 by a G-lane butterfly,
                    # then every lane takes the four sums from the groups' first lanes. A 32-lane butterfly over
                    # the nwarps partials would only add the zeros of lanes >= nwarps, which changes nothing but
                    # the sign of a zero sum (no effect on alpha or the rsqrt): the same bits in every thread.
                    gw = T.truncmod(lane, G)
                    gq = T.truncdiv(lane, G)
                    for j in T.unroll(QP):
                        sc4[j] = T.if_then_else(gw < nwarps and gq * QP + j < 4,
                                                red[rb, T.min(gq * QP + j, 3), gw], T.float32(0))
                    for off in g_offs:
                        for j in T.unroll(QP):
                            sc4[j] = sc4[j] + T.shfl_xor(sc4[j], off)
                    for q in T.unroll(4, explicit=True):
                        tot[q] = T.shfl_sync(sc4[q % QP], (q // QP) * G)
                    r_h = rsqrt(tot[0] * inv_d + eps)
                    r_k = rsqrt(tot[1] * inv_d + eps)
                    sc = r_h * r_k * tot[2] * inv_sqrt_d
                    a = T.float32(1) / (T.float32(1) + T.exp(-sc))
                    r_v = rsqrt(a * a * (tot[3] * inv_d) + eps)
                    if it >= R and tx == 0:
                        alpha[bm, t] = a
                        rr_h[bm, t] = r_h
                        rr_k[bm, t] = r_k
                        rr_v[bm, t] = r_v
                    for s in T.unroll(slots):
                        c0 = (s * threads + tx) * VEC
                        if c0 < d:
                            if NF > 1:
                                load32(wf, wsm, 1, c0)
                            else:
                                for e in T.vectorized(VEC):
                                    wl[e] = w_v[c0 + e]
                                for k in T.unroll(VEC // 2):
                                    wf[2 * k] = lo(wl, 2 * k)
                                    wf[2 * k + 1] = hi(wl, 2 * k)
                            # n rounded in pairs, then widened back from the packed pair
                            for k in T.unroll(VEC // 2):
                                i = s * VEC + 2 * k
                                pack(no, 2 * k, a * lo(xv, i) * wf[2 * k] * r_v, a * hi(xv, i) * wf[2 * k + 1] * r_v)
                            for k in T.unroll(VEC // 2):
                                nf[2 * k] = lo(no, 2 * k)
                                nf[2 * k + 1] = hi(no, 2 * k)
                            if it >= R:  # halo tokens only feed the ring: no u, no Y
                                for q in T.unroll(taps, explicit=True):
                                    # tap taps-1-q times n of q chain steps back (q = 0: this token)
                                    if NF > 2 + q:
                                        load32(wf, wsm, 2 + q, c0)
                                    else:
                                        for e in T.vectorized(VEC):
                                            wl[e] = conv_w[taps - 1 - q, c0 + e]
                                        for k in T.unroll(VEC // 2):
                                            wf[2 * k] = lo(wl, 2 * k)
                                            wf[2 * k + 1] = hi(wl, 2 * k)
                                    if q == 0:
                                        for e in T.unroll(VEC):
                                            uu[e] = wf[e] * nf[e]
                                    else:
                                        if ring32:
                                            load32(rg, ring, T.truncmod(it - q + RS * taps, RS), c0)
                                        else:
                                            for e in T.vectorized(VEC):
                                                rg[e] = ring[T.truncmod(it - q + RS * taps, RS), c0 + e]
                                        if ring32:
                                            for e in T.unroll(VEC):
                                                uu[e] += wf[e] * rg[e]
                                        else:
                                            for k in T.unroll(VEC // 2):
                                                uu[2 * k] += wf[2 * k] * lo(rg, 2 * k)
                                                uu[2 * k + 1] += wf[2 * k + 1] * hi(rg, 2 * k)
                                for k in T.unroll(VEC // 2):
                                    i = s * VEC + 2 * k
                                    vf[2 * k] = a * lo(xv, i)
                                    vf[2 * k + 1] = a * hi(xv, i)
                                    pack(vo, 2 * k, vf[2 * k], vf[2 * k + 1])
                                # Y = SiLU(u) + vhat
                                for k in T.unroll(VEC // 2):
                                    pack(yo, 2 * k, silu(uu[2 * k]) + vf[2 * k], silu(uu[2 * k + 1]) + vf[2 * k + 1])
                            if ring32:
                                store32(ring, slot, c0, nf)
                            else:
                                for e in T.vectorized(VEC):
                                    ring[slot, c0 + e] = no[e]
                            if it >= R:
                                for e in T.vectorized(VEC):
                                    Y[bm, t, c0 + e] = yo[e]
                                for e in T.vectorized(VEC):
                                    VH[bm, t, c0 + e] = vo[e]
                            if hist > 0:
                                if it >= R and t >= L - hist:  # halo tokens belong to the previous chunk
                                    for e in T.vectorized(VEC):
                                        state[bm, T.floormod(t, HS), c0 + e] = no[e]

    return main


def fuse_dconv(d: int) -> bool:
    """Whether the backward accumulates dconv_w inside the main kernel: only while its taps x d float32
    accumulators fit in shared memory next to the rings (d <= 4096 columns per CTA); larger rows use
    ``gate_conv_dconv_kernel``."""
    return row_layout(d)[1] <= 512


def cluster_sync():
    """Every thread of the thread block cluster waits for all of them (TileLang's ``tl.cluster_sync``: the
    barrier.cluster arrive / wait pair, release / acquire)."""
    return T.evaluate(tirx.call_intrin("void", tirx.op.Op.get("tl.cluster_sync")))


# The widest half row of the backward's cluster: the widest measured (session 38). Beyond it ``bwd_half_vecs`` gives 4
# vectors per thread, which spill (1,124 bytes at 8192 columns on sm_90a), although the rings fit up to 10,240.
MAX_HALF = 8192
# The threads of a cluster CTA whose half row is wider than 4096 columns (``bwd_half_vecs``).
HALF_THREADS = 384


def bwd_split(d: int) -> int:
    """CTAs that share a row in the backward: 2 (a thread block cluster, each CTA half of the columns) for rows
    wider than 4096 with 16-byte halves (d % 16 == 0) of at most ``MAX_HALF`` columns, else 1. Halves of up to
    4096 columns take the fused single-kernel path (``fuse_dconv(d // bwd_split(d))``: dconv_w accumulated in the
    main kernel), wider halves the dconv kernel."""
    return 2 if not fuse_dconv(d) and d % (2 * VEC) == 0 and d // 2 <= MAX_HALF else 1


def bwd_half_vecs(dw: int) -> int:
    """16-byte vectors per thread of a cluster CTA holding ``dw`` > 4096 columns (the unfused path): 2, or as many as
    keep the CTA within ``HALF_THREADS`` threads. sm_90a, 4 taps: 2 vectors at 4608 / 6144 columns take 168
    registers and spill 36 bytes, 3 vectors 255 and none, yet 3 measured 6 / 3.5 % slower (d = 9216 / 12288, H100);
    8192 columns at 2 vectors (512 threads, a 128-register cap) spill 612 bytes and run at half the speed of 3 vectors
    (352 threads, 48 bytes; PERF-NOTES session 38)."""
    return max(2, ceil_div(dw, VEC * HALF_THREADS))


@T.macro
def load_bwd_weights(wl, wm, cw, w_h, w_v, conv_w, s, c0, taps: int, EV: int):
    """Slot ``s``'s 16-byte vectors of w_h, w_v and the conv taps (``cw[p * EV + s * VEC ..]``)."""
    for e in T.vectorized(VEC):
        wl[s * VEC + e] = w_h[c0 + e]
    for e in T.vectorized(VEC):
        wm[s * VEC + e] = w_v[c0 + e]
    for p in T.unroll(taps):
        for e in T.vectorized(VEC):
            cw[p * EV + s * VEC + e] = conv_w[p, c0 + e]


def bwd_shared_bytes(d: int, taps: int, vecs: int, with_dconv: bool, acc_shared: bool = True) -> int:
    """Shared memory of the backward: the n ring (taps-1 rows of
    d), the g_u ring (taps float32 rows), the drms_w accumulators (2 float32 rows, if ``acc_shared``), the
    dconv_w accumulators (taps float32 rows, if ``with_dconv``) and the reduction scratch."""
    slots, threads = bwd_layout(d, vecs)
    DP = slots * threads * VEC
    rows32 = taps + (2 if acc_shared else 0) + (taps if with_dconv else 0)
    return max(taps - 1, 1) * DP * 2 + rows32 * DP * 4 + 4 * 1024


def bwd_fits(d: int, taps: int, vecs: int) -> bool:
    """Whether the backward kernel's rings for ``d`` columns per CTA fit in shared memory (bf16/fp16, with the
    drms_w accumulators moved to global memory if need be): up to 10,240 columns at 4 taps. Wider rows run the
    reference on the GPU unless ``bwd_split`` halves them."""
    return bwd_shared_bytes(d, taps, vecs, fuse_dconv(d), acc_shared=False) <= MAX_SMEM_PER_BLOCK


def bwd_layout(d: int, vecs: int) -> tuple[int, int]:
    """(slots, threads) of the backward: ``vecs`` 16-byte vectors per thread (more if 1024 threads would not
    cover d), threads a multiple of 32."""
    nvec = ceil_div(d, VEC)
    slots = max(vecs, ceil_div(nvec, 1024))
    return slots, ceil_div(ceil_div(nvec, slots), 32) * 32


# The backward's 2-CTA cluster (``split``). ``tk_st_peer_f32``: a float32 store into the same shared-memory
# variable of CTA ``rank`` of the cluster (st.async: no fence; completion is counted on that CTA's mbarrier ``bar``,
# which its waiters observe with acquire semantics). The mbarriers (arrival count 1: ``tk_mbar_expect``, which also
# announces the bytes due) are initialised before the first ``cluster_sync``. A cluster barrier per token instead
# (barrier.cluster.arrive has release semantics: a fence that waits for the thread's global stores) measured slower.
_CLUSTER = r"""
__device__ __forceinline__ unsigned tk_smem(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void tk_mbar_init(void* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(tk_smem(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void tk_mbar_expect(void* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(tk_smem(bar)), "r"(bytes) : "memory");
}
// Waits for phase ``parity`` of an mbarrier that guards only shared memory the peers wrote with st.async: a relaxed
// wait, then an acquire fence restricted to shared::cluster, which pairs with st.async's release (its complete_tx)
// without the L1 invalidation (CCTL.IVALL) that an acquire over all state spaces costs after every wait.
__device__ __forceinline__ void tk_mbar_wait(void* bar, unsigned parity) {
  asm volatile("{\n\t.reg .pred p;\n\tTK_WAIT:\n\t"
               "mbarrier.try_wait.parity.relaxed.cluster.shared::cta.b64 p, [%0], %1;\n\t@!p bra TK_WAIT;\n\t}"
               :: "r"(tk_smem(bar)), "r"(parity) : "memory");
  asm volatile("fence.acquire.sync_restrict::shared::cluster.cluster;" ::: "memory");
}
__device__ __forceinline__ void tk_st_peer_f32(float* p, void* bar, unsigned rank, float v) {
  unsigned a, b;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(tk_smem(p)), "r"(rank));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(b) : "r"(tk_smem(bar)), "r"(rank));
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];"
               :: "r"(a), "r"(__float_as_uint(v)), "r"(b) : "memory");
}
"""


def bwd_elementwise(dtype: str, approx: bool = False):
    """(prelude, el, pack, sigmoid) of the backward kernels. ``el(buf, i0, k, j)``: element i0 + 2k + j (i0 even,
    j in an explicitly unrolled loop, so the choice folds) of a 16-bit buffer as float32, by ``tk_gc_lo/hi`` for
    bfloat16. ``pack(buf, i, a, b)``: rounds
    a pair into buf[i], buf[i + 1]. ``sigmoid(sg, uu, tt, km)``: sg[e] = 1 / (1 + exp(-uu[e])) for the 8
    elements (the same expf and correctly rounded reciprocal as ``1 / (1 + exp(-u))``; tt, km are scratch), or
    with ``approx`` by ``SILU_APPROX``'s ``tk_sigmoid_approx``."""
    prelude, widen, pack = elementwise(dtype)

    def el(buf, i0, k, j):
        return widen(buf, i0 + 2 * k, j)

    @T.macro
    def sigmoid_approx(sg, uu, tt, km):
        for e in T.unroll(VEC):
            sg[e] = T.call_extern("float32", "tk_sigmoid_approx", uu[e])

    @T.macro
    def sigmoid(sg, uu, tt, km):
        for e in T.unroll(VEC):
            tt[e] = T.float32(1) + T.exp(-uu[e])
        km[0] = T.reinterpret(tt[0], "uint32")
        for e in T.unroll(1, VEC):
            km[0] = T.max(km[0], T.reinterpret(tt[e], "uint32"))
        if km[0] < T.uint32(RCP_FAST_BITS):
            for e in T.unroll(VEC):
                sg[e] = rcp_fast(tt[e])
        else:
            for e in T.unroll(VEC):
                sg[e] = T.float32(1) / tt[e]

    if approx:
        return prelude + SILU_APPROX, el, pack, sigmoid_approx
    return prelude + RCP_FAST, el, pack, sigmoid


# TileLang's shared-memory sync planner is off: it cannot see the cluster exchange's st.async / mbarrier protocol
# and, at d > 4096, added two barriers per token around it. The explicit barrier and mbarriers order every
# cross-thread access; the rings and accumulators are per-thread columns.
@kernel(pass_configs={"tl.disable_safe_memory_legalize": True, "tl.disable_thread_storage_sync": True})
def gate_conv_bwd_kernel(dtype: str, d: int, taps: int, dilation: int, chunk: int, with_dconv: bool = True,
                         vecs: int = 1, resident_w: bool = True, ahead: bool = True, planes: bool = True,
                         split: int = 1, approx_sigmoid: bool = False, idx32: bool = False):
    """Fused backward: one walk per chain chunk with a front halo (history of n) and a look-ahead of
    ``taps - 1`` chain tokens (the transposed convolution needs g_u of later tokens). Writes dH, dk, dv and
    per-CTA partial sums ``part[cta] = (sum c*H*k, sum g_n*vhat*r_v[, dconv_w[0..taps)])`` in float32,
    reduced in a fixed order afterwards: no atomics, bitwise reproducible.

    Iteration ``it`` runs stage A (n, u, g_u of chain token it-R) and stage B (the gate backward of token
    it-2R). Memory is pipelined: stage A's V and dY rows and its two statistics (alpha, rrms_v) arrive one
    iteration ahead (registers), stage B's H, k, V, dY rows and its four statistics (alpha, rrms_h, rrms_k, rrms_v)
    are issued at the top of the iteration so that they fly during stage A, and stay in registers across the barrier
    (no reload; the statistics there instead of after stage A: H100 at d=7168 0.645 -> 0.662 of copy, PERF-NOTES
    session 37). The per-thread rings (n, g_u) and the drms_w accumulators live in shared memory and move as 16-byte
    vectors. ``resident_w``: the thread's columns of w_h, w_v and the conv taps are loaded into registers once, before
    the walk (H200: 0.424 -> 0.470 of copy at d=4096, 0.425 -> 0.477 at d=7168; every load on the loop's path waits
    behind the rows in flight, PERF-NOTES session 35); otherwise each stage loads its slot's weights where it uses
    them (L1 hits), which lowers the register peak (on sm_100a the resident weights spill). ``ahead=False`` issues
    stage A's rows and statistics where it uses them (8 registers fewer per vector, still one round trip per
    iteration).

    Each element takes few instructions: ``bwd_elementwise``'s widening, pair rounding of n, the gated fast
    reciprocal (or with ``approx_sigmoid`` the approximate sigmoid of ``SILU_APPROX``), reduce-scatter butterflies
    for the four row sums, and the per-token factors folded into scalars before the column loop (a r_v for n, dv and
    drms_w_v; -c1 a^2 for dv; cc w_h^2 shared by dH and dk; a product order other than the reference's formulas, so
    the outputs match it to the tests' tolerances, not bit for bit). ``idx32``: the rows, statistics and outputs
    addressed by int32 element offsets from each tensor's base (``_IDX32``; the op passes it while the tensors hold
    fewer than 2**31 elements) instead of TileLang's int64 indices, whose products and carries ptxas recomputed per
    token at the register cap. Together, ~5 % fewer instructions per token; H100: 0.653 / 0.663 / 0.651 -> 0.668 /
    0.681 / 0.683 of copy at d = 4096 / 7168 / 7168 dilation 3 (PERF-NOTES session 43).

    ``planes``: the float32 rows in shared memory (ring_g, accw, dacc) in two planes (``f32_rows``; ncu at d=4096:
    45 % of the shared-memory wavefronts were bank conflicts; the planes took the kernel from 309 to 261 us). At
    d=7168 (2 vectors per thread, 128 registers) they measured 6 % slower, and the op keeps the vectors contiguous.

    ``split`` = 2: a cluster of 2 CTAs walks each chain chunk, CTA rank r owning columns [r d/2, (r + 1) d/2), so
    that a wide row takes the register and shared-memory budget of a half row (d=7168: 1 vector per thread and
    dconv_w in the main kernel, instead of 2 vectors, a 128-register cap and a second kernel). The per-token sums
    are the only coupling: each warp stores its 4 partials into the ``red`` slots of both CTAs (the peer's through
    distributed shared memory, ``_CLUSTER``), each CTA waits for its barrier and for its mbarrier of that ``red``
    buffer (the peer's partials are in), and both CTAs add the 2 x nwarps partials in the same fixed order, so
    they agree bit for bit.
    """
    assert split in (1, 2) and d % (split * VEC) == 0
    DW = d // split  # columns per CTA
    slots, threads = bwd_layout(DW, vecs)
    nwarps = threads // 32
    assert nwarps * split <= 32  # one lane per warp partial in the cross-warp sum
    R = taps - 1
    RS = max(R, 1)
    DP = slots * threads * VEC
    EV = slots * VEC
    NPW = 2 + taps if with_dconv else 2
    # Rows wider than ~7,600 (4 taps) leave no room for the drms_w accumulators in shared memory: they then
    # accumulate in the CTA's own row of ``part`` (L2-resident read-modify-writes of its own columns).
    acc_global = bwd_shared_bytes(DW, taps, vecs, with_dconv) > MAX_SMEM_PER_BLOCK
    inv_d = 1.0 / d
    inv_sqrt_d = 1.0 / math.sqrt(d)
    M = T.dynamic("M")
    L = T.dynamic("seq_len")
    NP = T.dynamic("num_parts")
    f32 = "float32"
    prelude, el, pack, sigmoid = bwd_elementwise(dtype, approx_sigmoid)
    if split > 1:
        prelude += _CLUSTER
    if idx32:
        prelude += _IDX32
    _, load32, store32 = f32_rows(DP, planes)

    @T.prim_func
    def main(
        dY: T.Tensor((M, L, d), dtype),
        H: T.Tensor((M, L, d), dtype),
        K: T.Tensor((M, L, d), dtype),
        V: T.Tensor((M, L, d), dtype),
        w_h: T.Tensor((d,), dtype),
        w_v: T.Tensor((d,), dtype),
        conv_w: T.Tensor((taps, d), dtype),
        alpha: T.Tensor((M, L), f32),
        rr_h: T.Tensor((M, L), f32),
        rr_k: T.Tensor((M, L), f32),
        rr_v: T.Tensor((M, L), f32),
        dH: T.Tensor((M, L, d), dtype),
        dK: T.Tensor((M, L, d), dtype),
        dV: T.Tensor((M, L, d), dtype),
        part: T.Tensor((NP, NPW, d), f32),
    ):
        with T.Kernel(T.ceildiv(L, dilation * chunk) * split, dilation, M, threads=threads, prelude=prelude,
                      cluster_dims=(split, 1, 1) if split > 1 else None) as (bx, br, bm):
            tx = T.get_thread_binding()
            lane = tx % 32
            warp = tx // 32
            bc = bx // split  # the chain chunk
            rank = bx % split  # the CTA's half of the columns
            cb = rank * DW
            ring_n = T.alloc_shared((RS, DP), dtype)
            ring_g = T.alloc_shared((taps, DP), f32)
            accw = T.alloc_shared((1, 32) if acc_global else (2, DP), f32)
            # dconv_w accumulators in shared memory: 32 registers fewer per vector than in registers
            dacc = T.alloc_shared((taps if with_dconv else 1, DP), f32)
            red = T.alloc_shared((2, 4, 32), f32)
            mbar = T.alloc_shared((2 if split > 1 else 1,), "uint64")  # split: the peer's partials, per red buffer
            tot = T.alloc_local((4,), f32)
            ps = T.alloc_local((4,), f32)
            sc = T.alloc_local((3,), f32)
            gn = T.alloc_local((EV,), f32)
            av = T.alloc_local((EV,), dtype)
            ad = T.alloc_local((EV,), dtype)
            nv = T.alloc_local((EV,), dtype)
            nd = T.alloc_local((EV,), dtype)
            xa = T.alloc_local((EV,), dtype)
            xb = T.alloc_local((EV,), dtype)
            xc = T.alloc_local((EV,), dtype)
            xd = T.alloc_local((EV,), dtype)
            wl = T.alloc_local((EV,), dtype)
            wm = T.alloc_local((EV,), dtype)
            cw = T.alloc_local((taps * EV,), dtype)
            rn = T.alloc_local((RS * VEC,), dtype)
            nn = T.alloc_local((VEC,), dtype)
            gv = T.alloc_local((VEC,), f32)
            aw = T.alloc_local((VEC,), f32)
            oa = T.alloc_local((VEC,), dtype)
            ob = T.alloc_local((VEC,), dtype)
            oc = T.alloc_local((VEC,), dtype)
            uu = T.alloc_local((VEC,), f32)
            tt = T.alloc_local((VEC,), f32)
            sg = T.alloc_local((VEC,), f32)
            km = T.alloc_local((1,), "uint32")
            sa = T.alloc_local((2,), f32)  # stage A's alpha and rrms_v (``ahead``: sn holds the next iteration's)
            sn = T.alloc_local((2,), f32)
            sb = T.alloc_local((4,), f32)  # stage B's alpha, rrms_h, rrms_k, rrms_v, loaded with its rows
            nch = T.ceildiv(L, dilation * chunk)
            base = br + dilation * chunk * bc
            pid = (bm * dilation + br) * nch + bc
            for s in T.unroll(slots):
                c0 = (s * threads + tx) * VEC
                for e in T.vectorized(VEC):
                    aw[e] = T.float32(0)
                for p in T.unroll(2):
                    if acc_global:
                        if c0 < DW:
                            for e in T.vectorized(VEC):
                                part[pid, p, cb + c0 + e] = aw[e]
                    else:
                        store32(accw, p, c0, aw)
                if with_dconv:
                    for p in T.unroll(taps):
                        store32(dacc, p, c0, aw)
            # stage A's first rows (the walk starts R chain tokens before the chunk)
            t0 = base - dilation * R
            if ahead and t0 >= 0:
                load_row(nv, V, bm, t0, tx, slots, threads, DW, cb)
                load_row(nd, dY, bm, t0, tx, slots, threads, DW, cb)
                sn[0] = alpha[bm, t0]
                sn[1] = rr_v[bm, t0]
            if split > 1:  # the peer's shared memory is written from the first token on: it must be running
                if tx == 0:
                    for q in T.unroll(2):
                        T.evaluate(T.call_extern("handle", "tk_mbar_init", T.address_of(mbar[q])))
                cluster_sync()
            if resident_w:
                for s in T.unroll(slots):
                    c0 = (s * threads + tx) * VEC
                    if c0 < DW:
                        load_bwd_weights(wl, wm, cw, w_h, w_v, conv_w, s, cb + c0, taps, EV)
            for it in T.serial(2 * R + chunk):
                tj = base + dilation * (it - R)
                ti = tj - dilation * R
                sj = T.truncmod(it, RS)
                gj = T.truncmod(it, taps)
                if ahead:
                    for e in T.unroll(EV):
                        av[e] = nv[e]
                        ad[e] = nd[e]
                    sa[0] = sn[0]
                    sa[1] = sn[1]
                elif tj >= 0 and tj < L:
                    load_row(av, V, bm, tj, tx, slots, threads, DW, cb)
                    load_row(ad, dY, bm, tj, tx, slots, threads, DW, cb)
                    sa[0] = alpha[bm, tj]
                    sa[1] = rr_v[bm, tj]
                do_b = it >= 2 * R and ti < L
                if do_b:
                    # (each tensor named: a Python loop over them would rename the kernel's parameters after its variable)
                    sb[0] = load_stat(alpha, bm, ti, idx32)
                    sb[1] = load_stat(rr_h, bm, ti, idx32)
                    sb[2] = load_stat(rr_k, bm, ti, idx32)
                    sb[3] = load_stat(rr_v, bm, ti, idx32)
                    load_row(xa, H, bm, ti, tx, slots, threads, DW, cb, idx32)
                    load_row(xb, K, bm, ti, tx, slots, threads, DW, cb, idx32)
                    load_row(xc, V, bm, ti, tx, slots, threads, DW, cb, idx32)
                    load_row(xd, dY, bm, ti, tx, slots, threads, DW, cb, idx32)
                tn = tj + dilation
                if ahead and it + 1 < 2 * R + chunk and tn >= 0 and tn < L:  # stage A of the next iteration
                    load_row(nv, V, bm, tn, tx, slots, threads, DW, cb, idx32)
                    load_row(nd, dY, bm, tn, tx, slots, threads, DW, cb, idx32)
                    sn[0] = load_stat(alpha, bm, tn, idx32)
                    sn[1] = load_stat(rr_v, bm, tn, idx32)
                # ---- stage A: chain token j = it - R (n history, u, g_u, dconv_w) ----
                if tj < 0:
                    for s in T.unroll(slots):
                        c0 = (s * threads + tx) * VEC
                        for e in T.vectorized(VEC):
                            nn[e] = T.cast(0, dtype)
                        for e in T.vectorized(VEC):
                            ring_n[sj, c0 + e] = nn[e]
                elif tj < L:
                    a = sa[0]
                    rv = sa[1]
                    arv = a * rv
                    for s in T.unroll(slots):
                        c0 = (s * threads + tx) * VEC
                        if c0 < DW:
                            if not resident_w:
                                load_bwd_weights(wl, wm, cw, w_h, w_v, conv_w, s, cb + c0, taps, EV)
                            for q in T.unroll(1, taps):
                                for e in T.vectorized(VEC):
                                    rn[(q - 1) * VEC + e] = ring_n[T.truncmod(it - q + RS * taps, RS), c0 + e]
                            for k in T.unroll(VEC // 2):
                                pack(nn, 2 * k, arv * el(av, s * VEC, k, 0) * el(wm, s * VEC, k, 0),
                                     arv * el(av, s * VEC, k, 1) * el(wm, s * VEC, k, 1))
                            for k in T.unroll(VEC // 2):
                                for j in T.unroll(2, explicit=True):
                                    e = 2 * k + j
                                    uu[e] = el(cw, (taps - 1) * EV + s * VEC, k, j) * el(nn, 0, k, j)
                                    for q in T.unroll(1, taps):
                                        uu[e] += el(cw, (taps - 1 - q) * EV + s * VEC, k, j) * el(rn, (q - 1) * VEC, k, j)
                            sigmoid(sg, uu, tt, km)
                            for k in T.unroll(VEC // 2):
                                for j in T.unroll(2, explicit=True):
                                    e = 2 * k + j
                                    gv[e] = el(ad, s * VEC, k, j) * (sg[e] * (T.float32(1) + uu[e] * (T.float32(1) - sg[e])))
                            if with_dconv:
                                if it >= R and it < R + chunk:
                                    load32(aw, dacc, taps - 1, c0)
                                    for k in T.unroll(VEC // 2):
                                        for j in T.unroll(2, explicit=True):
                                            e = 2 * k + j
                                            aw[e] += gv[e] * el(nn, 0, k, j)
                                    store32(dacc, taps - 1, c0, aw)
                                    for q in T.unroll(1, taps):
                                        load32(aw, dacc, taps - 1 - q, c0)
                                        for k in T.unroll(VEC // 2):
                                            for j in T.unroll(2, explicit=True):
                                                e = 2 * k + j
                                                aw[e] += gv[e] * el(rn, (q - 1) * VEC, k, j)
                                        store32(dacc, taps - 1 - q, c0, aw)
                            store32(ring_g, gj, c0, gv)
                            for e in T.vectorized(VEC):
                                ring_n[sj, c0 + e] = nn[e]
                else:
                    for s in T.unroll(slots):
                        c0 = (s * threads + tx) * VEC
                        for e in T.vectorized(VEC):
                            gv[e] = T.float32(0)
                        store32(ring_g, gj, c0, gv)
                # ---- stage B: token i = it - 2R (norm and gate backward, dH, dk, dv) ----
                if do_b:
                    a, rh, rk, rv = sb[0], sb[1], sb[2], sb[3]
                    for q in T.unroll(4):
                        ps[q] = T.float32(0)
                    for s in T.unroll(slots):
                        c0 = (s * threads + tx) * VEC
                        if c0 < DW:
                            if not resident_w:
                                load_bwd_weights(wl, wm, cw, w_h, w_v, conv_w, s, cb + c0, taps, EV)
                            for e in T.unroll(VEC):
                                gn[s * VEC + e] = T.float32(0)
                            for q in T.unroll(taps):
                                load32(gv, ring_g, T.truncmod(it - R + q + taps * taps, taps), c0)
                                for k in T.unroll(VEC // 2):
                                    for j in T.unroll(2, explicit=True):
                                        e = 2 * k + j
                                        gn[s * VEC + e] += el(cw, (taps - 1 - q) * EV + s * VEC, k, j) * gv[e]
                            for k in T.unroll(VEC // 2):
                                for j in T.unroll(2, explicit=True):
                                    e = 2 * k + j
                                    vv = el(xc, s * VEC, k, j)
                                    ps[0] += el(wm, s * VEC, k, j) * gn[s * VEC + e] * vv
                                    ps[1] += vv * vv
                                    ps[2] += el(xd, s * VEC, k, j) * vv
                                    ps[3] += el(xa, s * VEC, k, j) * el(xb, s * VEC, k, j) * (el(wl, s * VEC, k, j) * el(wl, s * VEC, k, j))
                    # CTA-wide sums: the warps' reduce-scatter, then the warps' partials (zeros past nwarps) by
                    # the same reduce-scatter in every warp and a broadcast from lanes 0, 8, 16, 24: the addition
                    # tree of warp_reduce_sum on both levels (fixed order, identical in every thread). ``red``
                    # is double-buffered, so one barrier per token suffices.
                    rb = T.truncmod(it, 2)
                    reduce_scatter_row_sums(sc, ps, lane)
                    if T.truncmod(lane, 8) == 0:
                        red[rb, T.truncdiv(lane, 8), rank * nwarps + warp] = sc[2]
                        if split > 1:
                            T.evaluate(T.call_extern("handle", "tk_st_peer_f32",
                                                     T.address_of(red[rb, T.truncdiv(lane, 8), rank * nwarps + warp]),
                                                     T.address_of(mbar[rb]), 1 - rank, sc[2]))
                    if split > 1 and tx == 0:
                        T.evaluate(T.call_extern("handle", "tk_mbar_expect", T.address_of(mbar[rb]), nwarps * 16))
                    T.sync_threads()
                    if split > 1:  # completion k of mbar[rb] is token 2R + rb + 2k's (stage B runs from it = 2R on)
                        T.evaluate(T.call_extern("handle", "tk_mbar_wait", T.address_of(mbar[rb]),
                                                 T.bitwise_and(T.truncdiv(it - 2 * R, 2), 1)))
                    for q in T.unroll(4):
                        tot[q] = T.if_then_else(lane < nwarps * split, red[rb, q, lane], T.float32(0))
                    reduce_scatter_row_sums(sc, tot, lane)
                    for q in T.unroll(4, explicit=True):
                        tot[q] = T.shfl_sync(sc[2], q * 8)
                    c1 = rv * rv * rv * (a * tot[0]) * inv_d
                    ga = rv * tot[0] - c1 * a * tot[1] + tot[2]
                    cc = ga * a * (T.float32(1) - a) * inv_sqrt_d * rh * rk
                    # per-token factors of the outputs: dv = a r_v w_v g_n - c1 a^2 v + a dY, dH = cc w_h^2 k -
                    # cc r_h^2 P/d H, dk = cc w_h^2 H - cc r_k^2 P/d k
                    arb = a * rv
                    nca2 = -(c1 * a) * a
                    ncch = -(cc * (rh * rh * tot[3] * inv_d))
                    ncck = -(cc * (rk * rk * tot[3] * inv_d))
                    for s in T.unroll(slots):
                        c0 = (s * threads + tx) * VEC
                        if c0 < DW:
                            for p in T.unroll(2):
                                if acc_global:
                                    for e in T.vectorized(VEC):
                                        aw[e] = part[pid, p, cb + c0 + e]
                                else:
                                    load32(aw, accw, p, c0)
                                for k in T.unroll(VEC // 2):
                                    for j in T.unroll(2, explicit=True):
                                        e = 2 * k + j
                                        if p == 0:
                                            aw[e] += cc * el(xa, s * VEC, k, j) * el(xb, s * VEC, k, j)
                                        else:
                                            aw[e] += arb * (gn[s * VEC + e] * el(xc, s * VEC, k, j))
                                if acc_global:
                                    for e in T.vectorized(VEC):
                                        part[pid, p, cb + c0 + e] = aw[e]
                                else:
                                    store32(accw, p, c0, aw)
                            for k in T.unroll(VEC // 2):
                                for j in T.unroll(2, explicit=True):
                                    e = 2 * k + j
                                    hv = el(xa, s * VEC, k, j)
                                    kv = el(xb, s * VEC, k, j)
                                    g = gn[s * VEC + e]
                                    ccw2 = cc * (el(wl, s * VEC, k, j) * el(wl, s * VEC, k, j))
                                    oc[e] = T.cast(arb * (el(wm, s * VEC, k, j) * g)
                                                   + (nca2 * el(xc, s * VEC, k, j) + a * el(xd, s * VEC, k, j)), dtype)
                                    oa[e] = T.cast(ccw2 * kv + ncch * hv, dtype)
                                    ob[e] = T.cast(ccw2 * hv + ncck * kv, dtype)
                            store_row(dH, oa, bm, ti, cb + c0, idx32)
                            store_row(dK, ob, bm, ti, cb + c0, idx32)
                            store_row(dV, oc, bm, ti, cb + c0, idx32)
            for s in T.unroll(slots):
                c0 = (s * threads + tx) * VEC
                if c0 < DW:
                    if not acc_global:
                        for p in T.unroll(2):
                            load32(aw, accw, p, c0)
                            for e in T.vectorized(VEC):
                                part[pid, p, cb + c0 + e] = aw[e]
                    if with_dconv:
                        for p in T.unroll(taps):
                            load32(aw, dacc, p, c0)
                            for e in T.vectorized(VEC):
                                part[pid, 2 + p, cb + c0 + e] = aw[e]

    return main


@kernel
def gate_conv_dconv_kernel(dtype: str, d: int, taps: int, dilation: int, chunk: int, threads: int = 128,
                           min_blocks: int = 4):
    """dconv_w partial sums for rows too wide to fuse them into the backward: CTAs own 8*threads columns
    of one chain chunk, recompute n, u and g_u column by column (no row reductions) and write
    ``part[cta, p, :] = sum_t g_u[t] * n[t - (taps-1-p)*dilation]`` for their columns. Each thread's next
    V and dY vectors are loaded one token ahead, so a load is always in flight behind the serial chain; the
    chunk (independent of the main kernel's) sets the grid: 128 tokens give one wave at d=7168 with
    ``min_blocks`` CTAs per SM (a register cap). Element math as in the main kernel (``bwd_elementwise``)."""
    R = taps - 1
    RS = max(R, 1)
    NCB = ceil_div(d, VEC * threads)
    M = T.dynamic("M")
    L = T.dynamic("seq_len")
    NP = T.dynamic("num_parts")
    f32 = "float32"
    prelude, el, pack, sigmoid = bwd_elementwise(dtype)

    @T.prim_func
    def main(
        dY: T.Tensor((M, L, d), dtype),
        V: T.Tensor((M, L, d), dtype),
        w_v: T.Tensor((d,), dtype),
        conv_w: T.Tensor((taps, d), dtype),
        alpha: T.Tensor((M, L), f32),
        rr_v: T.Tensor((M, L), f32),
        part: T.Tensor((NP, taps, d), f32),
    ):
        with T.Kernel(NCB * T.ceildiv(L, dilation * chunk), dilation, M, threads=threads, prelude=prelude) as (bx, br, bm):
            T.annotate_min_blocks_per_sm(min_blocks)
            tx = T.get_thread_binding()
            ring = T.alloc_local((RS * VEC,), dtype)  # n is rounded to dtype: exact, half the registers
            acc = T.alloc_local((taps * VEC,), f32)
            xc = T.alloc_local((VEC,), dtype)
            xd = T.alloc_local((VEC,), dtype)
            nc = T.alloc_local((VEC,), dtype)
            nd = T.alloc_local((VEC,), dtype)
            wm = T.alloc_local((VEC,), dtype)
            cw = T.alloc_local((taps * VEC,), dtype)
            nb = T.alloc_local((VEC,), dtype)
            nn = T.alloc_local((VEC,), f32)
            uu = T.alloc_local((VEC,), f32)
            tt = T.alloc_local((VEC,), f32)
            sg = T.alloc_local((VEC,), f32)
            km = T.alloc_local((1,), "uint32")
            nch = T.ceildiv(L, dilation * chunk)
            bc = bx // NCB
            c0 = ((bx % NCB) * threads + tx) * VEC
            base = br + dilation * chunk * bc
            for e in T.unroll(taps * VEC):
                acc[e] = T.float32(0)
            for e in T.unroll(RS * VEC):
                ring[e] = T.cast(0, dtype)
            if c0 < d:
                for e in T.vectorized(VEC):
                    wm[e] = w_v[c0 + e]
                for p in T.unroll(taps):
                    for e in T.vectorized(VEC):
                        cw[p * VEC + e] = conv_w[p, c0 + e]
                t0 = base - dilation * R
                if t0 >= 0:
                    for e in T.vectorized(VEC):
                        nc[e] = V[bm, t0, c0 + e]
                    for e in T.vectorized(VEC):
                        nd[e] = dY[bm, t0, c0 + e]
                for it in T.serial(R + chunk):
                    tj = base + dilation * (it - R)
                    for e in T.unroll(VEC):
                        xc[e] = nc[e]
                        xd[e] = nd[e]
                    tn = tj + dilation
                    if it + 1 < R + chunk and tn >= 0 and tn < L:
                        for e in T.vectorized(VEC):
                            nc[e] = V[bm, tn, c0 + e]
                        for e in T.vectorized(VEC):
                            nd[e] = dY[bm, tn, c0 + e]
                    if tj >= 0 and tj < L:
                        a = alpha[bm, tj]
                        rv = rr_v[bm, tj]
                        for k in T.unroll(VEC // 2):
                            pack(nb, 2 * k, a * el(xc, 0, k, 0) * el(wm, 0, k, 0) * rv,
                                 a * el(xc, 0, k, 1) * el(wm, 0, k, 1) * rv)
                        for k in T.unroll(VEC // 2):
                            for j in T.unroll(2, explicit=True):
                                e = 2 * k + j
                                nn[e] = el(nb, 0, k, j)
                                uu[e] = el(cw, (taps - 1) * VEC, k, j) * nn[e]
                                for q in T.unroll(1, taps):
                                    uu[e] += el(cw, (taps - 1 - q) * VEC, k, j) * el(ring, (q - 1) * VEC, k, j)
                        sigmoid(sg, uu, tt, km)
                        for k in T.unroll(VEC // 2):
                            for j in T.unroll(2, explicit=True):
                                e = 2 * k + j
                                gu = el(xd, 0, k, j) * (sg[e] * (T.float32(1) + uu[e] * (T.float32(1) - sg[e])))
                                if it >= R:
                                    acc[(taps - 1) * VEC + e] += gu * nn[e]
                                    for q in T.unroll(1, taps):
                                        acc[(taps - 1 - q) * VEC + e] += gu * el(ring, (q - 1) * VEC, k, j)
                    # shift the history (ring[q-1] holds the chain token q steps back); zeros before t = 0
                    for q in T.unroll(R - 1):
                        for e in T.unroll(VEC):
                            ring[(R - 1 - q) * VEC + e] = ring[(R - 2 - q) * VEC + e]
                    if R > 0:
                        for e in T.unroll(VEC):
                            ring[e] = T.if_then_else(tj >= 0 and tj < L, nb[e], T.cast(0, dtype))
                pid = (bm * dilation + br) * nch + bc
                for p in T.unroll(taps):
                    for e in T.vectorized(VEC):
                        part[pid, p, c0 + e] = acc[p * VEC + e]

    return main
