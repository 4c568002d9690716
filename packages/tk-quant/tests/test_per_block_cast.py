"""per_block_cast, per_block_cast_with_sf_only, per_block_cast_with_precomputed_sf: cpu, compile, gpu tiers."""

import pytest
import torch

from tk_core.formats import compute_scales, encode_e2m1, encode_e4m3, pack_e2m1
from tk_core.jit import ARCHS
from tk_core.testing import assert_equal, capture_cuda_graph, opcheck
from tk_quant import reference
from tk_quant.per_block_cast import (
    per_block_cast,
    per_block_cast_,
    per_block_cast_kernel,
    per_block_cast_with_precomputed_sf,
    per_block_cast_with_sf_only,
)

LAYOUTS = [(False, True, False), (True, True, True), (False, False, False), (True, False, False)]  # col, round, packed


def _f64_block_cast(x, fmt, bm, bk, round_sf):
    """Independent float64 block amax + the scale rule, quantized with the tk_core encoders."""
    t, h = x.shape
    nm, nk = -(-t // bm), -(-h // bk)
    a = torch.zeros(nm, nk, dtype=torch.float64)
    xd = x.double().abs()
    for m in range(nm):
        for k in range(nk):
            a[m, k] = xd[m * bm:(m + 1) * bm, k * bk:(k + 1) * bk].max()
    q = 448.0 if fmt == "e4m3" else 6.0
    sf, sf_inv = compute_scales(a.float(), q, 1e-4 if fmt == "e4m3" else 6 * 2.0**-126, round_sf)
    y = x.float() * sf_inv.repeat_interleave(bm, 0)[:t].repeat_interleave(bk, 1)[:, :h]
    return (encode_e4m3(y) if fmt == "e4m3" else pack_e2m1(encode_e2m1(y))), sf


# --- cpu tier ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("block", [(32, 32), (128, 128), (32, 128)])
@pytest.mark.parametrize("round_sf", [False, True])
def test_reference_against_float64(fmt, block, round_sf):
    x = torch.randn(77, 192) * 3
    out, sf = per_block_cast(x, fmt, block, round_sf=round_sf)
    ref_out, ref_sf = _f64_block_cast(x, fmt, *block, round_sf)
    assert_equal(out, ref_out)
    assert_equal(sf, ref_sf)


def test_hand_made_block():
    x = torch.zeros(32, 64)
    x[0, 0], x[5, 3] = 448.0 * 2, -224.0  # block (0, 0): amax 896 -> sf 2, values 448, -112
    out, sf = per_block_cast(x, "e4m3", (32, 32))
    assert sf[0, 0].item() == 2.0 and sf[0, 1].item() == pytest.approx(1e-4 / 448)
    assert out[0, 0].float().item() == 448.0 and out[5, 3].float().item() == -112.0


def test_cpu_variants_consistent():
    x = torch.randn(65, 128, dtype=torch.bfloat16)
    out, sf = per_block_cast(x, "e4m3", (32, 32), round_sf=True)
    assert_equal(per_block_cast_with_sf_only(x, "e4m3", (32, 32), round_sf=True), sf)
    assert_equal(per_block_cast_with_precomputed_sf(x, "e4m3", (32, 32), sf), out)


def test_zero_tokens_cpu():
    out, sf = per_block_cast(torch.empty(0, 128), "e2m1", (128, 128), True, True, True)
    assert out.shape == (0, 64) and sf.shape == (0, 1) and sf.dtype == torch.int32


@pytest.mark.parametrize(
    "kwargs, exc, msg",
    [
        (dict(x=torch.randn(4, 64, dtype=torch.float16)), TypeError, "x must be of dtype"),
        (dict(x=torch.randn(4, 96)), ValueError, "must be a multiple of 64"),
        (dict(x=torch.randn(4, 64, 2)), ValueError, "x must be 2-D"),
        (dict(x=torch.randn(64, 4).t()), ValueError, "x must be contiguous"),
        (dict(fmt="e5m6"), ValueError, "fmt must be one of"),
        (dict(block_size=(64, 32)), ValueError, "block_size\\[0\\] must be one of"),
        (dict(block_size=128), TypeError, "block_size must be a pair"),
        (dict(use_packed_ue8m0=True, use_tma_aligned_col_major_sf=True), ValueError, "round_sf=True"),
        (dict(use_packed_ue8m0=True, round_sf=True), ValueError, "use_tma_aligned_col_major_sf=True"),
    ],
)
def test_validation(kwargs, exc, msg):
    args = dict(x=torch.randn(4, 64), fmt="e4m3", block_size=(32, 32))
    args.update(kwargs)
    with pytest.raises(exc, match=msg):
        per_block_cast(**args)


@pytest.mark.parametrize("block_size", [(32.9, 128.2), (32.0, 128), ("32", "128"), (None, 32), (True, 32)])
def test_block_size_must_be_ints(block_size):
    """No conversion with ``int()``: (32.9, 128.2) once ran as (32, 128), ("32", "128") was parsed."""
    x = torch.randn(40, 128)
    match = r"block_size must be a pair of ints \(bm, bk\), got "
    with pytest.raises(TypeError, match="per_block_cast: " + match):
        per_block_cast(x, "e4m3", block_size)
    with pytest.raises(TypeError, match="per_block_cast_with_sf_only: " + match):
        per_block_cast_with_sf_only(x, "e4m3", block_size)
    with pytest.raises(TypeError, match="per_block_cast_with_precomputed_sf: " + match):
        per_block_cast_with_precomputed_sf(x, "e4m3", block_size, torch.ones(2, 1))


@pytest.mark.parametrize("flag", ["use_tma_aligned_col_major_sf", "round_sf", "use_packed_ue8m0"])
@pytest.mark.parametrize("value", ["no", "False", 0, None])
def test_flags_must_be_bools(flag, value):
    x = torch.randn(40, 128)
    for fn, args in ((per_block_cast, ()), (per_block_cast_with_sf_only, ()),
                     (per_block_cast_with_precomputed_sf, (torch.ones(2, 1),))):
        with pytest.raises(TypeError, match=f"{fn.__name__}: {flag} must be a bool, got {value!r}"):
            fn(x, "e4m3", (32, 128), *args, **{flag: value})


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_out_argument(device, fmt):
    """A preallocated output is filled (poisoned first) and returned; a wrong one is rejected."""
    x = torch.randn(65, 256, device=device)
    ref, ref_sf = reference.cast(x, fmt, (32, 128), round_sf=True)
    dtype, cols = (torch.float8_e4m3fn, 256) if fmt == "e4m3" else (torch.int8, 128)
    out = torch.full((65, cols), -1, dtype=torch.int8, device=device).view(dtype)
    d, s = per_block_cast(x, fmt, (32, 128), round_sf=True, out=out)
    assert d is out
    assert_equal(d, ref)
    assert_equal(s, ref_sf)
    out2 = torch.full((65, cols), -1, dtype=torch.int8, device=device).view(dtype)
    assert per_block_cast_with_precomputed_sf(x, fmt, (32, 128), ref_sf, out=out2) is out2
    assert_equal(out2, reference.cast(x, fmt, (32, 128), sf=ref_sf))
    wrong = [torch.empty(65, cols + 16, dtype=dtype, device=device), torch.empty(65, cols, dtype=torch.float32, device=device),
             torch.empty(cols, 65, dtype=dtype, device=device).t(), torch.empty(65 * cols + 1, dtype=torch.int8, device=device)[1:].view(65, cols).view(dtype)]
    for bad in wrong:
        with pytest.raises((ValueError, TypeError), match="per_block_cast: out must be"):
            per_block_cast(x, fmt, (32, 128), round_sf=True, out=bad)


def test_precomputed_sf_validation():
    x = torch.randn(40, 64)
    with pytest.raises(ValueError, match="sf must be of shape"):
        per_block_cast_with_precomputed_sf(x, "e4m3", (32, 32), torch.ones(1, 2))
    with pytest.raises(TypeError, match="sf must be of dtype"):
        per_block_cast_with_precomputed_sf(x, "e4m3", (32, 32), torch.ones(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="use_tma_aligned_col_major_sf"):
        per_block_cast_with_precomputed_sf(x, "e4m3", (32, 32), torch.ones(2, 2), use_tma_aligned_col_major_sf=True)


def test_launch_takes_the_linear_grid_past_65535_row_blocks():
    """A 2-D grid's y extent (the row blocks) stops at 65,535; past it the launch takes ``linear_grid``."""
    from tk_quant.per_block_cast import _params

    for bm in (32, 128):
        for t, linear in ((65535 * bm, False), (65535 * bm + 1, True)):
            x = torch.empty(t, 64, dtype=torch.bfloat16, device="meta")
            assert _params(x, "e4m3", bm, 128, "row", True, "cast").get("linear_grid", False) is linear


# --- compile tier -------------------------------------------------------------------------------------

COMPILE_VARIANTS = [
    dict(in_dtype="bfloat16", fmt="e4m3", hidden=7168, bm=128, bk=128, layout="row", round_sf=True, mode="cast"),
    dict(in_dtype="bfloat16", fmt="e4m3", hidden=7168, bm=32, bk=32, layout="packed", round_sf=True, mode="cast"),
    dict(in_dtype="float32", fmt="e2m1", hidden=576, bm=32, bk=128, layout="col", round_sf=False, mode="cast"),
    dict(in_dtype="bfloat16", fmt="e4m3", hidden=576, bm=128, bk=32, layout="row", round_sf=False, mode="sf_only"),
    dict(in_dtype="float32", fmt="e2m1", hidden=2560, bm=128, bk=32, layout="row", round_sf=False, mode="cast_only"),
    dict(in_dtype="bfloat16", fmt="e2m1", hidden=7168, bm=32, bk=128, layout="packed", round_sf=True, mode="cast",
         linear_grid=True),
]


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("params", COMPILE_VARIANTS, ids=lambda p: "-".join(str(v) for v in p.values()))
def test_compiles(arch, params):
    from tk_core.testing.compile_check import assert_compiles

    src = assert_compiles(per_block_cast_kernel, arch, **params)
    assert "__fdividef" not in src and "__frcp" not in src
    if params["fmt"] == "e4m3" and params["mode"] != "sf_only":
        assert "__NV_SATFINITE" in src


# --- gpu tier -----------------------------------------------------------------------------------------

gpu = pytest.mark.gpu


def _poison_run(x, fmt, block, col, rnd, packed):
    """per_block_cast with outputs pre-filled with 0xFF so unwritten bytes show up."""
    from tk_core.config import get_amax_clamp
    from tk_core.layout import ceil_div, sf_layout
    from tk_quant.common import alloc_data
    from tk_quant.per_block_cast import alloc_sf_storage

    t, h = x.shape
    out = alloc_data(fmt, t, h, x.device)
    out.view(torch.uint8).fill_(0xFF)
    layout = sf_layout("t", col, packed, rnd)
    flat, sf = alloc_sf_storage(ceil_div(t, block[0]), ceil_div(h, block[1]), layout, x.device)
    flat.view(torch.uint8).fill_(0xFF)
    if t:
        per_block_cast_(x, out, flat, fmt, *block, layout, rnd, get_amax_clamp(fmt))
    return out, sf


GPU_CASES = [
    (dt, fmt, blk, lay, h)
    for i, (dt, fmt, blk, lay) in enumerate(
        (dt, fmt, blk, lay)
        for dt in (torch.bfloat16, torch.float32)
        for fmt in ("e4m3", "e2m1")
        for blk in ((128, 128), (32, 32))
        for lay in ((False, True, False), (True, True, True))
    )
    for h in ((576, 7168)[i % 2],)
] + [
    (torch.bfloat16, "e4m3", (32, 128), (False, False, False), 2048),
    (torch.float32, "e2m1", (128, 32), (True, False, False), 2560),
]


@gpu
@pytest.mark.parametrize("t", [0, 1, 33, 4001])
@pytest.mark.parametrize("in_dtype,fmt,block,layout,h", GPU_CASES)
def test_kernel_matches_reference(t, h, in_dtype, fmt, block, layout):
    col, rnd, packed = layout
    x = (torch.randn(t, h, device="cuda") * 2.0 ** torch.randint(-8, 8, (1,)).item()).to(in_dtype)
    if t > 2:
        x[1, 5] = float("nan")  # ignored by the amax; e4m3 keeps NaN, e2m1 gives 6
        x[2, :64] = 0
    ref_out, ref_sf = reference.cast(x, fmt, block, round_sf=rnd, use_tma_aligned_col_major_sf=col, use_packed_ue8m0=packed)
    out, sf = _poison_run(x, fmt, block, col, rnd, packed)
    assert_equal(out, ref_out)
    assert_equal(sf, ref_sf, check_stride=True)
    out2, sf2 = per_block_cast(x, fmt, block, col, rnd, packed)
    assert_equal(out2, out)
    assert_equal(sf2, sf)
    assert_equal(per_block_cast_with_sf_only(x, fmt, block, col, rnd, packed), sf)
    if not col and t:
        sf_row = sf.contiguous()
        assert_equal(per_block_cast_with_precomputed_sf(x, fmt, block, sf_row), reference.cast(x, fmt, block, sf=sf_row))


@gpu
@pytest.mark.parametrize("fmt,block,layout", [("e4m3", (32, 32), (False, True, False)), ("e2m1", (32, 128), (True, True, True))])
def test_more_row_blocks_than_a_grid_dimension(fmt, block, layout):
    """65,535 x 32 + 97 tokens: 65,539 row blocks, more than a grid's y extent holds (the linear grid)."""
    col, rnd, packed = layout
    x = torch.randn(65535 * 32 + 97, 64, device="cuda", dtype=torch.bfloat16)
    x[-1] = 0  # the last, partial block's only row
    ref_out, ref_sf = reference.cast(x, fmt, block, round_sf=rnd, use_tma_aligned_col_major_sf=col, use_packed_ue8m0=packed)
    out, sf = _poison_run(x, fmt, block, col, rnd, packed)
    assert_equal(out, ref_out)
    assert_equal(sf, ref_sf, check_stride=True)
    assert_equal(per_block_cast_with_sf_only(x, fmt, block, col, rnd, packed), sf)


@gpu
def test_opcheck_compile_graph():
    x = torch.randn(257, 512, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(257, 512, device="cuda", dtype=torch.float8_e4m3fn)
    flat = torch.empty(9 * 4, device="cuda")
    opcheck(per_block_cast_.op, (x, out, flat, "e4m3", 32, 128, "row", True, 1e-4))
    ref = per_block_cast(x, "e4m3", (32, 128), round_sf=True)
    got = torch.compile(lambda v: per_block_cast(v, "e4m3", (32, 128), round_sf=True), fullgraph=True)(x)
    assert_equal(got[0], ref[0]) and assert_equal(got[1], ref[1])
    replay, res = capture_cuda_graph(lambda: per_block_cast(x, "e4m3", (32, 128), round_sf=True))
    x.copy_(torch.randn_like(x))
    replay()
    ref = per_block_cast(x, "e4m3", (32, 128), round_sf=True)
    assert_equal(res[0], ref[0])
    assert_equal(res[1], ref[1])
