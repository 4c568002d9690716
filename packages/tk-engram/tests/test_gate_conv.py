"""GateConv forward/backward, the autograd Function, the decode step and the op objects: cpu, compile and gpu
tiers (see gate_conv.py and decode.py for the math)."""

import math

import pytest
import torch
import torch.nn.functional as F

from tk_core import config
from tk_core.jit import ARCHS, arch_of
from tk_core.testing import assert_equal, calc_diff, capture_cuda_graph
from tk_core.testing.compile_check import MAX_SMEM_PER_BLOCK, assert_compiles, dynamic_smem_bytes
from tk_engram import (
    EngramDecodeFwdOp,
    EngramGateConvBwdOp,
    EngramGateConvFn,
    EngramGateConvFwdOp,
    engram_decode_step,
    engram_gate_conv,
    engram_gate_conv_bwd,
    engram_gate_conv_fwd,
    init_decode_state,
    reference,
)
from tk_engram import _gate_conv_kernels as K


def _inputs(M, T, d, taps, dtype, device="cpu", scale=1.0):
    g = lambda *s: torch.randn(*s, dtype=torch.float32, device=device)  # noqa: E731
    H = g(M, T, d).to(dtype)
    k = g(M, T, d).to(dtype)
    v = g(M, T, d).to(dtype)
    wh = (1 + 0.3 * g(d)).to(dtype)
    wv = (1 + 0.3 * g(d)).to(dtype)
    cw = (0.5 * g(taps, d)).to(dtype)
    return H, k, v, wh, wv, cw


def _independent_fwd64(H, k, v, wh, wv, cw, dilation, eps):
    """float64 GateConv written with F.rms_norm-style math and torch's depthwise conv1d (no rounding)."""
    H, k, v, wh, wv, cw = (x.double() for x in (H, k, v, wh, wv, cw))
    d = H.shape[-1]
    norm = lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w  # noqa: E731
    alpha = torch.sigmoid((norm(H, wh) * norm(k, wh)).sum(-1, keepdim=True) / math.sqrt(d))
    vh = alpha * v
    n = norm(vh, wv)
    taps = cw.shape[0]
    x = F.pad(n.transpose(1, 2), ((taps - 1) * dilation, 0))
    u = F.conv1d(x, cw.t().unsqueeze(1), dilation=dilation, groups=d).transpose(1, 2)
    return F.silu(u) + vh, n


# ------------------------------------------------------------------------------------------------ cpu tier
@pytest.mark.parametrize("taps,dilation", [(4, 1), (4, 3), (3, 2), (1, 1)])
def test_fwd_reference_matches_float64_math(taps, dilation):
    M, T, d = 2, 13, 24
    x = _inputs(M, T, d, taps, torch.float64)
    Y, vhat, alpha, rh, rk, rv, st = reference.gate_conv_fwd_ref(*x, dilation, 1e-6)
    Y64, n64 = _independent_fwd64(*x, dilation, 1e-6)
    torch.testing.assert_close(Y, Y64, rtol=1e-12, atol=1e-12)
    hist = dilation * (taps - 1)
    assert st.shape == (M, hist, d)
    for tau in range(T - hist, T):  # ring layout: slot tau mod hist holds token tau, zeros before 0
        want = n64[:, tau] if tau >= 0 else torch.zeros_like(n64[:, 0])
        torch.testing.assert_close(st[:, tau % hist], want, rtol=1e-12, atol=1e-12)


def test_fwd_reference_short_sequence_state_zeros():
    x = _inputs(1, 2, 16, 4, torch.float64)
    st = reference.gate_conv_fwd_ref(*x, 3, 1e-6)[-1]  # hist = 9 > T = 2
    assert st.shape == (1, 9, 16)
    nz = [s for s in range(9) if st[0, s].abs().sum() > 0]
    assert nz == [0, 1]  # tokens 0 and 1 at slots 0 and 1


@pytest.mark.parametrize("taps,dilation", [(4, 1), (3, 2)])
def test_bwd_reference_matches_autograd_float64(taps, dilation):
    x = _inputs(2, 11, 16, taps, torch.float64)
    out = reference.gate_conv_fwd_ref(*x, dilation, 1e-6)
    leaves = [t.clone().requires_grad_() for t in x]
    Y = reference.gate_conv_fwd_ref(*leaves, dilation, 1e-6)[0]
    dY = torch.randn_like(Y)
    Y.backward(dY)
    got = reference.gate_conv_bwd_ref(dY, *x, *out[2:6], dilation)
    for g, leaf in zip(got, leaves, strict=False):
        torch.testing.assert_close(g, leaf.grad, rtol=1e-10, atol=1e-12)


def test_gradcheck_gate_conv_fn_float64():
    x = [t.requires_grad_() for t in _inputs(2, 7, 8, 3, torch.float64)]
    assert torch.autograd.gradcheck(lambda *a: EngramGateConvFn.apply(*a, 2, 1e-6), x, eps=1e-6, atol=1e-6)


def test_autograd_function_bf16_cpu_matches_float64():
    x64 = _inputs(1, 9, 16, 4, torch.float64)
    xb = [t.to(torch.bfloat16).requires_grad_() for t in x64]
    Y = engram_gate_conv(*xb, dilation=1)
    dY = torch.randn_like(Y)
    Y.backward(dY)
    l64 = [t.to(torch.bfloat16).double().requires_grad_() for t in x64]
    Y64 = reference.gate_conv_fwd_ref(*l64, 1, 1e-6)[0]
    Y64.backward(dY.double())
    assert calc_diff(Y, Y64) < 1e-4
    for a, b in zip(xb, l64, strict=False):
        assert a.grad.dtype == torch.bfloat16
        assert calc_diff(a.grad, b.grad) < 1e-3


@pytest.mark.parametrize("taps,dilation", [(4, 1), (4, 3)])
def test_prefill_then_decode_equals_full_prefill_cpu(taps, dilation):
    M, T, N, d, d_mem = 2, 5, 12, 16, 24
    dt = torch.float64
    E = torch.randn(M, T + N, d_mem, dtype=dt)
    WK, WV = 0.2 * torch.randn(d_mem, d, dtype=dt), 0.2 * torch.randn(d_mem, d, dtype=dt)
    H = torch.randn(M, T + N, d, dtype=dt)
    _, _, _, wh, wv, cw = _inputs(1, 1, d, taps, dt)
    k, v = E @ WK, E @ WV
    fwd = EngramGateConvFwdOp(taps, dilation)
    Y_all, *_, st_all = fwd(H, k, v, wh, wv, cw)
    Y_pre, *_, state = fwd(H[:, :T], k[:, :T], v[:, :T], wh, wv, cw)
    torch.testing.assert_close(Y_pre, Y_all[:, :T], rtol=1e-12, atol=1e-12)
    dec = EngramDecodeFwdOp(taps, dilation)
    state = state.clone()
    pos = torch.full((M,), T, dtype=torch.int32)
    for i in range(T, T + N):
        y = dec(E[:, i], H[:, i], state, pos, WK, WV, wh, wv, cw)
        torch.testing.assert_close(y, Y_all[:, i], rtol=1e-10, atol=1e-12)
    assert pos.tolist() == [T + N] * M
    torch.testing.assert_close(state, st_all, rtol=1e-10, atol=1e-12)


