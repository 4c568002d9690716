"""TileLang kernels of the Engram gate: forward, backward and the weight-gradient reduction.

Private module; the public ops live in ``gate.py``. Every kernel is written thread by thread: a thread
owns 8-element (16-byte) column vectors ``d0 = (r * threads + tx) * 8`` for ``r < R`` of one row, so all
global accesses are 16-byte vectors. Rows used only after a barrier are staged by cp.async into shared
memory slots that the same thread reads back (no cross-thread staging). Only compile-time
parameters are the number of streams ``n``, the hidden size, the thread count and flags; the token
count, the input strides (in units of 8 elements), eps, clamp and the backward chunk size are runtime
arguments.

Strided inputs are passed as flat 1-D views of their storage span (see ``gate._flat``) with their
row strides divided by 8, so the vector alignment is provable and no stride is baked into a kernel.
"""

import tilelang.language as T

from tk_core.jit import blocks_per_sm, kernel
from tk_core.ptx import CP_ASYNC, ST_GLOBAL_V4, cp_async16, cp_async_wait_all

VEC = 8  # bf16 elements per 16-byte vector
BF16 = "bfloat16"
F32 = "float32"


MAX_HIDDEN = 14336


VECS_PER_THREAD = 4


def threads_for(hidden: int) -> int:
    """Threads of a gate CTA: a thread owns at most 4 vectors of a row (7168 -> 224 threads, 14336 -> 448), so
    all of a token's loads fit in registers at once and several CTAs share an SM (more bytes in flight than
    few fat threads that cannot issue all their loads before the first FMA)."""
    warps = -(-(hidden // VEC) // (VECS_PER_THREAD * 32))
    return 32 * max(1, warps)


def fwd_blocks_per_sm(hidden: int, threads: int | None = None) -> int:
    """Resident CTAs the forward is register-budgeted for: 96 registers with at most 4 vectors per thread (x and
    k take 32; v is staged in shared memory), i.e. 3 CTAs x 7 warps at H = 7168 (measured on the H200: 3,934
    GB/s against 3,849 with 4 CTAs of 72 registers), but at least 2 CTAs, so that one CTA's loads overlap
    another's reduction (14-warp CTAs at H = 14336 get 72 registers); 128 with more vectors."""
    threads = threads or threads_for(hidden)
    if -(-hidden // (VEC * threads)) > VECS_PER_THREAD:
        return blocks_per_sm(threads, 128)
    return max(2, blocks_per_sm(threads, 96))


def bwd_blocks_per_sm(hidden: int, threads: int | None = None) -> int:
    """Resident CTAs the backward is register-budgeted for: 144 registers with at most 4 vectors per thread (the
    weight-gradient accumulators take 32, G and v 32, the other streams' G rows 16), 255 with more."""
    threads = threads or threads_for(hidden)
    return blocks_per_sm(threads, 144 if -(-hidden // (VEC * threads)) <= VECS_PER_THREAD else 255)


def bwd_xk_late(hidden: int, threads: int | None = None) -> bool:
    """Whether the backward loads x and k after its barrier (``gate_bwd_kernel``'s ``xk_late``): in the layouts
    of 2 CTAs per SM with at most 4 vectors per thread (160-224 threads, H = 4160-7168), where it measured
    3,955 against 3,808 GB/s on the H200 at the anchor line. The other layouts (1 CTA of 256-448 threads, or 3 and
    more small CTAs per SM) keep the cp.async stages: not measured, and with one CTA per SM nothing covers a load
    issued after the barrier."""
    threads = threads or threads_for(hidden)
    return -(-hidden // (VEC * threads)) <= VECS_PER_THREAD and bwd_blocks_per_sm(hidden, threads) == 2


def _inv_sqrt_hidden(hidden: int):
    # Correctly rounded sqrtf then an IEEE division: the same float32 value as the reference's
    # ``1 / sqrt(float32(H))``.
    return T.float32(1.0) / T.sqrt(T.float32(hidden))


# The flat strided views are indexed past what TileLang can prove in bounds; the host guarantees it.
# The barriers are explicit: a thread reads back only the shared-memory vectors it wrote itself (weights,
# cp.async stages), except the cross-warp reduction scratch, which is double-buffered around the one
# T.sync_threads per token. The automatic pass would add a second barrier per token (it cannot see
# through the cp.async calls).
PASS_CONFIGS = {"tl.disable_safe_memory_legalize": True, "tl.disable_thread_storage_sync": True}


# cp.async (``tk_core.ptx``): a thread only reads back the vectors it copied itself, after its own wait, so no
# barrier orders a copy with its reader. Reusing a buffer is another matter (cp.async is not ordered with the
# thread's earlier shared-memory reads of it): both kernels copy into two stages by token parity and rely on the
# per-token barrier between the two uses of a stage.


# Eight float32 values rounded to bf16 (round to nearest even, as the TileLang cast) and written with one 16-byte
# store instruction (needs ``ST_GLOBAL_V4`` before it): from the TileLang vector store nvcc emitted 4 x
# st.global.u32 for grad_v.
STORE_BF16X8 = r"""
#include <cuda_bf16.h>
__device__ __forceinline__ void tk_store_bf16x8(void* dst, const float* v) {
  unsigned int u[4];
  #pragma unroll
  for (int i = 0; i < 4; ++i) {
    __nv_bfloat162 p = __float22bfloat162_rn(make_float2(v[2 * i], v[2 * i + 1]));
    u[i] = *reinterpret_cast<unsigned int*>(&p);
  }
  tk_st_global_v4(dst, u[0], u[1], u[2], u[3]);
}
"""


def _store_bf16x8(buf, index, vals):
    return T.call_extern("handle", "tk_store_bf16x8", T.address_of(buf[index]), T.address_of(vals[0]))


@kernel(pass_configs=PASS_CONFIGS)
def gate_fwd_kernel(n: int, hidden: int, save: bool, threads: int, masked: bool = False, blocks: int = 0):
    """Persistent CTAs, one per (token chunk p, stream h), stream fastest so the n CTAs sharing ``v[t]``
    run side by side (v is read from DRAM once, the other streams hit L2).

    CTA (p, h) walks tokens [p * chunk, min((p + 1) * chunk, T)). Per token: every thread loads its x and k
    vectors (kept in registers) and v, accumulates sum x^2, sum k^2 and sum x*w*k in float32 (fixed order), the
    sums are reduced over the warp (shuffles) and over the warps in a fixed order (shared memory,
    double-buffered by token parity: one barrier per token), then out = x + g * v is written. All loads of a
    token are issued before the first FMA (one memory round trip per token): x and k into registers, v (used
    only after the barrier, so ptxas would sink a plain load) as cp.async copies into shared memory, stage
    t % 2, so that the barrier between tokens t - 1 and t + 1 orders a copy after the reads of its stage (as in
    the backward: cp.async is not ordered with the thread's earlier shared-memory reads). The
    other CTAs on the SM keep DRAM busy meanwhile (a bulk L2 prefetch of the next token's rows by one thread
    measured 15-20% slower on the H200). ``blocks`` (0: the default ``fwd_blocks_per_sm``) sets the CTAs per
    SM the registers are capped for; the host sizes the grid to match.
    With ``masked``, tokens whose uint8 ``Mask[t]`` is non-zero pass through (out = x bit for bit, saved
    gate 0).
    """
    R = -(-hidden // (VEC * threads))
    W = threads // 32
    nt = T.dynamic("num_tokens")
    lx, lk, lv = T.dynamic("len_x, len_k, len_v", "int64")

    @T.macro
    def body(X, K, V, Wf, Out, Dot, Gate, Rx, Rk, Mask, sx0, sx1, sk0, sk1, sv0, eps, clamp, chunk, nparts):
        with T.Kernel(nparts * n, threads=threads, prelude=CP_ASYNC) as bid:
            T.annotate_min_blocks_per_sm(blocks or fwd_blocks_per_sm(hidden, threads))
            tx = T.get_thread_binding()
            p = bid // n
            h = bid % n
            xl = T.alloc_local((R, VEC), BF16)
            kl = T.alloc_local((R, VEC), BF16)
            vl = T.alloc_local((VEC,), BF16)
            vs = T.alloc_shared((2 * hidden,), BF16)
            wl = T.alloc_local((VEC,), F32)
            acc = T.alloc_local((3,), F32)
            red = T.alloc_shared((2, W, 3), F32)
            ws = T.alloc_shared((hidden,), F32)
            gv = T.alloc_var(F32)
            rxv = T.alloc_var(F32)
            rkv = T.alloc_var(F32)
            sv = T.alloc_var(F32)
            mk = T.alloc_var("int32")
            # this stream's weight row stays in shared memory (each thread reads back only its own columns)
            for r in T.unroll(R):
                d0 = (r * threads + tx) * VEC
                if d0 < hidden:
                    for j in T.vectorized(VEC):
                        ws[d0 + j] = Wf[h, d0 + j]
            t_begin = p * chunk
            t_end = T.min(t_begin + chunk, nt)
            for t in T.serial(t_begin, t_end):
                t64 = T.cast(t, "int64")
                xbase = (t64 * sx0 + T.cast(h, "int64") * sx1) * VEC
                kbase = (t64 * sk0 + T.cast(h, "int64") * sk1) * VEC
                vbase = t64 * sv0 * VEC
                if masked:
                    mk = T.cast(Mask[t], "int32")
                for i in T.unroll(3):
                    acc[i] = T.float32(0)
                for r in T.unroll(R):
                    d0 = (r * threads + tx) * VEC
                    if d0 < hidden:
                        cp_async16(T.address_of(vs[(t % 2) * hidden + d0]), T.address_of(V[vbase + d0]))
                        for j in T.vectorized(VEC):
                            xl[r, j] = X[xbase + d0 + j]
                        for j in T.vectorized(VEC):
                            kl[r, j] = K[kbase + d0 + j]
                for r in T.unroll(R):
                    d0 = (r * threads + tx) * VEC
                    if d0 < hidden:
                        for j in T.vectorized(VEC):
                            wl[j] = ws[d0 + j]
                        for j in T.unroll(VEC):
                            acc[0] += T.cast(xl[r, j], F32) * T.cast(xl[r, j], F32)
                            acc[1] += T.cast(kl[r, j], F32) * T.cast(kl[r, j], F32)
                            acc[2] += T.cast(xl[r, j], F32) * wl[j] * T.cast(kl[r, j], F32)
                for i in T.unroll(3):
                    acc[i] = T.warp_reduce_sum(acc[i])
                if tx % 32 == 0:
                    for i in T.unroll(3):
                        red[t % 2, tx // 32, i] = acc[i]
                T.sync_threads()
                for i in T.unroll(3):
                    acc[i] = red[t % 2, 0, i]
                    for w in T.unroll(1, W):
                        acc[i] += red[t % 2, w, i]
                rxv = T.float32(1.0) / T.sqrt(acc[0] / T.float32(hidden) + eps)
                rkv = T.float32(1.0) / T.sqrt(acc[1] / T.float32(hidden) + eps)
                sv = acc[2] * rxv * rkv * _inv_sqrt_hidden(hidden)
                # sign(s) * sqrt(max(|s|, clamp)); sign(0) = 0 so g(0) = 1/2 (and NaN propagates).
                gv = T.sqrt(T.max(T.abs(sv), clamp))
                gv = T.if_then_else(sv > 0, gv, T.if_then_else(sv < 0, -gv, sv))
                gv = T.float32(1.0) / (T.float32(1.0) + T.exp(-gv))
                cp_async_wait_all()
                for r in T.unroll(R):
                    d0 = (r * threads + tx) * VEC
                    if d0 < hidden:
                        for j in T.vectorized(VEC):
                            vl[j] = vs[(t % 2) * hidden + d0 + j]
                        if masked:
                            # image tokens pass straight through, bit for bit
                            for j in T.vectorized(VEC):
                                Out[t, h, d0 + j] = T.if_then_else(
                                    mk != 0, xl[r, j], T.cast(T.cast(xl[r, j], F32) + gv * T.cast(vl[j], F32), BF16)
                                )
                        else:
                            for j in T.vectorized(VEC):
                                Out[t, h, d0 + j] = T.cast(T.cast(xl[r, j], F32) + gv * T.cast(vl[j], F32), BF16)
                if save:
                    if tx == 0:
                        Dot[t, h] = acc[2]
                        Gate[t, h] = T.if_then_else(mk != 0, T.float32(0), gv) if masked else gv
                        Rx[t, h] = rxv
                        Rk[t, h] = rkv

    if save and not masked:

        @T.prim_func
        def fwd_save(
            X: T.Tensor((lx,), BF16),
            K: T.Tensor((lk,), BF16),
            V: T.Tensor((lv,), BF16),
            Wf: T.Tensor((n, hidden), F32),
            Out: T.Tensor((nt, n, hidden), BF16),
            Dot: T.Tensor((nt, n), F32),
            Gate: T.Tensor((nt, n), F32),
            Rx: T.Tensor((nt, n), F32),
            Rk: T.Tensor((nt, n), F32),
            sx0: T.int64,
            sx1: T.int64,
            sk0: T.int64,
            sk1: T.int64,
            sv0: T.int64,
            eps: T.float32,
            clamp: T.float32,
            chunk: T.int32,
            num_parts: T.int32,
        ):
            body(X, K, V, Wf, Out, Dot, Gate, Rx, Rk, None, sx0, sx1, sk0, sk1, sv0, eps, clamp, chunk, num_parts)

        return fwd_save

    if not save and not masked:

        @T.prim_func
        def fwd_nosave(
            X: T.Tensor((lx,), BF16),
            K: T.Tensor((lk,), BF16),
            V: T.Tensor((lv,), BF16),
            Wf: T.Tensor((n, hidden), F32),
            Out: T.Tensor((nt, n, hidden), BF16),
            sx0: T.int64,
            sx1: T.int64,
            sk0: T.int64,
            sk1: T.int64,
            sv0: T.int64,
            eps: T.float32,
            clamp: T.float32,
            chunk: T.int32,
            num_parts: T.int32,
        ):
            body(X, K, V, Wf, Out, None, None, None, None, None, sx0, sx1, sk0, sk1, sv0, eps, clamp, chunk, num_parts)

        return fwd_nosave

    if save and masked:

        @T.prim_func
        def fwd_save_masked(
            X: T.Tensor((lx,), BF16),
            K: T.Tensor((lk,), BF16),
            V: T.Tensor((lv,), BF16),
            Wf: T.Tensor((n, hidden), F32),
            Out: T.Tensor((nt, n, hidden), BF16),
            Dot: T.Tensor((nt, n), F32),
            Gate: T.Tensor((nt, n), F32),
            Rx: T.Tensor((nt, n), F32),
            Rk: T.Tensor((nt, n), F32),
            Mask: T.Tensor((nt,), "uint8"),
            sx0: T.int64,
            sx1: T.int64,
            sk0: T.int64,
            sk1: T.int64,
            sv0: T.int64,
            eps: T.float32,
            clamp: T.float32,
            chunk: T.int32,
            num_parts: T.int32,
        ):
            body(X, K, V, Wf, Out, Dot, Gate, Rx, Rk, Mask, sx0, sx1, sk0, sk1, sv0, eps, clamp, chunk, num_parts)

        return fwd_save_masked

    if not save and masked:

        @T.prim_func
        def fwd_nosave_masked(
            X: T.Tensor((lx,), BF16),
            K: T.Tensor((lk,), BF16),
            V: T.Tensor((lv,), BF16),
            Wf: T.Tensor((n, hidden), F32),
            Out: T.Tensor((nt, n, hidden), BF16),
            Mask: T.Tensor((nt,), "uint8"),
            sx0: T.int64,
            sx1: T.int64,
            sk0: T.int64,
            sk1: T.int64,
            sv0: T.int64,
            eps: T.float32,
            clamp: T.float32,
            chunk: T.int32,
            num_parts: T.int32,
        ):
            body(X, K, V, Wf, Out, None, None, None, None, Mask, sx0, sx1, sk0, sk1, sv0, eps, clamp, chunk, num_parts)

        return fwd_nosave_masked
    raise AssertionError("unreachable")


@kernel(pass_configs=PASS_CONFIGS)
def gate_bwd_kernel(n: int, hidden: int, threads: int, masked: bool = False, blocks: int = 0,
                    xk_late: bool | None = None):
    """Persistent CTAs, one per (token chunk p, stream h), stream fastest.

    CTA (p, h) walks the tokens ``[p * chunk, min((p + 1) * chunk, T))`` in order. Per token it loads its
    G, x, k and v vectors, reduces dg = sum_d G v over the CTA (fixed order; the reduction scratch is
    double-buffered by token parity so one barrier per token suffices), then writes grad_x and grad_k
    and accumulates ddot * x * k for grad_w (registers or shared memory, see below). grad_v[t] = sum_h g_h G_h
    (heads in order 0..n-1) is split among the n CTAs of a chunk: CTA h computes the vectors (r, warp) with
    (r + warp) % n == h, reading the other streams' G (L2 hits: the n CTAs of a chunk run side by side). At the
    end the CTA writes its partial grad_w row ``Partial[p, h, :]`` (zeros when it had no token): no atomics.
    With ``masked``, tokens whose uint8 ``Mask[t]`` is non-zero get grad_x = G (bit for bit), grad_k = 0,
    grad_v = 0 and add nothing to grad_w.

    G, v, the other streams' G rows and the per-token scalars are loaded into registers, all before the first
    FMA. x and k are used only after the barrier; ``xk_late`` (None: ``bwd_xk_late``) picks how they arrive:

    - ``xk_late=False``: as cp.async copies into shared memory, issued in the source with token t's other loads
      into stage t % 2 (ptxas places them after the dg FMAs: two dependent round trips per token). A copy may
      land before the same thread's earlier shared-memory reads of its stage have been performed (cp.async is
      not ordered with them); the barrier between tokens t - 1 and t + 1 orders them (one stage measured wrong
      results on long token chunks). The grad_w accumulators stay in registers.
    - ``xk_late=True``: as 16-byte loads into registers, written after the barrier in the source; ptxas hoists
      them (read-only ld.global.nc) above it, next to the dg shuffles (sm_90a, 224 threads): the same two round
      trips. The grad_w accumulators live in shared memory (each thread reads and writes back only its own
      columns, once per token), which frees 32 registers and the 56 KB of x/k stages (57 KB of shared memory
      instead of 84 KB per CTA at H = 7168). Measured 3,955 against 3,808 GB/s at the anchor line (2 CTAs of 224
      threads per SM).

    The values and the order of every float operation are the same in both. Copying token t + 1's rows while
    token t is processed measured slower (3,523 against 3,773 GB/s on the H200 at the anchor line), and so did
    issuing x/k of token t + 1 earlier (3,705-3,761 against 3,833 GB/s). ``blocks`` (0: the default
    ``bwd_blocks_per_sm``) sets the CTAs per SM the registers are capped for; it changes no arithmetic.
    """
    R = -(-hidden // (VEC * threads))
    RO = -(-R // n)
    blocks = blocks or bwd_blocks_per_sm(hidden, threads)
    xk_late = bwd_xk_late(hidden, threads) if xk_late is None else xk_late
    W = threads // 32
    nt = T.dynamic("num_tokens")
    nparts = T.dynamic("num_parts")
    lg, lx, lk, lv = T.dynamic("len_g, len_x, len_k, len_v", "int64")

    @T.macro
    def copy_xk(X, K, xs, ks, t, h, sx0, sx1, sk0, sk1, tx):
        # token t's x and k vectors into stage t % 2 (each thread copies, and later reads, only its own)
        t64 = T.cast(t, "int64")
        xbase = (t64 * sx0 + T.cast(h, "int64") * sx1) * VEC
        kbase = (t64 * sk0 + T.cast(h, "int64") * sk1) * VEC
        for r in T.unroll(R):
            d0 = (r * threads + tx) * VEC
            if d0 < hidden:
                cp_async16(T.address_of(xs[(t % 2) * hidden + d0]), T.address_of(X[xbase + d0]))
                cp_async16(T.address_of(ks[(t % 2) * hidden + d0]), T.address_of(K[kbase + d0]))

    @T.macro
    def load_xk(X, K, xr, kr, t64, h, sx0, sx1, sk0, sk1, tx):
        # token t's x and k vectors into registers, all issued together
        xbase = (t64 * sx0 + T.cast(h, "int64") * sx1) * VEC
        kbase = (t64 * sk0 + T.cast(h, "int64") * sk1) * VEC
        for r in T.unroll(R):
            d0 = (r * threads + tx) * VEC
            if d0 < hidden:
                for j in T.vectorized(VEC):
                    xr[r, j] = X[xbase + d0 + j]
                for j in T.vectorized(VEC):
                    kr[r, j] = K[kbase + d0 + j]

    @T.macro
    def body(G, X, K, V, Wf, Dot, Gate, Rx, Rk, GX, GK, GV, Partial, Mask, sg0, sg1, sx0, sx1, sk0, sk1, sv0, clamp, chunk):
        with T.Kernel(nparts * n, threads=threads, prelude=CP_ASYNC + ST_GLOBAL_V4 + STORE_BF16X8) as bid:
            T.annotate_min_blocks_per_sm(blocks)
            tx = T.get_thread_binding()
            p = bid // n
            h = bid % n
            gl = T.alloc_local((R, VEC), BF16)
            vl = T.alloc_local((R, VEC), BF16)
            gvl = T.alloc_local((RO, n, VEC), BF16)
            xl = T.alloc_local((VEC,), BF16)
            kl = T.alloc_local((VEC,), BF16)
            if xk_late:
                xr = T.alloc_local((R, VEC), BF16)
                kr = T.alloc_local((R, VEC), BF16)
                accs = T.alloc_shared((hidden,), F32)
            else:
                xs = T.alloc_shared((2 * hidden,), BF16)
                ks = T.alloc_shared((2 * hidden,), BF16)
            wl = T.alloc_local((VEC,), F32)
            acc = T.alloc_local((R, VEC), F32)
            gvacc = T.alloc_local((VEC,), F32)
            gates = T.alloc_local((n,), F32)
            ox = T.alloc_local((VEC,), F32)
            ok = T.alloc_local((VEC,), F32)
            red = T.alloc_shared((2, W), F32)
            ws = T.alloc_shared((hidden,), F32)
            dg = T.alloc_var(F32)
            dot = T.alloc_var(F32)
            gate = T.alloc_var(F32)
            rx = T.alloc_var(F32)
            rk = T.alloc_var(F32)
            s = T.alloc_var(F32)
            ddot = T.alloc_var(F32)
            ca = T.alloc_var(F32)
            cb = T.alloc_var(F32)
            mk = T.alloc_var("int32")
            # this thread's grad_v vectors: r = r_own + q * n, the r < R with (r + warp) % n == h
            r_own = (h + n - (tx // 32) % n) % n
            if xk_late:
                for r in T.unroll(R):
                    d0 = (r * threads + tx) * VEC
                    if d0 < hidden:
                        for j in T.vectorized(VEC):
                            accs[d0 + j] = T.float32(0)
            else:
                for r in T.unroll(R):
                    for j in T.unroll(VEC):
                        acc[r, j] = T.float32(0)
            for r in T.unroll(R):
                d0 = (r * threads + tx) * VEC
                if d0 < hidden:
                    for j in T.vectorized(VEC):
                        ws[d0 + j] = Wf[h, d0 + j]
            t_begin = p * chunk
            t_end = T.min(t_begin + chunk, nt)
            for t in T.serial(t_begin, t_end):
                t64 = T.cast(t, "int64")
                gbase = (t64 * sg0 + T.cast(h, "int64") * sg1) * VEC
                vbase = t64 * sv0 * VEC
                if masked:
                    mk = T.cast(Mask[t], "int32")
                # Every load of the token but x and k with xk_late is issued here in the source (ptxas still
                # sinks the cp.async copies below the dg FMAs, see the docstring).
                if not xk_late:
                    copy_xk(X, K, xs, ks, t, h, sx0, sx1, sk0, sk1, tx)
                for r in T.unroll(R):
                    d0 = (r * threads + tx) * VEC
                    if d0 < hidden:
                        for j in T.vectorized(VEC):
                            gl[r, j] = G[gbase + d0 + j]
                        for j in T.vectorized(VEC):
                            vl[r, j] = V[vbase + d0 + j]
                for q in T.unroll(RO):
                    r = r_own + q * n
                    d0 = (r * threads + tx) * VEC
                    if r < R and d0 < hidden:
                        for h2 in T.unroll(n):
                            for j in T.vectorized(VEC):
                                gvl[q, h2, j] = G[(t64 * sg0 + h2 * sg1) * VEC + d0 + j]
                for h2 in T.unroll(n):
                    gates[h2] = Gate[t, h2]
                dot = Dot[t, h]
                gate = Gate[t, h]
                rx = Rx[t, h]
                rk = Rk[t, h]
                dg = T.float32(0)
                for r in T.unroll(R):
                    d0 = (r * threads + tx) * VEC
                    if d0 < hidden:
                        for j in T.unroll(VEC):
                            dg += T.cast(gl[r, j], F32) * T.cast(vl[r, j], F32)
                dg = T.warp_reduce_sum(dg)
                if tx % 32 == 0:
                    red[t % 2, tx // 32] = dg
                T.sync_threads()
                dg = red[t % 2, 0]
                for w in T.unroll(1, W):
                    dg += red[t % 2, w]
                if xk_late:
                    load_xk(X, K, xr, kr, t64, h, sx0, sx1, sk0, sk1, tx)
                # grad_v[t] = sum_h g_h G_h (needs no reduction)
                for q in T.unroll(RO):
                    r = r_own + q * n
                    d0 = (r * threads + tx) * VEC
                    if r < R and d0 < hidden:
                        for j in T.unroll(VEC):
                            gvacc[j] = T.float32(0)
                        for h2 in T.unroll(n):
                            for j in T.unroll(VEC):
                                gvacc[j] += gates[h2] * T.cast(gvl[q, h2, j], F32)
                        if masked:
                            for j in T.unroll(VEC):
                                gvacc[j] = T.if_then_else(mk != 0, T.float32(0), gvacc[j])
                        _store_bf16x8(GV, (t, d0), gvacc)
                # Same expression (and order) as the forward's s, so the clamp mask matches it.
                s = dot * rx * rk * _inv_sqrt_hidden(hidden)
                ddot = T.if_then_else(
                    T.abs(s) >= clamp,
                    dg * gate * (T.float32(1) - gate) * T.float32(0.5)
                    * T.sqrt(_inv_sqrt_hidden(hidden) * rx * rk / T.abs(dot)),
                    T.float32(0),
                )
                ca = dot * rx * rx / T.float32(hidden)
                cb = dot * rk * rk / T.float32(hidden)
                if not xk_late:
                    cp_async_wait_all()
                for r in T.unroll(R):
                    d0 = (r * threads + tx) * VEC
                    if d0 < hidden:
                        if xk_late:
                            for j in T.vectorized(VEC):
                                xl[j] = xr[r, j]
                            for j in T.vectorized(VEC):
                                kl[j] = kr[r, j]
                            for j in T.vectorized(VEC):
                                acc[r, j] = accs[d0 + j]
                        else:
                            for j in T.vectorized(VEC):
                                xl[j] = xs[(t % 2) * hidden + d0 + j]
                            for j in T.vectorized(VEC):
                                kl[j] = ks[(t % 2) * hidden + d0 + j]
                        for j in T.vectorized(VEC):
                            wl[j] = ws[d0 + j]
                        for j in T.unroll(VEC):
                            ox[j] = T.cast(gl[r, j], F32) + ddot * (T.cast(kl[j], F32) * wl[j] - T.cast(xl[j], F32) * ca)
                            ok[j] = ddot * (T.cast(xl[j], F32) * wl[j] - T.cast(kl[j], F32) * cb)
                            if masked:
                                acc[r, j] = T.if_then_else(
                                    mk != 0, acc[r, j], acc[r, j] + ddot * T.cast(xl[j], F32) * T.cast(kl[j], F32)
                                )
                            else:
                                acc[r, j] += ddot * T.cast(xl[j], F32) * T.cast(kl[j], F32)
                        if xk_late:
                            for j in T.vectorized(VEC):
                                accs[d0 + j] = acc[r, j]
                        if masked:
                            # image tokens: grad_x = G bit for bit, grad_k = 0
                            for j in T.vectorized(VEC):
                                GX[t, h, d0 + j] = T.if_then_else(mk != 0, gl[r, j], T.cast(ox[j], BF16))
                            for j in T.vectorized(VEC):
                                GK[t, h, d0 + j] = T.if_then_else(mk != 0, T.bfloat16(0), T.cast(ok[j], BF16))
                        else:
                            for j in T.vectorized(VEC):
                                GX[t, h, d0 + j] = T.cast(ox[j], BF16)
                            for j in T.vectorized(VEC):
                                GK[t, h, d0 + j] = T.cast(ok[j], BF16)
            for r in T.unroll(R):
                d0 = (r * threads + tx) * VEC
                if d0 < hidden:
                    if xk_late:
                        for j in T.vectorized(VEC):
                            Partial[p, h, d0 + j] = accs[d0 + j]
                    else:
                        for j in T.vectorized(VEC):
                            Partial[p, h, d0 + j] = acc[r, j]


    if masked:

        @T.prim_func
        def bwd_masked(
            G: T.Tensor((lg,), BF16),
            X: T.Tensor((lx,), BF16),
            K: T.Tensor((lk,), BF16),
            V: T.Tensor((lv,), BF16),
            Wf: T.Tensor((n, hidden), F32),
            Dot: T.Tensor((nt, n), F32),
            Gate: T.Tensor((nt, n), F32),
            Rx: T.Tensor((nt, n), F32),
            Rk: T.Tensor((nt, n), F32),
            GX: T.Tensor((nt, n, hidden), BF16),
            GK: T.Tensor((nt, n, hidden), BF16),
            GV: T.Tensor((nt, hidden), BF16),
            Partial: T.Tensor((nparts, n, hidden), F32),
            Mask: T.Tensor((nt,), "uint8"),
            sg0: T.int64,
            sg1: T.int64,
            sx0: T.int64,
            sx1: T.int64,
            sk0: T.int64,
            sk1: T.int64,
            sv0: T.int64,
            clamp: T.float32,
            chunk: T.int32,
        ):
            body(G, X, K, V, Wf, Dot, Gate, Rx, Rk, GX, GK, GV, Partial, Mask, sg0, sg1, sx0, sx1, sk0, sk1, sv0, clamp, chunk)

        return bwd_masked

    @T.prim_func
    def bwd(
        G: T.Tensor((lg,), BF16),
        X: T.Tensor((lx,), BF16),
        K: T.Tensor((lk,), BF16),
        V: T.Tensor((lv,), BF16),
        Wf: T.Tensor((n, hidden), F32),
        Dot: T.Tensor((nt, n), F32),
        Gate: T.Tensor((nt, n), F32),
        Rx: T.Tensor((nt, n), F32),
        Rk: T.Tensor((nt, n), F32),
        GX: T.Tensor((nt, n, hidden), BF16),
        GK: T.Tensor((nt, n, hidden), BF16),
        GV: T.Tensor((nt, hidden), BF16),
        Partial: T.Tensor((nparts, n, hidden), F32),
        sg0: T.int64,
        sg1: T.int64,
        sx0: T.int64,
        sx1: T.int64,
        sk0: T.int64,
        sk1: T.int64,
        sv0: T.int64,
        clamp: T.float32,
        chunk: T.int32,
    ):
        body(G, X, K, V, Wf, Dot, Gate, Rx, Rk, GX, GK, GV, Partial, None, sg0, sg1, sx0, sx1, sk0, sk1, sv0, clamp, chunk)

    return bwd


@kernel
def grad_w_reduce_kernel(n: int, hidden: int):
    """S = sum_p Partial[p] in the fixed order p = 0, 1, ..., B-1 (B is a runtime size), then
    GWh += S * float(We) and GWe += S * float(Wh), each a rounded product then a rounded sum (no FMA), as
    the reference's ``acc += S * w`` does. A thread owns 4 consecutive columns of the flat (n * H)."""
    threads = 128
    cols = n * hidden
    nb = T.dynamic("num_parts")

    @T.prim_func
    def reduce(
        Partial: T.Tensor((nb, n, hidden), F32),
        Wh: T.Tensor((n, hidden), BF16),
        We: T.Tensor((n, hidden), BF16),
        GWh: T.Tensor((n, hidden), F32),
        GWe: T.Tensor((n, hidden), F32),
    ):
        with T.Kernel(T.ceildiv(cols, 4 * threads), threads=threads) as bx:
            tx = T.get_thread_binding()
            sacc = T.alloc_local((4,), F32)
            buf = T.alloc_local((4, 4), F32)
            wh = T.alloc_local((4,), BF16)
            we = T.alloc_local((4,), BF16)
            gh = T.alloc_local((4,), F32)
            ge = T.alloc_local((4,), F32)
            c0 = (bx * threads + tx) * 4
            if c0 < cols:
                i = c0 // hidden
                d = c0 % hidden
                for j in T.unroll(4):
                    sacc[j] = T.float32(0)
                for b4 in T.serial(nb // 4):
                    for u in T.unroll(4):
                        for j in T.vectorized(4):
                            buf[u, j] = Partial[b4 * 4 + u, i, d + j]
                    for u in T.unroll(4):
                        for j in T.unroll(4):
                            sacc[j] = sacc[j] + buf[u, j]
                for b in T.serial(nb // 4 * 4, nb):
                    for j in T.vectorized(4):
                        buf[0, j] = Partial[b, i, d + j]
                    for j in T.unroll(4):
                        sacc[j] = sacc[j] + buf[0, j]
                for j in T.vectorized(4):
                    wh[j] = Wh[i, d + j]
                for j in T.vectorized(4):
                    we[j] = We[i, d + j]
                for j in T.vectorized(4):
                    gh[j] = GWh[i, d + j]
                for j in T.vectorized(4):
                    ge[j] = GWe[i, d + j]
                for j in T.unroll(4):
                    gh[j] = gh[j] + T.call_extern(F32, "__fmul_rn", sacc[j], T.cast(we[j], F32))
                    ge[j] = ge[j] + T.call_extern(F32, "__fmul_rn", sacc[j], T.cast(wh[j], F32))
                for j in T.vectorized(4):
                    GWh[i, d + j] = gh[j]
                for j in T.vectorized(4):
                    GWe[i, d + j] = ge[j]

    return reduce


@kernel
def fused_weight_kernel(n: int, hidden: int):
    """Out = float(Wh) * float(We) (exact in float32), 8 columns per thread."""
    threads = 128
    cols = n * hidden

    @T.prim_func
    def fused(Wh: T.Tensor((n, hidden), BF16), We: T.Tensor((n, hidden), BF16), Out: T.Tensor((n, hidden), F32)):
        with T.Kernel(T.ceildiv(cols, VEC * threads), threads=threads) as bx:
            tx = T.get_thread_binding()
            a = T.alloc_local((VEC,), BF16)
            b = T.alloc_local((VEC,), BF16)
            o = T.alloc_local((VEC,), F32)
            c0 = (bx * threads + tx) * VEC
            if c0 < cols:
                i = c0 // hidden
                d = c0 % hidden
                for j in T.vectorized(VEC):
                    a[j] = Wh[i, d + j]
                for j in T.vectorized(VEC):
                    b[j] = We[i, d + j]
                for j in T.unroll(VEC):
                    o[j] = T.cast(a[j], F32) * T.cast(b[j], F32)
                for j in T.vectorized(VEC):
                    Out[i, d + j] = o[j]

    return fused
