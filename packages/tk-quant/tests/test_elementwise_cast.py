"""tk_quant.cast (element-wise narrowing cast, optional stochastic rounding): cpu, compile and gpu tiers."""

import math
import struct
import sys

import pytest
import torch

import tk_quant
from tk_core.formats import encode_e4m3, stochastic_bits
from tk_core.jit import ARCHS
from tk_core.testing import assert_equal, capture_cuda_graph, opcheck
from tk_core.testing.compile_check import assert_compiles
from tk_quant import reference
from tk_quant.elementwise_cast import cast_, cast_kernel

PAIRS = [(torch.float32, torch.bfloat16), (torch.float32, torch.float8_e4m3fn), (torch.bfloat16, torch.float8_e4m3fn)]
CUDA = torch.device("cuda")
_module = sys.modules["tk_quant.elementwise_cast"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int8)


# --- cpu tier ---------------------------------------------------------------------------------------


def test_cpu_round_to_nearest_hand_made():
    x = torch.tensor([1.0, 1.00390625, 1.01171875, 464.0, 500.0, -1e9, -0.0, float("nan"), float("inf")])
    assert_equal(tk_quant.cast(x, torch.bfloat16), x.to(torch.bfloat16))  # ties to even: 1.0039 -> 1, 1.0117 -> 1.0156
    assert tk_quant.cast(x[:3], torch.bfloat16).tolist() == [1.0, 1.0, 1.015625]
    e = tk_quant.cast(x, torch.float8_e4m3fn).float()
    assert e[3:7].tolist() == [448.0, 448.0, -448.0, 0.0] and str(e[6].item()) == "-0.0" and e[7].isnan() and e[8] == 448
    assert_equal(tk_quant.cast(x.bfloat16(), torch.float8_e4m3fn), encode_e4m3(x.bfloat16().float()))


def _f32(v: float) -> float:
    return struct.unpack("<f", struct.pack("<f", v))[0]


@pytest.mark.parametrize("src,dst", PAIRS)
def test_cpu_stochastic_against_float64(src, dst):
    """Each result is the lower or upper grid neighbour of x, the upper one when the position's 16 bits plus the
    truncated fractional position reach 2**16; mean over seeds close to x."""
    x = (torch.randn(4, 300, dtype=torch.float64) * torch.exp2(torch.randint(-8, 8, (4, 300)).double())).to(src)
    out = tk_quant.cast(x, dst, stochastic_rounding=True, seed=77)
    assert out.shape == x.shape and out.dtype == dst
    i = torch.arange(x.numel())
    r = stochastic_bits(77, i >> 32, i & 0xFFFFFFFF).tolist()
    mbits, emin = (7, -126) if dst == torch.bfloat16 else (3, -6)
    for v, rb, g in zip(x.float().flatten().tolist(), r, out.float().flatten().tolist()):
        a = abs(v)
        if a < 2.0**emin:
            a = _f32(a + 2.0**emin) - 2.0**emin
        q = 2.0 ** (max(math.frexp(a)[1] - 1, emin) - mbits) if a else 2.0 ** (emin - mbits)
        lo = math.floor(a / q) * q
        want = lo + q if rb + math.floor((a - lo) / q * 2**16) >= 2**16 else lo
        want = min(want, 448.0) if dst == torch.float8_e4m3fn else want
        assert g == math.copysign(want, v), (v, rb, g, want)
    assert_equal(out, reference.elementwise_cast(x, dst, stochastic_seed=77))
    mean = torch.stack([tk_quant.cast(x, dst, stochastic_rounding=True, seed=s).float() for s in range(32)]).mean(0)
    assert (mean - x.float()).abs().mean() < 0.5 * (tk_quant.cast(x, dst).float() - x.float()).abs().mean()


