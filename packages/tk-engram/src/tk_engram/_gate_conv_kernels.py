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

from tk_core.jit import kernel
from tk_core.layout import ceil_div

VEC = 8  # elements per 16-byte access (float16 / bfloat16)


@T.macro
def add_row_sums(part, hv, kv, vv, wh):
    """The gate's four per-row sums (float32): h.h, k.k, (h w_h).(k w_h) and v.v."""
    part[0] += hv * hv
    part[1] += kv * kv
    part[2] += hv * kv * (wh * wh)
    part[3] += vv * vv


@T.macro
def load_row(dst, src, m, t, tx, slots: int, threads: int, d: int):
    """This thread's ``slots`` 16-byte column vectors of the row ``src[m, t, :]`` into ``dst``."""
    for s in T.unroll(slots):
        c0 = (s * threads + tx) * VEC
        if c0 < d:
            for e in T.vectorized(VEC):
                dst[s * VEC + e] = src[m, t, c0 + e]


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


@kernel(pass_configs={"tl.disable_safe_memory_legalize": True})
def gate_conv_fwd_kernel(dtype: str, d: int, taps: int, dilation: int, chunk: int, vecs: int = 2,
                         min_blocks: int = 2, early_v: bool = False):
    """Forward walk. Each thread owns ``slots`` column vectors (2 by default: 256 threads at d=4096, 448 at
    d=7168) and several CTAs share an SM, so the fixed per-token cost is amortised and other CTAs' loads
    overlap a CTA's barrier. Per token: one barrier (``red`` is double-buffered), a two-level shuffle
    reduction (lanes, then the warps' partials read by one lane each: same fixed order in every thread), the
    next token's H, k, v already in flight in registers, and the n history as 16-byte vectors in shared memory.
    ``early_v`` issues the next token's v with its H and k instead of after the barrier (v in flight for a
    whole token, at the cost of its registers across the reduction)."""
    slots, threads = fwd_layout(d, vecs)
    nwarps = threads // 32
    R = taps - 1
    RS = max(R, 1)
    hist = dilation * R
    HS = max(hist, 1)
    DP = slots * threads * VEC
    EV = slots * VEC
    inv_d = 1.0 / d
    inv_sqrt_d = 1.0 / math.sqrt(d)
    M = T.dynamic("M")
    L = T.dynamic("seq_len")
    f32 = "float32"

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
        with T.Kernel(T.ceildiv(L, dilation * chunk), dilation, M, threads=threads) as (bc, br, bm):
            T.annotate_min_blocks_per_sm(min_blocks)
            tx = T.get_thread_binding()
            lane = tx % 32
            warp = tx // 32
            ring = T.alloc_shared((RS, DP), dtype)
            red = T.alloc_shared((2, 4, 32), f32)
            tot = T.alloc_local((4,), f32)
            part = T.alloc_local((4,), f32)
            uu = T.alloc_local((VEC,), f32)
            wl = T.alloc_local((VEC,), dtype)
            cw = T.alloc_local((VEC,), dtype)
            rg = T.alloc_local((VEC,), dtype)
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
                            if early_v:
                                for e in T.vectorized(VEC):
                                    nv[s * VEC + e] = V[bm, tn, c0 + e]
                if t < 0:
                    if pre and not early_v:
                        load_row(nv, V, bm, tn, tx, slots, threads, d)
                    for s in T.unroll(slots):
                        c0 = (s * threads + tx) * VEC
                        for e in T.vectorized(VEC):
                            ring[slot, c0 + e] = T.cast(0, dtype)
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
                            for e in T.vectorized(VEC):
                                wl[e] = w_h[c0 + e]
                            for e in T.unroll(VEC):
                                hv = T.cast(xh[s * VEC + e], f32)
                                kv = T.cast(xk[s * VEC + e], f32)
                                vv = T.cast(xv[s * VEC + e], f32)
                                wh = T.cast(wl[e], f32)
                                add_row_sums(part, hv, kv, vv, wh)
                    for q in T.unroll(4):
                        part[q] = T.warp_reduce_sum(part[q])
                    if lane == 0:
                        for q in T.unroll(4):
                            red[rb, q, warp] = part[q]
                    T.sync_threads()
                    # the next token's v only now (unless ``early_v``): H and k of this token are dead, which keeps
                    # the register peak under the 2-CTA/SM cap (128)
                    if pre and not early_v:
                        load_row(nv, V, bm, tn, tx, slots, threads, d)
                    for q in T.unroll(4):
                        tot[q] = T.if_then_else(lane < nwarps, red[rb, q, lane], T.float32(0))
                    for q in T.unroll(4):
                        tot[q] = T.warp_reduce_sum(tot[q])
                    r_h = T.rsqrt(tot[0] * inv_d + eps)
                    r_k = T.rsqrt(tot[1] * inv_d + eps)
                    sc = r_h * r_k * tot[2] * inv_sqrt_d
                    a = T.float32(1) / (T.float32(1) + T.exp(-sc))
                    r_v = T.rsqrt(a * a * (tot[3] * inv_d) + eps)
                    if it >= R and tx == 0:
                        alpha[bm, t] = a
                        rr_h[bm, t] = r_h
                        rr_k[bm, t] = r_k
                        rr_v[bm, t] = r_v
                    for s in T.unroll(slots):
                        c0 = (s * threads + tx) * VEC
                        if c0 < d:
                            for e in T.vectorized(VEC):
                                wl[e] = w_v[c0 + e]
                            for e in T.vectorized(VEC):
                                cw[e] = conv_w[taps - 1, c0 + e]
                            for e in T.unroll(VEC):
                                no[e] = T.cast(a * T.cast(xv[s * VEC + e], f32) * T.cast(wl[e], f32) * r_v, dtype)
                                uu[e] = T.cast(cw[e], f32) * T.cast(no[e], f32)
                            for q in T.unroll(1, taps):
                                for e in T.vectorized(VEC):
                                    cw[e] = conv_w[taps - 1 - q, c0 + e]
                                for e in T.vectorized(VEC):
                                    rg[e] = ring[T.truncmod(it - q + RS * taps, RS), c0 + e]
                                for e in T.unroll(VEC):
                                    uu[e] += T.cast(cw[e], f32) * T.cast(rg[e], f32)
                            for e in T.unroll(VEC):
                                vh = a * T.cast(xv[s * VEC + e], f32)
                                vo[e] = T.cast(vh, dtype)
                                yo[e] = T.cast(uu[e] / (T.float32(1) + T.exp(-uu[e])) + vh, dtype)
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
    accumulators fit in shared memory next to the rings (d <= 4096); larger rows use ``gate_conv_dconv_kernel``."""
    return row_layout(d)[1] <= 512


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


def bwd_layout(d: int, vecs: int) -> tuple[int, int]:
    """(slots, threads) of the backward: ``vecs`` 16-byte vectors per thread (more if 1024 threads would not
    cover d), threads a multiple of 32."""
    nvec = ceil_div(d, VEC)
    slots = max(vecs, ceil_div(nvec, 1024))
    return slots, ceil_div(ceil_div(nvec, slots), 32) * 32


@kernel(pass_configs={"tl.disable_safe_memory_legalize": True})
def gate_conv_bwd_kernel(dtype: str, d: int, taps: int, dilation: int, chunk: int, with_dconv: bool = True,
                         vecs: int = 1, hoist_w: bool = True, ahead: bool = True):
    """Fused backward: one walk per chain chunk with a front halo (history of n) and a look-ahead of
    ``taps - 1`` chain tokens (the transposed convolution needs g_u of later tokens). Writes dH, dk, dv and
    per-CTA partial sums ``part[cta] = (sum c*H*k, sum g_n*vhat*r_v[, dconv_w[0..taps)])`` in float32,
    reduced in a fixed order afterwards: no atomics, bitwise reproducible.

    Iteration ``it`` runs stage A (n, u, g_u of chain token it-R) and stage B (the gate backward of token
    it-2R). Memory is pipelined: stage A's V and dY rows arrive one iteration ahead (registers), stage B's
    H, k, V, dY rows and the weights are issued at the top of the iteration so that they fly during stage A,
    and stay in registers across the barrier (no reload). The per-thread rings (n, g_u) and the drms_w
    accumulators live in shared memory and move as 16-byte vectors. ``hoist_w`` loads the weights once per
    iteration, with the rows; otherwise each stage loads its slot's weights where it uses them (L1 hits), which
    lowers the register peak (no spills at d=4096 on sm_90a and sm_100a). ``ahead=False`` issues stage A's rows with stage
    B's at the top of their own iteration (8 registers fewer per vector, still one round trip per iteration)."""
    slots, threads = bwd_layout(d, vecs)
    nwarps = threads // 32
    R = taps - 1
    RS = max(R, 1)
    DP = slots * threads * VEC
    EV = slots * VEC
    NPW = 2 + taps if with_dconv else 2
    inv_d = 1.0 / d
    inv_sqrt_d = 1.0 / math.sqrt(d)
    M = T.dynamic("M")
    L = T.dynamic("seq_len")
    NP = T.dynamic("num_parts")
    f32 = "float32"

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
        with T.Kernel(T.ceildiv(L, dilation * chunk), dilation, M, threads=threads) as (bc, br, bm):
            tx = T.get_thread_binding()
            lane = tx % 32
            warp = tx // 32
            ring_n = T.alloc_shared((RS, DP), dtype)
            ring_g = T.alloc_shared((taps, DP), f32)
            accw = T.alloc_shared((2, DP), f32)
            # dconv_w accumulators in shared memory: 32 registers fewer per vector than in registers
            dacc = T.alloc_shared((taps if with_dconv else 1, DP), f32)
            red = T.alloc_shared((2, 4, 32), f32)
            tot = T.alloc_local((4,), f32)
            ps = T.alloc_local((4,), f32)
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
            uu = T.alloc_local((1,), f32)
            nch = T.ceildiv(L, dilation * chunk)
            base = br + dilation * chunk * bc
            for s in T.unroll(slots):
                c0 = (s * threads + tx) * VEC
                for e in T.vectorized(VEC):
                    aw[e] = T.float32(0)
                for p in T.unroll(2):
                    for e in T.vectorized(VEC):
                        accw[p, c0 + e] = aw[e]
                if with_dconv:
                    for p in T.unroll(taps):
                        for e in T.vectorized(VEC):
                            dacc[p, c0 + e] = aw[e]
            # stage A's first rows (the walk starts R chain tokens before the chunk)
            t0 = base - dilation * R
            if ahead and t0 >= 0:
                load_row(nv, V, bm, t0, tx, slots, threads, d)
                load_row(nd, dY, bm, t0, tx, slots, threads, d)
            for it in T.serial(2 * R + chunk):
                tj = base + dilation * (it - R)
                ti = tj - dilation * R
                sj = T.truncmod(it, RS)
                gj = T.truncmod(it, taps)
                if ahead:
                    for e in T.unroll(EV):
                        av[e] = nv[e]
                        ad[e] = nd[e]
                elif tj >= 0 and tj < L:
                    load_row(av, V, bm, tj, tx, slots, threads, d)
                    load_row(ad, dY, bm, tj, tx, slots, threads, d)
                do_b = it >= 2 * R and ti < L
                if do_b:
                    load_row(xa, H, bm, ti, tx, slots, threads, d)
                    load_row(xb, K, bm, ti, tx, slots, threads, d)
                    load_row(xc, V, bm, ti, tx, slots, threads, d)
                    load_row(xd, dY, bm, ti, tx, slots, threads, d)
                tn = tj + dilation
                if ahead and it + 1 < 2 * R + chunk and tn >= 0 and tn < L:  # stage A of the next iteration
                    load_row(nv, V, bm, tn, tx, slots, threads, d)
                    load_row(nd, dY, bm, tn, tx, slots, threads, d)
                if hoist_w:
                    for s in T.unroll(slots):
                        c0 = (s * threads + tx) * VEC
                        if c0 < d:
                            load_bwd_weights(wl, wm, cw, w_h, w_v, conv_w, s, c0, taps, EV)
                # ---- stage A: chain token j = it - R (n history, u, g_u, dconv_w) ----
                if tj < 0:
                    for s in T.unroll(slots):
                        c0 = (s * threads + tx) * VEC
                        for e in T.vectorized(VEC):
                            nn[e] = T.cast(0, dtype)
                        for e in T.vectorized(VEC):
                            ring_n[sj, c0 + e] = nn[e]
                elif tj < L:
                    a = alpha[bm, tj]
                    rv = rr_v[bm, tj]
                    for s in T.unroll(slots):
                        c0 = (s * threads + tx) * VEC
                        if c0 < d:
                            if not hoist_w:
                                load_bwd_weights(wl, wm, cw, w_h, w_v, conv_w, s, c0, taps, EV)
                            for q in T.unroll(1, taps):
                                for e in T.vectorized(VEC):
                                    rn[(q - 1) * VEC + e] = ring_n[T.truncmod(it - q + RS * taps, RS), c0 + e]
                            for e in T.unroll(VEC):
                                nn[e] = T.cast(a * T.cast(av[s * VEC + e], f32) * T.cast(wm[s * VEC + e], f32) * rv,
                                               dtype)
                                uu[0] = T.cast(cw[(taps - 1) * EV + s * VEC + e], f32) * T.cast(nn[e], f32)
                                for q in T.unroll(1, taps):
                                    uu[0] += T.cast(cw[(taps - 1 - q) * EV + s * VEC + e], f32) * T.cast(
                                        rn[(q - 1) * VEC + e], f32
                                    )
                                sg = T.float32(1) / (T.float32(1) + T.exp(-uu[0]))
                                gv[e] = T.cast(ad[s * VEC + e], f32) * (sg * (T.float32(1) + uu[0] * (T.float32(1) - sg)))
                            if with_dconv:
                                if it >= R and it < R + chunk:
                                    for e in T.vectorized(VEC):
                                        aw[e] = dacc[taps - 1, c0 + e]
                                    for e in T.unroll(VEC):
                                        aw[e] += gv[e] * T.cast(nn[e], f32)
                                    for e in T.vectorized(VEC):
                                        dacc[taps - 1, c0 + e] = aw[e]
                                    for q in T.unroll(1, taps):
                                        for e in T.vectorized(VEC):
                                            aw[e] = dacc[taps - 1 - q, c0 + e]
                                        for e in T.unroll(VEC):
                                            aw[e] += gv[e] * T.cast(rn[(q - 1) * VEC + e], f32)
                                        for e in T.vectorized(VEC):
                                            dacc[taps - 1 - q, c0 + e] = aw[e]
                            for e in T.vectorized(VEC):
                                ring_g[gj, c0 + e] = gv[e]
                            for e in T.vectorized(VEC):
                                ring_n[sj, c0 + e] = nn[e]
                else:
                    for s in T.unroll(slots):
                        c0 = (s * threads + tx) * VEC
                        for e in T.vectorized(VEC):
                            gv[e] = T.float32(0)
                        for e in T.vectorized(VEC):
                            ring_g[gj, c0 + e] = gv[e]
                # ---- stage B: token i = it - 2R (norm and gate backward, dH, dk, dv) ----
                if do_b:
                    a = alpha[bm, ti]
                    rh = rr_h[bm, ti]
                    rk = rr_k[bm, ti]
                    rv = rr_v[bm, ti]
                    for q in T.unroll(4):
                        ps[q] = T.float32(0)
                    for s in T.unroll(slots):
                        c0 = (s * threads + tx) * VEC
                        if c0 < d:
                            if not hoist_w:
                                load_bwd_weights(wl, wm, cw, w_h, w_v, conv_w, s, c0, taps, EV)
                            for e in T.unroll(VEC):
                                gn[s * VEC + e] = T.float32(0)
                            for q in T.unroll(taps):
                                for e in T.vectorized(VEC):
                                    gv[e] = ring_g[T.truncmod(it - R + q + taps * taps, taps), c0 + e]
                                for e in T.unroll(VEC):
                                    gn[s * VEC + e] += T.cast(cw[(taps - 1 - q) * EV + s * VEC + e], f32) * gv[e]
                            for e in T.unroll(VEC):
                                vv = T.cast(xc[s * VEC + e], f32)
                                wh = T.cast(wl[s * VEC + e], f32)
                                ps[0] += T.cast(wm[s * VEC + e], f32) * gn[s * VEC + e] * vv
                                ps[1] += vv * vv
                                ps[2] += T.cast(xd[s * VEC + e], f32) * vv
                                ps[3] += T.cast(xa[s * VEC + e], f32) * T.cast(xb[s * VEC + e], f32) * (wh * wh)
                    # CTA-wide sums: lanes, then the warps' partials read by one lane each and summed by the
                    # same shuffle tree (fixed order, identical in every thread); ``red`` is double-buffered,
                    # so one barrier per token suffices.
                    rb = T.truncmod(it, 2)
                    for q in T.unroll(4):
                        ps[q] = T.warp_reduce_sum(ps[q])
                    if lane == 0:
                        for q in T.unroll(4):
                            red[rb, q, warp] = ps[q]
                    T.sync_threads()
                    for q in T.unroll(4):
                        tot[q] = T.if_then_else(lane < nwarps, red[rb, q, lane], T.float32(0))
                    for q in T.unroll(4):
                        tot[q] = T.warp_reduce_sum(tot[q])
                    c1 = rv * rv * rv * (a * tot[0]) * inv_d
                    ga = rv * tot[0] - c1 * a * tot[1] + tot[2]
                    cc = ga * a * (T.float32(1) - a) * inv_sqrt_d * rh * rk
                    ch = rh * rh * tot[3] * inv_d
                    ck = rk * rk * tot[3] * inv_d
                    for s in T.unroll(slots):
                        c0 = (s * threads + tx) * VEC
                        if c0 < d:
                            for p in T.unroll(2):
                                for e in T.vectorized(VEC):
                                    aw[e] = accw[p, c0 + e]
                                for e in T.unroll(VEC):
                                    hv = T.cast(xa[s * VEC + e], f32)
                                    kv = T.cast(xb[s * VEC + e], f32)
                                    vh = a * T.cast(xc[s * VEC + e], f32)
                                    if p == 0:
                                        aw[e] += cc * hv * kv
                                    else:
                                        aw[e] += gn[s * VEC + e] * vh * rv
                                for e in T.vectorized(VEC):
                                    accw[p, c0 + e] = aw[e]
                            for e in T.unroll(VEC):
                                hv = T.cast(xa[s * VEC + e], f32)
                                kv = T.cast(xb[s * VEC + e], f32)
                                vh = a * T.cast(xc[s * VEC + e], f32)
                                wh = T.cast(wl[s * VEC + e], f32)
                                g = gn[s * VEC + e]
                                gvh = rv * T.cast(wm[s * VEC + e], f32) * g - c1 * vh + T.cast(xd[s * VEC + e], f32)
                                oc[e] = T.cast(a * gvh, dtype)
                                oa[e] = T.cast(cc * (wh * wh * kv - ch * hv), dtype)
                                ob[e] = T.cast(cc * (wh * wh * hv - ck * kv), dtype)
                            for e in T.vectorized(VEC):
                                dH[bm, ti, c0 + e] = oa[e]
                            for e in T.vectorized(VEC):
                                dK[bm, ti, c0 + e] = ob[e]
                            for e in T.vectorized(VEC):
                                dV[bm, ti, c0 + e] = oc[e]
            pid = (bm * dilation + br) * nch + bc
            for s in T.unroll(slots):
                c0 = (s * threads + tx) * VEC
                if c0 < d:
                    for p in T.unroll(2):
                        for e in T.vectorized(VEC):
                            part[pid, p, c0 + e] = accw[p, c0 + e]
                    if with_dconv:
                        for p in T.unroll(taps):
                            for e in T.vectorized(VEC):
                                part[pid, 2 + p, c0 + e] = dacc[p, c0 + e]

    return main