def test_decode_from_empty_state_equals_prefill_cpu():
    M, N, d, d_mem, taps, dil = 1, 8, 16, 8, 4, 2
    dt = torch.float64
    E, H = torch.randn(M, N, d_mem, dtype=dt), torch.randn(M, N, d, dtype=dt)
    WK, WV = torch.randn(d_mem, d, dtype=dt), torch.randn(d_mem, d, dtype=dt)
    _, _, _, wh, wv, cw = _inputs(1, 1, d, taps, dt)
    Y_all = engram_gate_conv_fwd(H, E @ WK, E @ WV, wh, wv, cw, dilation=dil)[0]
    state, pos = init_decode_state(M, d, taps, dil, dtype=dt)
    for i in range(N):
        y = engram_decode_step(E[:, i], H[:, i], state, pos, WK, WV, wh, wv, cw, dilation=dil)
        pos += 1
        torch.testing.assert_close(y, Y_all[:, i], rtol=1e-10, atol=1e-12)


def test_public_cpu_bf16_shapes_and_dtypes():
    x = _inputs(2, 6, 16, 4, torch.bfloat16)
    Y, vhat, a, rh, rk, rv, st = engram_gate_conv_fwd(*x, dilation=2)
    assert Y.dtype == vhat.dtype == st.dtype == torch.bfloat16 and a.dtype == torch.float32
    assert Y.shape == (2, 6, 16) and a.shape == (2, 6) and st.shape == (2, 6, 16)
    dY = torch.randn_like(Y)
    g = engram_gate_conv_bwd(dY, *x, a, rh, rk, rv, dilation=2)
    assert [t.dtype for t in g] == [torch.bfloat16] * 3 + [torch.float32] * 3
    assert g[5].shape == (4, 16)
    bwd = EngramGateConvBwdOp(4, 2, target="torch")
    for p, q in zip(bwd(dY, *x, a, rh, rk, rv), g, strict=False):
        assert_equal(p, q)


def test_empty_tokens_cpu():
    x = _inputs(2, 0, 16, 4, torch.bfloat16)
    Y, vhat, a, rh, rk, rv, st = engram_gate_conv_fwd(*x)
    assert Y.shape == (2, 0, 16) and st.shape == (2, 3, 16) and not st.any()


def test_validation_errors():
    x = list(_inputs(1, 4, 16, 4, torch.bfloat16))
    with pytest.raises(TypeError, match="engram_gate_conv_fwd: k must be of dtype"):
        engram_gate_conv_fwd(x[0], x[1].half(), *x[2:])
    with pytest.raises(ValueError, match="engram_gate_conv_fwd: v must be of shape"):
        engram_gate_conv_fwd(x[0], x[1], x[2][:, :3], *x[3:])
    with pytest.raises(ValueError, match="engram_gate_conv_fwd: rms_w_v must be of shape"):
        engram_gate_conv_fwd(*x[:4], x[4][:8], x[5])
    with pytest.raises(ValueError, match="engram_gate_conv_fwd: dilation must be a positive int"):
        engram_gate_conv_fwd(*x, dilation=0)
    with pytest.raises(ValueError, match="engram_gate_conv_fwd: H must be 3-D"):
        engram_gate_conv_fwd(x[0][0], *x[1:])
    with pytest.raises(TypeError, match="engram_gate_conv_fwd: H must be a torch.Tensor"):
        engram_gate_conv_fwd(None, *x[1:])
    with pytest.raises(ValueError, match="EngramGateConvFwdOp: target must be one of"):
        EngramGateConvFwdOp(target="cuda")
    with pytest.raises(ValueError, match="EngramGateConvFwdOp: conv_w must be of shape \\(3, d\\)"):
        EngramGateConvFwdOp(3)(*x)
    with pytest.raises(ValueError, match="EngramGateConvFwdOp: inputs must be CUDA tensors"):
        EngramGateConvFwdOp(target="tilelang")(*x)
    a = torch.zeros(1, 4)
    with pytest.raises(ValueError, match="engram_gate_conv_bwd: alpha must be of shape"):
        engram_gate_conv_bwd(x[0], *x, a[:, :2], a, a, a)
    with pytest.raises(TypeError, match="engram_gate_conv_bwd: rrms_v must be of dtype"):
        engram_gate_conv_bwd(x[0], *x, a, a, a, a.half())


def test_decode_validation_errors():
    d, d_mem = 16, 8
    x = _inputs(1, 1, d, 4, torch.bfloat16)
    e, h = torch.randn(2, d_mem).bfloat16(), torch.randn(2, d).bfloat16()
    W = torch.randn(d_mem, d).bfloat16()
    st, pos = init_decode_state(2, d, 4, 2)
    with pytest.raises(ValueError, match="engram_decode_step: conv_state must be of length >= dilation\\*\\(w-1\\) = 9"):
        engram_decode_step(e, h, st, pos, W, W, *x[3:], dilation=3)
    with pytest.raises(TypeError, match="engram_decode_step: cache_pos must be of dtype"):
        engram_decode_step(e, h, st, pos.long(), W, W, *x[3:], dilation=2)
    with pytest.raises(ValueError, match="engram_decode_step: W_V must be of shape"):
        engram_decode_step(e, h, st, pos, W, W[:4], *x[3:], dilation=2)
    with pytest.raises(ValueError, match="EngramDecodeFwdOp: eps must be a finite float >= 0"):
        EngramDecodeFwdOp(eps=-1.0)
    args = _decode_args()
    with pytest.raises(TypeError, match="EngramDecodeFwdOp: advance must be a bool, got 'no'"):
        EngramDecodeFwdOp()(*args, advance="no")
    assert int(args[3].sum()) == 0  # nothing ran, cache_pos did not move


def _decode_args(d=16, dtype=torch.bfloat16):
    """[e_t, h_t, conv_state, cache_pos, W_K, W_V, rms_w_h, rms_w_v, conv_w]: 2 rows, 4 taps, an empty history."""
    B, d_mem = 2, 8
    _, _, _, wh, wv, cw = _inputs(1, 1, d, 4, dtype)
    st, pos = init_decode_state(B, d, 4, dtype=dtype)
    W = lambda: (0.2 * torch.randn(d_mem, d)).to(dtype)  # noqa: E731
    return [torch.randn(B, d_mem).to(dtype), torch.randn(B, d).to(dtype), st, pos, W(), W(), wh, wv, cw]


@pytest.mark.parametrize("target", [None, "torch"])
def test_op_objects_validate_on_every_target(target):
    x = list(_inputs(2, 5, 16, 4, torch.bfloat16))
    fwd, bwd = EngramGateConvFwdOp(target=target), EngramGateConvBwdOp(target=target)
    Y, _, *stats, _ = fwd(*x)
    dY = torch.randn_like(Y)
    for a, b in zip(fwd(*x), engram_gate_conv_fwd(*x), strict=True):
        assert_equal(a, b)
    with pytest.raises(ValueError, match=r"engram_gate_conv_fwd: v must be of shape \(2, 5, 16\)"):
        fwd(x[0], x[1], x[2][:1], *x[3:])  # would broadcast in the reference
    with pytest.raises(TypeError, match="engram_gate_conv_fwd: H must be of dtype"):
        fwd(*(t.int() for t in x[:3]), *x[3:])
    with pytest.raises(ValueError, match=r"engram_gate_conv_bwd: alpha must be of shape \(2, 5\)"):
        bwd(dY, *x, stats[0][:1], *stats[1:])
    dec = EngramDecodeFwdOp(target=target)
    args = _decode_args()
    with pytest.raises(ValueError, match="engram_decode_step: conv_state must be of length >= dilation"):
        dec(*args[:2], args[2][:, :2], *args[3:])
    with pytest.raises(TypeError, match="engram_decode_step: cache_pos must be of dtype int32"):
        dec(*args[:3], args[3].float(), *args[4:])
    assert args[3].tolist() == [0, 0]  # nothing ran


