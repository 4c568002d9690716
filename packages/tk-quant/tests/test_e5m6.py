"""E5M6: per_token_cast(fmt='e5m6') / per_token_cast_to_e5m6 and cast_back(x_special_fmt='e5m6')."""

import pytest
import torch

import tk_quant
from tk_core.formats import decode_e5m6, encode_e5m6, pack_e5m6, reinterpret, unpack_e5m6
from tk_core.jit import ARCHS
from tk_core.testing import assert_equal, calc_diff, capture_cuda_graph
from tk_core.testing.compile_check import assert_compiles
from tk_core.testing.generators import generate_e5m6_inputs
from tk_quant import reference
from tk_quant.cast_back import cast_back_kernel
from tk_quant.per_token_cast import per_token_cast_kernel

CUDA = torch.device("cuda")
LAYOUTS = [(False, True, False), (True, True, True), (False, False, False), (True, False, False)]


def _clear_unused(sf):
    return reinterpret(sf, torch.uint8)[:, :1] if sf.dtype == torch.int32 else sf.contiguous()


# --- cpu tier ---------------------------------------------------------------------------------------


def test_reference_e5m6_float64():
    """Normal-range results are RNE to 6 mantissa bits; the codes decode exactly; sf = 2**ceil(log2(A/Q))."""
    x = torch.randn(6, 64) * 3
    data, sf = reference.cast_to_e5m6(x, 64, round_sf=True)
    amax = x.abs().amax(dim=1).double()
    k = torch.ceil(torch.log2(amax / 65024.0))
    assert torch.equal(sf.double().flatten(), 2.0**k)
    y = (x.double() * 2.0 ** (-k).unsqueeze(1))
    got = decode_e5m6(unpack_e5m6(data)).double()
    # RNE to 7 significant bits in the normal fp16 range (|y| >= 2**-14)
    e = torch.floor(torch.log2(y.abs()))
    ulp = 2.0 ** (e - 6)
    want = torch.round(y / ulp) * ulp  # torch.round is half-to-even
    normal = y.abs() >= 2.0**-14
    assert torch.equal(got[normal], want[normal])


def test_reference_e5m6_hand_made():
    # 1 + 1/128 is a tie between 1 and 1+1/64 -> even (1); 1 + 3/128 -> 1 + 4/128
    y = torch.tensor([1.0 + 1 / 128, 1.0 + 3 / 128, -2.0, 65024.0, 0.0, -0.0, 2.0**-20, 2.0**-14])
    codes = encode_e5m6(y)
    assert decode_e5m6(codes).tolist() == [1.0, 1.0 + 4 / 128, -2.0, 65024.0, 0.0, -0.0, 2.0**-20, 2.0**-14]
    words = pack_e5m6(codes.unsqueeze(0))
    assert words.shape == (1, 12) and torch.equal(unpack_e5m6(words), (codes & 0xFFF).unsqueeze(0))


@pytest.mark.parametrize("col,round_sf,packed", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_public_round_trip(col, round_sf, packed, dtype):
    for x, special in generate_e5m6_inputs(9, 576, dtype):
        data, sf = tk_quant.per_token_cast(x, "e5m6", 576, None, col, round_sf, packed)
        rd, rs = reference.cast_to_e5m6(x, 576, col, round_sf, packed)
        assert_equal(data, rd)
        assert_equal(_clear_unused(sf), _clear_unused(rs))
        assert data.shape == (9, 864) and data.dtype == torch.uint8
        for out in ("bf16", "fp32"):
            back = tk_quant.cast_back((data, sf), out, (1, 576), "e5m6")
            assert_equal(back, reference.cast_back_from_e5m6((data, sf), out, (1, 576)))
            if out == "fp32":
                assert calc_diff(x.float(), back) < (5e-6 if special else 1e-4)


def test_cpu_grouped_scales():
    """An extension: one scale per (1, bk) group, bk in {16, 32, 64, 128}."""
    x = torch.randn(5, 256)
    data, sf = tk_quant.per_token_cast(x, "e5m6", 64, round_sf=True)
    assert sf.shape == (5, 4)
    rd, rs = reference.cast_to_e5m6(x, 64, round_sf=True)
    assert_equal(data, rd)
    assert_equal(sf, rs)
    assert calc_diff(x, tk_quant.cast_back_e5m6((data, sf), "fp32", (1, 64))) < 1e-4


def test_validation_errors():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="num_per_channels must be the hidden size 64 or one of"):
        tk_quant.per_token_cast(x, "e5m6", 48)
    with pytest.raises(ValueError, match="hidden must be a multiple of 16"):
        tk_quant.per_token_cast(torch.randn(4, 24), "e5m6", 24)
    with pytest.raises(ValueError, match="x must be a bf16/fp32 tensor for fmt='e5m6'"):
        tk_quant.per_token_cast(reference.cast(x, "e4m3", (1, 32)), "e5m6", 64, x_block_size=(1, 32))
    with pytest.raises(ValueError, match="use_packed_ue8m0 must come with round_sf=True"):
        tk_quant.per_token_cast(x, "e5m6", 64, None, True, False, True)
    d, s = reference.cast_to_e5m6(x, 64)
    with pytest.raises(TypeError, match=r"x\[0\] \(data\) must be of dtype uint8"):
        tk_quant.cast_back((d.view(torch.int8), s), "bf16", (1, 64), "e5m6")
    with pytest.raises(ValueError, match=r"x\[1\] \(sf\) must be of shape"):
        tk_quant.cast_back_e5m6((d, s), "bf16", (1, 32))


