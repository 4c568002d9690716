"""Fused SwiGLU + quantization: references (cpu), kernel compilation (compile), kernels vs references (gpu;
TK_FULL_TEST=1 widens the gpu grids to the 1.0.0 matrices)."""

import math
from fractions import Fraction

import pytest
import torch

import tk_quant
from tk_core.formats import compute_scales, encode_e4m3
from tk_core.jit import ARCHS
from tk_core.layout import sf_layout, sf_to_row_major
from tk_core.testing import (
    assert_equal,
    calc_diff,
    capture_cuda_graph,
    full_test,
    generate_fused_mapping,
    generate_topk_idx,
    opcheck,
)
from tk_core.testing.compile_check import assert_compiles
from tk_quant import reference as R
from tk_quant import swiglu as S

# --- helpers (self-contained: the MoE fused layout of moe-engram-mhc.md §4.0) ---------------------


def expand_to_fused(x: torch.Tensor, pos_to_token_topk: torch.Tensor, num_topk: int) -> torch.Tensor:
    out = torch.zeros((pos_to_token_topk.numel(), x.shape[1]), dtype=x.dtype, device=x.device)
    real = pos_to_token_topk >= 0
    out[real] = x[pos_to_token_topk[real].long() // num_topk]
    return out


def moe_case(num_tokens: int, num_topk: int, num_experts: int, alignment: int, device):
    idx = (
        torch.stack([torch.randperm(num_experts, device=device)[:num_topk] for _ in range(num_tokens)])
        if num_tokens
        else (torch.empty((0, num_topk), dtype=torch.int64, device=device))
    )
    idx = torch.where(torch.rand(idx.shape, device=device) < 0.2, -1, idx)  # some (t, k) routed elsewhere
    return idx, generate_fused_mapping(idx, num_experts, alignment)


def f32(v: float) -> torch.Tensor:
    return torch.tensor([v], dtype=torch.float32)


# --- cpu tier: references ---------------------------------------------------------------------------


def _exact_fma(a: float, b: float, c: float) -> float:
    """Correctly rounded float32 of the exact a*b+c (Fractions), via a round-to-nearest-even search."""
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    approx = torch.tensor(float(exact), dtype=torch.float64).float()
    best = None
    for cand in (torch.nextafter(approx, f32(-math.inf)[0]), approx, torch.nextafter(approx, f32(math.inf)[0])):
        d = abs(Fraction(cand.item()) - exact)
        even = (cand.view(torch.int32).item() & 1) == 0
        if best is None or d < best[0] or (d == best[0] and even):
            best = (d, cand.item())
    return best[1]


def test_fma_f32_double_rounding_cases():
    a = f32(1 + 2**-12)
    # the exact product is an f32 midpoint; a tiny c decides the direction (naive float64 gets it wrong)
    assert R.fma_f32(a, a, f32(2.0**-80)).item() == 1 + 2**-11 + 2**-23
    assert R.fma_f32(a, a, f32(-(2.0**-80))).item() == 1 + 2**-11
    assert (a.double() * a.double() + 2.0**-80).float().item() == 1 + 2**-11  # what naive code gives
    assert R.fma_f32(f32(3.0), f32(0.0), f32(-0.0)).item() == 0.0
    assert math.copysign(1, R.fma_f32(f32(-1.0), f32(0.0), f32(-0.0)).item()) == -1


def test_fma_f32_random_against_fractions():
    g = torch.randn(300) * 4
    s = torch.sigmoid(torch.randn(300) * 3)
    one_minus = 1.0 - s
    got = R.fma_f32(g, one_minus, torch.ones(300))
    for i in range(300):
        assert got[i].item() == _exact_fma(g[i].item(), one_minus[i].item(), 1.0), i


def test_swiglu_forward_against_float64():
    x = torch.randn(33, 2 * 96) * 3
    ref = R.swiglu_forward(x)
    g, u = x.double()[:, :96], x.double()[:, 96:]
    want = g / (1 + torch.exp(-g)) * u
    torch.testing.assert_close(ref.double(), want, rtol=2e-6, atol=1e-7)


def test_swiglu_forward_clamp_weights_counts():
    x = torch.tensor([[2.0, -3.0, 0.25, 5.0, -7.0, 0.5]])  # g = (2, -3, 0.25), u = (5, -7, 0.5)
    cnt = torch.zeros(3, dtype=torch.int64)
    out = R.swiglu_forward(x, swiglu_clamp_value=1.0, clamped_count=cnt)
    assert cnt.tolist() == [1, 1, 1]
    g = torch.tensor([1.0, -3.0, 0.25])
    u = torch.tensor([1.0, -1.0, 0.5])
    assert_equal(out, (g / (1 + torch.exp(-g)) * u)[None])
    w = torch.tensor([[0.5, 2.0]])
    assert_equal(R.swiglu_forward(x, torch.tensor([1], dtype=torch.int32), w), R.swiglu_forward(x) * 2.0)
    assert_equal(R.swiglu_forward(x, torch.tensor([-1], dtype=torch.int32), w), R.swiglu_forward(x) * 0.0)


@pytest.mark.parametrize("fmt_max", [448.0, 6.0, 57344.0])
def test_pow2_scale_constants_give_the_rounded_scale_rule(fmt_max):
    """The kernels' scale rule from the amax's bits (``int_scale``) against the division of ``compute_scales``:
    every exponent of the range, each with the significands around ``fmt_max``'s (where ``k`` steps) and random
    ones."""
    p, round_up, lo = S.pow2_scale_constants(fmt_max)
    mant_f = 0x7FFFFF - round_up
    g = torch.Generator().manual_seed(42)
    mants = torch.cat([
        torch.tensor([0, 1, mant_f - 1, mant_f, mant_f + 1, 0x7FFFFE, 0x7FFFFF]).clamp(0, 0x7FFFFF),
        torch.randint(0, 1 << 23, (64,), generator=g),
    ])
    exps = torch.arange(lo >> 23, 255)
    bits = ((exps[:, None] << 23) | mants[None, :]).flatten()
    bits = bits[bits >= lo].to(torch.int32)
    a = bits.view(torch.float32)
    sf, sf_inv = compute_scales(a, fmt_max, 0.0, round_sf=True)
    t = (bits.long() + round_up) >> 23
    assert torch.equal(sf.view(torch.int32).long(), (t - p) << 23)
    assert torch.equal(sf_inv.view(torch.int32).long(), (254 + p - t) << 23)
    with pytest.raises(ValueError, match="pow2_scale_constants: fmt_max must be at least 4"):
        S.pow2_scale_constants(2.0)


def test_wgrad_dot_order_and_value():
    grad = torch.randn(5, 1280)
    act = torch.randn(5, 1280)
    got = R.wgrad_dot(grad, act)
    want = (grad.double() * act.double()).sum(1)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    # the order is the kernel's, not torch's: lane 0 alone (columns 0..7 of each span) for a one-hot grad
    g1 = torch.zeros(1, 512)
    g1[0, 3] = 1.0
    assert R.wgrad_dot(g1, torch.full((1, 512), 7.0)).item() == 7.0


def test_swiglu_backward_against_float64_autograd():
    e, h, bk = 24, 256, 128
    xq, xs = R.cast(torch.randn(e, 2 * h), "e4m3", (1, bk))
    n, k = 16, 2
    weight = torch.rand(n, k)
    ptt = torch.full((e,), -1, dtype=torch.int32)
    perm = torch.randperm(n * k)[: e - 4]
    ptt[: e - 4] = perm.int()
    ttp = torch.full((n * k,), -1, dtype=torch.int32)
    ttp[perm] = torch.arange(e - 4, dtype=torch.int32)
    grad = torch.randn(e, h).bfloat16()
    out, x_grad, wg = R.swiglu_backward((xq, xs), grad, weight, ptt, ttp.view(n, k), bk)
    xf = (xq.float() * xs.repeat_interleave(bk, 1)).double().requires_grad_()
    w = torch.where(ptt >= 0, weight.view(-1)[ptt.long().clamp(min=0)], 0.0).double()[:, None].requires_grad_()
    g, u = xf[:, :h], xf[:, h:]
    act = g * torch.sigmoid(g) * u
    (act * w * grad.double()).sum().backward()
    torch.testing.assert_close(out.double(), (act * w).detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x_grad.double(), xf.grad, rtol=1e-4, atol=1e-5)
    want_wg = torch.zeros(n * k, dtype=torch.float64)
    want_wg[ptt[ptt >= 0].long()] = (act.detach() * grad.double()).sum(1)[ptt >= 0]
    torch.testing.assert_close(wg.view(-1).double(), want_wg, rtol=1e-4, atol=1e-3)
    assert (wg.view(-1)[ttp < 0] == 0).all()


def test_swiglu_backward_clamped_gradients_are_zero():
    e, h, bk = 4, 128, 32
    xq, xs = R.cast(torch.randn(e, 2 * h) * 4, "e4m3", (1, bk))
    weight = torch.rand(2, 2)
    ptt = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    ttp = torch.arange(4, dtype=torch.int32).view(2, 2)
    _, x_grad, _ = R.swiglu_backward((xq, xs), torch.randn(e, h).bfloat16(), weight, ptt, ttp, bk, 0.5)
    xf = xq.float() * xs.repeat_interleave(bk, 1)
    assert (x_grad[:, :h][xf[:, :h] > 0.5] == 0).all()
    assert (x_grad[:, h:][xf[:, h:].abs() > 0.5] == 0).all()


@pytest.mark.parametrize(
    "layout, bk",
    [
        (lay, bk)
        for lay in [(False, False, False), (False, True, False), (True, True, False), (True, True, True)]
        for bk in (32, 128, 256)
        if not (bk == 256 and lay[0])
    ],  # one scale per row (256 = H) is row-major only
)
def test_forward_per_token_reference_matches_composition(layout, bk):
    col, round_sf, packed = layout
    x = torch.randn(19, 512).bfloat16()
    out, sf = R.swiglu_forward_and_per_token_cast(x, "e4m3", bk, None, None, None, col, round_sf, packed)
    want_out, want_sf = R.cast(
        R.swiglu_forward(x),
        "e4m3",
        (1, bk),
        round_sf=round_sf,
        use_tma_aligned_col_major_sf=col,
        use_packed_ue8m0=packed,
    )
    assert_equal(out, want_out)
    assert_equal(sf, want_sf, check_stride=True)


def test_forward_per_token_reference_masks_counts_and_floor():
    x = torch.randn(8, 512).bfloat16() * 4
    pe = torch.tensor([0, -1, 1, 2, -1, 0, 0, 3], dtype=torch.int32)
    cnt = torch.zeros(4, dtype=torch.int64)
    out, sf = R.swiglu_forward_and_per_token_cast(
        x, "e4m3", 128, pos_to_expert=pe, swiglu_clamp_value=0.5, clamped_count=cnt
    )
    keep = pe >= 0
    assert (out[~keep].view(torch.uint8) == 0).all() and (sf[~keep] == 0).all()
    xf = x.float()[keep]
    assert cnt.tolist() == [
        int((xf[:, :256] > 0.5).sum()),
        int((xf[:, 256:] > 0.5).sum()),
        int((xf[:, 256:] < -0.5).sum()),
        6 * 256,
    ]
    _, sf_floor = R.swiglu_forward_and_per_token_cast(torch.zeros(2, 512), "e4m3", 128, sf_clamp_min=0.5)
    assert (sf_floor == torch.tensor(0.5) / 448).all()


def test_forward_per_token_weights_per_row_and_mapped():
    x = torch.randn(6, 256).bfloat16()
    w = torch.randn(3, 2)
    ptt = torch.tensor([0, 5, -1, 2, 3, 1], dtype=torch.int32)
    a, sa = R.swiglu_forward_and_per_token_cast(x, "e4m3", 128, ptt, w)
    per_row = torch.where(ptt >= 0, w.view(-1)[ptt.long().clamp(min=0)], 0.0)
    b, sb = R.swiglu_forward_and_per_token_cast(x, "e4m3", 128, None, per_row)
    assert_equal(a, b)
    assert_equal(sa, sb)


@pytest.mark.parametrize("transpose", [False, True])
def test_forward_per_channel_reference(transpose):
    x = torch.randn(64, 2 * 192).bfloat16()
    out, sf = R.swiglu_forward_and_per_channel_cast_and_transpose(x, "e4m3", 32, True, not transpose)
    a = R.swiglu_forward(x).bfloat16().float()
    amax = a.abs().view(2, 32, 192).amax(1)
    s, si = compute_scales(amax, 448.0, 1e-4, True)
    q = encode_e4m3(a * si.repeat_interleave(32, 0))
    assert_equal(sf, s)
    assert_equal(out, q.t().contiguous() if transpose else q)
    assert calc_diff(out.float().t() if transpose else out.float(), a / s.repeat_interleave(32, 0)) < 1e-3


@pytest.mark.parametrize("impl", S.CLAMP_IMPLS)
def test_clamp_impl_for(monkeypatch, impl):
    monkeypatch.setattr(S, "CLAMP_IMPL", impl)
    exact = "bf16" if impl == "bf16" else impl
    other = "nan" if impl == "bf16" else impl  # bf16 only where it is exact
    assert S.clamp_impl_for(torch.bfloat16, 0.5) == exact
    assert S.clamp_impl_for(torch.bfloat16, 7.0) == exact
    assert S.clamp_impl_for(torch.bfloat16, 0.3) == other  # not a bf16 value
    assert S.clamp_impl_for(torch.bfloat16, 1e-40) == other  # float32 subnormal, not a bf16 value
    assert S.clamp_impl_for(torch.float32, 0.5) == other
    assert S.clamp_impl_for(torch.bfloat16, None) == other


def test_public_functions_on_cpu_run_the_reference():
    x = torch.randn(16, 256).bfloat16()
    assert_equal(
        tk_quant.swiglu_forward_and_per_token_cast(x, "e4m3", 128)[0],
        R.swiglu_forward_and_per_token_cast(x, "e4m3", 128)[0],
    )
    q = R.cast(torch.randn(16, 256), "e4m3", (1, 32))
    args = (
        torch.randn(16, 128).bfloat16(),
        torch.rand(8, 2),
        torch.arange(16, dtype=torch.int32),
        torch.arange(16, dtype=torch.int32).view(8, 2),
        32,
    )
    got = tk_quant.swiglu_backward_and_per_token_cast(q, *args)
    want = R.swiglu_backward_and_per_token_cast(q, *args)
    for a, b in zip(
        (got[0], got[1][0], got[1][1], got[2], got[3]), (want[0], want[1][0], want[1][1], want[2], want[3]), strict=True
    ):
        assert_equal(a, b)
    back = R.cast_back(got[1], "fp32", (1, 32))
    assert calc_diff(back, got[2].float()) < 2e-3


@pytest.mark.parametrize("h", [512, 7168, 16384, 32768, 32769, 33792, 100000])
def test_backward_warps_per_row_fit_one_cta(h):
    # one CTA per row of at most 32 warps, each taking wgrad_spans(h) 512-column spans; wider rows than 32,768 once
    # asked for more than 1,024 threads, which no launch accepts
    spans = R.wgrad_spans(h)
    warps = -(-h // (512 * spans))
    assert warps <= 32 and (spans == R.WGRAD_SPANS or -(-h // (512 * (spans - 1))) > 32)
    grad, act = torch.randn(3, h), torch.randn(3, h)
    want = (grad.double() * act.double()).sum(1)
    assert torch.allclose(R.wgrad_dot(grad, act).double(), want, rtol=1e-4, atol=1e-3)


def test_backward_empty_gives_zero_weight_grad():
    q = (torch.empty((0, 256), dtype=torch.float8_e4m3fn), torch.empty((0, 8)))
    out, (gq, gs), xg, wg = tk_quant.swiglu_backward_and_per_token_cast(
        q,
        torch.empty((0, 128), dtype=torch.bfloat16),
        torch.rand(5, 2),
        torch.empty(0, dtype=torch.int32),
        torch.full((5, 2), -1, dtype=torch.int32),
        32,
    )
    assert out.shape == (0, 128) and gq.shape == (0, 256) and gs.shape == (0, 8) and xg.shape == (0, 256)
    assert (wg == 0).all() and wg.shape == (5, 2)


# --- cpu tier: validation ---------------------------------------------------------------------------

FWD = tk_quant.swiglu_forward_and_per_token_cast
BWD = tk_quant.swiglu_backward_and_per_token_cast
CHAN = tk_quant.swiglu_forward_and_per_channel_cast_and_transpose


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(x=torch.randn(4, 256, dtype=torch.float16)), TypeError, "x must be of dtype"),
        (dict(x=torch.randn(4, 256).bfloat16()[:, :128]), ValueError, "x must be contiguous"),
        (dict(x=torch.randn(4, 2 * 192).bfloat16()), ValueError, "hidden .* multiple of 128"),
        (dict(fmt="e2m1"), ValueError, "fmt must be one of"),
        (dict(num_per_channels=16), ValueError, "num_per_channels must be one of"),
        (dict(num_per_channels=128.0), TypeError, r"num_per_channels must be one of .*, got 128.0 \(float\)"),
        (dict(use_packed_ue8m0=True, use_tma_aligned_col_major_sf=True), ValueError, "round_sf=True"),
        (dict(use_packed_ue8m0=True, round_sf=True), ValueError, "use_tma_aligned_col_major_sf"),
        (
            dict(x=torch.randn(4, 512).bfloat16(), num_per_channels=256, use_tma_aligned_col_major_sf=True),
            ValueError,
            "False with one scale per row",
        ),
        (dict(pos_to_token_topk=torch.zeros(4, dtype=torch.int32)), ValueError, "topk_weights must be given"),
        (
            dict(pos_to_token_topk=torch.zeros(3, dtype=torch.int32), topk_weights=torch.rand(2, 2)),
            ValueError,
            "pos_to_token_topk must be of shape",
        ),
        (
            dict(pos_to_token_topk=torch.zeros(4, dtype=torch.int64), topk_weights=torch.rand(2, 2)),
            TypeError,
            "pos_to_token_topk must be of dtype int32",
        ),
        (
            dict(pos_to_token_topk=torch.zeros(4, dtype=torch.int32), topk_weights=torch.rand(2, 2).double()),
            TypeError,
            "topk_weights must be of dtype float32",
        ),
        (dict(topk_weights=torch.rand(5)), ValueError, "topk_weights .* must be of shape"),
        (dict(pos_to_expert=torch.zeros(5, dtype=torch.int32)), ValueError, "pos_to_expert must be of shape"),
        (dict(swiglu_clamp_value=-1.0), ValueError, "swiglu_clamp_value must be a finite float > 0"),
        (dict(swiglu_clamp_value=math.inf), ValueError, "swiglu_clamp_value must be a finite float > 0"),
        (dict(swiglu_clamp_value="1"), TypeError, "swiglu_clamp_value must be a float"),
        (dict(clamped_count=torch.zeros(3, dtype=torch.int64)), ValueError, "clamped_count must be None"),
        (
            dict(swiglu_clamp_value=1.0, clamped_count=torch.zeros(3, dtype=torch.int32)),
            TypeError,
            "clamped_count must be of dtype int64",
        ),
        (
            dict(swiglu_clamp_value=1.0, clamped_count=torch.zeros(5, dtype=torch.int64)),
            ValueError,
            r"clamped_count.shape\[0\] must be one of",
        ),
        (dict(sf_clamp_min=1e-40), ValueError, "sf_clamp_min must be"),
        (dict(sf_clamp_min="1e-3"), TypeError, "sf_clamp_min must be a float or None, got str"),
        (dict(sf_clamp_min=True), TypeError, "sf_clamp_min must be a float or None, got bool"),
        (dict(sf_clamp_min=[1e-3]), TypeError, "sf_clamp_min must be a float or None, got list"),
        (dict(sf_clamp_min=math.nan), ValueError, "sf_clamp_min must be a finite float"),
        (dict(round_sf="no"), TypeError, "round_sf must be a bool, got 'no'"),
        (dict(use_tma_aligned_col_major_sf=1), TypeError, "use_tma_aligned_col_major_sf must be a bool, got 1"),
        (dict(use_packed_ue8m0="False"), TypeError, "use_packed_ue8m0 must be a bool, got 'False'"),
    ],
)
def test_forward_per_token_validation(kwargs, exc, match):
    args = dict(x=torch.randn(4, 256).bfloat16(), fmt="e4m3", num_per_channels=128)
    args.update(kwargs)
    with pytest.raises(exc, match=match) as info:
        FWD(**args)
    assert str(info.value).startswith("swiglu_forward_and_per_token_cast: ")


def _bwd_args(**kw):
    e, h = 4, 128
    q = R.cast(torch.randn(e, 2 * h), "e4m3", (1, 32))
    args = dict(
        x=q,
        grad_out=torch.randn(e, h).bfloat16(),
        weight=torch.rand(2, 2),
        pos_to_token_topk=torch.arange(4, dtype=torch.int32),
        token_topk_to_pos=torch.arange(4, dtype=torch.int32).view(2, 2),
        num_per_channels=32,
    )
    args.update(kw)
    return args


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(x=torch.zeros(4, 256)), TypeError, "x must be a QuantTensor"),
        (dict(x=(torch.zeros(4, 256), torch.ones(4, 8))), TypeError, r"x\[0\] \(x_fp8\) must be of dtype"),
        (
            dict(x=(torch.zeros(4, 256).to(torch.float8_e4m3fn), torch.ones(4, 4))),
            ValueError,
            r"x\[1\] \(x_sf\) must be of shape",
        ),
        (
            dict(x=(torch.zeros(4, 256).to(torch.float8_e4m3fn), torch.ones(4, 8).double())),
            TypeError,
            r"x\[1\] \(x_sf\) must be of dtype",
        ),
        (dict(num_per_channels=16), ValueError, "num_per_channels must be one of"),
        (dict(grad_out=torch.randn(4, 128)), TypeError, "grad_out must be of dtype bfloat16"),
        (dict(grad_out=torch.randn(4, 64).bfloat16()), ValueError, "grad_out must be of 4 x 128"),
        (dict(weight=torch.rand(2, 2).bfloat16()), TypeError, "weight must be of dtype float32"),
        (dict(pos_to_token_topk=torch.arange(3, dtype=torch.int32)), ValueError, "pos_to_token_topk must be of shape"),
        (
            dict(token_topk_to_pos=torch.arange(6, dtype=torch.int32).view(3, 2)),
            ValueError,
            "token_topk_to_pos must be of shape",
        ),
        (dict(swiglu_clamp_value=0.0), ValueError, "swiglu_clamp_value must be a finite float > 0"),
        (dict(use_packed_ue8m0=True, use_tma_aligned_col_major_sf=True), ValueError, "round_sf=True"),
        (dict(round_sf="no"), TypeError, "round_sf must be a bool, got 'no'"),
        (dict(use_packed_ue8m0=0), TypeError, "use_packed_ue8m0 must be a bool, got 0"),
    ],
)
def test_backward_validation(kwargs, exc, match):
    with pytest.raises(exc, match=match) as info:
        BWD(**_bwd_args(**kwargs))
    assert str(info.value).startswith("swiglu_backward_and_per_token_cast: ")


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(x=torch.randn(64, 256)), TypeError, "x must be of dtype bfloat16"),
        (dict(x=torch.randn(64, 2 * 96).bfloat16()), ValueError, "hidden .* multiple of 64"),
        (dict(x=torch.randn(48, 256).bfloat16()), ValueError, "tokens.* multiple of 32"),
        (dict(num_per_tokens=64), ValueError, "num_per_tokens must be one of"),
        (dict(fmt="e5m6"), ValueError, "fmt must be one of"),
        (dict(swiglu_clamp_value=float("nan")), ValueError, "swiglu_clamp_value must be a finite float > 0"),
        (dict(num_per_tokens=32.0), TypeError, r"num_per_tokens must be one of \(32, 128\), got 32.0 \(float\)"),
        (dict(round_sf="no"), TypeError, "round_sf must be a bool, got 'no'"),
        (dict(without_transpose="False"), TypeError, "without_transpose must be a bool, got 'False'"),
    ],
)
def test_per_channel_validation(kwargs, exc, match):
    args = dict(x=torch.randn(64, 256).bfloat16(), fmt="e4m3", num_per_tokens=32)
    args.update(kwargs)
    with pytest.raises(exc, match=match) as info:
        CHAN(**args)
    assert str(info.value).startswith("swiglu_forward_and_per_channel_cast_and_transpose: ")


