"""``EngramGateFn`` and ``engram_gate``: the Engram gate as a differentiable function of the two weights.

``engram_gate(hidden_states, k, v, weight_hidden, weight_embed, clamp_value, eps, image_token_mask=None)`` with hidden_states and
k of shape [*, n, H], v [*, H], weights (n, H) bf16, returns out [*, n, H] = x + g * v as in ``gate.py``
with ``weight_fused = fused_weight(weight_hidden, weight_embed)``.

- Inference path: when grad mode is off or no input requires grad, it runs the forward with
  ``save_for_backward=False`` and saves nothing.
- Training path (``EngramGateFn``): saves x, k, v, both weights, the fused weight and the four (T, n)
  float32 intermediates; the backward never recomputes the forward. Weight gradients are reduced
  deterministically (``grad_w_reduce`` over per-chunk partials, no atomics). If a weight has a
  ``main_grad`` attribute (a Megatron-style float32 buffer), its gradient is accumulated into it in place
  and None is returned for that weight; otherwise a float32 gradient is returned (autograd casts it to the
  parameter's dtype).
- Leading dimensions are flattened with ``reshape`` (a copy only when a view is impossible) once k, v and
  the mask are checked against hidden_states' shape (``ValueError`` naming engram_gate otherwise); grads come
  back in the inputs' shapes. On CPU tensors the references run (so float64 ``gradcheck`` works).
"""

import torch

from tk_core import checks

from .fused_weight import fused_weight
from .gate import engram_gate_bwd, engram_gate_fwd, grad_w_reduce

OP = "engram_gate"


def _flatten(hidden_states, k, v, image_token_mask):
    """(x, k, v, mask) with the leading dimensions flattened, after checking the layout in the caller's shapes
    (k like hidden_states [*, n, H], v [*, H], the mask [*]): a reshape alone would reinterpret wrong ones."""
    checks.check_tensor(OP, "hidden_states", hidden_states)
    if hidden_states.dim() < 2:
        checks.fail(OP, "hidden_states", "[*, n, H]", f"shape {tuple(hidden_states.shape)}")
    *lead, n, hidden = hidden_states.shape
    layout = [("k", k, (*lead, n, hidden)), ("v", v, (*lead, hidden))]
    if image_token_mask is not None:
        layout.append(("image_token_mask", image_token_mask, tuple(lead)))
    for name, t, shape in layout:
        checks.check_tensor(OP, name, t)
        checks.check_shape(OP, name, t, shape)
    mask = None if image_token_mask is None else image_token_mask.reshape(-1)
    return hidden_states.reshape(-1, n, hidden), k.reshape(-1, n, hidden), v.reshape(-1, hidden), mask


def _accumulator(weight: torch.Tensor, like: torch.Tensor):
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is not None:
        return main_grad, True
    dt = torch.promote_types(weight.dtype, torch.float32)
    return torch.zeros(weight.shape, dtype=dt, device=like.device), False


class EngramGateFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_states, k, v, weight_hidden, weight_embed, clamp_value, eps, image_token_mask=None):
        x, kk, vv, mask = _flatten(hidden_states, k, v, image_token_mask)
        w = fused_weight(weight_hidden, weight_embed)
        out, dot, gate, rstd_x, rstd_k = engram_gate_fwd(x, kk, vv, w, eps, clamp_value, True, mask)
        ctx.save_for_backward(x, kk, vv, weight_hidden, weight_embed, w, dot, gate, rstd_x, rstd_k, mask)
        ctx.clamp_value = clamp_value
        ctx.shapes = (hidden_states.shape, k.shape, v.shape)
        return out.view(hidden_states.shape)

    @staticmethod
    def backward(ctx, grad_out):
        x, kk, vv, weight_hidden, weight_embed, w, dot, gate, rstd_x, rstd_k, mask = ctx.saved_tensors
        x_shape, k_shape, v_shape = ctx.shapes
        G = grad_out.reshape(x.shape)
        if G.stride(-1) != 1:
            G = G.contiguous()
        grad_x, grad_k, grad_v, partial = engram_gate_bwd(
            G, x, kk, vv, w, dot, gate, rstd_x, rstd_k, ctx.clamp_value, mask
        )
        acc_h, main_h = _accumulator(weight_hidden, x)
        acc_e, main_e = _accumulator(weight_embed, x)
        grad_w_reduce(partial, weight_hidden, weight_embed, acc_h, acc_e)
        return (
            grad_x.view(x_shape),
            grad_k.view(k_shape),
            grad_v.view(v_shape),
            None if main_h else acc_h,
            None if main_e else acc_e,
            None,
            None,
            None,
        )


def engram_gate(
    hidden_states: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    weight_hidden: torch.Tensor,
    weight_embed: torch.Tensor,
    clamp_value: float,
    eps: float,
    image_token_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Engram gate out = x + g * v (see the module docstring); differentiable in all five tensors.
    ``image_token_mask`` (optional bool [*]): flagged tokens pass through (out = x; grads to k, v and the
    weights are zero for them)."""
    for name, t in (("hidden_states", hidden_states), ("k", k), ("v", v), ("weight_hidden", weight_hidden),
                    ("weight_embed", weight_embed)):
        checks.check_tensor(OP, name, t)  # before requires_grad is read
    needs_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (hidden_states, k, v, weight_hidden, weight_embed)
    )
    if not needs_grad:
        x, kk, vv, mask = _flatten(hidden_states, k, v, image_token_mask)
        w = fused_weight(weight_hidden, weight_embed)
        out = engram_gate_fwd(x, kk, vv, w, eps, clamp_value, False, mask)[0]
        return out.view(hidden_states.shape)
    return EngramGateFn.apply(hidden_states, k, v, weight_hidden, weight_embed, clamp_value, eps, image_token_mask)