@pytest.mark.parametrize("target", [None, "torch", "tilelang"])
def test_op_objects_reject_non_tensors(target):
    x = list(_inputs(1, 4, 16, 4, torch.bfloat16))
    with pytest.raises(TypeError, match="H must be a torch.Tensor, got list"):
        EngramGateConvFwdOp(target=target)(x[0].tolist(), *x[1:])
    with pytest.raises(TypeError, match="H must be a torch.Tensor, got NoneType"):
        EngramGateConvBwdOp(target=target)(x[0], None, *x[1:], *torch.zeros(4, 1, 4))
    args = _decode_args()
    with pytest.raises(TypeError, match="h_t must be a torch.Tensor, got list"):
        EngramDecodeFwdOp(target=target)(args[0], args[1].tolist(), *args[2:])
    with pytest.raises(TypeError, match="EngramGateConvFwdOp: conv_w must be a torch.Tensor, got NoneType"):
        EngramGateConvFwdOp(target=target)(*x[:5], None)


def test_conv_w_shape_errors():
    x = list(_inputs(1, 4, 16, 4, torch.bfloat16))
    a = torch.zeros(1, 4)
    scalar_w = torch.tensor(1.0).bfloat16()
    with pytest.raises(ValueError, match=r"engram_gate_conv_fwd: conv_w must be 2-D, got shape \(\)"):
        engram_gate_conv_fwd(*x[:5], scalar_w)
    with pytest.raises(ValueError, match=r"engram_gate_conv_bwd: conv_w must be 2-D, got shape \(\)"):
        engram_gate_conv_bwd(x[0], *x[:5], scalar_w, a, a, a, a)
    args = _decode_args()
    with pytest.raises(ValueError, match=r"engram_decode_step: conv_w must be of shape \(\*, 16\), got shape \(\)"):
        engram_decode_step(*args[:8], scalar_w)
    with pytest.raises(ValueError, match="EngramGateConvFwdOp: conv_w must be 2-D"):
        EngramGateConvFwdOp()(*x[:5], scalar_w)
    with pytest.raises(ValueError, match="EngramGateConvBwdOp: conv_w must be 2-D"):
        EngramGateConvBwdOp()(x[0], *x[:5], scalar_w, a, a, a, a)
    with pytest.raises(ValueError, match="EngramDecodeFwdOp: conv_w must be 2-D"):
        EngramDecodeFwdOp()(*args[:8], scalar_w)
    # zero taps: the error names conv_w (not conv_kernel_size)
    with pytest.raises(ValueError, match=r"engram_gate_conv_fwd: conv_w must be of shape \(w >= 1, d\)"):
        engram_gate_conv_fwd(*x[:5], x[5][:0])
    with pytest.raises(ValueError, match=r"engram_gate_conv_bwd: conv_w must be of shape \(w >= 1, d\)"):
        engram_gate_conv_bwd(x[0], *x[:5], x[5][:0], a, a, a, a)
    with pytest.raises(ValueError, match=r"engram_decode_step: conv_w must be of shape \(w >= 1, d\)"):
        engram_decode_step(*args[:8], args[8][:0])


@pytest.mark.parametrize("eps,exc", [("1e-6", TypeError), (None, TypeError), (True, TypeError),
                                     (math.inf, ValueError), (math.nan, ValueError), (-1.0, ValueError)])
def test_eps_errors(eps, exc):
    x = _inputs(1, 4, 16, 4, torch.bfloat16)
    with pytest.raises(exc, match="engram_gate_conv_fwd: eps must be a"):
        engram_gate_conv_fwd(*x, eps=eps)
    with pytest.raises(exc, match="engram_decode_step: eps must be a"):
        engram_decode_step(*_decode_args(), eps=eps)
    for op in (EngramGateConvFwdOp, EngramGateConvBwdOp, EngramDecodeFwdOp):
        with pytest.raises(exc, match=f"{op.__name__}: eps must be a"):
            op(eps=eps)


def test_zero_width_rows_rejected():
    x = _inputs(2, 3, 0, 4, torch.bfloat16)
    with pytest.raises(ValueError, match=r"engram_gate_conv_fwd: H must be of shape \(M, T, d\) with d >= 1"):
        engram_gate_conv_fwd(*x)
    a = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"engram_gate_conv_bwd: H must be of shape \(M, T, d\) with d >= 1"):
        engram_gate_conv_bwd(x[0], *x, a, a, a, a)
    with pytest.raises(ValueError, match=r"engram_decode_step: h_t must be of shape \(B, d\) with d >= 1"):
        engram_decode_step(*_decode_args(d=0))


def test_bwd_errors_name_dY():
    x = list(_inputs(1, 4, 16, 4, torch.bfloat16))
    a = torch.zeros(1, 4)
    with pytest.raises(TypeError, match="engram_gate_conv_bwd: dY must be of dtype torch.bfloat16 like H, got"):
        engram_gate_conv_bwd(x[0].half(), *x, a, a, a, a)
    with pytest.raises(ValueError, match=r"engram_gate_conv_bwd: dY must be of shape \(1, 4, 16\), got"):
        engram_gate_conv_bwd(x[0][:, :2], *x, a, a, a, a)


def test_init_decode_state_errors():
    with pytest.raises(ValueError, match="init_decode_state: batch must be a non-negative int, got -1"):
        init_decode_state(-1, 16)
    with pytest.raises(ValueError, match="init_decode_state: d must be a non-negative int, got -8"):
        init_decode_state(2, -8)
    with pytest.raises(TypeError, match="init_decode_state: batch must be a non-negative int, got 2.5"):
        init_decode_state(2.5, 16)
    with pytest.raises(ValueError, match="init_decode_state: conv_kernel_size must be a positive int, got 0"):
        init_decode_state(2, 16, 0)
    for dilation in (0, -1):
        with pytest.raises(ValueError, match="init_decode_state: dilation must be a positive int"):
            init_decode_state(2, 16, 4, dilation)
    with pytest.raises(TypeError, match="init_decode_state: dilation must be a positive int, got True"):
        init_decode_state(2, 16, 4, True)
    st, pos = init_decode_state(0, 0)
    assert st.shape == (0, 3, 0) and pos.shape == (0,)


def test_decode_rejects_an_overlapping_state_on_cpu():
    args = _decode_args(dtype=torch.float32)
    expanded = torch.zeros(1, 3, 16).expand(2, 3, 16)  # both rows' cache in one memory
    with pytest.raises(ValueError, match="engram_decode_step: conv_state must be contiguous"):
        engram_decode_step(*args[:2], expanded, *args[3:])
    assert not expanded.any()


