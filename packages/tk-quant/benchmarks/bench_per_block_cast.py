"""Benchmarks of per_block_cast and per_block_cast_lossless, one case per anchor line
(shared/spec/anchor-figures.md): the kernel ("tk"), the eager reference ("torch") and
torch.compile(reference) ("torch.compile"). Bytes: input (data + sf) + output (data + sf), logical numel."""

import pytest
import torch

from tk_core.testing import count_bytes
from tk_quant import reference
from tk_quant.per_block_cast import per_block_cast
from tk_quant.per_block_cast_lossless import per_block_cast_lossless

IMPLS = ["tk", "torch", "torch.compile"]


@pytest.mark.benchmark
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("block", [(128, 128), (32, 32)])
def test_bench_per_block_cast(gpu_benchmark, impl, block, packed):
    t, h = 8001, 7168
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    kw = dict(round_sf=True, use_tma_aligned_col_major_sf=packed, use_packed_ue8m0=packed)
    ref = lambda: reference.cast(x, "e4m3", block, **kw)  # noqa: E731
    fn = {
        "tk": lambda: per_block_cast(x, "e4m3", block, packed, True, packed),
        "torch": ref,
        "torch.compile": torch.compile(lambda: reference.cast(x, "e4m3", block, **kw)),
    }[impl]
    out = per_block_cast(x, "e4m3", block, packed, True, packed)
    gpu_benchmark(
        fn, kernel="per_block_cast", impl=impl, bytes=count_bytes(x, out),
        block_size=list(block), fmt="e4m3", hidden=h, in_dtype="bf16", num_tokens=t, round_sf=True,
        use_packed_ue8m0=packed, use_tma_aligned_col_major_sf=packed,
    )


# "tk" is the default call (check=True: a stream sync; the kernel writes nonzero error counts to pinned host memory,
# so no copy is timed); "tk-unchecked" is check=False, the CUDA-graph path and the anchor's own setting (its check is
# a device-side assert): one kernel.
@pytest.mark.benchmark
@pytest.mark.parametrize("impl", ["tk", "tk-unchecked", "torch", "torch.compile"])
@pytest.mark.parametrize("out_block,packed", [((1, 128), False), ((32, 32), False), ((128, 128), False), ((1, 128), True)])
def test_bench_per_block_cast_lossless(gpu_benchmark, impl, out_block, packed):
    t, h = 8001, 7168
    x = torch.randn(t, h, device="cuda")
    xq = reference.cast(x, "e2m1", (1, 32), round_sf=True)
    ref = lambda: reference.per_block_cast_lossless(xq, "e4m3", (1, 32), out_block, packed, True, packed)  # noqa: E731
    fn = {
        "tk": lambda: per_block_cast_lossless(xq, "e4m3", (1, 32), out_block, packed, True, packed),
        "tk-unchecked": lambda: per_block_cast_lossless(xq, "e4m3", (1, 32), out_block, packed, True, packed, check=False),
        "torch": ref,
        "torch.compile": torch.compile(lambda: reference.per_block_cast_lossless(xq, "e4m3", (1, 32), out_block, packed, True, packed)),
    }[impl]
    out = per_block_cast_lossless(xq, "e4m3", (1, 32), out_block, packed, True, packed)
    gpu_benchmark(
        fn, kernel="per_block_cast_lossless", impl=impl, bytes=count_bytes(xq, out),
        hidden=h, in_round_sf=True, in_sf_block=[1, 32], in_use_packed_ue8m0=False, in_use_tma_aligned_col_major_sf=False,
        num_tokens=t, out_round_sf=True, out_sf_block=list(out_block), out_use_packed_ue8m0=packed,
        out_use_tma_aligned_col_major_sf=packed,
    )