@kernel
def gate_conv_dconv_kernel(dtype: str, d: int, taps: int, dilation: int, chunk: int, threads: int = 128,
                           min_blocks: int = 4):
    """dconv_w partial sums for rows too wide to fuse them into the backward: CTAs own 8*threads columns
    of one chain chunk, recompute n, u and g_u column by column (no row reductions) and write
    ``part[cta, p, :] = sum_t g_u[t] * n[t - (taps-1-p)*dilation]`` for their columns. Each thread's next
    V and dY vectors are loaded one token ahead, so a load is always in flight behind the serial chain; the
    chunk (independent of the main kernel's) sets the grid: 128 tokens give one wave at d=7168 with
    ``min_blocks`` CTAs per SM (a register cap)."""
    R = taps - 1
    RS = max(R, 1)
    NCB = ceil_div(d, VEC * threads)
    M = T.dynamic("M")
    L = T.dynamic("seq_len")
    NP = T.dynamic("num_parts")
    f32 = "float32"

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
        with T.Kernel(NCB * T.ceildiv(L, dilation * chunk), dilation, M, threads=threads) as (bx, br, bm):
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
            nn = T.alloc_local((VEC,), f32)
            uu = T.alloc_local((1,), f32)
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
                        for e in T.unroll(VEC):
                            nn[e] = T.cast(T.cast(a * T.cast(xc[e], f32) * T.cast(wm[e], f32) * rv, dtype), f32)
                            uu[0] = T.cast(cw[(taps - 1) * VEC + e], f32) * nn[e]
                            for q in T.unroll(1, taps):
                                uu[0] += T.cast(cw[(taps - 1 - q) * VEC + e], f32) * T.cast(ring[(q - 1) * VEC + e], f32)
                            sg = T.float32(1) / (T.float32(1) + T.exp(-uu[0]))
                            gu = T.cast(xd[e], f32) * (sg * (T.float32(1) + uu[0] * (T.float32(1) - sg)))
                            if it >= R:
                                acc[(taps - 1) * VEC + e] += gu * nn[e]
                                for q in T.unroll(1, taps):
                                    acc[(taps - 1 - q) * VEC + e] += gu * T.cast(ring[(q - 1) * VEC + e], f32)
                    # shift the history (ring[q-1] holds the chain token q steps back); zeros before t = 0
                    for q in T.unroll(R - 1):
                        for e in T.unroll(VEC):
                            ring[(R - 1 - q) * VEC + e] = ring[(R - 2 - q) * VEC + e]
                    if R > 0:
                        for e in T.unroll(VEC):
                            ring[e] = T.if_then_else(tj >= 0 and tj < L, T.cast(nn[e], dtype), T.cast(0, dtype))
                pid = (bm * dilation + br) * nch + bc
                for p in T.unroll(taps):
                    for e in T.vectorized(VEC):
                        part[pid, p, c0 + e] = acc[p * VEC + e]

    return main