@pytest.mark.parametrize(
    "args, kwargs, exc, match",
    [
        ((torch.randn(4), torch.float16), {}, TypeError, r"cast: \(x.dtype, dtype\) must be one of float32 -> bfloat16"),
        ((torch.randn(4).bfloat16(), torch.bfloat16), {}, TypeError, "got torch.bfloat16 -> torch.bfloat16"),
        (([1.0], torch.bfloat16), {}, TypeError, "cast: x must be a torch.Tensor, got list"),
        ((torch.randn(4), torch.bfloat16), dict(seed=3), ValueError, "seed must be None unless stochastic_rounding=True"),
        ((torch.randn(4), torch.bfloat16), dict(stochastic_rounding=True, seed=2**32), ValueError, r"seed must be in"),
        ((torch.randn(4), [torch.bfloat16]), {}, TypeError, r"cast: dtype must be a torch.dtype, got \[torch.bfloat16\] \(list\)"),
        ((torch.randn(4), "bf16"), {}, TypeError, "cast: dtype must be a torch.dtype, got 'bf16'"),
        ((torch.randn(4), torch.bfloat16), dict(stochastic_rounding="no"), TypeError,
         "cast: stochastic_rounding must be a bool, got 'no'"),
    ],
)
def test_validation_errors(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        tk_quant.cast(*args, **kwargs)


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("src,dst", PAIRS)
def test_cpu_result_is_contiguous(src, dst, stochastic):
    """A transposed input gives a contiguous result of its shape, as on the GPU (``torch.empty(x.shape)``)."""
    x = torch.randn(5, 3).to(src).t()
    seed = 5 if stochastic else None
    y = tk_quant.cast(x, dst, stochastic_rounding=stochastic, seed=seed)
    assert y.shape == x.shape and y.is_contiguous()
    assert_equal(y, tk_quant.cast(x.contiguous(), dst, stochastic_rounding=stochastic, seed=seed))


# --- compile tier -----------------------------------------------------------------------------------


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("src,dst", PAIRS)
def test_compiles(arch, stochastic, src, dst):
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float8_e4m3fn: "float8_e4m3fn"}
    code = assert_compiles(cast_kernel, arch, in_dtype=names[src], out_dtype=names[dst], stochastic=stochastic)
    # 16-byte loads (32-byte ones for float32 on sm_100a)
    assert ("*(float4*)(xl" in code or "load_global_256" in code) if src == torch.float32 else ("*(uint4*)(xl" in code)
    assert ("*(uint4*)(y" in code) if dst == torch.bfloat16 else ("*(fp8_e4_8_t*)(y" in code)


# --- gpu tier ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (8,), (1000003,), (37, 129), (2, 4096, 1000)])
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("src,dst", PAIRS)
def test_gpu_matches_reference(shape, stochastic, src, dst):
    x = (torch.randn(shape, device=CUDA) * 3).to(src)
    if x.numel() > 10:
        x.view(-1)[:4] = torch.tensor([0.0, -0.0, 1e-30, 500.0], device=CUDA).to(src)
    seed = 2**31 + 1 if stochastic else None
    torch.full((1 << 24,), -1, dtype=torch.int8, device=CUDA)  # a poisoned block for the output to reuse
    out = tk_quant.cast(x, dst, stochastic_rounding=stochastic, seed=seed)
    assert_equal(out, reference.elementwise_cast(x, dst, stochastic_seed=seed))
    assert_equal(tk_quant.cast(x, dst, stochastic_rounding=stochastic, seed=seed), out)  # repeatable
    if stochastic and x.numel() > 100:
        assert not torch.equal(_bits(tk_quant.cast(x, dst, stochastic_rounding=True, seed=5)), _bits(out))


@pytest.mark.gpu
@pytest.mark.parametrize("src,dst", PAIRS)
def test_gpu_views_chunks_and_special_values(src, dst, monkeypatch):
    """A transposed view and a misaligned storage offset (logical order), several launches (a small chunk:
    positions continue across launches), inf / NaN / subnormals."""
    base = torch.randn(301, 257, device=CUDA).to(src)
    for x in (base.t(), base.view(-1)[3:3 + 4097]):
        assert_equal(tk_quant.cast(x, dst, stochastic_rounding=True, seed=9),
                     reference.elementwise_cast(x.contiguous(), dst, stochastic_seed=9))
    monkeypatch.setattr(_module, "CHUNK", 2048)
    x = base.view(-1)[:10001]
    assert_equal(tk_quant.cast(x, dst, stochastic_rounding=True, seed=9), reference.elementwise_cast(x, dst, stochastic_seed=9))
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 3e38, -1e-40, 1e-45, 2.0**-127, 0.0],
                           device=CUDA).to(src)
    for stochastic in (False, True):
        got = tk_quant.cast(special, dst, stochastic_rounding=stochastic, seed=1 if stochastic else None).float()
        want = reference.elementwise_cast(special, dst, stochastic_seed=1 if stochastic else None).float()
        assert got[2].isnan() and want[2].isnan()
        keep = [0, 1, 3, 4, 5, 6, 7]
        assert_equal(got[keep], want[keep])


@pytest.mark.gpu
def test_gpu_opcheck_compile_and_graph():
    x = torch.randn(4099, device=CUDA)
    out = torch.empty(4099, dtype=torch.bfloat16, device=CUDA)
    opcheck(cast_.op, (x, out, False, 0))
    opcheck(cast_.op, (x, out, True, 2**32 - 1))

    def f(x):
        return tk_quant.cast(x, torch.float8_e4m3fn, stochastic_rounding=True, seed=12)

    assert_equal(torch.compile(f, fullgraph=True)(x), f(x))
    static_x = x.clone()
    replay, gy = capture_cuda_graph(lambda: f(static_x))
    static_x.copy_(torch.randn_like(x))
    replay()
    assert_equal(gy, f(static_x))