# --- compile tier ------------------------------------------------------------------------------------

FWD_VARIANTS = [  # with the launcher's chunks per warp (strict: no spills)
    dict(in_dtype="bfloat16", hidden=3584, group=128, layout="packed", round_sf=True, clamp_mode="none", chunks=2,
         min_blocks=10, pair_scales=True),
    dict(in_dtype="bfloat16", hidden=3584, group=128, layout="packed", round_sf=True, clamp_mode="none", chunks=2,
         min_blocks=10, pair_scales=True, widen_words=True, short_div=True),
    dict(in_dtype="bfloat16", hidden=3584, group=128, layout="packed", round_sf=True, clamp_mode="none", chunks=2,
         min_blocks=10, pair_scales=True, widen_words=True, short_div=True, short_exp=True),
    dict(in_dtype="bfloat16", hidden=3584, group=128, layout="packed", round_sf=True, clamp_mode="none", chunks=2,
         min_blocks=10, pair_scales=True, widen_words=True, short_div=True, short_exp=True,
         load_order="early_if_pe"),
    dict(in_dtype="bfloat16", hidden=3584, group=128, layout="packed", round_sf=True, clamp_mode="count", chunks=2,
         pair_scales=True, short_div=True),  # the "nan" clamp: g may be no bf16 value
    dict(in_dtype="bfloat16", hidden=1280, group=128, layout="row", round_sf=False, clamp_mode="clamp", chunks=1,
         min_blocks=10, pair_scales=True),
    dict(in_dtype="float32", hidden=7168, group=32, layout="col", round_sf=True, clamp_mode="count", chunks=2,
         min_blocks=1, pair_scales=True),
    dict(in_dtype="bfloat16", hidden=1152, group=64, layout="packed", round_sf=True, clamp_mode="none"),
    dict(in_dtype="bfloat16", hidden=2048, group=2048, layout="row", round_sf=True, clamp_mode="count"),
    dict(
        in_dtype="bfloat16",
        hidden=1280,
        group=32,
        layout="col",
        round_sf=False,
        clamp_mode="count",
        chunks=5,
        pair_scales=True,
    ),
    # the count kernel's earlier configurations (packed count reduction, word widening; the min.NaN clamp on the
    # float32 values or on the loaded bf16 pairs; at ptxas's own register count: they spill 12 bytes at the
    # launcher's 10 CTAs per SM), then the launcher's: the lean parameters at 10 CTAs per SM, weighted at 9
    dict(in_dtype="bfloat16", hidden=3584, group=128, layout="packed", round_sf=True, clamp_mode="count", chunks=2,
         pair_scales=True, pack_counts=True, clamp_impl="nan", widen_words=True),
    dict(in_dtype="bfloat16", hidden=3584, group=128, layout="packed", round_sf=True, clamp_mode="count", chunks=2,
         pair_scales=True, pack_counts=True, clamp_impl="bf16", widen_words=True, short_div=True, short_exp=True,
         load_order="early"),
    dict(in_dtype="bfloat16", hidden=3584, group=128, layout="packed", round_sf=True, clamp_mode="count", chunks=2,
         min_blocks=10, pair_scales=True, weighted=False, pack_counts=True, clamp_impl="bf16", widen_words=True,
         short_div=True, short_exp=True, load_order="early", int_counts=True, int_scale=True, sf_index32=True,
         redux_counts=True, bf16_keys=True),
    dict(in_dtype="bfloat16", hidden=3584, group=128, layout="packed", round_sf=True, clamp_mode="count", chunks=2,
         min_blocks=9, pair_scales=True, weighted=True, pack_counts=True, clamp_impl="bf16", widen_words=True,
         short_div=True, short_exp=True, load_order="early", int_counts=True, int_scale=True, sf_index32=True,
         redux_counts=True, bf16_keys=True),
    dict(in_dtype="bfloat16", hidden=1280, group=128, layout="col", round_sf=True, clamp_mode="none", chunks=1,
         min_blocks=10, pair_scales=True, int_scale=True, short_div=True, short_exp=True,
         bf16_keys=True),  # the scale rule from the bits without pairing, the bf16 gate without a clamp
    dict(in_dtype="bfloat16", hidden=3584, group=3584, layout="row", round_sf=True, clamp_mode="clamp",
         int_scale=True),  # and in the one-scale-per-row mode
    dict(in_dtype="bfloat16", hidden=1280, group=128, layout="row", round_sf=False, clamp_mode="clamp", chunks=1,
         min_blocks=10, pair_scales=True, load_order="early_if_pe"),  # a tail span (1280 = 2.5 spans of 512)
    dict(in_dtype="bfloat16", hidden=1152, group=64, layout="row", round_sf=False, clamp_mode="clamp", chunks=1,
         clamp_impl="bf16", widen_words=True),
    dict(in_dtype="float32", hidden=1280, group=32, layout="col", round_sf=True, clamp_mode="count", chunks=1,
         clamp_impl="nan"),
]
BWD_VARIANTS = [  # the anchor shapes get the launcher's tuning per arch (strict: no spills at its CTA cap)
    dict(hidden=7168, group=32, layout="row", round_sf=True, clamp_on=False, tuned=True),
    dict(hidden=7168, group=128, layout="row", round_sf=True, clamp_on=True, tuned=True),
    dict(hidden=1280, group=64, layout="col", round_sf=False, clamp_on=True),
    dict(hidden=1152, group=128, layout="packed", round_sf=True, clamp_on=False),
    # 8 warps per row: the tuned 4 CTAs per SM lowered to 3 by the register budget (at 4 it spilled 56 bytes)
    dict(hidden=8192, group=128, layout="row", round_sf=True, clamp_on=False, tuned=True),
    dict(hidden=8192, group=32, layout="row", round_sf=True, clamp_on=True, tuned=True),
]
CHAN_VARIANTS = [
    dict(hidden=7168, bm=32, round_sf=True, transpose=False, clamp_on=False, **S.CHANNEL_TUNING[32]),
    dict(hidden=7168, bm=32, round_sf=True, transpose=False, clamp_on=False, short_div=True, **S.CHANNEL_TUNING[32]),
    dict(hidden=7168, bm=32, round_sf=False, transpose=True, clamp_on=True, short_div=True, **S.CHANNEL_TUNING[32]),
    dict(hidden=7168, bm=128, round_sf=True, transpose=True, clamp_on=False),
    dict(hidden=576, bm=32, round_sf=False, transpose=True, clamp_on=True),
    dict(hidden=7168, bm=32, round_sf=True, transpose=False, clamp_on=True, clamp_impl="nan", widen_words=True,
         **S.CHANNEL_TUNING[32]),
    dict(hidden=7168, bm=32, round_sf=True, transpose=False, clamp_on=True, clamp_impl="bf16", widen_words=True,
         **S.CHANNEL_TUNING[32]),
    dict(hidden=7168, bm=32, round_sf=True, transpose=False, clamp_on=True, clamp_impl="bf16", widen_words=True,
         short_div=True, **S.CHANNEL_TUNING[32]),
    dict(hidden=1024, bm=128, round_sf=False, transpose=True, clamp_on=True, clamp_impl="bf16", widen_words=True),
    dict(hidden=7168, bm=32, round_sf=True, transpose=True, clamp_on=False, short_div=True, linear_grid=True,
         **S.CHANNEL_TUNING[32]),
]