def test_decode_plan_cpu():
    from tk_engram import decode

    for d in (200, 1088, 4096, 7168):
        for B in (1, 3, 8, 13, 16):
            assert decode.decode_plan(B, 2048, d)[0] == "gemv"
        # more rows: the GEMV with the W ring (whole panels, one CTA per SM), else the fused kernel or two launches
        ring = d in (1088, 4096)
        assert decode.decode_plan(17, 2048, d)[0] == ("gemv" if ring else "fused")
        assert decode.decode_plan(32, 2048, d)[0] == ("gemv" if ring else "two_launch" if d <= 4096 else "fused")
        for B in (33, 64):
            assert decode.decode_plan(B, 2048, d)[0] == ("gemv" if ring else "two_launch" if d <= 4096 else "fused")
        assert decode.decode_plan(65, 2048, d)[0] == "two_launch"
    for B in (17, 32):
        assert decode.decode_plan(B, 2048, 4096)[1] == dict(mt=2, nw=4, depth=8, min_blocks=1, ring=decode.GEMV_RING,
                                                            mw=1)
    for B in (33, 48, 64):  # 4 m-tiles, two warps per ring slot
        assert decode.decode_plan(B, 2048, 4096)[1] == dict(mt=4, nw=4, depth=8, min_blocks=1, ring=decode.GEMV_RING,
                                                            mw=2)
    assert decode.decode_plan(17, 2040, 4096)[0] == "fused"  # d_mem: no whole ring chunks per warp
    assert decode.decode_plan(32, 2040, 4096)[0] == "two_launch"
    assert decode.decode_plan(32, 2048, 4096, 127)[0] == "two_launch"  # 128 CTAs would not fit one per SM
    assert decode.decode_plan(64, 2048, 4096, 127)[0] == "two_launch"
    # two warps per slot: one m-tile of each warp's reduction tile needs two ring chunks per slot owner's W bytes
    assert decode.decode_plan(33, 256, 4096)[0] == "two_launch" and decode.decode_plan(32, 256, 4096)[0] == "gemv"
    assert decode.decode_plan(33, 512, 4096)[0] == "gemv"
    assert decode.decode_plan(70, 512, 7168)[0] == "two_launch"
    assert decode.decode_plan(8, 2048, 7168, sms=100)[0] == "two_launch"  # 112 waiting CTAs need 113 SMs
    # the W ring: whole panels and k16 steps, the whole grid resident (2 CTAs per SM for one m-tile, which the
    # waiting V CTAs' rule already implies), room beside the epilogue's operands at 2 CTAs per SM
    for d, sms in ((4096, 132), (4096, 65), (7168, 132), (7168, 113)):
        assert decode.decode_plan(16, 2048, d, sms) == ("gemv", decode.gemv_config(16, 2048, d))
        assert decode.gemv_config(16, 2048, d)["ring"] == decode.GEMV_RING
    assert decode.decode_plan(1, 2048, 200)[1]["ring"] == decode.decode_plan(1, 2040, 4096)[1]["ring"] == 0
    rings = [decode.decode_plan(1, 2048, 4096, taps=taps)[1]["ring"] for taps in range(1, 53)]
    assert rings == sorted(rings, reverse=True) and rings[0] == decode.GEMV_RING and rings[-1] == 0
    for taps, ring in enumerate(rings, 1):
        assert (decode._gemv_epilogue(1, 4, taps, decode.GEMV_RING)[2] <= decode.GEMV_RING_SMEM) == (ring > 0)
    part, sums = decode.decode_scratch(8, 2048, 7168, "cpu")
    assert part.numel() == 0 and sums.shape == (8, 112, 4)
    part, sums = decode.decode_scratch(32, 2048, 4096, "cpu")
    assert part.numel() == 0 and sums.shape == (32, 64, 4)
    part, sums = decode.decode_scratch(64, 2048, 7168, "cpu")
    assert part.shape == (decode.fused_config(64, 2048, 7168)["splits"], 2, 64, 7168) and sums.shape == (64, 112, 4)


