"""Plain-PyTorch references of every tk-quant op (CPU or GPU); the golden models the kernels match bit
for bit. Built on ``tk_core.formats`` (conversions, the scale rule) and ``tk_core.layout`` (SF layouts)."""


# --- per-token / general block casts, cast back, E5M6 (§9.1-9.4) ---------------------------------

import torch  # noqa: E402

from tk_core.formats import (  # noqa: E402
    compute_scales,
    decode_e5m6,
    encode_e2m1,
    encode_e4m3,
    encode_e5m6,
    pack_e2m1,
    pack_e5m6,
    round_stochastic,
    stochastic_bits_grid,
    unpack_e5m6,
)
from tk_core.layout import ceil_div, sf_to_layout  # noqa: E402

from .common import (  # noqa: E402
    FMT_MAX,
    OUT_DTYPES,
    QuantInput,
    alloc_sf_out,
    amax_clamp,
    check_quant_input,
    decode_data,
    decode_sf,
    expand_sf,
    sf_out_layout,
)


def _block_amax(v: torch.Tensor, bm: int, bk: int) -> torch.Tensor:
    """max |v| over each (bm, bk) block (partial edge blocks use their valid elements) -> (nm, nk).

    NaN is ignored like the kernels' ``fmaxf`` does (a NaN-only block gives 0)."""
    t, h = v.shape
    nm, nk = ceil_div(t, bm), ceil_div(h, bk)
    a = torch.nan_to_num(v.abs(), nan=0.0, posinf=float("inf"))
    a = torch.nn.functional.pad(a, (0, nk * bk - h, 0, nm * bm - t))
    return a.view(nm, bm, nk, bk).amax(dim=(1, 3))


def _sf_to_out(sf_rows: torch.Tensor, layout: str, e4m3_sf: bool) -> torch.Tensor:
    if not e4m3_sf:
        return sf_to_layout(sf_rows, layout)
    out = alloc_sf_out(*sf_rows.shape, layout, sf_rows.device, e4m3_sf=True)
    out.copy_(sf_rows)
    return out


def cast(
    x,
    fmt: str,
    block_size=(32, 32),
    sf: torch.Tensor | None = None,
    x_block_size=None,
    round_sf: bool = False,
    use_tma_aligned_col_major_sf: bool = False,
    use_packed_ue8m0: bool = False,
    use_e4m3_sf: bool = False,
    stochastic_seed: int | None = None,
):
    """General 2-D block quantizer to e4m3 or packed e2m1 with scale block ``block_size = (bm, bk)``.

    ``x`` is a bf16/fp32 ``(T, H)`` tensor (any row stride) or a QuantTensor ``(data, sf_in)`` with block
    ``x_block_size``; a QuantTensor is requantized in kernel order: ``amax = max |decode(data)*s_in|``,
    ``q = convert(decode(data) * (s_in * sf_inv))``. Scales follow ``tk_core.formats.compute_scales``
    (floor ``tk_core.config.get_amax_clamp``); with ``use_e4m3_sf`` the scale is ``sf = e4m3(A'/Q)`` and
    ``sf_inv = 1/float(sf)``. With ``sf`` given (any layout), ``sf_inv = 1/sf`` and only the data is returned.
    Returns ``(data, sf)`` with ``sf`` in the layout of the flags (``tk_core.layout``).
    """
    op = "tk_quant.reference.cast"
    if fmt not in ("e4m3", "e2m1"):
        raise ValueError(f"{op}: fmt must be one of ('e4m3', 'e2m1'), got {fmt!r}")
    bm, bk = block_size
    if isinstance(x, (tuple, list)):
        q = check_quant_input(op, x, x_block_size)
        s_in = expand_sf(decode_sf(q.sf, q.nm, q.nk), q.t, q.h, *q.block)
        base = decode_data(q.data)
        v = base * s_in
    else:
        if x.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"{op}: x must be of dtype float32 or bfloat16, got {x.dtype}")
        base, s_in = x.float(), None
        v = base
    t, h = v.shape
    if fmt == "e2m1" and h % 2:
        raise ValueError(f"{op}: hidden must be even for e2m1, got {h}")
    nm, nk = ceil_div(t, bm), ceil_div(h, bk)
    layout = sf_out_layout(op, use_tma_aligned_col_major_sf, use_packed_ue8m0, round_sf, use_e4m3_sf)
    if sf is not None:
        sf_rows = decode_sf(sf, nm, nk)
        if tuple(sf_rows.shape) != (nm, nk):
            raise ValueError(f"{op}: sf must be of shape {(nm, nk)}, got shape {tuple(sf.shape)}")
        sf_inv = torch.ones_like(sf_rows) / sf_rows  # tensor / tensor: the correctly rounded division
    else:
        amax = _block_amax(v, bm, bk)
        if use_e4m3_sf:
            a = torch.clamp_min(amax, amax_clamp(fmt, True))
            # tensor / tensor: on CUDA ``tensor / python_scalar`` multiplies by a rounded reciprocal
            sf_rows = encode_e4m3(a / torch.full_like(a, FMT_MAX[fmt])).float()
            sf_inv = torch.ones_like(sf_rows) / sf_rows
        else:
            sf_rows, sf_inv = compute_scales(amax, FMT_MAX[fmt], amax_clamp(fmt), round_sf)
    mult = expand_sf(sf_inv, t, h, bm, bk)
    y = base * (s_in * mult) if s_in is not None else base * mult
    if stochastic_seed is not None:
        y = round_stochastic(y, fmt, stochastic_bits_grid(stochastic_seed, t, h, y.device))
    data = encode_e4m3(y) if fmt == "e4m3" else pack_e2m1(encode_e2m1(y))
    if sf is not None:
        return data
    return data, _sf_to_out(sf_rows, layout, use_e4m3_sf)