def _common_codegen_checks(src: str, short_div: bool = False, short_exp: bool = False):
    assert "__expf" not in src and "__fdividef" not in src and "__frcp" not in src, "approximate math in kernel"
    assert "expf(" in src
    assert "__NV_SATFINITE" in src or "cvt.rn.satfinite" in src
    assert (src.count("tk_div_silu_bf16(") > 1) == short_div  # definition and calls
    assert (src.count("tk_one_plus_exp_neg_bf16(") > 1) == short_exp


def _bf16_gates(params: dict) -> bool:
    """Whether the forward's g is always a bf16 value: bf16 rows without a clamp, or with the clamp on the loaded
    bf16 pairs (per-token: not where counting needs the clamp predicates, i.e. one-pass rows)."""
    if params.get("in_dtype", "bfloat16") != "bfloat16":
        return False
    if params.get("clamp_mode", "clamp" if params.get("clamp_on") else "none") == "none":
        return True
    return params.get("clamp_impl") == "bf16" and not (params.get("clamp_mode") == "count" and params["group"] > 128)


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("params", FWD_VARIANTS, ids=lambda p: "-".join(str(v) for v in p.values()))
def test_compile_forward_per_token(arch, params):
    if "chunks" in params and params.get("min_blocks"):  # the launcher's tuning
        assert params["chunks"] == S.fwd_token_chunks(params["hidden"], params["in_dtype"])
        assert params["min_blocks"] == S.fwd_token_min_blocks(
            params["in_dtype"], params["clamp_mode"], params.get("weighted", True)
        )
    src = assert_compiles(S.swiglu_fwd_token_kernel, arch, **params)
    short = params.get("short_div", False) and _bf16_gates(params)
    _common_codegen_checks(src, short, short and params.get("short_exp", False))
    assert "uint4" in src or "float4" in src  # 16-byte loads
    if params["clamp_mode"] == "count":
        assert "AtomicAdd" in src
    predicates = params["clamp_mode"] == "count" and params["in_dtype"] == "float32"  # keeps the selects
    if params.get("clamp_impl") in ("nan", "bf16") and params["clamp_mode"] != "none" and not predicates:
        assert ("min.NaN.bf16x2" if params["clamp_impl"] == "bf16" else "min.NaN.f32") in src


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("params", BWD_VARIANTS, ids=lambda p: "-".join(str(v) for v in p.values()))
def test_compile_backward(arch, params):
    params = dict(params)
    if params.pop("tuned", False):
        params.update(S.bwd_tuning(arch, params["clamp_on"]))
    src = assert_compiles(S.swiglu_bwd_token_kernel, arch, **params)
    _common_codegen_checks(src)
    assert "__fmaf_rn" in src and "__fmul_rn" in src
    assert "atomic" not in src.lower().replace("tl_templates/cuda/atomic.h", "")
    # the fast divisions in the plain loop only (the preload pipeline has no registers to spare for them)
    pipelined = params.get("preload", True) and (params.get("spans") or R.wgrad_spans(params["hidden"])) > 1
    assert (src.count("tk_rcp_fast(") > 1 and src.count("tk_div_fast(") > 1) != pipelined  # definitions and calls


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("params", CHAN_VARIANTS, ids=lambda p: "-".join(str(v) for v in p.values()))
def test_compile_forward_per_channel(arch, params):
    src = assert_compiles(S.swiglu_fwd_channel_kernel, arch, **params)
    _common_codegen_checks(src, params.get("short_div", False) and _bf16_gates(params))
    if params.get("clamp_impl") == "bf16":
        assert "min.NaN.bf16x2" in src
    if params["transpose"]:
        assert "fp8_e4_16_t" in src  # 16-byte transposed stores
    else:
        assert "fp8_e4_8_t" in src