def test_row_layout():
    for d in (8, 200, 264, 4096, 7168, 8192, 12288):
        slots, threads = K.row_layout(d)
        assert threads % 32 == 0 and threads <= 1024 and slots * threads * 8 >= d
    assert K.row_layout(4096) == (1, 512) and K.row_layout(7168) == (1, 896)
    assert K.fuse_dconv(4096) and not K.fuse_dconv(7168)
    # the backward's 2-CTA cluster: rows of 4096 < d <= 16384 with 16-byte halves; halves wider than 4096 columns
    # at 2 vectors per thread, or 3 where 2 would take more than 384 threads
    widths = (4096, 4104, 4112, 7168, 8192, 8208, 12288, 12296, 16384, 16400)
    assert [d for d in widths if K.bwd_split(d) == 2] == [4112, 7168, 8192, 8208, 12288, 16384]
    assert [K.bwd_half_vecs(d // 2) for d in (8208, 12288, 16384)] == [2, 2, 3]
    assert all(K.bwd_fits(d // 2, 4, K.bwd_half_vecs(d // 2)) for d in (8208, 12288, 16384))
    # the backward's shared memory: the drms_w accumulators leave it above ~7,600 columns, the rings above 10,240
    assert K.bwd_shared_bytes(7168, 4, 2, False) <= MAX_SMEM_PER_BLOCK < K.bwd_shared_bytes(8192, 4, 2, False)
    assert K.bwd_fits(10240, 4, 2) and not K.bwd_fits(10304, 4, 2)


# -------------------------------------------------------------------------------------------- compile tier
GC_VARIANTS = [  # (dtype, d, taps, dilation): tests (d=200) and benchmarks (4096, 7168)
    ("bfloat16", 4096, 4, 1),
    ("bfloat16", 7168, 4, 1),
    ("bfloat16", 4096, 4, 3),
    ("bfloat16", 7168, 4, 3),
    ("float16", 200, 3, 2),
    ("bfloat16", 8192, 4, 2),  # backward: 2-CTA cluster of 4096-column halves
    ("float16", 4104, 3, 2),  # backward: odd half rows, so 2 vectors per thread and the dconv kernel
    ("bfloat16", 12288, 4, 1),  # backward: a cluster of 6144-column halves (2 vectors per thread, the dconv kernel)
    ("float16", 16384, 3, 2),  # the same with 8192-column halves at 3 vectors per thread
]


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype,d,taps,dilation", GC_VARIANTS)
def test_compile_gate_conv(arch, dtype, d, taps, dilation):
    from tk_engram.gate_conv import CHUNK, DCONV_PARAMS, FWD_PARAMS, bwd_config

    p = dict(dtype=dtype, d=d, taps=taps, dilation=dilation, chunk=CHUNK)
    fp = dict(p, **FWD_PARAMS)
    # d = 7168: 2 CTAs of 448 threads cap ptxas at 72 registers; no spill on sm_90a, 16-20 bytes on sm_100a
    # (L1-resident), and it still beat 4 vectors per thread (no spills) on the H200. d = 8192 (2 CTAs of 512 threads:
    # 64 registers) spills 64 bytes on sm_90a; it is no benchmark shape.
    spills = K.fwd_layout(d, FWD_PARAMS["vecs"])[1] * FWD_PARAMS["min_blocks"] > (896 if arch == "sm_90a" else 512)
    src = assert_compiles(K.gate_conv_fwd_kernel, arch, allow_spills=spills, **fp)
    assert "uint4" in src and "__expf" not in src and "__fdividef" not in src
    assert src.count("tk_silu_approx(") > 1 and "expf(" in src  # SiLU approximate, the gate's sigmoid precise
    bp = dict(p, **bwd_config(d, arch))
    if bp["with_dconv"]:
        # sm_90a keeps the weights in registers for the whole walk (without a spill: the check above)
        assert bp["resident_w"] == (arch == "sm_90a")
        src = assert_compiles(K.gate_conv_bwd_kernel, arch, **bp)
    else:
        # the unfused kernels spill 32-88 bytes (a 168-register choice of ptxas at 288-384 threads)
        src = assert_compiles(K.gate_conv_bwd_kernel, arch, allow_spills=True, **bp)
        # on sm_100a the 128-register cap of 4 CTAs/SM (one wave) spills ~36 bytes
        assert_compiles(K.gate_conv_dconv_kernel, arch, allow_spills=arch != "sm_90a", **dict(p, **DCONV_PARAMS))
    # exactly the split kernels sync their cluster, write the peer's shared memory, wait for it with the acquire
    # restricted to shared memory and take the approximate sigmoid
    assert ("tl::cluster_sync()" in src) == ("st.async.shared::cluster" in src) == (bp["split"] == 2)
    assert ("fence.acquire.sync_restrict::shared::cluster" in src) == (bp["split"] == 2)
    assert bp["idx32"] and src.count("tk_st16(") == 4  # the three outputs by int32 offsets (and the helper)
    assert "mbarrier.try_wait.parity.acquire" not in src
    assert (src.count("tk_sigmoid_approx(") > 1) == (bp["split"] == 2)


DECODE_VARIANTS = [("bfloat16", 2048, 4096, 4, 1), ("bfloat16", 2048, 7168, 4, 3), ("float16", 64, 200, 4, 2)]


# One test per decode kernel, so that xdist spreads the long compiles (the d=4096 kernels took 95 s in one test).
@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype,d_mem,d,taps,dilation", DECODE_VARIANTS)
def test_compile_decode_gemv(arch, dtype, d_mem, d, taps, dilation):
    from tk_engram import decode

    p = dict(dtype=dtype, d_mem=d_mem, d=d, taps=taps, dilation=dilation)
    path, cfg = decode.decode_plan(1, d_mem, d)
    assert path == "gemv"
    src = assert_compiles(decode.decode_gemv_kernel, arch, **p, **cfg)
    assert "mma.sync" in src and "tkd_poll" in src and "__expf" not in src and "tk_silu_approx(" in src
    # the W ring (TMA into shared memory) where the shape allows it, else the register-direct loads
    assert ("tma_load(" in src and "tkd_ring_step(" in src) == (cfg["ring"] > 0) == (d != 200)
    assert ("tkd_ldw((" in src) != (cfg["ring"] > 0)
    # W's copies (read once) under the L2 evict-first hint; e's (read by every CTA) under the normal one
    assert all(("tma_load<tl::CacheHintSm90::EVICT_FIRST>(" + f"{w}_desc") in src for w in ("WK", "WV")) == (d != 200)
    assert "EVICT_FIRST>(E_desc" not in src
    assert "tkd_stamp((" not in src  # the probe's timeline only where asked for


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("B,mt,mw", [(32, 2, 1), (64, 4, 2)])
def test_compile_decode_gemv_m_tiles(arch, B, mt, mw):
    """2 and 4 m-tiles through the W ring at the d=4096 anchor."""
    from tk_engram import decode

    dtype, d_mem, d, taps, dilation = DECODE_VARIANTS[0]
    path, cfg = decode.decode_plan(B, d_mem, d)
    assert path == "gemv" and (cfg["mt"], cfg["mw"]) == (mt, mw) and cfg["ring"] > 0
    src = assert_compiles(decode.decode_gemv_kernel, arch, dtype=dtype, d_mem=d_mem, d=d, taps=taps,
                          dilation=dilation, **cfg)
    assert "tma_load(" in src and "tkd_ring_step(" in src and ("tkd_bar_sync(" in src) == (mw > 1)


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype,d_mem,d,taps,dilation", DECODE_VARIANTS)
def test_compile_decode_fused(arch, dtype, d_mem, d, taps, dilation):
    """block_m 64, as at B=64 (d = 7168); from 17 rows where the ring does not apply."""
    from tk_engram import decode

    src = assert_compiles(decode.decode_fused_kernel, arch, dtype=dtype, d_mem=d_mem, d=d, taps=taps,
                          dilation=dilation, **decode.fused_config(64, d_mem, d))
    assert "mma" in src and "tk_grid_wait" in src and "__expf" not in src


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("B", [1, 64])  # the two-launch path: large batches, and smaller GPUs
@pytest.mark.parametrize("dtype,d_mem,d,taps,dilation", DECODE_VARIANTS)
def test_compile_decode_two_launch(arch, B, dtype, d_mem, d, taps, dilation):
    from tk_engram import decode

    cfg = decode.proj_config(B, d_mem, d)
    src = assert_compiles(decode.decode_proj_kernel, arch, dtype=dtype, d_mem=d_mem, d=d, **cfg)
    assert "mma" in src and "cp_async" in src
    assert_compiles(decode.decode_step_kernel, arch, dtype=dtype, d=d, taps=taps, dilation=dilation,
                    splits=cfg["splits"], cluster=decode.STEP_CLUSTER)


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
def test_compile_decode_gemv_odd_d(arch):
    """The GEMV kernel at a d of 17 panels (a multiple of 64, no anchor) with the anchors' d_mem."""
    from tk_engram import decode

    path, cfg = decode.decode_plan(8, 2048, 1088)
    assert path == "gemv"
    assert_compiles(decode.decode_gemv_kernel, arch, dtype="bfloat16", d_mem=2048, d=1088, taps=4, dilation=2, **cfg)
    src = assert_compiles(decode.decode_gemv_kernel, arch, dtype="bfloat16", d_mem=2048, d=1088, taps=4, dilation=2,
                          timeline=True, **cfg)  # benchmarks/probe_l2_flush.py
    assert src.count("tkd_stamp((") == 10  # the start, then 3 in a K CTA and 6 in a V CTA


# ------------------------------------------------------------------------------------------------ gpu tier
def _poison():
    """Fills freed allocator blocks with NaN so that outputs allocated next start poisoned."""
    x = torch.full((1 << 26,), float("nan"), device="cuda")
    del x


def _tol(dtype):
    return dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=4e-3, atol=4e-3)


GPU_CASES = [  # (M, T, d, taps, dilation, dtype)
    (2, 67, 200, 3, 2, torch.float16),
    (3, 130, 4096, 4, 1, torch.bfloat16),
    (1, 201, 7168, 4, 3, torch.bfloat16),
    (2, 5, 4096, 4, 3, torch.bfloat16),  # T < dilation*(w-1): zero history, partial state
    (1, 70, 8192, 4, 2, torch.bfloat16),  # the forward reads w_h and w_v from global memory (no room in shared)
    (2, 90, 4104, 3, 2, torch.float16),  # backward: no 16-byte halves, so one CTA per chunk and the dconv kernel
    (1, 40, 12320, 3, 1, torch.float16),  # backward: a cluster of 6160-column halves (a partial last vector group)
    (1, 33, 16384, 4, 3, torch.bfloat16),  # backward: 8192-column halves at 3 vectors per thread
]


@pytest.mark.gpu
@pytest.mark.parametrize("M,T,d,taps,dilation,dtype", GPU_CASES)
def test_gpu_fwd_matches_reference(M, T, d, taps, dilation, dtype):
    x = _inputs(M, T, d, taps, dtype, "cuda")
    ref = reference.gate_conv_fwd_ref(*x, dilation, 1e-6)
    _poison()
    out = engram_gate_conv_fwd(*x, dilation=dilation)
    for name, o, r in zip(("Y", "vhat", "alpha", "rrms_h", "rrms_k", "rrms_v", "state"), out, ref, strict=False):
        assert o.shape == r.shape and o.dtype == r.dtype, name
        assert not o.float().isnan().any(), name
        tol = dict(rtol=1e-4, atol=1e-5) if o.dtype == torch.float32 else _tol(dtype)
        torch.testing.assert_close(o.float(), r.float(), **tol, msg=name)
        assert calc_diff(o, r) < 1e-5, name
    again = engram_gate_conv_fwd(*x, dilation=dilation)
    for o, p in zip(out, again, strict=False):
        assert_equal(o, p)


@pytest.mark.gpu
def test_gpu_fwd_silu_of_large_and_zero_u():
    """The forward's approximate SiLU (``SILU_APPROX``) where its exponent argument is large: conv taps that push
    many |u| past 64 (the exp2 overflows to inf for u < -88), next to channels with zero taps, where u = 0 gives
    SiLU = 0 and Y = vhat exactly."""
    H, k, v, wh, wv, cw = _inputs(2, 99, 1024, 4, torch.bfloat16, "cuda")
    cw = (cw.float() * 60).to(cw.dtype)
    cw[:, 100:164] = 0
    ref = reference.gate_conv_fwd_ref(H, k, v, wh, wv, cw, 1, 1e-6)
    u_big = (ref[0].float() - ref[1].float()).abs() > 64  # Y - vhat = silu(u), and silu(u) > 64 means u > 64
    assert u_big.float().mean() > 0.05
    out = engram_gate_conv_fwd(H, k, v, wh, wv, cw)
    for name, o, r in zip(("Y", "vhat"), out, ref, strict=False):
        assert not o.float().isnan().any(), name
        torch.testing.assert_close(o.float(), r.float(), **_tol(torch.bfloat16), msg=name)
    assert_equal(out[0][..., 100:164], out[1][..., 100:164])  # silu(0) = 0: Y = vhat + 0 exactly


# budget 0: every weight read from global memory and the n ring in the input dtype; the float32 shared rows with
# contiguous vectors (no planes)
FWD_KERNEL_VARIANTS = [dict(budget=0), dict(planes=False)]


@pytest.mark.gpu
@pytest.mark.parametrize("M,T,d,taps,dilation,dtype", GPU_CASES[:4])
def test_gpu_fwd_kernel_variants_are_bit_identical(M, T, d, taps, dilation, dtype):
    """The forward's shared-memory plan and layout must reproduce the op default's bits (every output)."""
    from tk_engram.gate_conv import FWD_PARAMS

    x = _inputs(M, T, d, taps, dtype, "cuda")
    hist = dilation * (taps - 1)
    p = dict(dtype={torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype], d=d, taps=taps, dilation=dilation,
             **FWD_PARAMS)

    def run(**v):
        out = [torch.full((M, T, d), float("nan"), dtype=dtype, device="cuda") for _ in range(2)]
        out += [torch.full((M, T), float("nan"), device="cuda") for _ in range(4)]
        out.append(torch.full((M, max(hist, 1), d), float("nan"), dtype=dtype, device="cuda"))
        K.gate_conv_fwd_kernel.get(x[0].device, **dict(p, **v))(*x, *out, 1e-6)
        return out[:6] + [out[6][:, :hist]]

    default = run()
    for v in FWD_KERNEL_VARIANTS:
        for a, b in zip(run(**v), default, strict=True):
            assert_equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("M,T,d,taps,dilation,dtype", GPU_CASES[:4])
@pytest.mark.parametrize("flag", ["planes", "resident_w", "ahead", "idx32"])
def test_gpu_bwd_layouts_are_bit_identical(M, T, d, taps, dilation, dtype, flag):
    """The backward with one layout choice flipped (the float32 shared rows in two planes or contiguous, the
    weights in registers for the walk or loaded per stage, stage A's rows and statistics an iteration ahead or
    not, int32 or int64 addresses): the same bits in every output."""
    from tk_engram.gate_conv import _num_parts, bwd_config

    x = _inputs(M, T, d, taps, dtype, "cuda")
    stats = engram_gate_conv_fwd(*x, dilation=dilation)[2:6]
    dY = torch.randn(M, T, d, device="cuda").to(dtype)
    cfg = bwd_config(d, arch_of(x[0].device))
    p = dict(dtype={torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype], d=d, taps=taps, dilation=dilation,
             **cfg)
    rows = 2 + taps if cfg["with_dconv"] else 2

    def run(**over):
        out = [torch.full((M, T, d), float("nan"), dtype=dtype, device="cuda") for _ in range(3)]
        out.append(torch.full((_num_parts(M, T, dilation, cfg["chunk"]), rows, d), float("nan"), device="cuda"))
        K.gate_conv_bwd_kernel.get(x[0].device, **dict(p, **over))(dY, *x, *stats, *out)
        return out

    for a, b in zip(run(), run(**{flag: not p[flag]}), strict=True):
        assert_equal(a, b)


@pytest.mark.gpu
def test_gpu_bwd_rows_wider_than_the_kernel():
    """d = 16448 (halves wider than the cluster's 8192 columns, a whole row wider than the rings' 10,240) does not
    fit the backward's kernel: the op runs the reference on the GPU."""
    x = _inputs(1, 9, 16448, 4, torch.bfloat16, "cuda")
    stats = engram_gate_conv_fwd(*x)[2:6]
    dY = torch.randn(1, 9, 16448, device="cuda").to(torch.bfloat16)
    out = engram_gate_conv_bwd(dY, *x, *stats)
    ref = reference.gate_conv_bwd_ref(dY, *x, *stats, 1)
    for o, r in zip(out, ref, strict=True):
        assert o.shape == r.shape and o.dtype == r.dtype and calc_diff(o, r) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("M,T,d,taps,dilation,dtype", GPU_CASES)
def test_gpu_bwd_matches_reference_and_is_deterministic(M, T, d, taps, dilation, dtype):
    x = _inputs(M, T, d, taps, dtype, "cuda")
    stats = engram_gate_conv_fwd(*x, dilation=dilation)[2:6]
    dY = torch.randn(M, T, d, device="cuda").to(dtype)
    ref = reference.gate_conv_bwd_ref(dY, *x, *stats, dilation)
    _poison()
    out = engram_gate_conv_bwd(dY, *x, *stats, dilation=dilation)
    for name, o, r in zip(("dH", "dk", "dv", "drms_w_h", "drms_w_v", "dconv_w"), out, ref, strict=False):
        assert o.shape == r.shape and o.dtype == r.dtype, name
        assert not o.float().isnan().any(), name
        assert calc_diff(o, r) < 1e-4, name
    again = engram_gate_conv_bwd(dY, *x, *stats, dilation=dilation)
    for o, p in zip(out, again, strict=False):
        assert_equal(o, p)


@pytest.mark.gpu
def test_gpu_empty_and_strided():
    x = _inputs(2, 0, 200, 4, torch.bfloat16, "cuda")
    out = engram_gate_conv_fwd(*x)
    assert out[0].shape == (2, 0, 200) and not out[-1].any()
    g = engram_gate_conv_bwd(out[0], *x, *out[2:6])
    assert g[0].shape == (2, 0, 200) and not g[5].any()
    big = [torch.randn(2, 40, 416, device="cuda").bfloat16() for _ in range(3)]
    H, k, v = (t[:, ::2, 8:208] for t in big)  # strided, offset rows
    _, _, _, wh, wv, cw = _inputs(1, 1, 200, 4, torch.bfloat16, "cuda")
    got = engram_gate_conv_fwd(H, k, v, wh, wv, cw)
    ref = reference.gate_conv_fwd_ref(H, k, v, wh, wv, cw, 1, 1e-6)
    assert calc_diff(got[0], ref[0]) < 1e-5


@pytest.mark.gpu
def test_gpu_autograd_chain_matches_float64():
    x = _inputs(2, 50, 200, 4, torch.bfloat16, "cuda")
    leaves = [t.clone().requires_grad_() for t in x]
    Y = engram_gate_conv(*leaves, dilation=2)
    dY = torch.randn_like(Y)
    Y.backward(dY)
    l64 = [t.double().cpu().requires_grad_() for t in x]
    Y64 = reference.gate_conv_fwd_ref(*l64, 2, 1e-6)[0]
    Y64.backward(dY.double().cpu())
    assert calc_diff(Y.cpu(), Y64) < 1e-4
    for a, b in zip(leaves, l64, strict=False):
        assert calc_diff(a.grad.cpu(), b.grad) < 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("d", [200, 7168])  # 7168: the backward's 2-CTA cluster launch
def test_gpu_opcheck_compile_and_cuda_graph(d):
    from tk_engram import gate_conv

    x = _inputs(2, 33, d, 4, torch.bfloat16, "cuda")
    M, T = 2, 33
    outs = [torch.empty(M, T, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    stats = [torch.empty(M, T, device="cuda") for _ in range(4)]
    state = torch.empty(M, 3, d, device="cuda", dtype=torch.bfloat16)
    torch.library.opcheck(gate_conv._gate_conv_fwd_dev.op, (*x, *outs, *stats, state, 1, 1e-6))
    dY = torch.randn(M, T, d, device="cuda").bfloat16()
    fw = engram_gate_conv_fwd(*x)
    grads = [torch.empty(M, T, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    part = torch.empty(gate_conv._num_parts(M, T, 1), 6, d, device="cuda")
    torch.library.opcheck(gate_conv._gate_conv_bwd_dev.op,
                          (dY, *x, *fw[2:6], *grads, part, torch.empty(1, 1, 1, device="cuda"), 1))
    eager = engram_gate_conv_fwd(*x)
    compiled = torch.compile(engram_gate_conv_fwd, fullgraph=True)(*x)
    for a, b in zip(eager, compiled, strict=False):
        assert_equal(a, b)
    cb = torch.compile(engram_gate_conv_bwd, fullgraph=True)(dY, *x, *fw[2:6])
    for a, b in zip(engram_gate_conv_bwd(dY, *x, *fw[2:6]), cb, strict=False):
        assert_equal(a, b)

    def step():
        out = engram_gate_conv_fwd(*x)
        return out, engram_gate_conv_bwd(dY, *x, *out[2:6])

    replay, (g_out, g_bwd) = capture_cuda_graph(step)
    replay()
    for a, b in zip(eager, g_out, strict=False):
        assert_equal(a, b)
    for a, b in zip(engram_gate_conv_bwd(dY, *x, *fw[2:6]), g_bwd, strict=False):
        assert_equal(a, b)


# GEMV kernel up to 16 rows (odd batches, ragged d = 200 and d_mem = 520, the anchors' d_mem at d = 7168, a full
# 16-row tile at d = 1088); fused kernel with block_m 64 and a partial row tile (B=33, d=7168); the two launches at
# B=65, d=1088 (33 rows or more where the ring does not take them, d <= 4096), B=40 with d_mem 256 (too few ring
# chunks for two warps per slot) and at B=70, d=7168 (too many panel finishers for the fused kernel).
DECODE_CASES = [(1, 64, 200, 4, 2, torch.float16), (8, 2048, 4096, 4, 1, torch.bfloat16),
                (13, 2048, 7168, 4, 3, torch.bfloat16), (16, 520, 1088, 4, 2, torch.bfloat16),
                (3, 24, 200, 4, 1, torch.bfloat16), (65, 256, 1088, 4, 3, torch.bfloat16),
                (40, 256, 640, 4, 1, torch.float16), (33, 1024, 7168, 4, 2, torch.bfloat16),
                (70, 512, 7168, 4, 3, torch.bfloat16),
                # 53 taps: the GEMV kernel's epilogue operands would overflow shared memory, so the fused path
                (2, 64, 200, 53, 1, torch.bfloat16), (2, 64, 200, 52, 1, torch.bfloat16),
                # the GEMV's W ring: a full row tile, and one slot of k16 steps per warp
                (16, 256, 4096, 4, 2, torch.bfloat16), (1, 256, 640, 4, 1, torch.float16),
                # the ring with 2 m-tiles (one row of the second; both full), and the fused kernel where the ring
                # does not apply (d_mem 520)
                (17, 256, 640, 4, 2, torch.float16), (32, 512, 4096, 4, 1, torch.bfloat16),
                (24, 520, 4096, 4, 2, torch.bfloat16),
                # 4 m-tiles, two warps per ring slot: one row of the third m-tile, a partial fourth, all four full
                (33, 1024, 4096, 4, 3, torch.bfloat16), (50, 2048, 4096, 4, 1, torch.bfloat16),
                (64, 512, 640, 4, 2, torch.float16)]


def _decode_inputs(B, d_mem, d, taps, dtype):
    e = torch.randn(B, d_mem, device="cuda").to(dtype)
    h = torch.randn(B, d, device="cuda").to(dtype)
    WK = (torch.randn(d_mem, d, device="cuda") / math.sqrt(d_mem)).to(dtype)
    WV = (torch.randn(d_mem, d, device="cuda") / math.sqrt(d_mem)).to(dtype)
    _, _, _, wh, wv, cw = _inputs(1, 1, d, taps, dtype, "cuda")
    return e, h, WK, WV, wh, wv, cw


def test_decode_plan_keeps_the_gemv_kernel_within_shared_memory():
    from tk_engram import decode

    assert decode.decode_plan(2, 64, 200, taps=52)[0] == "gemv"
    assert decode.decode_plan(2, 64, 200, taps=53)[0] != "gemv"
    assert decode._gemv_epilogue(1, 4, 52)[2] <= MAX_SMEM_PER_BLOCK < decode._gemv_epilogue(1, 4, 53)[2]
    parts, _ = decode.decode_scratch(2, 64, 200, "cpu", taps=53)
    assert parts.numel() > 1  # the fused path's partials, not the GEMV kernel's none


@pytest.mark.compile
@pytest.mark.parametrize("d,taps", [(4096, 4), (7168, 4), (38400, 4), (38408, 4), (4096, 29), (4096, 30)])
def test_forward_shared_memory_plan_is_the_kernels(d, taps):
    # fwd_fits decides between the kernel and the reference on the GPU: its byte count is the kernel's allocation
    from tk_engram.gate_conv import FWD_PARAMS

    params = dict(dtype="bfloat16", d=d, taps=taps, dilation=1, **FWD_PARAMS)
    smem = dynamic_smem_bytes(K.gate_conv_fwd_kernel, "sm_90a", **params)
    assert K.fwd_shared_bytes(d, taps) == smem
    assert K.fwd_fits(d, taps) == (smem <= MAX_SMEM_PER_BLOCK)


def test_grid_limits_are_input_errors():
    from tk_engram.hash import engram_hash

    H, k, v, wh, wv, cw = _inputs(1, 8, 64, 1, torch.float32, "cpu")
    with pytest.raises(ValueError, match="dilation must be at most 65535"):
        engram_gate_conv_fwd(H, k, v, wh, wv, cw, dilation=70000)
    B = 65536
    h = torch.zeros(B, 8)
    with pytest.raises(ValueError, match="at most 65535 rows"):
        engram_decode_step(torch.zeros(B, 8), h, torch.zeros(B, 4, 8), torch.zeros(B, dtype=torch.int32),
                                  torch.zeros(8, 8), torch.zeros(8, 8), torch.ones(8), torch.ones(8), torch.ones(4, 8))
    ids = torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="at most 65535 layers"):
        engram_hash(ids, torch.ones(65536, 2, dtype=torch.int64), torch.ones(65536, 1, 1, dtype=torch.int32),
                    torch.zeros(65536, 1, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("d,taps", [(4096, 30), (38408, 4)])
def test_gpu_forward_beyond_shared_memory_runs_the_reference(d, taps):
    H, k, v, wh, wv, cw = _inputs(1, 40, d, taps, torch.bfloat16, "cuda")
    got = engram_gate_conv_fwd(H, k, v, wh, wv, cw)
    want = reference.gate_conv_fwd_ref(H.cpu(), k.cpu(), v.cpu(), wh.cpu(), wv.cpu(), cw.cpu(), 1, 1e-6)
    for a, b in zip(got, want, strict=True):
        assert a.is_cuda
        torch.testing.assert_close(a.cpu().float(), b.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("B,d_mem,d,taps,dilation,dtype", DECODE_CASES)
def test_gpu_decode_matches_reference(B, d_mem, d, taps, dilation, dtype):
    from tk_engram import decode

    e, h, WK, WV, wh, wv, cw = _decode_inputs(B, d_mem, d, taps, dtype)
    L = dilation * (taps - 1) + 1  # a longer ring than needed
    state = torch.randn(B, L, d, device="cuda").to(dtype)
    pos = torch.randint(0, 50, (B,), device="cuda", dtype=torch.int32)
    st_ref = state.clone()
    y_ref = reference.decode_step_ref(e, h, st_ref, pos, WK, WV, wh, wv, cw, dilation, 1e-6)
    _poison()
    y = engram_decode_step(e, h, state, pos, WK, WV, wh, wv, cw, dilation=dilation)
    torch.testing.assert_close(y.float(), y_ref.float(), **_tol(dtype))
    assert calc_diff(y, y_ref) < 1e-5
    torch.testing.assert_close(state.float(), st_ref.float(), **_tol(dtype))
    s2 = st_ref.clone()
    y2 = engram_decode_step(e, h, s2, pos, WK, WV, wh, wv, cw, dilation=dilation)
    assert_equal(y, y2)
    assert not decode._counters(h.device)[decode._GEMV_CTR:].any()  # the GEMV kernel's counters are back at zero


@pytest.mark.gpu
@pytest.mark.parametrize("taps,dilation", [(4, 1), (4, 3)])
def test_gpu_prefill_then_decode_equals_full_prefill(taps, dilation):
    M, T, N, d, d_mem, dt = 3, 20, 12, 4096, 256, torch.bfloat16
    E = torch.randn(M, T + N, d_mem, device="cuda").to(dt)
    WK = (torch.randn(d_mem, d, device="cuda") / 16).to(dt)
    WV = (torch.randn(d_mem, d, device="cuda") / 16).to(dt)
    H = torch.randn(M, T + N, d, device="cuda").to(dt)
    _, _, _, wh, wv, cw = _inputs(1, 1, d, taps, dt, "cuda")
    k, v = (E.float() @ WK.float()).to(dt), (E.float() @ WV.float()).to(dt)
    Y_all, *_, st_all = EngramGateConvFwdOp(taps, dilation)(H, k, v, wh, wv, cw)
    _, *_, state = EngramGateConvFwdOp(taps, dilation)(H[:, :T], k[:, :T], v[:, :T], wh, wv, cw)
    dec = EngramDecodeFwdOp(taps, dilation)
    pos = torch.full((M,), T, dtype=torch.int32, device="cuda")
    ys = [dec(E[:, i].contiguous(), H[:, i].contiguous(), state, pos, WK, WV, wh, wv, cw) for i in range(T, T + N)]
    y = torch.stack(ys, 1)
    assert calc_diff(y, Y_all[:, T:]) < 1e-5
    torch.testing.assert_close(y.float(), Y_all[:, T:].float(), rtol=3e-2, atol=3e-2)
    assert calc_diff(state, st_all) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("B,d_mem,d,ring", [(4, 64, 200, False), (4, 256, 4096, True), (20, 256, 4096, True),
                                             (40, 512, 4096, True)])
def test_gpu_decode_opcheck_compile_graph(B, d_mem, d, ring):
    """Both GEMV paths (register loads; the TMA ring, whose descriptors are kernel parameters built per launch,
    with 1, 2 and 4 m-tiles, the last with two warps per slot) under opcheck, torch.compile and CUDA-graph replay."""
    from tk_engram import decode

    path, cfg = decode.device_plan(B, d_mem, d, torch.device("cuda", torch.cuda.current_device()))
    if ring and not cfg.get("ring"):
        pytest.skip(f"{config.get_num_sms(torch.cuda.current_device())} SMs: decode_plan takes no W ring at d={d}")
    assert path == "gemv" and bool(cfg["ring"]) == ring
    e, h, WK, WV, wh, wv, cw = _decode_inputs(B, d_mem, d, 4, torch.bfloat16)
    state, pos = init_decode_state(B, d, 4, 1, device="cuda")
    tmp = [*decode.decode_scratch(B, d_mem, d, "cuda"), torch.empty(B, d, device="cuda", dtype=torch.bfloat16)]
    torch.library.opcheck(decode._decode_dev.op, (e, h, state.clone(), pos, WK, WV, wh, wv, cw, *tmp, 1, 1e-6))
    s1, s2, s3 = state.clone(), state.clone(), state.clone()
    y1 = engram_decode_step(e, h, s1, pos, WK, WV, wh, wv, cw)
    y2 = torch.compile(engram_decode_step, fullgraph=True)(e, h, s2, pos, WK, WV, wh, wv, cw)
    assert_equal(y1, y2)
    assert_equal(s1, s2)
    replay, y3 = capture_cuda_graph(lambda: engram_decode_step(e, h, s3, pos, WK, WV, wh, wv, cw))
    s3.copy_(state)
    replay()
    assert_equal(y1, y3)
    assert_equal(s1, s3)
