"""Engram GateConv forward and backward (TileOPs ``EngramGateConvFwdOp`` / ``EngramGateConvBwdOp`` contract,
extended with dilation, any tap count, a prefill->decode conv state and an autograd Function).

Math, per sequence row m and token t (vectors in R^d, float32 arithmetic, T = storage dtype fp16/bf16):

    r_h = (mean_j H_j^2 + eps)^-1/2        r_k = (mean_j k_j^2 + eps)^-1/2     (the mean divides by the true d)
    s   = r_h r_k sum_j H_j k_j w_h,j^2 / sqrt(d),   alpha = sigmoid(s)        (one rms_w_h for query and key)
    vhat = alpha * v (float32; saved rounded to T)   r_v = (alpha^2 mean_j v_j^2 + eps)^-1/2
    n_t = round_T(vhat * w_v * r_v)                  (the normalised value; what the conv and the cache see)
    u_t = sum_{p<w} conv_w[p] * n_{t-(w-1-p)*dilation}   (n_tau = 0 for tau < 0: causal, dilated, depthwise)
    Y_t = round_T(SiLU(u_t) + vhat_t)

Forward outputs: Y, vhat (M, T, d) in T; alpha, rrms_h, rrms_k, rrms_v (M, T) float32; conv_state
(M, dilation*(w-1), d) in T: the ring cache of n, slot (tau mod len) holding token tau of the last
dilation*(w-1) tokens (zeros for tau < 0), ready for ``decode.engram_decode_step`` at ``cache_pos = T``.

Backward (closed form of the above, rounding treated as identity; G = dY):
    g_u = G * sigma(u) * (1 + u (1 - sigma(u)))        g_n,t = sum_p conv_w[p] * g_u,{t+(w-1-p)*dilation}
    B = <w_v g_n, v>, C = <v, v>, D = <G, v>, P = <H k, w_h^2>          (one CTA-wide reduction per token)
    c1 = r_v^3 alpha B / d;  g_vhat = r_v w_v g_n - c1 vhat + G;  dv = alpha g_vhat
    g_alpha = r_v B - c1 alpha C + D;  c = g_alpha alpha (1 - alpha) r_h r_k / sqrt(d)
    dH = c (w_h^2 k - r_h^2 P/d H);  dk = c (w_h^2 H - r_k^2 P/d k)
    drms_w_h = 2 w_h sum_{m,t} c H k;  drms_w_v = sum g_n vhat r_v;  dconv_w[p] = sum g_u,t n_{t-(w-1-p)*dilation}
vhat is recomputed from v and alpha (not read). Weight gradients are float32, reduced from per-CTA partials in
a fixed order: deterministic, no atomics.

Shapes and errors: H, k, v (M, T, d) of one dtype (fp16/bf16 on CUDA; CPU also float32/float64, which run
the reference); d >= 1, d % 8 == 0 on CUDA (16-byte vectors); weights in H's dtype; conv_w (w, d) with w >= 1;
dilation >= 1; eps finite and >= 0. Violations raise TypeError (types, dtypes) or ValueError (shape, device,
parameters) naming the op and the argument. M*T == 0 returns empty outputs (and an all-zero state) without a
launch.

Kernels (``_gate_conv_kernels``): one CTA walks consecutive tokens of one residue chain (t mod dilation) of
one row (32 in the forward, at 2 CTAs per SM; 64 in the backward) with whole d-rows per CTA and 16-byte
vectors; the conv history lives in shared memory per thread column. In the backward, rows of 4096 < d <= 16384
(d % 16 == 0) go to a cluster of 2 CTAs per 128-token chunk, each CTA half of the columns, the per-token row
sums exchanged through distributed shared memory.
Numerics: float32 arithmetic (row sums in a fixed tree order); the forward's SiLU (and the sigmoid of g_u in the
backward's clusters) comes from the hardware's approximate exp2 and reciprocal (relative error < 2**-17 for
|u| < 64), so the outputs match the reference to about the rounding of T, not bit for bit. Runs are bitwise
reproducible.
Forward: 1 launch; backward: 1 launch (+1 column-split dconv launch where a CTA holds more than 4096 columns) +
fixed-order sums. The backward's rings fill shared memory: rows it cannot hold (4 taps: d > 16,384, or d > 10,240
without 16-byte halves; ``bwd_fits``) run the reference on the GPU (same outputs to the test tolerances,
deterministic, slower); so does the forward above d = 38,400 at 4 taps, or from 30 taps at d = 4096 (``fwd_fits``:
its n ring of taps - 1 rows).
Runtime (no recompile): M, T, eps. Compile-time: dtype, d, w, dilation.

Roofline bytes (e = element size, N = M*T tokens; the benchmark's ``bytes``):
    forward  = N*d*e*(3 reads H,k,v + 2 writes Y,vhat) + 16*N (4 float32 stats) + 3*d*e + w*d*e
    backward = N*d*e*(4 reads dY,H,k,v + 3 writes dH,dk,dv) + 16*N + (2 + w)*d*(e + 4)
Halo re-reads (w-1 chain tokens per 32 in the forward, per 64 or 128 in the backward) and the per-CTA
partials are not counted.
"""