# --- gpu tier ---------------------------------------------------------------------------------------

DEV = "cuda"


def _poison(t: torch.Tensor) -> torch.Tensor:
    t.view(torch.uint8).fill_(0xFF) if t.numel() else None
    return t


def _fwd_inputs(e_tokens: int, h: int, topk: int, experts: int, align_rows: int, in_dtype=torch.bfloat16):
    idx, (pe, ptt, ttp) = moe_case(e_tokens, topk, experts, align_rows, DEV)
    x = expand_to_fused(torch.randn(e_tokens, 2 * h, device=DEV).to(in_dtype), ptt, topk)
    w = torch.randn(e_tokens, topk, device=DEV)
    return x, pe, ptt, w


FWD_GPU_CASES = [
    # (h, bk, (col, round, packed), in_dtype, pos_to_expert, weights, clamp)
    (3584, 128, (True, True, True), torch.bfloat16, True, "none", None),
    (3584, 128, (True, True, True), torch.bfloat16, False, "none", 0.5),
    (1280, 128, (False, True, False), torch.bfloat16, True, "mapped", 10.0),
    (1280, 32, (False, False, False), torch.float32, True, "mapped", 0.5),
    (1152, 64, (True, True, True), torch.bfloat16, True, "row", None),
    (1024, 1024, (False, True, False), torch.bfloat16, True, "mapped", 0.5),
    (2048, 128, (True, False, False), torch.bfloat16, False, "none", None),
]
if full_test():  # TK_FULL_TEST: the 1.0.0 grid (hidden sizes x bk x layouts x masks x weights x clamps)
    FWD_GPU_CASES += [
        (h, bk, lay, torch.bfloat16, pe, wm, cl)
        for h in (1024, 1280, 1536, 2048, 3072, 3584)
        for bk in (128, h)
        for lay in ((False, True, False), (True, True, True))
        if not (bk == h and lay[0])
        for pe in (True, False)
        for wm in ("none", "mapped")
        if not (wm == "mapped" and lay[2])
        for cl in (None, 10.0, 0.5)
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("case", FWD_GPU_CASES, ids=lambda c: "-".join(str(v) for v in c))
def test_gpu_forward_per_token(case):
    h, bk, (col, rnd, packed), in_dtype, use_pe, wmode, clamp = case
    x, pe, ptt, w = _fwd_inputs(700, h, 2, 9, 16, in_dtype)
    kwargs = dict(use_tma_aligned_col_major_sf=col, round_sf=rnd, use_packed_ue8m0=packed, swiglu_clamp_value=clamp)
    kwargs["pos_to_expert"] = pe if use_pe else None
    if wmode == "mapped":
        kwargs.update(pos_to_token_topk=ptt, topk_weights=w)
    elif wmode == "row":
        kwargs.update(topk_weights=torch.randn(x.shape[0], device=DEV))
    cnt = torch.full((4,), 5, dtype=torch.int64, device=DEV) if clamp is not None else None
    cnt_ref = cnt.clone() if cnt is not None else None
    out, sf = FWD(x, "e4m3", bk, clamped_count=cnt, **kwargs)
    ref_out, ref_sf = R.swiglu_forward_and_per_token_cast(x, "e4m3", bk, clamped_count=cnt_ref, **kwargs)
    assert_equal(out, ref_out)
    assert_equal(sf, ref_sf, check_stride=True)
    if cnt is not None:
        assert_equal(cnt, cnt_ref)
    # poisoned outputs through the device op: every element (and packed padding byte) is written
    layout = sf_layout("t", col, packed, rnd)
    out2 = _poison(torch.empty_like(out))
    flat, sf2 = S.alloc_sf_storage(x.shape[0], -(-h // bk), layout, x.device)
    _poison(flat)
    S.swiglu_forward_and_per_token_cast_(
        x,
        kwargs["pos_to_expert"],
        kwargs.get("pos_to_token_topk"),
        kwargs.get("topk_weights"),
        out2,
        flat,
        None,
        bk,
        layout,
        rnd,
        clamp,
        1e-4,
    )
    assert_equal(out2, ref_out)
    assert_equal(sf2, ref_sf)
    # repeat runs are bit-identical
    out3, sf3 = FWD(x, "e4m3", bk, **kwargs)
    assert_equal(out3, out)
    assert_equal(sf3, sf)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [0, 1, 7, 333])
def test_gpu_forward_per_token_small_and_odd(rows):
    x = torch.randn(rows, 2 * 1280, device=DEV).bfloat16()
    cnt = torch.zeros(3, dtype=torch.int64, device=DEV)
    cnt_ref = cnt.clone()
    got = FWD(
        x,
        "e4m3",
        128,
        use_tma_aligned_col_major_sf=True,
        round_sf=True,
        use_packed_ue8m0=True,
        swiglu_clamp_value=0.5,
        clamped_count=cnt,
        sf_clamp_min=1e-2,
    )
    want = R.swiglu_forward_and_per_token_cast(x, "e4m3", 128, None, None, None, True, True, True, 0.5, cnt_ref, 1e-2)
    assert_equal(got[0], want[0])
    assert_equal(got[1], want[1], check_stride=True)
    assert_equal(cnt, cnt_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", S.CLAMP_IMPLS)
@pytest.mark.parametrize("clamp", [0.5, 0.3, 1e-33, 100.0])
def test_gpu_forward_clamp_impls(monkeypatch, impl, clamp):
    """Every clamp implementation, on values around the clamp (+-c, +-0, subnormals, beyond the fast-division
    range) and with clamp values that are bf16 values (0.5, 100) or not (0.3, 1e-33)."""
    monkeypatch.setattr(S, "CLAMP_IMPL", impl)
    mag = torch.exp2(torch.rand(128, 2 * 1280, device=DEV) * 147 - 135)
    x = torch.where(torch.rand_like(mag) < 0.5, -mag, mag)
    x[:32] = torch.randn(32, 2 * 1280, device=DEV) * 2
    x[torch.rand_like(mag) < 0.05] = clamp
    x[torch.rand_like(mag) < 0.05] = -clamp
    x[torch.rand_like(mag) < 0.02] = 0.0
    x[torch.rand_like(mag) < 0.02] = -0.0
    x = x.bfloat16()
    for count in (True, False):
        cnt = torch.zeros(4, dtype=torch.int64, device=DEV) if count else None
        cnt_ref = cnt.clone() if count else None
        got = FWD(x, "e4m3", 128, None, None, None, True, True, True, clamp, cnt)
        want = R.swiglu_forward_and_per_token_cast(x, "e4m3", 128, None, None, None, True, True, True, clamp, cnt_ref)
        assert_equal(got[0], want[0])
        assert_equal(got[1], want[1])
        if count:
            assert_equal(cnt, cnt_ref)
    for bm, transpose in ((32, False), (128, True)):
        got = CHAN(x[:bm], "e4m3", bm, True, not transpose, clamp)
        want = R.swiglu_forward_and_per_channel_cast_and_transpose(x[:bm], "e4m3", bm, True, not transpose, clamp)
        assert_equal(got[0], want[0])
        assert_equal(got[1], want[1])


@pytest.mark.gpu
def test_gpu_forward_per_token_opcheck_compile_graph():
    x, pe, ptt, w = _fwd_inputs(300, 1024, 2, 9, 16)
    e = x.shape[0]
    out = torch.empty((e, 1024), dtype=torch.float8_e4m3fn, device=DEV)
    flat, _ = S.alloc_sf_storage(e, 8, "packed", x.device)
    cnt = torch.zeros(4, dtype=torch.int64, device=DEV)
    opcheck(S.swiglu_forward_and_per_token_cast_.op, (x, pe, ptt, w, out, flat, cnt, 128, "packed", True, 0.5, 1e-4))

    def f(x, pe, ptt, w, cnt):
        return FWD(x, "e4m3", 128, ptt, w, pe, True, True, True, 0.5, cnt)

    c1, c2 = torch.zeros_like(cnt), torch.zeros_like(cnt)
    eager = f(x, pe, ptt, w, c1)
    compiled = torch.compile(f, fullgraph=True)(x, pe, ptt, w, c2)
    assert_equal(compiled[0], eager[0])
    assert_equal(compiled[1], eager[1])
    assert_equal(c1, c2)
    c3 = torch.zeros_like(cnt)
    replay, captured = capture_cuda_graph(lambda: f(x, pe, ptt, w, c3))
    c3.zero_()  # the warm-up call counted into it
    replay()
    assert_equal(captured[0], eager[0])
    assert_equal(captured[1], eager[1])
    assert_equal(c3, c1)


def _bwd_inputs(tokens: int, h: int, bk: int, topk: int = 2, experts: int = 9, spread: bool = False):
    """``spread``: every 8 columns get their own magnitude, 2**-20 to 2**11, so that after the per-block cast some
    8-column chunks hold a |g| above 64 (beyond the fast divisions' range), some zeros next to non-zeros, and some
    only values in range. (The cast's amax floor keeps non-zero |g| above 2**-40: the range's lower end, 2**-64,
    cannot be reached through a quantized input.)"""
    idx, (pe, ptt, ttp) = moe_case(tokens, topk, experts, bk, DEV)
    x = torch.randn(tokens, 2 * h, device=DEV)
    if spread:
        x = x * torch.exp2(torch.randint(-20, 12, (tokens, 2 * h // 8, 1), device=DEV).float()).expand(-1, -1, 8).reshape(tokens, -1)
    x = expand_to_fused(x.bfloat16(), ptt, topk)
    q = R.cast(x, "e4m3", (1, bk))
    weight = torch.rand(tokens, topk, device=DEV)
    grad = torch.randn(x.shape[0], h, device=DEV).bfloat16()
    return q, grad, weight, ptt, ttp


BWD_GPU_CASES = [
    # (h, bk, round, clamp, (col, packed))
    (2048, 128, True, None, (False, False)),
    (7168, 32, True, 0.5, (False, False)),
    (1280, 64, False, 10.0, (False, False)),
    (1152, 128, True, 0.5, (True, True)),
    (2560, 32, False, None, (True, False)),
    (8192, 128, True, None, (False, False)),  # 8 warps per row: 3 CTAs per SM (BWD_REGISTERS)
    (33792, 128, True, 0.5, (False, False)),  # 66 spans: 3 per warp, so the CTA stays within 1,024 threads
]
if full_test():
    BWD_GPU_CASES += [
        (h, bk, rnd, cl, (False, False))
        for h in (2048, 2560, 3072, 4096, 6144, 7168)
        for bk in (32, 128)
        for rnd in (False, True)
        for cl in (None, 10.0, 0.5)
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("case", BWD_GPU_CASES, ids=lambda c: "-".join(str(v) for v in c))
def test_gpu_backward(case):
    h, bk, rnd, clamp, (col, packed) = case
    q, grad, weight, ptt, ttp = _bwd_inputs(600, h, bk)
    args = (q, grad, weight, ptt, ttp, bk, rnd, clamp, col, packed)
    got = BWD(*args)
    want = R.swiglu_backward_and_per_token_cast(*args)
    assert_equal(got[0], want[0])
    assert_equal(got[1][0], want[1][0])
    assert_equal(got[1][1], want[1][1], check_stride=True)
    assert_equal(got[2], want[2])
    assert_equal(got[3], want[3])  # weight_grad: exact (fixed summation order)
    # poisoned outputs through the device op
    e = q[0].shape[0]
    layout = sf_layout("t", col, packed, rnd)
    outs = [_poison(torch.empty_like(got[0])), _poison(torch.empty_like(got[1][0]))]
    flat, sf2 = S.alloc_sf_storage(e, 2 * h // bk, layout, q[0].device)
    _poison(flat)
    xg2, wg2 = _poison(torch.empty_like(got[2])), _poison(torch.empty_like(got[3]))
    S.swiglu_backward_and_per_token_cast_(
        q[0], q[1], grad, weight, ptt, outs[0], outs[1], flat, xg2, wg2, bk, layout, rnd, clamp, 1e-4
    )
    for a, b in zip(
        (outs[0], outs[1], sf2, xg2, wg2), (want[0], want[1][0], want[1][1], want[2], want[3]), strict=True
    ):
        assert_equal(a, b)
    again = BWD(*args)
    for a, b in zip((again[0], again[1][0], again[2], again[3]), (got[0], got[1][0], got[2], got[3]), strict=True):
        assert_equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [0, 1, 5])
def test_gpu_backward_small(tokens):
    q, grad, weight, ptt, ttp = _bwd_inputs(tokens, 1024, 128)
    weight = torch.rand(max(tokens, 3), 2, device=DEV)
    ttp = torch.full_like(weight, -1, dtype=torch.int32)
    ttp.view(-1)[ptt[ptt >= 0].long()] = (ptt >= 0).nonzero().squeeze(1).int()
    got = BWD(q, grad, weight, ptt, ttp, 128, True, 0.5)
    want = R.swiglu_backward_and_per_token_cast(q, grad, weight, ptt, ttp, 128, True, 0.5)
    for a, b in zip(
        (got[0], got[1][0], got[1][1], got[2], got[3]), (want[0], want[1][0], want[1][1], want[2], want[3]), strict=True
    ):
        assert_equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("clamp", [None, 0.5, 100.0])
def test_gpu_backward_wide_values(clamp):
    """Chunks with a |g| beyond the fast divisions' range (above 64) next to in-range ones in one launch, so each
    8-column chunk of the clamp kernel picks its own path; a clamp of 100 is itself out of range and keeps every
    chunk on the IEEE path."""
    q, grad, weight, ptt, ttp = _bwd_inputs(300, 2048, 32, spread=True)
    g = (q[0][:, :1024].float() * q[1][:, :32].repeat_interleave(32, 1)).view(-1, 128, 8).abs().amax(-1)
    assert (g > 64).any() and ((g > 0) & (g <= 64)).any()
    got = BWD(q, grad, weight, ptt, ttp, 32, True, clamp)
    want = R.swiglu_backward_and_per_token_cast(q, grad, weight, ptt, ttp, 32, True, clamp)
    for a, b in zip(
        (got[0], got[1][0], got[1][1], got[2], got[3]), (want[0], want[1][0], want[1][1], want[2], want[3]), strict=True
    ):
        assert_equal(a, b)


@pytest.mark.gpu
def test_gpu_backward_opcheck_compile_graph():
    q, grad, weight, ptt, ttp = _bwd_inputs(200, 1024, 128)
    e = q[0].shape[0]
    bufs = (
        torch.empty(e, 1024, dtype=torch.bfloat16, device=DEV),
        torch.empty(e, 2048, dtype=torch.float8_e4m3fn, device=DEV),
        torch.empty(e * 16, device=DEV),
        torch.empty(e, 2048, dtype=torch.bfloat16, device=DEV),
        torch.empty_like(weight),
    )
    opcheck(
        S.swiglu_backward_and_per_token_cast_.op, (q[0], q[1], grad, weight, ptt, *bufs, 128, "row", True, 0.5, 1e-4)
    )

    def f(xq, xs, grad, weight, ptt, ttp):
        out, (gq, gs), xg, wg = BWD((xq, xs), grad, weight, ptt, ttp, 128, True, 0.5)
        return out, gq, gs, xg, wg

    eager = f(q[0], q[1], grad, weight, ptt, ttp)
    compiled = torch.compile(f, fullgraph=True)(q[0], q[1], grad, weight, ptt, ttp)
    for a, b in zip(compiled, eager, strict=True):
        assert_equal(a, b)
    replay, captured = capture_cuda_graph(lambda: f(q[0], q[1], grad, weight, ptt, ttp))
    replay()
    for a, b in zip(captured, eager, strict=True):
        assert_equal(a, b)


CHAN_GPU_CASES = [
    # (tokens, h, bm, round, transpose, clamp)
    (4096, 7168, 32, True, False, None),
    (8064, 2048, 32, False, False, 0.5),
    (4096, 576, 32, True, True, 10.0),
    (256, 3072, 128, False, True, None),
    (128, 576, 128, True, False, 0.5),
    (0, 1024, 32, True, True, None),
    (0, 7168, 32, True, True, 0.5),  # no launch: shapes of the empty (H, 0) output and (0, H) scales
]
if full_test():
    CHAN_GPU_CASES += [
        (t, h, bm, rnd, tr, cl)
        for t in (4096, 8064)
        for h in (576, 2048, 2560, 3072, 4096, 6144, 7168)
        for bm in (32, 128)
        for rnd in (True, False)
        for tr in (True, False)
        for cl in (None, 10.0, 0.5)
        if t % bm == 0
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CHAN_GPU_CASES, ids=lambda c: "-".join(str(v) for v in c))
def test_gpu_forward_per_channel(case):
    t, h, bm, rnd, transpose, clamp = case
    x = torch.randn(t, 2 * h, device=DEV).bfloat16()
    got = CHAN(x, "e4m3", bm, rnd, not transpose, clamp)
    want = R.swiglu_forward_and_per_channel_cast_and_transpose(x, "e4m3", bm, rnd, not transpose, clamp)
    assert_equal(got[0], want[0])
    assert_equal(got[1], want[1])
    out2, sf2 = _poison(torch.empty_like(got[0])), _poison(torch.empty_like(got[1]))
    if t:
        S.swiglu_forward_and_per_channel_cast_and_transpose_(x, out2, sf2, bm, rnd, transpose, clamp, 1e-4)
        assert_equal(out2, want[0])
        assert_equal(sf2, want[1])
    again = CHAN(x, "e4m3", bm, rnd, not transpose, clamp)
    assert_equal(again[0], got[0])


@pytest.mark.gpu
@pytest.mark.parametrize("transpose", [True, False])
def test_gpu_forward_per_channel_more_token_blocks_than_a_grid_dimension(transpose):
    """65,536 x 32 tokens: more 32-token blocks than a grid's y extent holds (the linear grid)."""
    x = torch.randn(65536 * 32, 2 * 64, device=DEV).bfloat16()
    got = CHAN(x, "e4m3", 32, True, not transpose, 0.5)
    want = R.swiglu_forward_and_per_channel_cast_and_transpose(x, "e4m3", 32, True, not transpose, 0.5)
    assert_equal(got[0], want[0])
    assert_equal(got[1], want[1])


@pytest.mark.gpu
def test_gpu_forward_per_channel_transposed_more_than_2_31_elements():
    """A transposed (7,168, 299,616) output, more than 2**31 elements, stored through a flat view (whose length
    TileLang's host code reads as int32). Token blocks are independent: the reference runs on the last one."""
    t = -(-(2**31) // 7168 // 32) * 32
    x = torch.randn(t, 2 * 7168, device=DEV).bfloat16()
    out, sf = CHAN(x, "e4m3", 32, True, False, None)
    want = R.swiglu_forward_and_per_channel_cast_and_transpose(x[t - 32:], "e4m3", 32, True, False, None)
    assert_equal(out[:, t - 32:], want[0])
    assert_equal(sf[-1:], want[1])


@pytest.mark.gpu
def test_gpu_forward_per_channel_runtime_clamp_no_recompile():
    x = torch.randn(128, 2 * 1024, device=DEV).bfloat16()
    CHAN(x, "e4m3", 32, True, False, 0.5)
    n = len(S.swiglu_fwd_channel_kernel._cache)
    for c in (0.25, 1.5, 3.0):
        got = CHAN(x, "e4m3", 32, True, False, c)
        want = R.swiglu_forward_and_per_channel_cast_and_transpose(x, "e4m3", 32, True, False, c)
        assert_equal(got[0], want[0])
    assert len(S.swiglu_fwd_channel_kernel._cache) == n


@pytest.mark.gpu
def test_gpu_forward_per_channel_opcheck_compile_graph():
    x = torch.randn(256, 2 * 1024, device=DEV).bfloat16()
    out = torch.empty(1024, 256, dtype=torch.float8_e4m3fn, device=DEV)
    sf = torch.empty(8, 1024, device=DEV)
    opcheck(S.swiglu_forward_and_per_channel_cast_and_transpose_.op, (x, out, sf, 32, True, True, 0.5, 1e-4))

    def f(x):
        return CHAN(x, "e4m3", 32, True, False, 0.5)

    eager = f(x)
    compiled = torch.compile(f, fullgraph=True)(x)
    assert_equal(compiled[0], eager[0])
    assert_equal(compiled[1], eager[1])
    replay, captured = capture_cuda_graph(lambda: f(x))
    replay()
    assert_equal(captured[0], eager[0])
    assert_equal(captured[1], eager[1])


@pytest.mark.gpu
def test_gpu_moe_generator_layout():
    """The anchor's MoE generator feeds the same kernels (E from generate_topk_idx, alignment 16)."""
    params = dict(num_send_tokens=500, num_topk=2, num_experts=9, num_ep_ranks=8)
    idx = generate_topk_idx(params, device=DEV)
    pe, ptt, ttp = generate_fused_mapping(idx, 9, 16)
    x = expand_to_fused(torch.randn(idx.shape[0], 2 * 1024, device=DEV).bfloat16(), ptt, 2)
    got = FWD(x, "e4m3", 128, pos_to_expert=pe, use_tma_aligned_col_major_sf=True, round_sf=True, use_packed_ue8m0=True)
    want = R.swiglu_forward_and_per_token_cast(x, "e4m3", 128, None, None, pe, True, True, True)
    assert_equal(got[0], want[0])
    assert_equal(sf_to_row_major(got[1], 8), sf_to_row_major(want[1], 8))
