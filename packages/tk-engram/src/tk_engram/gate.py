"""Engram gate: RMSNorm-fused gating forward, its backward and the weight-gradient reduction.

Notation: x = ``hidden_states`` (T, n, H), k (T, n, H), v (T, H), w = ``weight_fused`` = w_h * w_e (n, H)
float32, c = H^(-1/2). Per token t and stream h (float32 arithmetic)::

    rx  = (sum_d x_d^2 / H + eps)^(-1/2)          rk = (sum_d k_d^2 / H + eps)^(-1/2)
    dot = sum_d x_d w_d k_d                       s  = dot * rx * rk * c
    g   = sigmoid(sign(s) * sqrt(max(|s|, clamp)))   (sign(0) = 0: s = 0 gives g = 1/2; NaN propagates)
    out[t, h, :] = bf16(x + g * v[t, :])

``engram_gate_fwd`` returns ``(out, dot, gate, rstd_x, rstd_k)``, the last four float32 (T, n) or None
with ``save_for_backward=False`` (``out`` is bit-identical either way).

``engram_gate_bwd`` (G = ``grad_out``) uses the saved values, with no recomputation of the forward::

    dg = sum_d G_d v_d
    ddot = dg g (1-g) / 2 * sqrt(c rx rk / |dot|)   if |s| >= clamp, else 0        (= dL/ds * rx rk c)
    grad_x = bf16(G + ddot (k w - x dot rx^2 / H))     grad_k = bf16(ddot (x w - k dot rk^2 / H))
    grad_v[t] = bf16(sum_h g_h G_h)                    (heads in order 0..n-1)
    grad_w_partial[p] = sum over the tokens of chunk p of ddot x k  (float32, fixed order, no atomics)

Chunk p holds tokens [p*chunk, (p+1)*chunk) with chunk = ceil(T / P); P (the partial rows) follows the SM
count and the token count, so grad_w is deterministic for a given configuration. ``grad_w_reduce`` sums
the P rows in order and adds S*w_e to grad_weight_hidden and S*w_h to grad_weight_embed in place.

Inputs and layouts: bf16 x, k, v, grad_out on CUDA (on CPU any one float dtype for the four, where the
references of ``reference.py`` run); H a multiple of 64, at most 14336; the last dimension unit-stride, other strides
arbitrary (runtime arguments; a stride that is not a multiple of 8 elements or a base not 16-byte aligned costs a
copy); ``weight_fused`` float32 (n, H); eps >= 0 and clamp_value > 0 are runtime scalars: no recompile for a new
token count, stride, eps or clamp. Outputs are contiguous. T = 0 returns empty outputs (zero partials).

Image tokens (optional bool (T,) ``image_token_mask``, TileKernels 2.1.0): the forward passes them through
(out = x bit for bit, saved gate 0); the backward gives grad_x = grad_out, grad_k = grad_v = 0 and no weight
gradient for them.

Errors: ``TypeError`` for wrong dtypes, ``ValueError`` for shapes, devices, strides and scalars, each as
``"<op>: <arg> must be <expected>, got <actual>"``.

Kernels (``_gate_kernels.py``): persistent CTAs over (token chunk, stream), one wave, a thread owning at
most 4 vectors of a row (224 threads at H = 7168); all accesses are 16-byte vectors. The forward issues all
of a token's loads together (registers and cp.async copies into shared memory). The backward loads G, v and
the other streams' G rows into registers first; x and k are used only after its per-token barrier. In the
layouts of 2 CTAs per SM (160-224 threads: H = 4160-7168, the anchor included; ``bwd_xk_late``) x and k are
loaded into registers, placed after the barrier in the source (ptxas issues them during the dg reduction),
and the chunk's weight gradient accumulates in shared memory; in the other layouts x and k arrive as
cp.async copies into shared memory (two stages by token parity) and the weight gradient accumulates in
registers. Either way two dependent memory round trips per token (the other CTAs of the SM, where several
fit, cover them) and the same result bits. Each CTA writes one partial weight-gradient row.
"""

import torch

from tk_core import checks, config
from tk_core.layout import vector_aligned
from tk_core.library import device_op