def test_validation_num_per_channels_and_x_block_size():
    x = torch.randn(4, 256)
    for cast in (lambda bk: tk_quant.per_token_cast(x, "e5m6", bk), lambda bk: tk_quant.per_token_cast_to_e5m6(x, bk)):
        with pytest.raises(TypeError, match="per_token_cast_to_e5m6: num_per_channels must be a positive int, got 256.0"):
            cast(256.0)
        with pytest.raises(TypeError, match="num_per_channels must be a positive int, got True"):
            cast(True)
    with pytest.raises(ValueError, match="num_per_channels must be a positive int, got 0"):
        tk_quant.per_token_cast(torch.randn(4, 0), "e5m6", 0)
    with pytest.raises(ValueError, match=r"per_token_cast: x_block_size must be None for a plain tensor input, got \(1, 128\)"):
        tk_quant.per_token_cast(x, "e5m6", 256, (1, 128))
    with pytest.raises(TypeError, match="per_token_cast: use_e4m3_sf must be a bool, got 'no'"):
        tk_quant.per_token_cast(x, "e5m6", 256, use_e4m3_sf="no")
    with pytest.raises(TypeError, match="per_token_cast_to_e5m6: round_sf must be a bool, got 'False'"):
        tk_quant.per_token_cast_to_e5m6(x, 256, round_sf="False")


def test_cast_back_reports_the_packed_width_first():
    # 383 bytes are no whole number of 3-byte pairs: that, not the hidden size derived from them, is the problem
    with pytest.raises(ValueError, match=r"cast_back: x\[0\] \(data\) must be of width 3\*H/2 \(packed E5M6\), got shape \(4, 383\)"):
        tk_quant.cast_back((torch.zeros(4, 383, dtype=torch.uint8), torch.ones(4, 2)), "fp32", (1, 128), "e5m6")


# --- compile tier: the benchmark variants (per_token_cast_to_e5m6, cast_back_e5m6 anchor lines) ------

# The SF kind only changes one store, so two of the four anchor variants of each op are compiled here.
CAST_VARIANTS = [
    dict(in_dtype="bfloat16", fmt="e5m6", hidden=7168, bk=7168, round_sf=True, sf_out="fp32"),
    dict(in_dtype="float32", fmt="e5m6", hidden=7168, bk=7168, round_sf=True, sf_out="packed"),
]
BACK_VARIANTS = [
    dict(fmt="e5m6", out_dtype="bfloat16", hidden=7168, bm=1, bk=7168, sf="fp32"),
    dict(fmt="e5m6", out_dtype="float32", hidden=7168, bm=1, bk=7168, sf="packed"),
]


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("params", CAST_VARIANTS, ids=lambda p: f"{p['in_dtype']}-{p['sf_out']}")
def test_compiles_cast(arch, params):
    src = assert_compiles(per_token_cast_kernel, arch, **params)
    # packed RZ conversions; a warp's words staged in shared memory and stored as 16-byte chunks
    assert "cvt.rz.f16x2.f32" in src and "*(int4*)(Y" in src and "__float2half_rz" not in src


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("params", BACK_VARIANTS, ids=lambda p: f"{p['out_dtype']}-{p['sf']}")
def test_compiles_cast_back(arch, params):
    src = assert_compiles(cast_back_kernel, arch, **params)
    assert "*(float4*)(Y" in src or "*(uint4*)(Y" in src


# --- gpu tier ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("t,h,strided", [(1, 592, False), (133, 592, True), (133, 576, True), (9, 7168, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_e5m6_edge_values(t, h, strided, dtype):
    """The sweep's odd cases: hidden 592 (8-byte stores) and 576/7168 (words staged in shared memory, 8 rows
    or 7 warps per CTA), a zero row, -0, a tiny, a near-FLT_MAX and a negative value in one row, strided rows;
    packed SF compares byte 0 only."""
    x = torch.randn(t, h + (8 if strided else 0), device=CUDA, dtype=dtype)[:, :h]
    x[0] = 0
    x[-1, :4] = torch.tensor([-0.0, 1e-30, 3e38, -6.5], device=CUDA, dtype=dtype)
    for col, round_sf, packed in LAYOUTS:
        data, sf = tk_quant.per_token_cast(x, "e5m6", h, None, col, round_sf, packed)
        rd, rs = reference.cast_to_e5m6(x, h, col, round_sf, packed)
        assert_equal(data, rd)
        assert_equal(_clear_unused(sf), _clear_unused(rs))
        for out_fmt in ("bf16", "fp32"):
            assert_equal(tk_quant.cast_back((data, sf), out_fmt, (1, h), "e5m6"),
                         reference.cast_back_from_e5m6((rd, rs), out_fmt, (1, h)))


