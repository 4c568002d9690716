"""Benchmarks of GateConv forward and backward (M*T = 8192 tokens, d in {4096, 7168}, 4 taps; dilation 1 and
the paper's 3) and of the decode step (batch 1, 8, 64; d_mem = 2048; d in {4096, 7168}): the kernel ("tk"),
the eager reference ("torch") and torch.compile(reference) ("torch.compile").

Bytes are the roofline formulas of gate_conv.py / decode.py (``fwd_roofline_bytes``, ``bwd_roofline_bytes``,
``decode_roofline_bytes``): each input read once and each output written once, halos, partial sums and the
decode's k/v intermediates not counted. Acceptance: forward/backward >= 85 % of copy bandwidth; decode reads
W_K and W_V (2*d_mem*d*2 bytes, almost all of ``bytes``) at >= 80 %.
"""

import math

import pytest
import torch

from tk_engram import engram_decode_step, engram_gate_conv_bwd, engram_gate_conv_fwd, init_decode_state, reference
from tk_engram.decode import decode_roofline_bytes
from tk_engram.gate_conv import bwd_roofline_bytes, fwd_roofline_bytes

IMPLS = ["tk", "torch", "torch.compile"]
TAPS = 4
PREFILL = [(4, 2048, 4096, 1), (4, 2048, 7168, 1), (2, 4096, 7168, 3)]  # (M, T, d, dilation)
DECODE = [(b, 2048, d) for d in (4096, 7168) for b in (1, 8, 64)]  # (batch, d_mem, d)


def _inputs(M, T, d):
    dt = torch.bfloat16
    H, k, v = (torch.randn(M, T, d, device="cuda").to(dt) for _ in range(3))
    wh, wv = ((1 + 0.1 * torch.randn(d, device="cuda")).to(dt) for _ in range(2))
    cw = (0.3 * torch.randn(TAPS, d, device="cuda")).to(dt)
    return H, k, v, wh, wv, cw


def decode_inputs(B, d_mem, d):
    """Arguments of ``engram_decode_step`` for ``B`` rows, a cache 5 tokens in (also ``probe_l2_flush.py``'s)."""
    dt = torch.bfloat16
    e = torch.randn(B, d_mem, device="cuda").to(dt)
    h = torch.randn(B, d, device="cuda").to(dt)
    WK, WV = ((torch.randn(d_mem, d, device="cuda") / math.sqrt(d_mem)).to(dt) for _ in range(2))
    _, _, _, wh, wv, cw = _inputs(1, 1, d)
    state, pos = init_decode_state(B, d, TAPS, 1, dtype=dt, device="cuda")
    pos += 5
    return e, h, state, pos, WK, WV, wh, wv, cw


@pytest.mark.benchmark
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("M,T,d,dilation", PREFILL)
def test_bench_gate_conv_fwd(gpu_benchmark, impl, M, T, d, dilation):
    x = _inputs(M, T, d)
    fn = {
        "tk": lambda: engram_gate_conv_fwd(*x, dilation=dilation),
        "torch": lambda: reference.gate_conv_fwd_ref(*x, dilation, 1e-6),
        "torch.compile": (lambda f: lambda: f(*x, dilation, 1e-6))(torch.compile(reference.gate_conv_fwd_ref)),
    }[impl]
    gpu_benchmark(fn, kernel="engram_gate_conv_fwd", impl=impl, bytes=fwd_roofline_bytes(M, T, d, TAPS),
                  M=M, T=T, d=d, dilation=dilation, taps=TAPS)


@pytest.mark.benchmark
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("M,T,d,dilation", PREFILL)
def test_bench_gate_conv_bwd(gpu_benchmark, impl, M, T, d, dilation):
    x = _inputs(M, T, d)
    stats = engram_gate_conv_fwd(*x, dilation=dilation)[2:6]
    dY = torch.randn(M, T, d, device="cuda").bfloat16()
    args = (dY, *x, *stats)
    fn = {
        "tk": lambda: engram_gate_conv_bwd(*args, dilation=dilation),
        "torch": lambda: reference.gate_conv_bwd_ref(*args, dilation),
        "torch.compile": (lambda f: lambda: f(*args, dilation))(torch.compile(reference.gate_conv_bwd_ref)),
    }[impl]
    gpu_benchmark(fn, kernel="engram_gate_conv_bwd", impl=impl, bytes=bwd_roofline_bytes(M, T, d, TAPS),
                  M=M, T=T, d=d, dilation=dilation, taps=TAPS)


@pytest.mark.benchmark
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("B,d_mem,d", DECODE)
def test_bench_decode(gpu_benchmark, impl, B, d_mem, d):
    args = decode_inputs(B, d_mem, d)
    fn = {
        "tk": lambda: engram_decode_step(*args),
        "torch": lambda: reference.decode_step_ref(*args, 1, 1e-6),
        "torch.compile": (lambda f: lambda: f(*args, 1, 1e-6))(torch.compile(reference.decode_step_ref)),
    }[impl]
    gpu_benchmark(fn, kernel="engram_decode_step", impl=impl, bytes=decode_roofline_bytes(B, d_mem, d, TAPS),
                  batch=B, d_mem=d_mem, d=d, taps=TAPS)