import torch

from tk_core import checks
from tk_core.jit import arch_of
from tk_core.layout import vector_aligned
from tk_core.library import device_op

from . import reference
from ._gate_conv_kernels import (
    bwd_fits,
    bwd_half_vecs,
    bwd_split,
    fuse_dconv,
    fwd_fits,
    gate_conv_bwd_kernel,
    gate_conv_dconv_kernel,
    gate_conv_fwd_kernel,
)

CHUNK = 64  # chain tokens per CTA in the backward
# Forward: 32 tokens x 2 vectors per thread gives 256 CTAs of 256/448 threads at 8192 tokens, 2 per SM. The
# per-token work is a serial chain (loads, two-level reduction, barrier): halving each thread's share of it
# beat 4 vectors by 5-28 % on the H200 (chunk 16 or 64 lose to halo reads or too few CTAs). A cp.async ring
# with the next 1-3 tokens' rows in flight measured no better (0.60 against 0.56 of copy at d=4096, 0.48-0.55
# against 0.59 at d=7168): then the per-token instruction count, not latency, bound it (no longer since the
# approximate SiLU: ncu in PERF-NOTES session 10, so the ring is worth measuring again). The kernel's defaults cut
# that count: 74 KB of float32 weights and ring in shared memory, and SiLU from ex2/rcp.approx (session 10: 0.761 /
# 0.731 / 0.727 -> 0.80 / 0.82 / 0.83 of copy at d=4096 / 7168 / 7168 dilation 3; the precise SiLU had been 1-2 %
# faster with ``tk_div_fast`` than with the IEEE division). On the H200 a 100 KB budget was 5-13 % slower (less L1
# left for the weights read from global memory; with the approximate SiLU: 90 KB 1 %, 100 KB up to 9 %, 3 or 4
# vectors per thread 3-23 %, 1 vector per thread 0-21 % slower), a token loop unrolled by 2 (no copy of the
# prefetched rows) 15 % slower at d=4096 and spilling at d=7168, and 4 vectors per thread slower again. The halo
# tokens skip the convolution and SiLU (the same bits, about 4 % fewer instructions, no spill left at d=7168 on
# sm_90a): 0.744 / 0.733 / 0.731 of copy on the H200 at d=4096 / 7168 / 7168 dilation 3 against 0.742 / 0.726 / 0.722.
# Two tokens per iteration (one barrier per pair) was slower: 0.680 / 0.362 / 0.363 (0.519 / 0.636 / 0.639 at 1 CTA
# per SM).
FWD_PARAMS = dict(chunk=32, vecs=2, min_blocks=2)
# Backward main kernel, 1 CTA per SM (the rings fill shared memory), keyed by whether dconv_w is accumulated in it
# (``fuse_dconv`` of the columns per CTA). Fused (up to 4096 columns per CTA: d <= 4096, and 4096 < d <= 8192 through
# the 2-CTA cluster of ``bwd_split``): 1 vector per thread, the float32 shared rows in two planes (no bank conflicts:
# 309 -> 261 us at d=4096, sweep_gate_conv_bwd_s6.log). The cluster took d=7168 from 675 to 510 us on the H200,
# 0.288 -> 0.382 of copy (sweep_gate_conv_bwd_s7.log). Other wide rows: 2 vectors per thread (448 threads at d=7168
# measured 0.288 / 0.279 of copy at dilation 1 / 3 against 0.268 / 0.271 with 1 vector and 896 threads, whose
# 72-register cap spills), contiguous rows (the planes measured 6 % slower there) and the dconv kernel; cluster halves
# wider than 4096 columns (8192 < d <= 16384) take ``bwd_half_vecs`` vectors instead (H100, 8192 tokens: d = 9216
# 2,549 -> 935 us against one CTA per chunk, d = 12288 / 16384 1,118 / 1,845 us against 26.9 / 35.7 ms for the
# reference that ran there before; sweeps/sweep_gate_conv_bwd_wide_s38.log). Both: stage
# A's rows and statistics one iteration ahead (the statistics: 0.470 -> 0.489 of copy at d=4096 on the H200), the
# weights in registers for the whole walk where that does not spill (``RESIDENT_W_ARCHS``), else loaded where each
# stage uses them.
BWD_PARAMS = {
    True: dict(vecs=1, ahead=True, planes=True),
    False: dict(vecs=2, ahead=True, planes=False),
}
# Archs whose fused backward keeps the weights in registers (``resident_w``) without spilling: on sm_100a the
# same kernels spill 8-36 bytes at the 128-register cap (1 CTA of 512 / 448 threads per SM), and their speed there
# is unmeasured.
RESIDENT_W_ARCHS = ("sm_90a",)
# dconv kernel (wide rows without the fused path): 128 tokens x 128 threads at 4 CTAs/SM (one wave at d=7168, 8192
# tokens, where it ran before the cluster).
DCONV_PARAMS = dict(chunk=128, threads=128, min_blocks=4)