@pytest.mark.gpu
@pytest.mark.parametrize("h", [147456, 163840])
def test_gpu_e5m6_rows_wider_than_the_staging_memory(h):
    # one scale per row: the staged words of a row take 221,312 bytes of shared memory at 147,456 columns; wider rows
    # (245,888 bytes at 163,840, over the 227 KB a CTA may use) take the 8-byte stores instead of a failing launch
    x = torch.randn(3, h, device=CUDA)
    data, sf = tk_quant.per_token_cast(x, "e5m6", h)
    rd, rs = reference.cast_to_e5m6(x, h)
    assert_equal(data, rd)
    assert_equal(sf, rs)
    back = tk_quant.cast_back((data, sf), "fp32", (1, h), "e5m6")
    assert_equal(back, reference.cast_back_from_e5m6((rd, rs), "fp32", (1, h)))


@pytest.mark.gpu
def test_gpu_e5m6_cast_back_of_one_row_with_an_odd_row_stride():
    # one row of a byte buffer whose rows are 26 bytes long: the data view's (never stepped) row stride is not a
    # multiple of 4, which view(torch.int32) used to reject
    x = torch.randn(2, 16, device=CUDA)
    data, sf = tk_quant.per_token_cast(x, "e5m6", 16)
    buf = torch.zeros(2, 26, dtype=torch.uint8, device=CUDA)
    buf[:, :24] = data
    row = buf[:1, :24]
    assert row.stride(0) == 26
    assert_equal(tk_quant.cast_back((row, sf[:1]), "fp32", (1, 16), "e5m6"),
                 reference.cast_back_from_e5m6((data[:1], sf[:1]), "fp32", (1, 16)))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [0, 1, 4001])
@pytest.mark.parametrize("h", [576, 2048, 7168])
@pytest.mark.parametrize("col,round_sf,packed", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_e5m6_cast_and_back(t, h, col, round_sf, packed, dtype):
    for x, special in generate_e5m6_inputs(t, h, dtype, device=CUDA):
        out = torch.full((t, h * 3 // 2), 0xFF, dtype=torch.uint8, device=CUDA)
        data, sf = tk_quant.per_token_cast(x, "e5m6", h, None, col, round_sf, packed, out=out)
        rd, rs = reference.cast_to_e5m6(x, h, col, round_sf, packed)
        assert_equal(data, rd)
        assert_equal(_clear_unused(sf), _clear_unused(rs))
        for out_fmt in ("bf16", "fp32"):
            back = tk_quant.cast_back((data, sf), out_fmt, (1, h), "e5m6")
            assert_equal(back, reference.cast_back_from_e5m6((rd, rs), out_fmt, (1, h)))
            if t and out_fmt == "fp32":
                assert calc_diff(x.float(), back) < (5e-6 if special else 1e-4)
        d2, _ = tk_quant.per_token_cast(x, "e5m6", h, None, col, round_sf, packed)
        assert_equal(d2, data)


@pytest.mark.gpu
@pytest.mark.parametrize("bk", [16, 128])
def test_gpu_e5m6_grouped(bk):
    x = torch.randn(3001, 2048, device=CUDA)
    data, sf = tk_quant.per_token_cast(x, "e5m6", bk, None, True, True, True)
    rd, rs = reference.cast_to_e5m6(x, bk, True, True, True)
    assert_equal(data, rd)
    assert_equal(reinterpret(sf, torch.uint8)[:, : 2048 // bk], reinterpret(rs, torch.uint8)[:, : 2048 // bk])
    assert_equal(tk_quant.cast_back_e5m6((data, sf), "bf16", (1, bk)), reference.cast_back_from_e5m6((rd, rs), "bf16", (1, bk)))


@pytest.mark.gpu
def test_gpu_e5m6_strided_rows_and_graph():
    x = torch.randn(1001, 4096, device=CUDA)[:, :2048]
    d, s = tk_quant.per_token_cast_to_e5m6(x, 2048, round_sf=True)
    rd, rs = reference.cast_to_e5m6(x.contiguous(), 2048, round_sf=True)
    assert_equal(d, rd)
    assert_equal(s, rs)

    def f(x):
        d, s = tk_quant.per_token_cast_to_e5m6(x, 2048, True, True, True)
        return tk_quant.cast_back_e5m6((d, s), "bf16", (1, 2048))

    xc = x.contiguous()
    assert_equal(torch.compile(f, fullgraph=True)(xc), f(xc))
    replay, gy = capture_cuda_graph(lambda: f(xc))
    xc.copy_(torch.randn_like(xc))
    replay()
    assert_equal(gy, f(xc))