from . import reference
from ._gate_kernels import (
    MAX_HIDDEN,
    bwd_blocks_per_sm,
    fwd_blocks_per_sm,
    gate_bwd_kernel,
    gate_fwd_kernel,
    grad_w_reduce_kernel,
    threads_for,
)

HIDDEN_ALIGN = 64


def _vec_view(t: torch.Tensor):
    """A flat view of ``t``'s storage span and its leading strides in units of 8 elements.

    ``t`` has a unit-stride last dimension. If a leading stride is not a multiple of 8 or the base is not
    16-byte aligned, a contiguous copy is used instead (the kernels load 16-byte vectors).
    """
    t = vector_aligned(t)
    # a size-1 dimension is never stepped along: its stride is irrelevant (taken as 0)
    strides = [s if size > 1 else 0 for size, s in zip(t.shape, t.stride(), strict=False)]
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, strides, strict=False))
    return t.as_strided((span,), (1,)), [s // 8 for s in strides[:-1]]


def _device_sms(device: torch.device) -> int:
    return config.get_num_sms(device.index if device.index is not None else torch.cuda.current_device())


def token_chunks(num_tokens: int, max_parts: int):
    """(chunk, parts): ``parts <= max_parts`` contiguous chunks of ``chunk`` tokens covering ``num_tokens``
    (> 0), none of them empty."""
    parts = max(1, min(num_tokens, max_parts))
    chunk = -(-num_tokens // parts)
    return chunk, -(-num_tokens // chunk)


def _fwd_chunks(num_tokens: int, n: int, hidden: int, device: torch.device):
    """(chunk, parts) of the persistent forward: one wave of CTAs, equal contiguous token chunks."""
    return token_chunks(num_tokens, (_device_sms(device) * fwd_blocks_per_sm(hidden)) // n)


# ------------------------------------------------------------------------------------------ device ops


def _launch_gate_fwd(hidden_states, k, v, weight_fused, eps, clamp_value, out, saved: tuple, image_token_mask):
    """Launches the forward kernel; ``saved`` is ``(dot, gate_score, rstd_x, rstd_k)`` or ``()``."""
    n, hidden = weight_fused.shape
    X, (sx0, sx1) = _vec_view(hidden_states)
    K, (sk0, sk1) = _vec_view(k)
    V, (sv0,) = _vec_view(v)
    chunk, parts = _fwd_chunks(out.shape[0], n, hidden, out.device)
    masked = image_token_mask is not None
    kern = gate_fwd_kernel.get(
        out.device, n=n, hidden=hidden, save=bool(saved), threads=threads_for(hidden), masked=masked
    )
    mask = (image_token_mask.view(torch.uint8),) if masked else ()
    kern(
        X, K, V, weight_fused, out, *saved, *mask,
        sx0, sx1, sk0, sk1, sv0, eps, clamp_value, chunk, parts,
    )


@device_op("tk_engram::engram_gate_fwd", mutates_args=("out", "dot", "gate_score", "rstd_x", "rstd_k"))
def _gate_fwd_op(
    hidden_states: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    weight_fused: torch.Tensor,
    eps: float,
    clamp_value: float,
    out: torch.Tensor,
    dot: torch.Tensor,
    gate_score: torch.Tensor,
    rstd_x: torch.Tensor,
    rstd_k: torch.Tensor,
    image_token_mask: torch.Tensor | None = None,
) -> None:
    _launch_gate_fwd(hidden_states, k, v, weight_fused, eps, clamp_value, out, (dot, gate_score, rstd_x, rstd_k),
                     image_token_mask)


@device_op("tk_engram::engram_gate_fwd_nosave", mutates_args=("out",))
def _gate_fwd_nosave_op(
    hidden_states: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    weight_fused: torch.Tensor,
    eps: float,
    clamp_value: float,
    out: torch.Tensor,
    image_token_mask: torch.Tensor | None = None,
) -> None:
    _launch_gate_fwd(hidden_states, k, v, weight_fused, eps, clamp_value, out, (), image_token_mask)


@device_op(
    "tk_engram::engram_gate_bwd", mutates_args=("grad_x", "grad_k", "grad_v", "grad_w_partial")
)
def _gate_bwd_op(
    grad_out: torch.Tensor,
    hidden_states: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    weight_fused: torch.Tensor,
    dot: torch.Tensor,
    gate_score: torch.Tensor,
    rstd_x: torch.Tensor,
    rstd_k: torch.Tensor,
    clamp_value: float,
    grad_x: torch.Tensor,
    grad_k: torch.Tensor,
    grad_v: torch.Tensor,
    grad_w_partial: torch.Tensor,
    image_token_mask: torch.Tensor | None = None,
) -> None:
    n, hidden = weight_fused.shape
    num_tokens = grad_x.shape[0]
    chunk = -(-num_tokens // grad_w_partial.shape[0])
    Gf, (sg0, sg1) = _vec_view(grad_out)
    X, (sx0, sx1) = _vec_view(hidden_states)
    K, (sk0, sk1) = _vec_view(k)
    V, (sv0,) = _vec_view(v)
    masked = image_token_mask is not None
    kern = gate_bwd_kernel.get(grad_x.device, n=n, hidden=hidden, threads=threads_for(hidden), masked=masked)
    mask = (image_token_mask.view(torch.uint8),) if masked else ()
    kern(
        Gf, X, K, V, weight_fused, dot, gate_score, rstd_x, rstd_k, grad_x, grad_k, grad_v, grad_w_partial, *mask,
        sg0, sg1, sx0, sx1, sk0, sk1, sv0, clamp_value, chunk,
    )


@device_op("tk_engram::grad_w_reduce", mutates_args=("grad_weight_hidden", "grad_weight_embed"))
def _grad_w_reduce_op(
    grad_w_partial: torch.Tensor,
    weight_hidden: torch.Tensor,
    weight_embed: torch.Tensor,
    grad_weight_hidden: torch.Tensor,
    grad_weight_embed: torch.Tensor,
) -> None:
    n, hidden = weight_hidden.shape
    grad_w_reduce_kernel.get(grad_weight_hidden.device, n=n, hidden=hidden)(
        grad_w_partial, weight_hidden, weight_embed, grad_weight_hidden, grad_weight_embed
    )


# ------------------------------------------------------------------------------------------ checks


def _check_float(op: str, arg: str, t: torch.Tensor, cuda_dtype: torch.dtype) -> None:
    checks.check_tensor(op, arg, t)  # before its device is read
    if t.device.type == "cuda":
        checks.check_dtype(op, arg, t, cuda_dtype)
    else:
        checks.check_dtype(op, arg, t, (torch.bfloat16, torch.float16, torch.float32, torch.float64))


def _check_gate_inputs(op: str, hidden_states, k, v, weight_fused):
    _check_float(op, "hidden_states", hidden_states, torch.bfloat16)
    checks.check_ndim(op, "hidden_states", hidden_states, 3)
    num_tokens, n, hidden = hidden_states.shape
    if n < 1:
        checks.fail(op, "hidden_states", "of shape (T, n, H) with n >= 1", f"shape {tuple(hidden_states.shape)}")
    checks.check_divisible(op, "hidden size H", hidden, HIDDEN_ALIGN)
    if not 0 < hidden <= MAX_HIDDEN:
        checks.fail(op, "hidden size H", f"in [64, {MAX_HIDDEN}]", hidden)
    device = hidden_states.device
    for name, t, shape in (("k", k, (num_tokens, n, hidden)), ("v", v, (num_tokens, hidden))):
        checks.check_dtype(op, name, t, hidden_states.dtype)  # on CPU too: the reference would mix precisions
        checks.check_shape(op, name, t, shape)
    _check_float(op, "weight_fused", weight_fused, torch.float32)
    checks.check_shape(op, "weight_fused", weight_fused, (n, hidden))
    for name, t in (("hidden_states", hidden_states), ("k", k), ("v", v)):
        checks.check_same_device(op, name, t, device)
        checks.check_inner_contiguous(op, name, t)
    checks.check_same_device(op, "weight_fused", weight_fused, device)
    return num_tokens, n, hidden


def _check_mask(op: str, mask, num_tokens: int, device: torch.device):
    if mask is None:
        return None
    checks.check_dtype(op, "image_token_mask", mask, torch.bool)
    checks.check_shape(op, "image_token_mask", mask, (num_tokens,))
    checks.check_same_device(op, "image_token_mask", mask, device)
    return mask.contiguous()


# ------------------------------------------------------------------------------------------ public ops


def engram_gate_fwd(
    hidden_states: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    weight_fused: torch.Tensor,
    eps: float,
    clamp_value: float,
    save_for_backward: bool = True,
    image_token_mask: torch.Tensor | None = None,
):
    """Engram gate forward (see the module docstring for the math).

    Args: hidden_states and k (T, n, H), v (T, H): bf16 on CUDA, unit-stride last dimension, any other
    strides (k = kv[:, :n], v = kv[:, n] of a packed kv (T, n+1, H) need no copy); weight_fused (n, H)
    float32 (``fused_weight(w_h, w_e)``); eps >= 0; clamp_value > 0; image_token_mask: optional bool (T,),
    flagged (image) tokens pass through (out = x bit for bit, saved gate 0).
    Returns ``(out, dot, gate_score, rstd_x, rstd_k)``: out (T, n, H) in x's dtype, contiguous; the other
    four float32 (T, n), or None when ``save_for_backward`` is False.
    """
    op = "engram_gate_fwd"
    num_tokens, n, hidden = _check_gate_inputs(op, hidden_states, k, v, weight_fused)
    eps = checks.check_float(op, "eps", eps)
    clamp_value = checks.check_float(op, "clamp_value", clamp_value, strict=True)
    mask = _check_mask(op, image_token_mask, num_tokens, hidden_states.device)
    if hidden_states.device.type != "cuda":
        return reference.engram_gate_fwd_ref(
            hidden_states, k, v, weight_fused, eps, clamp_value, save_for_backward, mask
        )
    weight_fused = weight_fused.contiguous()
    out = torch.empty((num_tokens, n, hidden), dtype=hidden_states.dtype, device=hidden_states.device)
    if not save_for_backward:
        if num_tokens:
            _gate_fwd_nosave_op(hidden_states, k, v, weight_fused, eps, clamp_value, out, mask)
        return out, None, None, None, None
    dot, gate_score, rstd_x, rstd_k = (
        torch.empty((num_tokens, n), dtype=torch.float32, device=hidden_states.device) for _ in range(4)
    )
    if num_tokens:
        _gate_fwd_op(
            hidden_states, k, v, weight_fused, eps, clamp_value, out, dot, gate_score, rstd_x, rstd_k, mask
        )
    return out, dot, gate_score, rstd_x, rstd_k


def num_grad_w_parts(num_tokens: int, n: int, hidden: int, device: torch.device) -> int:
    """Rows of ``grad_w_partial`` the backward writes on ``device`` for ``num_tokens`` tokens."""
    if device.type != "cuda":
        return 1
    return max(1, min(num_tokens, (_device_sms(device) * bwd_blocks_per_sm(hidden)) // n))


def engram_gate_bwd(
    grad_out: torch.Tensor,
    hidden_states: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    weight_fused: torch.Tensor,
    dot: torch.Tensor,
    gate_score: torch.Tensor,
    rstd_x: torch.Tensor,
    rstd_k: torch.Tensor,
    clamp_value: float,
    image_token_mask: torch.Tensor | None = None,
):
    """Engram gate backward from the forward's saved (T, n) float32 ``dot, gate_score, rstd_x, rstd_k``.

    grad_out has x's shape (bf16 on CUDA, unit-stride last dimension). Returns
    ``(grad_x, grad_k, grad_v, grad_w_partial)``: grad_x and grad_k (T, n, H), grad_v (T, H), contiguous, in
    the inputs' dtypes; grad_w_partial float32 (P, n, H) whose row sum is dL/d weight_fused (feed it to
    ``grad_w_reduce``). Deterministic: no atomics. Tokens flagged in ``image_token_mask`` (bool (T,)) get
    grad_x = grad_out, grad_k = grad_v = 0 and add nothing to the weight gradient.
    """
    op = "engram_gate_bwd"
    num_tokens, n, hidden = _check_gate_inputs(op, hidden_states, k, v, weight_fused)
    checks.check_dtype(op, "grad_out", grad_out, hidden_states.dtype)
    checks.check_shape(op, "grad_out", grad_out, (num_tokens, n, hidden))
    checks.check_same_device(op, "grad_out", grad_out, hidden_states.device)
    checks.check_inner_contiguous(op, "grad_out", grad_out)
    for name, t in (("dot", dot), ("gate_score", gate_score), ("rstd_x", rstd_x), ("rstd_k", rstd_k)):
        _check_float(op, name, t, torch.float32)
        checks.check_shape(op, name, t, (num_tokens, n))
        checks.check_same_device(op, name, t, hidden_states.device)
    clamp_value = checks.check_float(op, "clamp_value", clamp_value, strict=True)
    device = hidden_states.device
    mask = _check_mask(op, image_token_mask, num_tokens, device)
    if device.type != "cuda":
        return reference.engram_gate_bwd_ref(
            grad_out, hidden_states, k, v, weight_fused, dot, gate_score, rstd_x, rstd_k, clamp_value,
            image_token_mask=mask,
        )
    parts = num_grad_w_parts(num_tokens, n, hidden, device)
    grad_x = torch.empty((num_tokens, n, hidden), dtype=hidden_states.dtype, device=device)
    grad_k = torch.empty((num_tokens, n, hidden), dtype=k.dtype, device=device)
    grad_v = torch.empty((num_tokens, hidden), dtype=v.dtype, device=device)
    if num_tokens == 0:
        return grad_x, grad_k, grad_v, torch.zeros((parts, n, hidden), dtype=torch.float32, device=device)
    grad_w_partial = torch.empty((parts, n, hidden), dtype=torch.float32, device=device)
    _gate_bwd_op(
        grad_out, hidden_states, k, v, weight_fused.contiguous(),
        dot.contiguous(), gate_score.contiguous(), rstd_x.contiguous(), rstd_k.contiguous(),
        clamp_value, grad_x, grad_k, grad_v, grad_w_partial, mask,
    )
    return grad_x, grad_k, grad_v, grad_w_partial


def grad_w_reduce(
    grad_w_partial: torch.Tensor,
    weight_hidden: torch.Tensor,
    weight_embed: torch.Tensor,
    grad_weight_hidden: torch.Tensor,
    grad_weight_embed: torch.Tensor,
) -> None:
    """In place: S = sum_p grad_w_partial[p] (fixed order p = 0..B-1, any B >= 0);
    grad_weight_hidden += S * float(weight_embed); grad_weight_embed += S * float(weight_hidden).

    grad_w_partial float32 (B, n, H); weights bf16 (n, H); accumulators float32 (n, H), contiguous (on CPU
    any float dtypes). H a multiple of 64. Deterministic and bit-exact against ``reference.grad_w_reduce_ref``.
    """
    op = "grad_w_reduce"
    _check_float(op, "grad_w_partial", grad_w_partial, torch.float32)
    checks.check_ndim(op, "grad_w_partial", grad_w_partial, 3)
    _, n, hidden = grad_w_partial.shape
    checks.check_divisible(op, "hidden size H", hidden, HIDDEN_ALIGN)
    device = grad_w_partial.device
    for name, t in (("weight_hidden", weight_hidden), ("weight_embed", weight_embed)):
        _check_float(op, name, t, torch.bfloat16)
        checks.check_shape(op, name, t, (n, hidden))
        checks.check_same_device(op, name, t, device)
    for name, t in (("grad_weight_hidden", grad_weight_hidden), ("grad_weight_embed", grad_weight_embed)):
        _check_float(op, name, t, torch.float32)
        checks.check_shape(op, name, t, (n, hidden))
        checks.check_same_device(op, name, t, device)
        checks.check_contiguous(op, name, t)
    if device.type != "cuda" or grad_w_partial.shape[0] == 0:
        # (no partial rows: S = +0, two elementwise ops; an empty tensor cannot be passed to the kernel)
        reference.grad_w_reduce_ref(grad_w_partial, weight_hidden, weight_embed, grad_weight_hidden, grad_weight_embed)
        return
    if n * hidden == 0:
        return
    _grad_w_reduce_op(
        grad_w_partial.contiguous(), weight_hidden.contiguous(), weight_embed.contiguous(),
        grad_weight_hidden, grad_weight_embed,
    )
