"""Benchmarks of ``tk_quant.cast`` (not an anchor line: TileKernels 1.0.0 has no such op) at 8001 x 7168, round
to nearest and stochastic, with the kernel ("tk"), the eager reference ("torch": ``x.to`` for round to nearest)
and torch.compile(reference). Bytes: the input read once plus the output written once."""

import pytest
import torch

import tk_quant
from tk_core.testing import count_bytes
from tk_quant import reference

IMPLS = ["tk", "torch", "torch.compile"]
T, H = 8001, 7168
CASES = [  # (input dtype, output dtype, stochastic)
    (torch.float32, torch.bfloat16, False),
    (torch.float32, torch.bfloat16, True),
    (torch.float32, torch.float8_e4m3fn, True),
    (torch.bfloat16, torch.float8_e4m3fn, True),
]


@pytest.mark.benchmark
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v).removeprefix("torch.") for v in c))
def test_bench_elementwise_cast(gpu_benchmark, case, impl):
    src, dst, stochastic = case
    x = torch.randn(T, H, device="cuda", dtype=src)
    seed = 1 if stochastic else None
    if impl == "tk":
        fn = lambda: tk_quant.cast(x, dst, stochastic_rounding=stochastic, seed=seed)  # noqa: E731
    else:
        ref = reference.elementwise_cast if impl == "torch" else torch.compile(reference.elementwise_cast)
        fn = lambda: ref(x, dst, stochastic_seed=seed)  # noqa: E731
    out = fn()
    gpu_benchmark(
        fn, kernel="elementwise_cast", impl=impl, bytes=count_bytes(x, out), hidden=H, num_tokens=T,
        in_dtype=str(src).removeprefix("torch."), out_dtype=str(dst).removeprefix("torch."), stochastic_rounding=stochastic,
    )
