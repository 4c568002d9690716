"""Plain-PyTorch references of every tk-engram op (CPU or GPU)."""


# ---------------------------------------------------------------------------------------------------------
# Engram hashing and gating (engram_hash, fused_weight, engram_gate_fwd/bwd, grad_w_reduce, engram_gate)
# ---------------------------------------------------------------------------------------------------------
import math  # noqa: E402

import torch  # noqa: E402


def make_offsets(vocab_sizes: torch.Tensor) -> torch.Tensor:
    """Per layer, the exclusive prefix sum of the flattened (N-1)*J table sizes: int32 (L, (N-1)*J)."""
    flat = vocab_sizes.reshape(vocab_sizes.shape[0], -1).to(torch.int64)
    return (flat.cumsum(1) - flat).to(torch.int32)


def engram_hash_ref(
    ngram_token_ids: torch.Tensor, multipliers: torch.Tensor, vocab_sizes: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """int32 (L, T, (N-1)*J): h ^= int64(id_i) * mult_i (wrapping); column block i-1 = floormod(h, vocab) + offset."""
    L, N = multipliers.shape
    J = vocab_sizes.shape[2]
    ids = ngram_token_ids.to(torch.int64)
    h = torch.zeros((L, ids.shape[0]), dtype=torch.int64, device=ids.device)
    cols = []
    for i in range(N):
        h = h ^ (ids[:, i][None, :] * multipliers[:, i][:, None].to(torch.int64))
        if i >= 1:
            vocab = vocab_sizes[:, i - 1, :].to(torch.int64)[:, None, :]
            off = offsets[:, (i - 1) * J : i * J].to(torch.int64)[:, None, :]
            cols.append(torch.remainder(h[:, :, None], vocab) + off)
    return torch.cat(cols, dim=-1).to(torch.int32)


def fused_weight_ref(weight_hidden: torch.Tensor, weight_embed: torch.Tensor) -> torch.Tensor:
    """float(w_h) * float(w_e) (exact for bf16 inputs)."""
    dt = torch.promote_types(torch.promote_types(weight_hidden.dtype, weight_embed.dtype), torch.float32)
    return weight_hidden.to(dt) * weight_embed.to(dt)


def _compute_dtype(*tensors) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _inv_sqrt(hidden: int, dtype: torch.dtype, device) -> torch.Tensor:
    # correctly rounded sqrt, then an IEEE division: the kernels' 1/sqrtf(H)
    return torch.tensor(float(hidden), dtype=dtype, device=device).sqrt().reciprocal()


def engram_gate_fwd_ref(
    hidden_states: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    weight_fused: torch.Tensor,
    eps: float,
    clamp_value: float,
    save_for_backward: bool = True,
):
    """out = x + g * v with g = sigmoid(sign(s) * sqrt(max(|s|, clamp))), s = dot * rx * rk / sqrt(H).

    x, k: (T, n, H); v: (T, H); weight_fused: (n, H). Computed in float32 (float64 if any input is float64),
    differentiable. Returns ``(out, dot, gate, rstd_x, rstd_k)`` (the last four None unless saving); out has
    x's dtype, the others the compute dtype, shape (T, n). sign(0) = 0, so s = 0 gives g = 1/2.
    """
    cd = _compute_dtype(hidden_states, k, v, weight_fused)
    x, kk, vv, w = hidden_states.to(cd), k.to(cd), v.to(cd), weight_fused.to(cd)
    H = x.shape[-1]
    rx = (x.square().mean(-1) + eps).sqrt().reciprocal()
    rk = (kk.square().mean(-1) + eps).sqrt().reciprocal()
    dot = (x * w * kk).sum(-1)
    s = dot * rx * rk * _inv_sqrt(H, cd, x.device)
    gate = torch.sigmoid(torch.sign(s) * s.abs().clamp_min(clamp_value).sqrt())
    out = (x + gate.unsqueeze(-1) * vv.unsqueeze(-2)).to(hidden_states.dtype)
    if not save_for_backward:
        return out, None, None, None, None
    return out, dot, gate, rx, rk


def engram_gate_ref(
    hidden_states: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    weight_hidden: torch.Tensor,
    weight_embed: torch.Tensor,
    clamp_value: float,
    eps: float,
    save_for_backward: bool = False,
):
    """The whole gate from the two weights (differentiable): x [*, n, H], k [*, n, H], v [*, H].

    Returns out, or ``(out, dot, gate, rstd_x, rstd_k)`` with ``save_for_backward``.
    """
    n, H = hidden_states.shape[-2:]
    res = engram_gate_fwd_ref(
        hidden_states.reshape(-1, n, H),
        k.reshape(-1, n, H),
        v.reshape(-1, H),
        fused_weight_ref(weight_hidden, weight_embed),
        eps,
        clamp_value,
        True,
    )
    out = res[0].view(hidden_states.shape)
    return (out, *res[1:]) if save_for_backward else out


def engram_gate_bwd_ref(
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
    num_parts: int = 1,
):
    """Closed-form backward of ``engram_gate_fwd_ref`` from its saved (T, n) intermediates.

    dg = sum_d G v; ddot = dg g (1-g) / 2 * sqrt(c rx rk / |dot|) where |s| >= clamp, else 0 (c = H^-1/2);
    grad_x = G + ddot (k w - x dot rx^2 / H); grad_k = ddot (x w - k dot rk^2 / H); grad_v = sum_h g_h G_h;
    grad_w_partial[p] = sum over the tokens of chunk p (chunk = ceil(T / num_parts)) of ddot x k.
    Returns ``(grad_x, grad_k, grad_v, grad_w_partial)``; grads in the inputs' dtypes, partial in the
    compute dtype, shape (num_parts, n, H).
    """
    cd = _compute_dtype(grad_out, hidden_states, k, v, weight_fused, dot)
    G, x, kk, vv, w = (t.to(cd) for t in (grad_out, hidden_states, k, v, weight_fused))
    dot, g, rx, rk = (t.to(cd) for t in (dot, gate_score, rstd_x, rstd_k))
    T_, n, H = x.shape
    c = _inv_sqrt(H, cd, x.device)
    s = dot * rx * rk * c
    dg = (G * vv.unsqueeze(-2)).sum(-1)
    ddot = torch.where(s.abs() >= clamp_value, dg * g * (1 - g) * 0.5 * (c * rx * rk / dot.abs()).sqrt(), 0.0)
    ca = (dot * rx * rx / H).unsqueeze(-1)
    cb = (dot * rk * rk / H).unsqueeze(-1)
    dd = ddot.unsqueeze(-1)
    grad_x = G + dd * (kk * w - x * ca)
    grad_k = dd * (x * w - kk * cb)
    grad_v = (g.unsqueeze(-1) * G).sum(-2)
    prod = dd * x * kk
    partial = torch.zeros((num_parts, n, H), dtype=cd, device=x.device)
    chunk = max(1, math.ceil(T_ / num_parts))
    for p in range(num_parts):
        if p * chunk < T_:
            partial[p] = prod[p * chunk : (p + 1) * chunk].sum(0)
    return grad_x.to(hidden_states.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), partial


def grad_w_reduce_ref(
    grad_w_partial: torch.Tensor,
    weight_hidden: torch.Tensor,
    weight_embed: torch.Tensor,
    grad_weight_hidden: torch.Tensor,
    grad_weight_embed: torch.Tensor,
) -> None:
    """In place: S = sum_p partial[p] in order p = 0..B-1 (starting from +0); grad_weight_hidden += S * w_e;
    grad_weight_embed += S * w_h (a rounded product, then a rounded sum). Bit-exact with the kernel."""
    acc_dt = grad_weight_hidden.dtype
    S = torch.zeros(grad_w_partial.shape[1:], dtype=grad_w_partial.dtype, device=grad_w_partial.device)
    for p in range(grad_w_partial.shape[0]):
        S = S + grad_w_partial[p]
    S = S.to(acc_dt)
    grad_weight_hidden.add_(S * weight_embed.to(acc_dt))
    grad_weight_embed.add_(S * weight_hidden.to(acc_dt))