def per_token_cast_and_cast_back(x: torch.Tensor, fmt: str, num_per_channels: int, round_sf: bool = False,
                                 use_e4m3_sf: bool = False) -> torch.Tensor:
    """``cast_back(cast(x, fmt, (1, num_per_channels), ...))`` in ``x``'s dtype (bf16 / fp32): the fake-quantized
    values (a new tensor; the op writes them into ``x``)."""
    q = cast(x, fmt, (1, num_per_channels), round_sf=round_sf, use_e4m3_sf=use_e4m3_sf)
    return cast_back(q, "bf16" if x.dtype == torch.bfloat16 else "fp32", (1, num_per_channels))


def elementwise_cast(x: torch.Tensor, dtype: torch.dtype, stochastic_seed: int | None = None) -> torch.Tensor:
    """``x`` (float32 / bfloat16) -> ``dtype`` (bfloat16 / float8_e4m3fn) element by element, no scaling: RNE
    (e4m3 saturating, ``encode_e4m3``), or with ``stochastic_seed`` ``round_stochastic`` onto the output's grid
    with the bits ``stochastic_bits(stochastic_seed, i >> 32, i % 2**32)`` of flat element ``i`` first."""
    y = x.float()
    if stochastic_seed is not None:
        n = x.numel()
        fmt = "bf16" if dtype == torch.bfloat16 else "e4m3"
        # flat element i is grid element (i >> 32, i % 2**32)
        bits = stochastic_bits_grid(stochastic_seed, ceil_div(n, 2**32), min(n, 2**32), x.device).reshape(-1)[:n]
        y = round_stochastic(y.reshape(-1), fmt, bits).view(x.shape)
    return y.to(torch.bfloat16) if dtype == torch.bfloat16 else encode_e4m3(y)


def cast_back(x, fmt: str, block_size=(32, 32)) -> torch.Tensor:
    """``round_out(decode(data) * s)`` with ``s`` the block's scale (any SF layout); ``fmt`` 'bf16'/'fp32'."""
    op = "tk_quant.reference.cast_back"
    if fmt not in OUT_DTYPES:
        raise ValueError(f"{op}: fmt must be one of ('bf16', 'fp32'), got {fmt!r}")
    q = check_quant_input(op, x, block_size)
    s = expand_sf(decode_sf(q.sf, q.nm, q.nk), q.t, q.h, *q.block)
    return (decode_data(q.data) * s).to(OUT_DTYPES[fmt])