def bwd_config(d: int, arch: str) -> dict:
    """The backward main kernel's parameters for rows of ``d`` columns: ``split`` CTAs (a cluster) per chain chunk
    (``bwd_split``: 2 for 4096 < d <= 16384), then ``BWD_PARAMS`` by whether dconv_w is accumulated in the main
    kernel (``with_dconv``; otherwise ``gate_conv_dconv_kernel`` runs after it; cluster halves wider than 4096
    columns take ``bwd_half_vecs`` vectors per thread). The cluster kernels take the
    approximate sigmoid (``approx_sigmoid``: 0.381 -> 0.400 of copy at d=7168 on the H200; at d=4096 it measured
    1.4 % slower, so the single-CTA kernels keep the precise one). A cluster walks ``2 * CHUNK``
    tokens, so that at 8192 tokens the clusters fill one wave as single CTAs of ``CHUNK`` tokens do (the H200 at
    d=7168: 544 us against 561 at 64 tokens and 597 at 32 per cluster; run 1 of sweep_gate_conv_bwd_s7.log).
    ``arch`` (of the device) picks whether the fused kernels keep the weights in registers (``RESIDENT_W_ARCHS``).
    ``idx32``: int32 element offsets where the tensors allow it (the launch clears it from 2**31 elements)."""
    split = bwd_split(d)
    fused = fuse_dconv(d // split)
    cfg = dict(chunk=CHUNK * split, split=split, with_dconv=fused, approx_sigmoid=split > 1, idx32=True,
               **bwd_params(fused, arch))
    if split > 1 and not fused:  # halves wider than 4096 columns
        cfg["vecs"] = bwd_half_vecs(d // split)
    return cfg


def bwd_params(fused: bool, arch: str) -> dict:
    """``BWD_PARAMS[fused]`` with ``resident_w`` for ``arch``: the fused kernels keep the weights in registers on
    ``RESIDENT_W_ARCHS``."""
    return dict(BWD_PARAMS[fused], resident_w=fused and arch in RESIDENT_W_ARCHS)


_TL_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
_CPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def fwd_roofline_bytes(M: int, T: int, d: int, taps: int, elem: int = 2) -> int:
    """Bytes the forward must move (module docstring): 3 reads + 2 writes of (M,T,d), 4 float32 stats, weights."""
    N = M * T
    return N * d * elem * 5 + 16 * N + (2 + taps) * d * elem


def bwd_roofline_bytes(M: int, T: int, d: int, taps: int, elem: int = 2) -> int:
    """Bytes the backward must move: 4 reads + 3 writes of (M,T,d), 4 float32 stats, weights and their grads."""
    N = M * T
    return N * d * elem * 7 + 16 * N + (2 + taps) * d * (elem + 4)


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """x, contiguous and 16-byte aligned (the kernels use 16-byte vectors); copies only when needed."""
    return vector_aligned(x.contiguous())


def _num_parts(M: int, T: int, dilation: int, chunk: int = CHUNK) -> int:
    return M * dilation * (-(-T // (dilation * chunk)))


def _check_dilation(op: str, dilation: int) -> None:
    checks.check_positive_int(op, "dilation", dilation)
    checks.check_grid_extent(op, "dilation", dilation)


def _check_params(op: str, conv_kernel_size: int, dilation: int, eps: float) -> float:
    """Checks an op object's hyperparameters; returns eps as a float."""
    checks.check_positive_int(op, "conv_kernel_size", conv_kernel_size)
    _check_dilation(op, dilation)
    return checks.check_float(op, "eps", eps)


def _check_inputs(op: str, names, seqs, weights, conv_w, use_reference: bool):
    """Checks (M, T, d) activations of one dtype/device (like the first, ``names[0]``) and the (d,) and (w, d)
    weights, for the kernel on CUDA tensors unless ``use_reference``, else for the reference; returns (M, T, d)."""
    x0 = seqs[0]
    checks.check_tensor(op, names[0], x0)
    kernel = x0.is_cuda and not use_reference
    allowed = tuple(_TL_DTYPES) if kernel else _CPU_DTYPES
    for name, x in zip(names, seqs, strict=False):
        checks.check_dtype(op, name, x, allowed)
        checks.check_ndim(op, name, x, 3)
    M, T, d = x0.shape
    for name, x in zip(names, seqs, strict=False):
        if x.dtype != x0.dtype:
            checks.fail(op, name, f"of dtype {x0.dtype} like {names[0]}", x.dtype, TypeError)
        checks.check_shape(op, name, x, (M, T, d))
        checks.check_same_device(op, name, x, x0.device)
    if d == 0:  # the RMS statistics would divide by zero
        checks.fail(op, names[0], "of shape (M, T, d) with d >= 1", f"shape {tuple(x0.shape)}")
    for name, x in weights:
        checks.check_dtype(op, name, x, (x0.dtype,))
        checks.check_shape(op, name, x, (d,))
        checks.check_same_device(op, name, x, x0.device)
    checks.check_dtype(op, "conv_w", conv_w, (x0.dtype,))
    checks.check_ndim(op, "conv_w", conv_w, 2)
    checks.check_shape(op, "conv_w", conv_w, (None, d))
    checks.check_same_device(op, "conv_w", conv_w, x0.device)
    if conv_w.shape[0] < 1:
        checks.fail(op, "conv_w", "of shape (w >= 1, d)", f"shape {tuple(conv_w.shape)}")
    if kernel:
        checks.check_divisible(op, "d (the last dimension of H)", d, 8)
        checks.check_grid_extent(op, names[0], M, "sequences (dimension 0)", f"shape {tuple(x0.shape)}")
    return M, T, d


# ----------------------------------------------------------------------------------------------- forward
@device_op(
    "tk_engram::gate_conv_fwd",
    mutates_args=("y", "vhat", "alpha", "rrms_h", "rrms_k", "rrms_v", "state"),
)
def _gate_conv_fwd_dev(
    H: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rms_w_h: torch.Tensor, rms_w_v: torch.Tensor,
    conv_w: torch.Tensor, y: torch.Tensor, vhat: torch.Tensor, alpha: torch.Tensor, rrms_h: torch.Tensor,
    rrms_k: torch.Tensor, rrms_v: torch.Tensor, state: torch.Tensor, dilation: int, eps: float,
) -> None:
    kern = gate_conv_fwd_kernel.get(
        H.device, dtype=_TL_DTYPES[H.dtype], d=H.shape[2], taps=conv_w.shape[0], dilation=dilation, **FWD_PARAMS
    )
    kern(H, k, v, rms_w_h, rms_w_v, conv_w, y, vhat, alpha, rrms_h, rrms_k, rrms_v, state, eps)


def engram_gate_conv_fwd(H, k, v, rms_w_h, rms_w_v, conv_w, *, dilation: int = 1, eps: float = 1e-6,
                         use_reference: bool = False):
    """GateConv forward (see the module docstring for the math).

    Args: H, k, v (M, T, d) fp16/bf16 (CPU: also fp32/fp64); rms_w_h, rms_w_v (d,); conv_w (w, d), tap p
    looking back (w-1-p)*dilation tokens; dilation >= 1; eps >= 0 (finite).
    Returns (Y, vhat, alpha, rrms_h, rrms_k, rrms_v, conv_state) as described in the module docstring.
    CUDA tensors run the TileLang kernel, CPU tensors the reference; ``use_reference`` runs the reference on
    any device (with the CPU's dtype rules; the op objects' target='torch').
    """
    op = "engram_gate_conv_fwd"
    checks.check_bool(op, "use_reference", use_reference)
    _check_dilation(op, dilation)
    eps = checks.check_float(op, "eps", eps)
    M, T, d = _check_inputs(op, ("H", "k", "v"), (H, k, v), (("rms_w_h", rms_w_h), ("rms_w_v", rms_w_v)), conv_w,
                            use_reference)
    if use_reference or not H.is_cuda:
        return reference.gate_conv_fwd_ref(H, k, v, rms_w_h, rms_w_v, conv_w, dilation, eps)
    taps = conv_w.shape[0]
    if not fwd_fits(d, taps, FWD_PARAMS["vecs"]):  # the n ring of taps - 1 rows would not fit in shared memory
        return reference.gate_conv_fwd_ref(H, k, v, rms_w_h, rms_w_v, conv_w, dilation, eps)
    hist = dilation * (taps - 1)
    dev = H.device
    y = torch.empty((M, T, d), dtype=H.dtype, device=dev)
    vhat = torch.empty_like(y)
    stats = [torch.empty((M, T), dtype=torch.float32, device=dev) for _ in range(4)]
    if M * T == 0:
        return y, vhat, stats[0], stats[1], stats[2], stats[3], torch.zeros((M, hist, d), dtype=H.dtype, device=dev)
    state = torch.empty((M, max(hist, 1), d), dtype=H.dtype, device=dev)
    _gate_conv_fwd_dev(
        _aligned(H), _aligned(k), _aligned(v), _aligned(rms_w_h), _aligned(rms_w_v), _aligned(conv_w),
        y, vhat, stats[0], stats[1], stats[2], stats[3], state, dilation, eps,
    )
    return y, vhat, stats[0], stats[1], stats[2], stats[3], state[:, :hist]


# ---------------------------------------------------------------------------------------------- backward
@device_op("tk_engram::gate_conv_bwd", mutates_args=("dH", "dk", "dv", "part", "dpart"))
def _gate_conv_bwd_dev(
    dY: torch.Tensor, H: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rms_w_h: torch.Tensor,
    rms_w_v: torch.Tensor, conv_w: torch.Tensor, alpha: torch.Tensor, rrms_h: torch.Tensor,
    rrms_k: torch.Tensor, rrms_v: torch.Tensor, dH: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
    part: torch.Tensor, dpart: torch.Tensor, dilation: int,
) -> None:
    d, taps = H.shape[2], conv_w.shape[0]
    cfg = bwd_config(d, arch_of(H.device))
    cfg["idx32"] = cfg["idx32"] and H.numel() < 2**31  # int32 element offsets (``bwd_config``)
    params = dict(dtype=_TL_DTYPES[H.dtype], d=d, taps=taps, dilation=dilation)
    gate_conv_bwd_kernel.get(H.device, **cfg, **params)(
        dY, H, k, v, rms_w_h, rms_w_v, conv_w, alpha, rrms_h, rrms_k, rrms_v, dH, dk, dv, part
    )
    if not cfg["with_dconv"]:
        gate_conv_dconv_kernel.get(H.device, **DCONV_PARAMS, **params)(dY, v, rms_w_v, conv_w, alpha, rrms_v, dpart)


def engram_gate_conv_bwd(dY, H, k, v, rms_w_h, rms_w_v, conv_w, alpha, rrms_h, rrms_k, rrms_v, *,
                         dilation: int = 1, use_reference: bool = False):
    """GateConv backward from the forward's saved statistics (module docstring for the formulas).

    Args: dY, H, k, v (M, T, d); the weights as in the forward; alpha, rrms_h, rrms_k, rrms_v (M, T) float32
    (float64 with float64 inputs on CPU). Returns (dH, dk, dv) in H's dtype and (drms_w_h, drms_w_v, dconv_w)
    in float32, deterministic (fixed-order reductions). CUDA tensors run the kernel, CPU the reference;
    ``use_reference`` as in the forward.
    """
    op = "engram_gate_conv_bwd"
    checks.check_bool(op, "use_reference", use_reference)
    _check_dilation(op, dilation)
    M, T, d = _check_inputs(
        op, ("H", "dY", "k", "v"), (H, dY, k, v), (("rms_w_h", rms_w_h), ("rms_w_v", rms_w_v)), conv_w,
        use_reference,
    )
    kernel = H.is_cuda and not use_reference
    sdt = (torch.float32,) if kernel else (torch.float32, torch.float64)
    for name, x in (("alpha", alpha), ("rrms_h", rrms_h), ("rrms_k", rrms_k), ("rrms_v", rrms_v)):
        checks.check_dtype(op, name, x, sdt)
        checks.check_shape(op, name, x, (M, T))
        checks.check_same_device(op, name, x, H.device)
    if not kernel:
        return reference.gate_conv_bwd_ref(dY, H, k, v, rms_w_h, rms_w_v, conv_w, alpha, rrms_h, rrms_k,
                                           rrms_v, dilation)
    taps = conv_w.shape[0]
    dev = H.device
    dH = torch.empty((M, T, d), dtype=H.dtype, device=dev)
    dk = torch.empty_like(dH)
    dv = torch.empty_like(dH)
    if M * T == 0:
        z = torch.zeros((2 + taps, d), dtype=torch.float32, device=dev)
        return dH, dk, dv, z[0], z[1], z[2:]
    cfg = bwd_config(d, arch_of(H.device))
    fused = cfg["with_dconv"]
    if not bwd_fits(d // cfg["split"], taps, cfg["vecs"]):  # rows too wide for the kernel's shared-memory rings
        return reference.gate_conv_bwd_ref(dY, H, k, v, rms_w_h, rms_w_v, conv_w, alpha, rrms_h, rrms_k, rrms_v,
                                           dilation)
    nparts = _num_parts(M, T, dilation, cfg["chunk"])
    part = torch.empty((nparts, 2 + taps if fused else 2, d), dtype=torch.float32, device=dev)
    dparts = _num_parts(M, T, dilation, DCONV_PARAMS["chunk"])
    dpart = torch.empty((dparts, taps, d) if not fused else (1, 1, 1), dtype=torch.float32, device=dev)
    a = [_aligned(x) for x in (dY, H, k, v, rms_w_h, rms_w_v, conv_w, alpha, rrms_h, rrms_k, rrms_v)]
    _gate_conv_bwd_dev(*a, dH, dk, dv, part, dpart, dilation)
    sums = part.sum(0)
    drms_w_h = 2.0 * rms_w_h.float() * sums[0]
    dconv = sums[2:] if fused else dpart.sum(0)
    return dH, dk, dv, drms_w_h, sums[1], dconv


# ---------------------------------------------------------------------------------------------- autograd
class EngramGateConvFn(torch.autograd.Function):
    """Y = GateConv(H, k, v; rms_w_h, rms_w_v, conv_w) with the fused backward. Weight gradients are
    returned in the weights' dtype (accumulated in float32)."""

    @staticmethod
    def forward(ctx, H, k, v, rms_w_h, rms_w_v, conv_w, dilation: int = 1, eps: float = 1e-6):
        y, _vhat, alpha, rh, rk, rv, _state = engram_gate_conv_fwd(
            H, k, v, rms_w_h, rms_w_v, conv_w, dilation=dilation, eps=eps
        )
        ctx.save_for_backward(H, k, v, rms_w_h, rms_w_v, conv_w, alpha, rh, rk, rv)
        ctx.dilation = dilation
        return y

    @staticmethod
    def backward(ctx, dY):
        H, k, v, wh, wv, cw, alpha, rh, rk, rv = ctx.saved_tensors
        dH, dk, dv, dwh, dwv, dcw = engram_gate_conv_bwd(
            dY.contiguous(), H, k, v, wh, wv, cw, alpha, rh, rk, rv, dilation=ctx.dilation
        )
        return dH, dk, dv, dwh.to(wh.dtype), dwv.to(wv.dtype), dcw.to(cw.dtype), None, None


def engram_gate_conv(H, k, v, rms_w_h, rms_w_v, conv_w, *, dilation: int = 1, eps: float = 1e-6):
    """Differentiable GateConv: returns Y (M, T, d); gradients flow to all six tensors."""
    return EngramGateConvFn.apply(H, k, v, rms_w_h, rms_w_v, conv_w, dilation, eps)


# ---------------------------------------------------------------------------------------------- op objects
def _use_reference(op: str, target, name: str, x) -> bool:
    """Whether an op object of ``target`` forces the reference ('torch'); None leaves the choice to the function
    (the kernel for CUDA inputs), 'tilelang' requires ``x`` (argument ``name``) on CUDA."""
    if target == "tilelang":
        checks.check_tensor(op, name, x)  # before its device is read
        if not x.is_cuda:
            checks.fail(op, "inputs", "CUDA tensors for target='tilelang'", f"device {x.device}")
    return target == "torch"


def _check_taps(op: str, conv_w, taps: int) -> None:
    """An op object's conv_w has its ``conv_kernel_size`` taps (the function checks the rest)."""
    checks.check_tensor(op, "conv_w", conv_w)
    checks.check_ndim(op, "conv_w", conv_w, 2)  # before its shape is read
    if conv_w.shape[0] != taps:
        checks.fail(op, "conv_w", f"of shape ({taps}, d)", f"shape {tuple(conv_w.shape)}")


def _check_target(op: str, target) -> None:
    if target is not None:
        checks.check_one_of(op, "target", target, (None, "tilelang", "torch"))


class EngramGateConvFwdOp:
    """TileOPs-style op: construct once with the hyperparameters, call with tensors.

    ``EngramGateConvFwdOp(conv_kernel_size=4, dilation=1, eps=1e-6, target=None)(H, k, v, rms_w_h, rms_w_v,
    conv_w) -> (Y, vhat, alpha, rrms_h, rrms_k, rrms_v, conv_state)``. target None runs the kernel for CUDA
    inputs and the reference otherwise; 'tilelang' requires CUDA inputs; 'torch' always runs the reference.
    """

    def __init__(self, conv_kernel_size: int = 4, dilation: int = 1, eps: float = 1e-6, *, target=None):
        op = type(self).__name__
        eps = _check_params(op, conv_kernel_size, dilation, eps)
        _check_target(op, target)
        self.conv_kernel_size, self.dilation, self.eps, self.target = conv_kernel_size, dilation, eps, target

    def __call__(self, H, k, v, rms_w_h, rms_w_v, conv_w):
        op = type(self).__name__
        _check_taps(op, conv_w, self.conv_kernel_size)
        return engram_gate_conv_fwd(H, k, v, rms_w_h, rms_w_v, conv_w, dilation=self.dilation, eps=self.eps,
                                    use_reference=_use_reference(op, self.target, "H", H))


class EngramGateConvBwdOp:
    """``EngramGateConvBwdOp(conv_kernel_size=4, dilation=1, eps=1e-6, target=None)(dY, H, k, v, rms_w_h,
    rms_w_v, conv_w, alpha, rrms_h, rrms_k, rrms_v) -> (dH, dk, dv, drms_w_h, drms_w_v, dconv_w)``.
    eps is accepted for symmetry and unused (the saved statistics carry it)."""

    def __init__(self, conv_kernel_size: int = 4, dilation: int = 1, eps: float = 1e-6, *, target=None):
        op = type(self).__name__
        eps = _check_params(op, conv_kernel_size, dilation, eps)
        _check_target(op, target)
        self.conv_kernel_size, self.dilation, self.eps, self.target = conv_kernel_size, dilation, eps, target

    def __call__(self, dY, H, k, v, rms_w_h, rms_w_v, conv_w, alpha, rrms_h, rrms_k, rrms_v):
        op = type(self).__name__
        _check_taps(op, conv_w, self.conv_kernel_size)
        return engram_gate_conv_bwd(dY, H, k, v, rms_w_h, rms_w_v, conv_w, alpha, rrms_h, rrms_k, rrms_v,
                                    dilation=self.dilation, use_reference=_use_reference(op, self.target, "H", H))
