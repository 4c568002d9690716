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

Kernels: a tensor-core GEMM per weight (W read once for up to 64 rows per CTA column panel, TMA pipeline),
then one CTA per row for the gate, convolution and cache update. Runtime: batch, L, positions, eps.

Roofline bytes (e = element size; the benchmark's ``bytes``):
    2*d_mem*d*e (W_K, W_V) + B*d_mem*e (e_t) + B*d*e (h_t) + B*d*e (y) + B*w*d*e (w-1 cache reads + 1 write)
    + (2 + w)*d*e (weights) + 4*B (positions)
The two B*d intermediate k, v (written and read once) are not counted.
"""

import torch

from tk_core import checks
from tk_core.library import device_op

from . import reference
from ._gate_conv_kernels import decode_proj_kernel, decode_step_kernel
from .gate_conv import _CPU_DTYPES, _TL_DTYPES, _aligned, _check_params, _check_target, _resolve_target


def decode_roofline_bytes(B: int, d_mem: int, d: int, taps: int, elem: int = 2) -> int:
    """Bytes one decode step must move (module docstring); 2*d_mem*d*elem of them are W_K and W_V."""
    return (2 * d_mem * d + B * d_mem + 2 * B * d + B * taps * d + (2 + taps) * d) * elem + 4 * B


def init_decode_state(batch: int, d: int, conv_kernel_size: int = 4, dilation: int = 1, *,
                      dtype=torch.bfloat16, device=None):
    """An empty decode history: (zero cache (batch, dilation*(w-1), d), cache_pos zeros (batch,) int32)."""
    hist = dilation * (conv_kernel_size - 1)
    return (torch.zeros((batch, hist, d), dtype=dtype, device=device),
            torch.zeros((batch,), dtype=torch.int32, device=device))


@device_op("tk_engram::decode_step", mutates_args=("conv_state", "kp", "vp", "y"))
def _decode_dev(
    e_t: torch.Tensor, h_t: torch.Tensor, conv_state: torch.Tensor, cache_pos: torch.Tensor, W_K: torch.Tensor,
    W_V: torch.Tensor, rms_w_h: torch.Tensor, rms_w_v: torch.Tensor, conv_w: torch.Tensor, kp: torch.Tensor,
    vp: torch.Tensor, y: torch.Tensor, dilation: int, eps: float,
) -> None:
    dt = _TL_DTYPES[h_t.dtype]
    proj = decode_proj_kernel.get(h_t.device, dtype=dt, d_mem=e_t.shape[1], d=h_t.shape[1])
    proj(e_t, W_K, kp)
    proj(e_t, W_V, vp)
    step = decode_step_kernel.get(h_t.device, dtype=dt, d=h_t.shape[1], taps=conv_w.shape[0], dilation=dilation)
    step(h_t, kp, vp, rms_w_h, rms_w_v, conv_w, conv_state, cache_pos, y, eps)


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
    kp = torch.empty_like(y)
    vp = torch.empty_like(y)
    _decode_dev(_aligned(e_t), _aligned(h_t), conv_state, _aligned(cache_pos), _aligned(W_K), _aligned(W_V),
                _aligned(rms_w_h), _aligned(rms_w_v), _aligned(conv_w), kp, vp, y, dilation, float(eps))
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