def cast_to_e5m6(
    x: torch.Tensor,
    num_per_channels: int,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
):
    """bf16/fp32 ``(T, H)`` -> (uint8 ``(T, 3H/2)`` packed E5M6 words, SF ``(T, H/bk)``).

    ``sf, sf_inv`` from the scale rule with ``Q = 65024`` and floor ``get_amax_clamp('e5m6')``;
    ``y = x * sf_inv``; each ``y`` is encoded by ``tk_core.formats.encode_e5m6`` (RZ to fp16, top 12 bits,
    round half-even on the fp32 bits below) and packed 8 codes -> 3 little-endian words.
    """
    op = "tk_quant.reference.cast_to_e5m6"
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"{op}: x must be of dtype float32 or bfloat16, got {x.dtype}")
    t, h = x.shape
    if h % 8 or h % num_per_channels:
        raise ValueError(f"{op}: hidden must be a multiple of 8 and of num_per_channels, got {h}")
    layout = sf_out_layout(op, use_tma_aligned_col_major_sf, use_packed_ue8m0, round_sf)
    v = x.float()
    amax = _block_amax(v, 1, num_per_channels)
    sf_rows, sf_inv = compute_scales(amax, FMT_MAX["e5m6"], amax_clamp("e5m6"), round_sf)
    y = v * expand_sf(sf_inv, t, h, 1, num_per_channels)
    data = pack_e5m6(encode_e5m6(y)) if t else torch.empty((0, h * 3 // 2), dtype=torch.uint8, device=x.device)
    return data, sf_to_layout(sf_rows, layout)


def cast_back_from_e5m6(x, fmt: str, x_block_size) -> torch.Tensor:
    """Packed E5M6 ``(data uint8 (T, 3H/2), sf)`` -> ``round_out(decode_e5m6(code) * s)`` in bf16/fp32."""
    op = "tk_quant.reference.cast_back_from_e5m6"
    if fmt not in OUT_DTYPES:
        raise ValueError(f"{op}: fmt must be one of ('bf16', 'fp32'), got {fmt!r}")
    q: QuantInput = check_quant_input(op, x, x_block_size, data_fmts=("e5m6",))
    codes = unpack_e5m6(q.data) if q.t else torch.empty((0, q.h), dtype=torch.int32, device=q.data.device)
    s = expand_sf(decode_sf(q.sf, q.nm, q.nk), q.t, q.h, *q.block)
    return (decode_e5m6(codes) * s).to(OUT_DTYPES[fmt])


# --- lossless FP4 -> FP8 block re-quantization, per-channel fused cast (§4, §9.7) ------------------


def per_block_cast_lossless(
    x,
    fmt: str,
    x_block_size,
    out_block_size,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = True,
    use_packed_ue8m0: bool = False,
):
    """FP4 ``(data int8 (T, H/2), sf)`` with power-of-two scales -> ``(e4m3 (T, H), sf_out, num_errors)``.

    Per output block: ``E = max e_i`` over the biased exponents of the input scales it covers,
    ``e_out = max(E - 6, 1)``, ``out = e4m3(fp4 * 2**(e_i - e_out))`` (0 for a zero scale), output scale
    ``2**(e_out - 127)``. ``num_errors`` counts the 32-column row segments whose scale is inadmissible
    (not ``+2**k`` or ``+0``, inf/NaN/byte 255, or ``e_i - e_out < -8``); those are still converted
    (RNE, saturating) as the kernel does.
    """
    from tk_core.formats import decode_e2m1, pow2, unpack_e2m1

    op = "tk_quant.reference.per_block_cast_lossless"
    if fmt != "e4m3" or not round_sf:
        raise ValueError(f"{op}: fmt must be 'e4m3' with round_sf=True, got {fmt!r}, round_sf={round_sf}")
    q = check_quant_input(op, x, x_block_size, data_fmts=("e2m1",))
    t, h = q.t, q.h
    (bmi, bki), (bmo, bko) = x_block_size, out_block_size
    layout = sf_out_layout(op, use_tma_aligned_col_major_sf, use_packed_ue8m0, True)
    dev = q.data.device
    if q.sf.dtype == torch.int32:
        from tk_core.formats import unpack_ue8m0

        e_in = unpack_ue8m0(q.sf.contiguous(), q.nk)[: q.nm].to(torch.int32)
        bad_in = e_in == 255
    else:
        bits = q.sf.float().contiguous()[: q.nm, : q.nk].view(torch.int32)
        e_in = (bits >> 23) & 0xFF
        bad_in = ((bits & -0x7F800001) != 0) | (e_in == 255)
    e = expand_sf(e_in.float(), t, h, bmi, bki).to(torch.int32)  # per element (exact: <= 255)
    bad = expand_sf(bad_in.float(), t, h, bmi, bki) != 0
    nmo, nko = ceil_div(t, bmo), ceil_div(h, bko)
    ep = torch.nn.functional.pad(e, (0, nko * bko - h, 0, nmo * bmo - t))
    e_max = ep.view(nmo, bmo, nko, bko).amax(dim=(1, 3)) if t else torch.zeros((0, nko), dtype=torch.int32, device=dev)
    e_out = torch.clamp_min(e_max - 6, 1)
    e_out_el = expand_sf(e_out.float(), t, h, bmo, bko).to(torch.int32)
    d = e - e_out_el
    bad = bad | ((e != 0) & (d < -8))
    mult = torch.where(e == 0, torch.zeros((), device=dev), pow2(torch.clamp_min(d, -126)))
    vals = decode_e2m1(unpack_e2m1(q.data)) if t else torch.zeros((0, h), device=dev)
    # magnitude * scale, then the sign: the kernel's byte LUT holds magnitudes and ORs the sign in
    out = encode_e4m3(vals.abs() * mult).view(torch.uint8) | (torch.signbit(vals).to(torch.uint8) << 7)
    out = out.view(torch.float8_e4m3fn)
    sf_rows = pow2(e_out - 127)
    n_err = int(bad.view(t, h // 32, 32).any(dim=2).sum()) if t else 0
    return out, sf_to_layout(sf_rows, layout), n_err


def per_channel_cast_fused(x, num_per_tokens: int, num_per_channels, round_sf: bool, pos_to_token=None):
    """§9.7: gather rows (``pos_to_token``; negative or out-of-range -> zero row), then a per-channel e4m3
    cast with blocks ``(num_per_tokens, 1)``. QuantTensor input ``(e4m3 (T, H), fp32 sf (T, H/bk))`` is
    dequantized as ``v = decode(x) * s_in`` and quantized as ``(decode(x) * s_in) * sf_inv``, left to right.
    Returns ``(out e4m3 (T_out, H), sf fp32 (ceil(T_out/bm), H))``."""
    if isinstance(x, (tuple, list)):
        data, s = x
        v = data.float() * expand_sf(s.float(), data.shape[0], data.shape[1], 1, num_per_channels)
    else:
        v = x.float()
    if pos_to_token is not None:
        idx = pos_to_token.long()
        valid = (idx >= 0) & (idx < v.shape[0])
        v = v[idx.clamp(0, max(v.shape[0] - 1, 0))] if v.shape[0] else v.new_zeros((idx.shape[0], v.shape[1]))
        v = torch.where(valid[:, None], v, torch.zeros((), device=v.device))
    amax = _block_amax(v, num_per_tokens, 1)
    sf_rows, sf_inv = compute_scales(amax, FMT_MAX["e4m3"], amax_clamp("e4m3"), round_sf)
    out = encode_e4m3(v * expand_sf(sf_inv, v.shape[0], v.shape[1], num_per_tokens, 1))
    return out, sf_rows


# --- fused SwiGLU + casts (§7, §9.5, §9.6) --------------------------------------------------------
#
# SwiGLU of a row [g | u]: act = g / (1 + exp(-g)) * u in float32, in this order (``torch.exp`` matches CUDA
# ``expf`` on the GPU; CPU results may differ from the GPU in the last bit of exp). The backward needs
# ``fma(g, 1 - s, 1)`` with one rounding, as the kernel's ``__fmaf_rn``: ``fma_f32`` computes it exactly on
# any device from float64 (the product of two floats is exact in float64; the sum is rounded to odd with a
# TwoSum error term, and round-to-odd at 53 bits followed by RNE to 24 bits is a correct single rounding).


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``fl32(a * b + c)`` with a single rounding (IEEE fma), bit-exact on CPU and GPU."""
    a64, b64, c64 = a.double(), b.double(), c.double()
    p = a64 * b64  # exact
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)  # TwoSum: p + c == s + err exactly
    inexact = (err != 0) & torch.isfinite(s)
    even = (s.view(torch.int64) & 1) == 0
    inf = torch.full_like(s, float("inf"))
    toward = torch.nextafter(s, torch.where(err > 0, inf, -inf))
    return torch.where(inexact & even, toward, s).float()


def _clamp_gu(g: torch.Tensor, u: torch.Tensor, c):
    """``(g', u', cg, cu_hi, cu_lo)``: g <- (g > c ? c : g), u <- clamp(u, -c, c) (selects, NaN kept)."""
    if c is None:
        return g, u, None, None, None
    c = torch.tensor(c, dtype=torch.float32, device=g.device)
    cg, chi, clo = g > c, u > c, u < -c
    return torch.where(cg, c, g), torch.where(chi, c, torch.where(clo, -c, u)), cg, chi, clo


def _swiglu_act(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return g / (1.0 + torch.exp(-g)) * u


def _row_weights(e: int, pos_to_token_topk, topk_weights, device):
    """Per-row weights (float32 ``(E,)``) or None: ``topk_weights.flat[idx]`` (0 for ``idx < 0``), or 1-D."""
    if topk_weights is None:
        return None
    if pos_to_token_topk is None:
        return topk_weights.float().reshape(e)
    idx = pos_to_token_topk.long()
    flat = topk_weights.float().reshape(-1)
    if flat.numel() == 0:
        return torch.zeros(e, device=device)
    valid = (idx >= 0) & (idx < flat.numel())  # like the kernels: out-of-range indices read weight 0
    return torch.where(valid, flat[idx.clamp(0, flat.numel() - 1)], torch.zeros((), device=device))


def swiglu_forward(x, pos_to_token_topk=None, topk_weights=None, swiglu_clamp_value=None, clamped_count=None):
    """§9.5: float32 ``(E, H)`` ``act * w`` of ``x = [g | u]`` (bf16/fp32 ``(E, 2H)``); ``w`` as in
    ``_row_weights`` (none when ``topk_weights`` is None). ``clamped_count[0..2] +=`` the counts of
    ``g > c``, ``u > c``, ``u < -c`` over all rows (before clamping)."""
    h = x.shape[1] // 2
    xf = x.float()
    g, u = xf[:, :h], xf[:, h:]
    g2, u2, cg, chi, clo = _clamp_gu(g, u, swiglu_clamp_value)
    if clamped_count is not None and cg is not None:
        clamped_count[:3] += torch.stack([cg.sum(), chi.sum(), clo.sum()]).to(clamped_count)
    act = _swiglu_act(g2, u2)
    w = _row_weights(x.shape[0], pos_to_token_topk, topk_weights, x.device)
    return act if w is None else act * w[:, None]


# Spans of 512 columns per warp in the backward kernel: a row is split over ceil(H / (512 * spans)) warps of one
# CTA, which fixes the summation order of ``wgrad_dot``.
WGRAD_SPANS = 2


def wgrad_spans(h: int) -> int:
    """Spans per warp of the backward kernel for rows of ``h`` columns: ``WGRAD_SPANS``, or more where a row
    would need more than 32 warps (a CTA has at most 1,024 threads; ``h > 32,768``)."""
    spans_per_row = -(-h // 512)
    return max(WGRAD_SPANS, -(-spans_per_row // 32))


def wgrad_dot(grad: torch.Tensor, act: torch.Tensor, spans: int = 0) -> torch.Tensor:
    """Per-row ``sum_j fl(grad[p, j] * act[p, j])`` in the kernel's order: warp ``w`` owns the ``spans``
    512-column spans ``w*spans .. w*spans + spans - 1``; its lane ``l`` owns columns ``it*512 + c*256 + l*8 + i``
    (c in {0, 1}, i in 0..7) and adds their products one by one in (it, c, i) order starting from +0; then
    ``v += shfl_xor(v, o)`` for o = 16, 8, 4, 2, 1; the row's sum is ``((s_0 + s_1) + s_2) + ...`` over the
    warps' sums. float32 ``(E,)``. ``spans`` 0: the kernel's, ``wgrad_spans(H)``."""
    e, h = grad.shape
    spans = spans or wgrad_spans(h)
    prod = grad.float() * act.float()
    warps = -(-h // (512 * spans))
    prod = torch.nn.functional.pad(prod, (0, warps * spans * 512 - h))
    p = prod.view(e, warps, spans, 2, 32, 8).permute(0, 1, 4, 2, 3, 5).reshape(e, warps, 32, spans * 16)
    acc = torch.zeros((e, warps, 32), dtype=torch.float32, device=grad.device)
    for j in range(spans * 16):
        acc = acc + p[..., j]
    lanes = torch.arange(32, device=grad.device)
    for off in (16, 8, 4, 2, 1):
        acc = acc + acc[:, :, lanes ^ off]
    tot = acc[:, 0, 0]
    for w in range(1, warps):
        tot = tot + acc[:, w, 0]
    return tot


def swiglu_backward(x, grad_out, weight, pos_to_token_topk, token_topk_to_pos, num_per_channels, swiglu_clamp_value=None):
    """§9.6: ``(out fp32 (E, H), x_grad fp32 (E, 2H), weight_grad fp32 (N, K))`` for ``x = (x_fp8, x_sf)``
    (per-token scales with ``num_per_channels`` columns). ``weight_grad`` holds ``wgrad_dot`` of each row
    with ``pos_to_token_topk >= 0`` at that flat index and 0 elsewhere (``token_topk_to_pos`` is unused)."""
    xq, xs = x
    xq = xq.reshape(-1, xq.shape[-1])
    e, h2 = xq.shape
    h = h2 // 2
    xf = xq.float() * expand_sf(xs.float(), e, h2, 1, num_per_channels)
    g, u, cg, chi, clo = _clamp_gu(xf[:, :h], xf[:, h:], swiglu_clamp_value)
    t = 1.0 + torch.exp(-g)
    s = torch.ones_like(t) / t
    act = g / t * u
    w = _row_weights(e, pos_to_token_topk, weight, xq.device)[:, None]
    out = act * w
    gf = grad_out.reshape(e, h).float()
    gws = gf * w * s
    dg = gws * u * fma_f32(g, 1.0 - s, torch.ones_like(g))
    du = gws * g
    if cg is not None:
        zero = torch.zeros((), device=xq.device)
        dg = torch.where(cg, zero, dg)
        du = torch.where(chi | clo, zero, du)
    weight_grad = torch.zeros_like(weight, dtype=torch.float32)
    idx = pos_to_token_topk.long()
    valid = (idx >= 0) & (idx < weight_grad.numel())
    if e:
        weight_grad.view(-1)[idx[valid]] = wgrad_dot(gf, act)[valid]
    return out, torch.cat([dg, du], dim=1), weight_grad


def swiglu_forward_and_per_token_cast(
    x,
    fmt: str,
    num_per_channels: int,
    pos_to_token_topk=None,
    topk_weights=None,
    pos_to_expert=None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
    swiglu_clamp_value=None,
    clamped_count=None,
    sf_clamp_min=None,
):
    """Golden model of ``tk_quant.swiglu_forward_and_per_token_cast``: ``v = act * w`` per row, a per-token
    e4m3 cast with ``(1, num_per_channels)`` blocks and floor ``sf_clamp_min`` (default
    ``get_amax_clamp('e4m3')``); rows with ``pos_to_expert < 0`` get zero data and zero scales and are not
    counted; ``clamped_count += [#g>c, #u>c, #u<-c(, H * rows)]`` over the other rows."""
    e, h = x.shape[0], x.shape[1] // 2
    layout = sf_out_layout("tk_quant.reference.swiglu_forward_and_per_token_cast", use_tma_aligned_col_major_sf,
                           use_packed_ue8m0, round_sf)
    keep = pos_to_expert >= 0 if pos_to_expert is not None else torch.ones(e, dtype=torch.bool, device=x.device)
    if clamped_count is not None and swiglu_clamp_value is not None:
        xf = x.float()[keep]
        c = torch.tensor(swiglu_clamp_value, dtype=torch.float32, device=x.device)
        g, u = xf[:, :h], xf[:, h:]
        counts = [(g > c).sum(), (u > c).sum(), (u < -c).sum()]
        if clamped_count.shape[0] > 3:
            counts.append(keep.sum() * h)
        clamped_count += torch.stack(counts).to(clamped_count)
    v = swiglu_forward(x, pos_to_token_topk, topk_weights, swiglu_clamp_value)
    clamp_min = amax_clamp(fmt) if sf_clamp_min is None else float(sf_clamp_min)
    amax = _block_amax(v, 1, num_per_channels)
    sf_rows, sf_inv = compute_scales(amax, FMT_MAX[fmt], clamp_min, round_sf)
    data = encode_e4m3(v * expand_sf(sf_inv, e, h, 1, num_per_channels))
    zero = torch.zeros((), device=x.device)
    data = torch.where(keep[:, None], data.view(torch.uint8), zero.to(torch.uint8)).view(torch.float8_e4m3fn)
    sf_rows = torch.where(keep[:, None], sf_rows, zero)
    return data, sf_to_layout(sf_rows, layout)


def swiglu_backward_and_per_token_cast(
    x,
    grad_out,
    weight,
    pos_to_token_topk,
    token_topk_to_pos,
    num_per_channels: int,
    round_sf: bool = False,
    swiglu_clamp_value=None,
    use_tma_aligned_col_major_sf: bool = False,
    use_packed_ue8m0: bool = False,
):
    """Golden model of ``tk_quant.swiglu_backward_and_per_token_cast``: ``swiglu_backward``, then
    ``out`` and ``x_grad`` rounded to bf16 and the float32 ``x_grad`` cast per token (``(1, bk)`` blocks).
    Returns ``(out, (x_grad_fp8, sf), x_grad, weight_grad)``."""
    out, x_grad, weight_grad = swiglu_backward(
        x, grad_out, weight, pos_to_token_topk, token_topk_to_pos, num_per_channels, swiglu_clamp_value
    )
    q = cast(x_grad, "e4m3", (1, num_per_channels), round_sf=round_sf,
             use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf, use_packed_ue8m0=use_packed_ue8m0)
    return out.bfloat16(), q, x_grad.bfloat16(), weight_grad


def swiglu_forward_and_per_channel_cast_and_transpose(
    x, fmt: str, num_per_tokens: int, round_sf: bool = False, without_transpose: bool = False, swiglu_clamp_value=None
):
    """Golden model of ``tk_quant.swiglu_forward_and_per_channel_cast_and_transpose``: ``a = bf16(act)``,
    per-channel e4m3 cast with ``(num_per_tokens, 1)`` blocks; data transposed to ``(H, T)`` unless
    ``without_transpose``; SF row-major ``(T / num_per_tokens, H)``."""
    a = swiglu_forward(x, swiglu_clamp_value=swiglu_clamp_value).bfloat16()
    data, sf = cast(a, fmt, (num_per_tokens, 1), round_sf=round_sf)
    return (data if without_transpose else data.t().contiguous()), sf
