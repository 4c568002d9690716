"""Benchmarks of every per_token_cast and per_token_cast_to_e5m6 line of the anchor figures, each with the
kernel ("tk"), the eager reference ("torch") and torch.compile(reference) ("torch.compile").

Bytes are counted as the anchor counts them: the input read once plus the data and the logical SF
written once (``count_bytes(x, out, sf)``; SF padding is not counted)."""

import pytest
import torch

import tk_quant
from tk_core.testing import count_bytes
from tk_quant import reference

IMPLS = ["tk", "torch", "torch.compile"]
T, H = 8001, 7168
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# (fmt, in_dtype, num_per_channels, col, round_sf, packed)
CAST_CASES = [
    ("e4m3", "fp32", 32, True, True, True),
    ("e2m1", "fp32", 32, True, True, True),
    ("e4m3", "fp32", 64, True, True, True),
    ("e2m1", "fp32", 64, True, True, True),
]
E5M6_CASES = [
    # (in_dtype, col, round_sf, packed)
    ("bf16", False, True, False),
    ("fp32", False, True, False),
    ("bf16", True, True, True),
    ("fp32", True, True, True),
]


def _ref_cast(x, fmt, bk, col, round_sf, packed):
    return reference.cast(x, fmt, (1, bk), None, None, round_sf, col, packed)


@pytest.mark.benchmark
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CAST_CASES, ids=lambda c: "-".join(str(v) for v in c))
def test_bench_per_token_cast(gpu_benchmark, case, impl):
    fmt, in_dtype, bk, col, round_sf, packed = case
    x = torch.randn(T, H, device="cuda", dtype=DTYPES[in_dtype])
    if impl == "tk":
        fn = lambda: tk_quant.per_token_cast(x, fmt, bk, None, col, round_sf, packed)  # noqa: E731
    else:
        ref = _ref_cast if impl == "torch" else torch.compile(_ref_cast)
        fn = lambda: ref(x, fmt, bk, col, round_sf, packed)  # noqa: E731
    out, sf = fn()
    gpu_benchmark(
        fn, kernel="per_token_cast", impl=impl, bytes=count_bytes(x, out, sf), fmt=fmt, hidden=H, in_dtype=in_dtype,
        num_per_channels=bk, num_tokens=T, round_sf=round_sf, use_packed_ue8m0=packed,
        use_tma_aligned_col_major_sf=col, x_block_size=None,
    )


@pytest.mark.benchmark
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", E5M6_CASES, ids=lambda c: "-".join(str(v) for v in c))
def test_bench_per_token_cast_to_e5m6(gpu_benchmark, case, impl):
    in_dtype, col, round_sf, packed = case
    x = torch.randn(T, H, device="cuda", dtype=DTYPES[in_dtype])
    if impl == "tk":
        fn = lambda: tk_quant.per_token_cast(x, "e5m6", H, None, col, round_sf, packed)  # noqa: E731
    else:
        ref = reference.cast_to_e5m6 if impl == "torch" else torch.compile(reference.cast_to_e5m6)
        fn = lambda: ref(x, H, col, round_sf, packed)  # noqa: E731
    out, sf = fn()
    gpu_benchmark(
        fn, kernel="per_token_cast_to_e5m6", impl=impl, bytes=count_bytes(x, out, sf), hidden=H, in_dtype=in_dtype,
        num_per_channels=H, num_tokens=T, round_sf=round_sf, use_packed_ue8m0=packed, use_tma_aligned_col_major_sf=col,
    )


# Stochastic rounding (not an anchor line: TileKernels 1.0.0 has none): the cost of the hash and the rounding
# against the round-to-nearest lines above, same shapes.
SR_CASES = [("e4m3", "fp32", 32), ("e2m1", "fp32", 32), ("e4m3", "bf16", 128)]


@pytest.mark.benchmark
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", SR_CASES, ids=lambda c: "-".join(str(v) for v in c))
def test_bench_per_token_cast_stochastic(gpu_benchmark, case, impl):
    fmt, in_dtype, bk = case
    x = torch.randn(T, H, device="cuda", dtype=DTYPES[in_dtype])
    if impl == "tk":
        fn = lambda: tk_quant.per_token_cast(x, fmt, bk, None, True, True, True, stochastic_rounding=True, seed=1)  # noqa: E731
    else:
        ref = reference.cast if impl == "torch" else torch.compile(reference.cast)
        fn = lambda: ref(x, fmt, (1, bk), None, None, True, True, True, stochastic_seed=1)  # noqa: E731
    out, sf = fn()
    gpu_benchmark(
        fn, kernel="per_token_cast_stochastic", impl=impl, bytes=count_bytes(x, out, sf), fmt=fmt, hidden=H,
        in_dtype=in_dtype, num_per_channels=bk, num_tokens=T, round_sf=True, use_packed_ue8m0=True,
        use_tma_aligned_col_major_sf=True,
    )


@pytest.mark.benchmark
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", [("e4m3", 128), ("e2m1", 32)], ids=lambda c: "-".join(str(v) for v in c))
def test_bench_per_token_cast_and_cast_back(gpu_benchmark, case, impl):
    """Fake quantization in place (not an anchor line): bf16 8001 x 7168 read and written once."""
    fmt, bk = case
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    if impl == "tk":
        fn = lambda: tk_quant.per_token_cast_and_cast_back(x, fmt, bk, round_sf=True)  # noqa: E731
    else:
        ref = reference.per_token_cast_and_cast_back
        ref = ref if impl == "torch" else torch.compile(ref)
        fn = lambda: ref(x, fmt, bk, True)  # noqa: E731
    fn()
    gpu_benchmark(
        fn, kernel="per_token_cast_and_cast_back", impl=impl, bytes=2 * count_bytes(x), fmt=fmt, hidden=H,
        in_dtype="bf16", num_per_channels=bk, num_tokens=T, round_sf=True,
    )
