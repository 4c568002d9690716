"""Benchmarks of engram_gate_fwd (save True/False) and engram_gate_bwd, one case per anchor line
(shared/spec/anchor-figures.md: hc=4, hidden=7168, num_tokens=8001): the kernel ("tk"), the eager reference
("torch") and torch.compile(reference) ("torch.compile").

Bytes as the anchor counts them:
- forward, save=True: x, k, v, w_fused, out, dot, gate, rstd_x, rstd_k (v once, although the n streams
  each read it); save=False: x, k, v, w_fused, out.
- backward: grad_out, x, k, v, w_fused, dot, gate, rstd_x, rstd_k, grad_x, grad_k, grad_v, grad_w_h,
  grad_w_e (the reduced weight gradients, not the partial rows the kernel writes).
"""

import pytest
import torch

import tk_engram
from tk_core.testing import count_bytes
from tk_engram import reference

IMPLS = ["tk", "torch", "torch.compile"]
T_, N, H = 8001, 4, 7168
EPS, CLAMP = 1e-6, 1e-6


def _inputs():
    x = torch.randn(T_, N, H, device="cuda").bfloat16()
    k = torch.randn(T_, N, H, device="cuda").bfloat16()
    v = torch.randn(T_, H, device="cuda").bfloat16()
    wh = (1 + 0.1 * torch.randn(N, H, device="cuda")).bfloat16()
    we = (1 + 0.1 * torch.randn(N, H, device="cuda")).bfloat16()
    return x, k, v, wh, we, tk_engram.fused_weight(wh, we)


@pytest.mark.benchmark
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("save", [True, False])
def test_bench_engram_gate_fwd(gpu_benchmark, impl, save):
    x, k, v, wh, we, w = _inputs()
    fn = {
        "tk": lambda: tk_engram.engram_gate_fwd(x, k, v, w, EPS, CLAMP, save),
        "torch": lambda: reference.engram_gate_fwd_ref(x, k, v, w, EPS, CLAMP, save),
        "torch.compile": (lambda f: lambda: f(x, k, v, w, EPS, CLAMP, save))(torch.compile(reference.engram_gate_fwd_ref)),
    }[impl]
    res = tk_engram.engram_gate_fwd(x, k, v, w, EPS, CLAMP, save)
    gpu_benchmark(
        fn, kernel="engram_gate_fwd", impl=impl, bytes=count_bytes(x, k, v, w, *res),
        hc=N, hidden=H, num_tokens=T_, save=save,
    )


@pytest.mark.benchmark
@pytest.mark.parametrize("impl", IMPLS)
def test_bench_engram_gate_bwd(gpu_benchmark, impl):
    x, k, v, wh, we, w = _inputs()
    G = torch.randn(T_, N, H, device="cuda").bfloat16()
    _, dot, gate, rx, rk = tk_engram.engram_gate_fwd(x, k, v, w, EPS, CLAMP)
    args = (G, x, k, v, w, dot, gate, rx, rk, CLAMP)
    fn = {
        "tk": lambda: tk_engram.engram_gate_bwd(*args),
        "torch": lambda: reference.engram_gate_bwd_ref(*args),
        "torch.compile": (lambda f: lambda: f(*args))(torch.compile(reference.engram_gate_bwd_ref)),
    }[impl]
    gx, gk, gv, _ = tk_engram.engram_gate_bwd(*args)
    grad_w_h = torch.empty(N, H, device="cuda")
    grad_w_e = torch.empty(N, H, device="cuda")
    gpu_benchmark(
        fn, kernel="engram_gate_bwd", impl=impl,
        bytes=count_bytes(G, x, k, v, w, dot, gate, rx, rk, gx, gk, gv, grad_w_h, grad_w_e),
        hc=N, hidden=H, num_tokens=T_,
    )
