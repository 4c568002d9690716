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

Kernels (two launches): one tensor-core projection for both weights (W read once for up to 64 rows per CTA
column panel; d_mem split into float32 partials so that the grid fills the GPU at small batch), then a
cluster of ``STEP_CLUSTER`` CTAs per row that sums the partials in a fixed order (deterministic), exchanges
the row sums through a small global scratch across a cluster barrier and does the gate, convolution and
cache update. Runtime: batch, L, positions, eps.

Roofline bytes (e = element size; the benchmark's ``bytes``):
    2*d_mem*d*e (W_K, W_V) + B*d_mem*e (e_t) + B*d*e (h_t) + B*d*e (y) + B*w*d*e (w-1 cache reads + 1 write)
    + (2 + w)*d*e (weights) + 4*B (positions)
The float32 partials of k and v (splits*2*B*d*4, written and read once, mostly in L2) are not counted.
"""

import math

import tilelang.language as T
import torch
from tvm import tirx

from tk_core import checks
from tk_core.jit import kernel
from tk_core.layout import ceil_div
from tk_core.library import device_op

from . import reference
from ._gate_conv_kernels import VEC, add_row_sums
from .gate_conv import _CPU_DTYPES, _TL_DTYPES, _aligned, _check_params, _check_target, _resolve_target

# CTAs per batch row in the step kernel (a thread block cluster): 8 SMs instead of 1 load a row at small batch.
STEP_CLUSTER = 8
_SMS = 132  # H100 / H200 SXM; the grid heuristics below only need the order of magnitude


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
    inv_d = 1.0 / d
    inv_sqrt_d = 1.0 / math.sqrt(d)
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
        with T.Kernel(cluster, B, threads=threads, cluster_dims=(cluster, 1, 1) if cluster > 1 else None) as (
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
                T.evaluate(tirx.call_intrin("void", tirx.op.Op.get("tl.cluster_sync")))
                for q in T.unroll(4):
                    part[q] = T.float32(0)
                for r in T.unroll(cluster):
                    for q in T.vectorized(4):
                        sv[q] = S[bb, r, q]
                    for q in T.unroll(4):
                        part[q] += sv[q]
            r_h = T.rsqrt(part[0] * inv_d + eps)
            r_k = T.rsqrt(part[1] * inv_d + eps)
            sc = r_h * r_k * part[2] * inv_sqrt_d
            a = T.float32(1) / (T.float32(1) + T.exp(-sc))
            r_v = T.rsqrt(a * a * (part[3] * inv_d) + eps)
            for s in T.unroll(slots):
                c0 = (br * vpc + s * threads + tx) * VEC
                if s * threads + tx < vpc and c0 < d:
                    for e in T.unroll(VEC):
                        no[e] = T.cast(a * vf[s * VEC + e] * T.cast(wv[s * VEC + e], f32) * r_v, dtype)
                        uu[e] = T.cast(cw[(s * taps + taps - 1) * VEC + e], f32) * T.cast(no[e], f32)
                    for q in T.unroll(R):
                        for e in T.unroll(VEC):
                            uu[e] += (T.cast(cw[(s * taps + taps - 2 - q) * VEC + e], f32)
                                      * T.cast(st[(s * R + q) * VEC + e], f32))
                    for e in T.unroll(VEC):
                        vh = a * vf[s * VEC + e]
                        yo[e] = T.cast(uu[e] / (T.float32(1) + T.exp(-uu[e])) + vh, dtype)
                    for e in T.vectorized(VEC):
                        Y[bb, c0 + e] = yo[e]
                    if R > 0:
                        for e in T.vectorized(VEC):
                            state[bb, rp, c0 + e] = no[e]

    return main


def decode_roofline_bytes(B: int, d_mem: int, d: int, taps: int, elem: int = 2) -> int:
    """Bytes one decode step must move (module docstring); 2*d_mem*d*elem of them are W_K and W_V."""
    return (2 * d_mem * d + B * d_mem + 2 * B * d + B * taps * d + (2 + taps) * d) * elem + 4 * B


def init_decode_state(batch: int, d: int, conv_kernel_size: int = 4, dilation: int = 1, *,
                      dtype=torch.bfloat16, device=None):
    """An empty decode history: (zero cache (batch, dilation*(w-1), d), cache_pos zeros (batch,) int32)."""
    hist = dilation * (conv_kernel_size - 1)
    return (torch.zeros((batch, hist, d), dtype=dtype, device=device),
            torch.zeros((batch,), dtype=torch.int32, device=device))


@device_op("tk_engram::decode_step", mutates_args=("conv_state", "part", "sums", "y"))
def _decode_dev(
    e_t: torch.Tensor, h_t: torch.Tensor, conv_state: torch.Tensor, cache_pos: torch.Tensor, W_K: torch.Tensor,
    W_V: torch.Tensor, rms_w_h: torch.Tensor, rms_w_v: torch.Tensor, conv_w: torch.Tensor, part: torch.Tensor,
    sums: torch.Tensor, y: torch.Tensor, dilation: int, eps: float,
) -> None:
    dt = _TL_DTYPES[h_t.dtype]
    (B, d), d_mem = h_t.shape, e_t.shape[1]
    cfg = proj_config(B, d_mem, d)
    proj = decode_proj_kernel.get(h_t.device, dtype=dt, d_mem=d_mem, d=d, **cfg)
    proj(e_t, W_K, W_V, part)
    step = decode_step_kernel.get(h_t.device, dtype=dt, d=d, taps=conv_w.shape[0], dilation=dilation,
                                  splits=cfg["splits"], cluster=STEP_CLUSTER)
    step(h_t, part, rms_w_h, rms_w_v, conv_w, conv_state, cache_pos, y, sums, eps)


def engram_decode_step(e_t, h_t, conv_state, cache_pos, W_K, W_V, rms_w_h, rms_w_v, conv_w, *,
                       dilation: int = 1, eps: float = 1e-6):
    """One fused Engram decode step (module docstring): returns y (B, d) and writes n into ``conv_state``.

    e_t (B, d_mem), h_t (B, d), W_K/W_V (d_mem, d), rms_w_* (d,), conv_w (w, d), conv_state (B, L, d)
    with L >= dilation*(w-1), all of one dtype (fp16/bf16; CPU also fp32/fp64); cache_pos (B,) int32 >= 0.
    On CUDA d and d_mem must be multiples of 8 and conv_state contiguous (it is updated in place).
    """
    op = "engram_decode_step"
    _check_params(op, conv_w.shape[0] if isinstance(conv_w, torch.Tensor) else 1, dilation, eps)
    checks.check_tensor(op, "h_t", h_t)
    allowed = tuple(_TL_DTYPES) if h_t.is_cuda else _CPU_DTYPES
    checks.check_dtype(op, "h_t", h_t, allowed)
    checks.check_ndim(op, "h_t", h_t, 2)
    B, d = h_t.shape
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
    if not h_t.is_cuda:
        return reference.decode_step_ref(e_t, h_t, conv_state, cache_pos, W_K, W_V, rms_w_h, rms_w_v, conv_w,
                                         dilation, float(eps))
    checks.check_divisible(op, "d (the last dimension of h_t)", d, 8)
    checks.check_divisible(op, "d_mem (the last dimension of e_t)", d_mem, 8)
    if not conv_state.is_contiguous() or (not torch.compiler.is_compiling() and conv_state.data_ptr() % 16):
        checks.fail(op, "conv_state", "contiguous and 16-byte aligned (updated in place)",
                    f"strides {tuple(conv_state.stride())}")
    y = torch.empty((B, d), dtype=h_t.dtype, device=h_t.device)
    if B == 0:
        return y
    part = torch.empty((proj_config(B, d_mem, d)["splits"], 2, B, d), dtype=torch.float32, device=h_t.device)
    sums = torch.empty((B, 8, 4), dtype=torch.float32, device=h_t.device)
    _decode_dev(_aligned(e_t), _aligned(h_t), conv_state, _aligned(cache_pos), _aligned(W_K), _aligned(W_V),
                _aligned(rms_w_h), _aligned(rms_w_v), _aligned(conv_w), part, sums, y, dilation, float(eps))
    return y


class EngramDecodeFwdOp:
    """``EngramDecodeFwdOp(conv_kernel_size=4, dilation=1, eps=1e-6, target=None)(e_t, h_t, conv_state,
    cache_pos, W_K, W_V, rms_w_h, rms_w_v, conv_w, advance=True) -> y``; updates ``conv_state`` in place and,
    with ``advance``, increments ``cache_pos``. target as for ``EngramGateConvFwdOp``."""

    def __init__(self, conv_kernel_size: int = 4, dilation: int = 1, eps: float = 1e-6, *, target=None):
        op = type(self).__name__
        _check_params(op, conv_kernel_size, dilation, eps)
        _check_target(op, target)
        self.conv_kernel_size, self.dilation, self.eps, self.target = conv_kernel_size, dilation, float(eps), target

    def init_state(self, batch: int, d: int, *, dtype=torch.bfloat16, device=None):
        return init_decode_state(batch, d, self.conv_kernel_size, self.dilation, dtype=dtype, device=device)

    def __call__(self, e_t, h_t, conv_state, cache_pos, W_K, W_V, rms_w_h, rms_w_v, conv_w, advance: bool = True):
        op = type(self).__name__
        if isinstance(conv_w, torch.Tensor) and conv_w.shape[0] != self.conv_kernel_size:
            checks.fail(op, "conv_w", f"of shape ({self.conv_kernel_size}, d)", f"shape {tuple(conv_w.shape)}")
        args = (e_t, h_t, conv_state, cache_pos, W_K, W_V, rms_w_h, rms_w_v, conv_w)
        if _resolve_target(op, self.target, h_t) or self.target is None:
            y = engram_decode_step(*args, dilation=self.dilation, eps=self.eps)
        else:
            y = reference.decode_step_ref(*args, self.dilation, self.eps)
        if advance:
            cache_pos.add_(1)
        return y
