"""Benchmarks of every transpose and batched_transpose line of the anchor figures, plus a 64 MiB and a
1 GiB case and four with unaligned output rows (8001 tokens), each next to the eager reference and
torch.compile(reference). Bytes: input plus output."""

import pytest
import torch

from tk_core.testing import count_bytes
from tk_transpose import batched_transpose, reference, transpose

DTYPES = {"e4m3": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp32": torch.float32}
CASES = [
    # (kernel, dtype, num_experts, num_tokens, hidden)
    ("transpose", "e4m3", None, 8064, 7168),
    ("transpose", "bf16", None, 8064, 7168),
    ("batched_transpose", "e4m3", 8, 8064, 7168),
    ("batched_transpose", "bf16", 8, 8064, 7168),
    ("transpose", "bf16", None, 4096, 8192),  # 64 MiB in
    ("batched_transpose", "bf16", 8, 8192, 8192),  # 1 GiB in
    # 8001 tokens (the quant anchors' count): output rows not 16-byte aligned, the shifted stores
    ("transpose", "e4m3", None, 8001, 7168),
    ("transpose", "bf16", None, 8001, 7168),
    ("batched_transpose", "bf16", 8, 8001, 7168),
    ("transpose", "fp32", None, 8001, 7168),
]
IMPLS = ["tk", "torch", "torch.compile"]


@pytest.mark.benchmark
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-E{c[2]}-T{c[3]}-H{c[4]}")
def test_bench_transpose(gpu_benchmark, case, impl):
    kernel, dtype, experts, tokens, hidden = case
    shape = (tokens, hidden) if experts is None else (experts, tokens, hidden)
    x = torch.randn(shape, device="cuda").to(DTYPES[dtype])
    ref = reference.transpose if experts is None else reference.batched_transpose
    fn = {"tk": transpose if experts is None else batched_transpose, "torch": ref, "torch.compile": torch.compile(ref)}[impl]
    out = fn(x)
    params = dict(dtype=dtype, num_tokens=tokens, hidden=hidden)
    if experts is not None:
        params["num_experts"] = experts
    gpu_benchmark(lambda: fn(x), kernel=kernel, impl=impl, bytes=count_bytes(x, out), **params)
