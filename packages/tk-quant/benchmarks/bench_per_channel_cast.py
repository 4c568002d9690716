"""Benchmarks of per_channel_cast, per_channel_cast_and_transpose and per_channel_cast_fused, one case per
anchor line (shared/spec/anchor-figures.md), impls "tk", "torch" (eager reference) and "torch.compile".
Bytes: input (data [+ sf] [+ pos_to_token]) + output data + sf."""

import pytest
import torch

from tk_core.testing import count_bytes
from tk_quant import reference
from tk_quant.per_channel_cast import per_channel_cast, per_channel_cast_and_transpose, per_channel_cast_fused

IMPLS = ["tk", "torch", "torch.compile"]


def _ref_transpose(x, bm, round_sf):
    out, sf = reference.cast(x, "e4m3", (bm, 1), round_sf=round_sf)
    return out.t().contiguous(), sf


@pytest.mark.benchmark
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("round_sf", [False, True])
def test_bench_per_channel_cast(gpu_benchmark, impl, round_sf):
    t, h = 8064, 7168
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    fn = {
        "tk": lambda: per_channel_cast(x, "e4m3", 128, round_sf),
        "torch": lambda: reference.cast(x, "e4m3", (128, 1), round_sf=round_sf),
        "torch.compile": torch.compile(lambda: reference.cast(x, "e4m3", (128, 1), round_sf=round_sf)),
    }[impl]
    gpu_benchmark(
        fn, kernel="per_channel_cast", impl=impl, bytes=count_bytes(x, per_channel_cast(x, "e4m3", 128, round_sf)),
        dtype="bf16", hidden=h, num_per_tokens=128, num_tokens=t, round_sf=round_sf,
    )


@pytest.mark.benchmark
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("round_sf", [True, False])
@pytest.mark.parametrize("bm", [32, 128])
def test_bench_per_channel_cast_and_transpose(gpu_benchmark, impl, bm, round_sf):
    t, h = 8064, 7168
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    fn = {
        "tk": lambda: per_channel_cast_and_transpose(x, "e4m3", bm, round_sf),
        "torch": lambda: _ref_transpose(x, bm, round_sf),
        "torch.compile": torch.compile(lambda: _ref_transpose(x, bm, round_sf)),
    }[impl]
    gpu_benchmark(
        fn, kernel="per_channel_cast_and_transpose", impl=impl,
        bytes=count_bytes(x, per_channel_cast_and_transpose(x, "e4m3", bm, round_sf)),
        dtype="bf16", hidden=h, num_per_channels=bm, num_tokens=t, round_sf=round_sf,
    )


@pytest.mark.benchmark
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("round_sf", [False, True])
@pytest.mark.parametrize("fused_cast_back", [False, True])
def test_bench_per_channel_cast_fused(gpu_benchmark, impl, fused_cast_back, round_sf):
    t, h = 4096, 7168
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    xin = reference.cast(x, "e4m3", (1, 128)) if fused_cast_back else x
    npc = 128 if fused_cast_back else None
    fn = {
        "tk": lambda: per_channel_cast_fused(xin, "e4m3", 128, round_sf, npc),
        "torch": lambda: reference.per_channel_cast_fused(xin, 128, npc, round_sf),
        "torch.compile": torch.compile(lambda: reference.per_channel_cast_fused(xin, 128, npc, round_sf)),
    }[impl]
    gpu_benchmark(
        fn, kernel="per_channel_cast_fused", impl=impl,
        bytes=count_bytes(xin, per_channel_cast_fused(xin, "e4m3", 128, round_sf, npc)),
        hidden=h, is_fused_cast_back=fused_cast_back, num_ep_ranks=0, num_experts=0, num_per_channels=128,
        num_per_tokens=128, num_tokens=t, num_topk=0, round_sf=round_sf,
    )
