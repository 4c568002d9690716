"""Benchmarks of every cast_back_per_token and cast_back_e5m6 line of the anchor figures, each with the
kernel ("tk"), the eager reference ("torch") and torch.compile(reference) ("torch.compile").

Bytes as the anchor counts them: the quantized data and its SF read once plus the output written once
(``count_bytes(x_original, data, sf)``, the original high-precision tensor having the output's size)."""

import pytest
import torch

import tk_quant
from tk_core.testing import count_bytes
from tk_quant import reference

IMPLS = ["tk", "torch", "torch.compile"]
T, H = 8001, 7168
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# (num_per_channels, out_dtype); fmt=e2m1, round_sf=True, row-major fp32 SF
PER_TOKEN_CASES = [(128, "fp32"), (128, "bf16"), (H, "fp32"), (H, "bf16")]
# (out_dtype, col, packed); num_per_channels = H, round_sf=True
E5M6_CASES = [("bf16", False, False), ("fp32", False, False), ("bf16", True, True), ("fp32", True, True)]


@pytest.mark.benchmark
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", PER_TOKEN_CASES, ids=lambda c: f"bk{c[0]}-{c[1]}")
def test_bench_cast_back_per_token(gpu_benchmark, case, impl):
    bk, out_dtype = case
    x = torch.randn(T, H, device="cuda", dtype=DTYPES[out_dtype])
    q = tk_quant.per_token_cast(x, "e2m1", bk, round_sf=True)
    if impl == "tk":
        fn = lambda: tk_quant.per_token_cast_back(q, out_dtype, bk)  # noqa: E731
    else:
        ref = reference.cast_back if impl == "torch" else torch.compile(reference.cast_back)
        fn = lambda: ref(q, out_dtype, (1, bk))  # noqa: E731
    fn()
    gpu_benchmark(
        fn, kernel="cast_back_per_token", impl=impl, bytes=count_bytes(x, q), fmt="e2m1", hidden=H, num_per_channels=bk,
        num_tokens=T, out_dtype=out_dtype, round_sf=True, use_packed_ue8m0=False, use_tma_aligned_col_major_sf=False,
    )


@pytest.mark.benchmark
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", E5M6_CASES, ids=lambda c: "-".join(str(v) for v in c))
def test_bench_cast_back_e5m6(gpu_benchmark, case, impl):
    out_dtype, col, packed = case
    x = torch.randn(T, H, device="cuda", dtype=DTYPES[out_dtype])
    q = tk_quant.per_token_cast(x, "e5m6", H, None, col, True, packed)
    if impl == "tk":
        fn = lambda: tk_quant.cast_back(q, out_dtype, (1, H), "e5m6")  # noqa: E731
    else:
        ref = reference.cast_back_from_e5m6 if impl == "torch" else torch.compile(reference.cast_back_from_e5m6)
        fn = lambda: ref(q, out_dtype, (1, H))  # noqa: E731
    out = fn()
    gpu_benchmark(
        fn, kernel="cast_back_e5m6", impl=impl, bytes=count_bytes(q, out), hidden=H, num_per_channels=H, num_tokens=T,
        out_dtype=out_dtype, round_sf=True, use_packed_ue8m0=packed, use_tma_aligned_col_major_sf=col,
    )
