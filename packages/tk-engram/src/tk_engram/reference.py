"""Plain-PyTorch references of every tk-engram op (CPU or GPU)."""


# ---------------------------------------------------------------------------------------------------------
# Engram hashing and gating (engram_hash, fused_weight, engram_gate_fwd/bwd, grad_w_reduce, engram_gate)
# ---------------------------------------------------------------------------------------------------------
import math  # noqa: E402

import torch  # noqa: E402

from tk_core import checks  # noqa: E402

INT32_MAX = 2**31 - 1


def make_offsets(vocab_sizes: torch.Tensor) -> torch.Tensor:
    """Per layer, the exclusive prefix sum of the flattened (N-1)*J table sizes of ``vocab_sizes`` (L, N-1, J):
    int32 (L, (N-1)*J). Raises ``ValueError`` where a layer's tables hold more than 2**31 - 1 rows in all (the
    offsets and row ids are int32)."""
    op = "make_offsets"
    checks.check_tensor(op, "vocab_sizes", vocab_sizes)
    checks.check_ndim(op, "vocab_sizes", vocab_sizes, 3)
    flat = vocab_sizes.reshape(vocab_sizes.shape[0], -1).to(torch.int64)
    ends = flat.cumsum(1)
    rows = int(ends[:, -1].max()) if ends.numel() else 0  # the largest layer's rows
    if rows > INT32_MAX:
        checks.fail(op, "vocab_sizes", f"at most {INT32_MAX} rows per layer in all (int32 row ids)", rows)
    return (ends - flat).to(torch.int32)


def engram_hash_ref(
    ngram_token_ids: torch.Tensor,
    multipliers: torch.Tensor,
    vocab_sizes: torch.Tensor,
    offsets: torch.Tensor,
    image_token_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """int32 (L, T, (N-1)*J): h ^= int64(id_i) * mult_i (wrapping); column block i-1 = floormod(h, vocab) + offset.
    Tokens flagged in ``image_token_mask`` (bool (T,)) get -1 in every column of every layer."""
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
    out = torch.cat(cols, dim=-1).to(torch.int32)
    if image_token_mask is not None:
        out = torch.where(image_token_mask[None, :, None], torch.full_like(out, -1), out)
    return out


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
    image_token_mask: torch.Tensor | None = None,
):
    """out = x + g * v with g = sigmoid(sign(s) * sqrt(max(|s|, clamp))), s = dot * rx * rk / sqrt(H).

    x, k: (T, n, H); v: (T, H); weight_fused: (n, H). Computed in float32 (float64 if any input is float64),
    differentiable. Returns ``(out, dot, gate, rstd_x, rstd_k)`` (the last four None unless saving); out has
    x's dtype, the others the compute dtype, shape (T, n). sign(0) = 0, so s = 0 gives g = 1/2.
    Tokens flagged in ``image_token_mask`` (bool (T,)) pass through: out = x, saved gate 0.
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
    if image_token_mask is not None:
        out = torch.where(image_token_mask[:, None, None], hidden_states, out)
        gate = torch.where(image_token_mask[:, None], torch.zeros_like(gate), gate)
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
    image_token_mask: torch.Tensor | None = None,
    save_for_backward: bool = False,
):
    """The whole gate from the two weights (differentiable): x [*, n, H], k [*, n, H], v [*, H], optional
    bool mask [*] of image tokens (passed through).

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
        None if image_token_mask is None else image_token_mask.reshape(-1),
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
    image_token_mask: torch.Tensor | None = None,
):
    """Closed-form backward of ``engram_gate_fwd_ref`` from its saved (T, n) intermediates.

    dg = sum_d G v; ddot = dg g (1-g) / 2 * sqrt(c rx rk / |dot|) where |s| >= clamp, else 0 (c = H^-1/2);
    grad_x = G + ddot (k w - x dot rx^2 / H); grad_k = ddot (x w - k dot rk^2 / H); grad_v = sum_h g_h G_h;
    grad_w_partial[p] = sum over the tokens of chunk p (chunk = ceil(T / num_parts)) of ddot x k.
    Returns ``(grad_x, grad_k, grad_v, grad_w_partial)``; grads in the inputs' dtypes, partial in the
    compute dtype, shape (num_parts, n, H). Tokens flagged in ``image_token_mask``: grad_x = G, grad_k = 0,
    grad_v = 0, no weight-gradient contribution.
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
    if image_token_mask is not None:
        m3 = image_token_mask[:, None, None]
        grad_x = torch.where(m3, G, grad_x)
        grad_k = torch.where(m3, torch.zeros_like(grad_k), grad_k)
        grad_v = torch.where(image_token_mask[:, None], torch.zeros_like(grad_v), grad_v)
        prod = torch.where(m3, torch.zeros_like(prod), prod)
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


# ---------------------------------------------------------------------------------------------------------
# GateConv (TileOPs-style Engram post-projection): forward, backward, decode step
# Conventions (see gate_conv.py): float32 math (float64 when an input is float64); "round" = to the storage
# dtype of H; n = round(vhat_f32 * w_v * r_v) is what the convolution and the decode cache see.
# ---------------------------------------------------------------------------------------------------------


def _gc_cdt(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _gc_shift(x: torch.Tensor, lag: int) -> torch.Tensor:
    """x[:, t - lag] along dim 1 (zeros outside [0, T)); lag may be negative (a look-ahead)."""
    if lag == 0:
        return x
    T_ = x.shape[1]
    out = torch.zeros_like(x)
    if abs(lag) >= T_:
        return out
    if lag > 0:
        out[:, lag:] = x[:, : T_ - lag]
    else:
        out[:, : T_ + lag] = x[:, -lag:]
    return out


def gate_conv_gate_ref(H, k, v, rms_w_h, rms_w_v, eps: float):
    """The per-token gate in compute precision: (alpha, r_h, r_k, r_v, vhat_f, n) with n rounded to H.dtype."""
    cd = _gc_cdt(H)
    d = H.shape[-1]
    h, kk, vv = H.to(cd), k.to(cd), v.to(cd)
    wh, wv = rms_w_h.to(cd), rms_w_v.to(cd)
    r_h = torch.rsqrt(h.square().mean(-1) + eps)
    r_k = torch.rsqrt(kk.square().mean(-1) + eps)
    s = (h * kk * (wh * wh)).sum(-1) * r_h * r_k / math.sqrt(d)
    a = torch.sigmoid(s)
    vh = a[..., None] * vv
    r_v = torch.rsqrt(a * a * vv.square().mean(-1) + eps)
    n = (vh * wv * r_v[..., None]).to(H.dtype).to(cd)
    return a, r_h, r_k, r_v, vh, n


def gate_conv_fwd_ref(H, k, v, rms_w_h, rms_w_v, conv_w, dilation: int = 1, eps: float = 1e-6):
    """GateConv forward. H, k, v: (M, T, d); rms_w_*: (d,); conv_w: (w, d).

    Returns (Y, vhat, alpha, rrms_h, rrms_k, rrms_v, conv_state): Y, vhat (M, T, d) in H.dtype; the four
    statistics (M, T) float32 (float64 for float64 inputs); conv_state (M, dilation*(w-1), d) in H.dtype, the
    ring cache of n for the last dilation*(w-1) tokens (slot tau mod len holds token tau; zeros before t=0).
    """
    cd = _gc_cdt(H)
    M, T_, d = H.shape
    w = conv_w.shape[0]
    hist = dilation * (w - 1)
    a, r_h, r_k, r_v, vh, n = gate_conv_gate_ref(H, k, v, rms_w_h, rms_w_v, eps)
    cw = conv_w.to(cd)
    u = torch.zeros_like(n)
    for p in range(w):
        u = u + cw[p] * _gc_shift(n, (w - 1 - p) * dilation)
    Y = (u * torch.sigmoid(u) + vh).to(H.dtype)
    st = torch.zeros((M, hist, d), dtype=H.dtype, device=H.device)
    if hist:
        padded = torch.cat([torch.zeros((M, hist, d), dtype=cd, device=H.device), n], dim=1)
        st = torch.roll(padded[:, -hist:], shifts=T_ % hist, dims=1).to(H.dtype)
    sd = torch.float64 if cd == torch.float64 else torch.float32
    return Y, vh.to(H.dtype), a.to(sd), r_h.to(sd), r_k.to(sd), r_v.to(sd), st


def gate_conv_bwd_ref(dY, H, k, v, rms_w_h, rms_w_v, conv_w, alpha, rrms_h, rrms_k, rrms_v, dilation: int = 1):
    """GateConv backward from the saved statistics (closed form, what the kernel computes).

    Returns (dH, dk, dv) in H.dtype and (drms_w_h, drms_w_v, dconv_w) in float32 (float64 for float64 inputs).
    """
    cd = _gc_cdt(H)
    d = H.shape[-1]
    w = conv_w.shape[0]
    g, h, kk, vv = dY.to(cd), H.to(cd), k.to(cd), v.to(cd)
    wh, wv, cw = rms_w_h.to(cd), rms_w_v.to(cd), conv_w.to(cd)
    a, rh, rk, rv = (x.to(cd)[..., None] for x in (alpha, rrms_h, rrms_k, rrms_v))
    vh = a * vv
    n = (vh * wv * rv).to(H.dtype).to(cd)
    u = torch.zeros_like(n)
    for p in range(w):
        u = u + cw[p] * _gc_shift(n, (w - 1 - p) * dilation)
    sg = torch.sigmoid(u)
    gu = g * sg * (1 + u * (1 - sg))
    gn = torch.zeros_like(gu)
    dconv = torch.zeros((w, d), dtype=cd, device=H.device)
    for p in range(w):
        lag = (w - 1 - p) * dilation
        gn = gn + cw[p] * _gc_shift(gu, -lag)
        dconv[p] = (gu * _gc_shift(n, lag)).sum((0, 1))
    B = (wv * gn * vv).sum(-1, keepdim=True)
    C = vv.square().sum(-1, keepdim=True)
    D = (g * vv).sum(-1, keepdim=True)
    P = (h * kk * wh * wh).sum(-1, keepdim=True)
    c1 = rv**3 * a * B / d
    gvh = rv * wv * gn - c1 * vh + g
    dv = a * gvh
    ga = rv * B - c1 * a * C + D
    cc = ga * a * (1 - a) / math.sqrt(d) * rh * rk
    dH = cc * (wh * wh * kk - rh * rh * P / d * h)
    dk = cc * (wh * wh * h - rk * rk * P / d * kk)
    drms_w_h = 2 * wh * (cc * h * kk).sum((0, 1))
    drms_w_v = (gn * vh * rv).sum((0, 1))
    sd = torch.float64 if cd == torch.float64 else torch.float32
    return dH.to(H.dtype), dk.to(H.dtype), dv.to(H.dtype), drms_w_h.to(sd), drms_w_v.to(sd), dconv.to(sd)


def decode_step_ref(e_t, h_t, conv_state, cache_pos, W_K, W_V, rms_w_h, rms_w_v, conv_w, dilation: int = 1,
                    eps: float = 1e-6):
    """One decode step; returns y (B, d) and updates ``conv_state`` (B, L, d) in place at slot pos mod L.

    k = round(e_t @ W_K), v = round(e_t @ W_V) (float32 accumulation; rounded to the storage dtype as a
    prefill's projection GEMM would); then the prefill gate; the cache holds n of earlier tokens at slot
    (position mod L); u = conv_w[w-1]*n + sum_q conv_w[w-1-q]*cache[(pos - q*dilation) mod L].
    """
    cd = _gc_cdt(h_t)
    B, d = h_t.shape
    w = conv_w.shape[0]
    kp = (e_t.to(cd) @ W_K.to(cd)).to(h_t.dtype)
    vp = (e_t.to(cd) @ W_V.to(cd)).to(h_t.dtype)
    a, _, _, _, vh, n = gate_conv_gate_ref(h_t, kp, vp, rms_w_h, rms_w_v, eps)
    cw = conv_w.to(cd)
    L = conv_state.shape[1]
    pos = cache_pos.to(torch.int64)
    rows = torch.arange(B, device=h_t.device)
    u = cw[w - 1] * n
    for q in range(1, w):
        u = u + cw[w - 1 - q] * conv_state[rows, torch.remainder(pos - q * dilation, L)].to(cd)
    y = (u * torch.sigmoid(u) + vh).to(h_t.dtype)
    if w > 1:
        conv_state[rows, torch.remainder(pos, L)] = n.to(conv_state.dtype)
    return y
