"""cast_back and per_token_cast_back (e4m3 / e2m1 data, any SF layout): cpu, compile and gpu tiers."""

import pytest
import torch

import tk_quant
from tk_core.formats import decode_e2m1, unpack_e2m1
from tk_core.jit import ARCHS
from tk_core.testing import assert_equal, calc_diff, capture_cuda_graph, opcheck
from tk_core.testing.compile_check import assert_compiles
from tk_quant import reference
from tk_quant.cast_back import cast_back_kernel

CUDA = torch.device("cuda")
LAYOUTS = [(False, False, False), (True, False, False), (True, True, True), (False, True, False)]


# --- cpu tier ---------------------------------------------------------------------------------------


def test_reference_cast_back_float64():
    """decode(data) * s in float64 (exact here), then rounded once to bf16/fp32."""
    x = torch.randn(37, 192)
    for fmt, block in (("e4m3", (1, 64)), ("e2m1", (32, 32)), ("e4m3", (128, 1)), ("e2m1", (1, 192))):
        data, sf = reference.cast(x, fmt, block)
        codes = decode_e2m1(unpack_e2m1(data)) if fmt == "e2m1" else data.float()
        s = sf.double().repeat_interleave(block[0], 0)[:37].repeat_interleave(block[1], 1)[:, :192]
        want = codes.double() * s
        assert torch.equal(reference.cast_back((data, sf), "fp32", block).double(), want.float().double())
        assert torch.equal(reference.cast_back((data, sf), "bf16", block), want.float().to(torch.bfloat16))


def test_reference_cast_back_hand_made():
    data = torch.tensor([[0x21, 0x9F]], dtype=torch.uint8).view(torch.int8)  # codes 1,2,15,9 -> 0.5, 1, -6, -0.5
    sf = torch.tensor([[3.0]])
    assert reference.cast_back((data, sf), "fp32", (1, 4)).tolist() == [[1.5, 3.0, -18.0, -1.5]]
    packed = torch.tensor([[128 + 2]], dtype=torch.int32)  # ue8m0 byte 130 -> 8.0
    assert reference.cast_back((data, packed.t().contiguous().t()), "fp32", (1, 4)).tolist() == [[4.0, 8.0, -48.0, -4.0]]


@pytest.mark.parametrize("col,round_sf,packed", LAYOUTS)
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_cpu_public_round_trip(col, round_sf, packed, fmt):
    x = torch.randn(19, 576)
    q = tk_quant.per_token_cast(x, fmt, 128, None, col, round_sf, packed)
    for out in ("bf16", "fp32"):
        y = tk_quant.per_token_cast_back(q, out, 128)
        assert_equal(y, reference.cast_back(q, out, (1, 128)))
        assert calc_diff(x, y.float()) < (2e-2 if fmt == "e2m1" else 1e-3)
    o = torch.empty(19, 576, dtype=torch.bfloat16)
    assert tk_quant.cast_back(q, "bf16", (1, 128), out=o) is o


@pytest.mark.parametrize(
    "args,exc,match",
    [
        (dict(fmt="fp16"), ValueError, "fmt must be one of"),
        (dict(x_special_fmt="e3m2"), ValueError, "x_special_fmt must be None or 'e5m6'"),
        (dict(x_block_size=None), ValueError, "x_block_size must be a"),
        (dict(x_block_size=(1, 0)), ValueError, "x_block_size must be a tuple of two positive ints"),
        (dict(x_block_size=(1, 64)), ValueError, r"x\[1\] \(sf\) must be of shape"),
        (dict(out=torch.empty(4, 256)), ValueError, "out must be a contiguous"),
        (dict(x="nope"), TypeError, r"x must be a QuantTensor \(data, sf\), got str"),
        (dict(x=torch.randn(4, 256)), TypeError, r"cast_back: x must be a QuantTensor \(data, sf\), got Tensor"),
        (dict(fmt=["fp32"]), TypeError, r"cast_back: fmt must be a str, one of \('bf16', 'fp32'\), got \['fp32'\]"),
        (dict(x_block_size=(1, 128.0)), TypeError, r"x_block_size must be a pair of ints \(bm, bk\), got \(1, 128.0\)"),
    ],
)
def test_validation_errors(args, exc, match):
    q = reference.cast(torch.randn(4, 256), "e4m3", (1, 128))
    kw = dict(x=q, fmt="bf16", x_block_size=(1, 128))
    kw.update(args)
    with pytest.raises(exc, match=match):
        tk_quant.cast_back(**kw)
    with pytest.raises(TypeError, match=r"x\[0\] \(data\) must be of dtype"):
        tk_quant.cast_back((torch.zeros(4, 256), q[1]), "bf16", (1, 128))


def test_out_must_not_overlap_the_input():  # the kernel would read bytes it has already overwritten
    data, sf = reference.cast(torch.randn(4, 256), "e4m3", (1, 128))
    buf = torch.empty(4, 256, dtype=torch.bfloat16)
    in_buf = buf.view(torch.float8_e4m3fn)[:, :256]  # the first half of each 512-byte row of out
    in_buf.copy_(data)
    with pytest.raises(ValueError, match=r"cast_back: out must be memory disjoint from x's data, got a tensor whose"):
        tk_quant.cast_back((in_buf, sf), "bf16", (1, 128), out=buf)
    sf_buf = torch.empty(4, 256)
    sf_buf.view(-1)[:8] = sf.view(-1)
    with pytest.raises(ValueError, match=r"cast_back: out must be memory disjoint from x's sf"):
        tk_quant.cast_back((data, sf_buf.view(-1)[:8].view(4, 2)), "fp32", (1, 128), out=sf_buf)


def test_per_token_cast_back_blames_num_per_channels():
    q = reference.cast(torch.randn(4, 256), "e4m3", (1, 128))
    with pytest.raises(TypeError, match="per_token_cast_back: num_per_channels must be a positive int, got 128.0"):
        tk_quant.per_token_cast_back(q, "fp32", 128.0)
    with pytest.raises(ValueError, match="per_token_cast_back: num_per_channels must be a positive int, got 0"):
        tk_quant.per_token_cast_back(q, "fp32", 0)


# --- compile tier -----------------------------------------------------------------------------------

COMPILE_VARIANTS = [
    # benchmarks: cast_back_per_token anchor lines
    dict(fmt="e2m1", out_dtype="float32", hidden=7168, bm=1, bk=128),
    dict(fmt="e2m1", out_dtype="bfloat16", hidden=7168, bm=1, bk=128),
    dict(fmt="e2m1", out_dtype="float32", hidden=7168, bm=1, bk=7168),
    dict(fmt="e2m1", out_dtype="bfloat16", hidden=7168, bm=1, bk=7168),
    # gpu tests: e4m3 data, per-channel/per-block scales, packed and e4m3 scales
    dict(fmt="e4m3", out_dtype="bfloat16", hidden=2048, bm=1, bk=128, sf="packed"),
    dict(fmt="e4m3", out_dtype="float32", hidden=576, bm=128, bk=1),
    dict(fmt="e2m1", out_dtype="bfloat16", hidden=4096, bm=1, bk=16, sf="e4m3"),
]


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("params", COMPILE_VARIANTS, ids=lambda p: "-".join(f"{v}" for v in p.values()))
def test_compiles(arch, params):
    src = assert_compiles(cast_back_kernel, arch, **params)
    # one vector load and one 16-byte store per output vector
    assert any(f"*({v}*)(xr" in src for v in ("char2", "int", "fp8_e4_4_t", "fp8_e4_8_t"))
    assert "*(float4*)(Y" in src or "*(uint4*)(Y" in src


# --- gpu tier ---------------------------------------------------------------------------------------


def _poison_allocator():
    for n in (1 << 16, 1 << 20, 1 << 24, 1 << 27):
        torch.full((n,), -1, dtype=torch.int8, device=CUDA)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [0, 1, 133, 4001])
@pytest.mark.parametrize("h", [576, 7168])
@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
@pytest.mark.parametrize("col,round_sf,packed", LAYOUTS)
@pytest.mark.parametrize("bk", [128, "H"])
@pytest.mark.parametrize("out_fmt", ["fp32", "bf16"])
def test_gpu_cast_back_per_token(t, h, fmt, col, round_sf, packed, bk, out_fmt):
    bk = h if bk == "H" else bk
    x = torch.randn(t, h, device=CUDA, dtype=torch.float32 if out_fmt == "fp32" else torch.bfloat16)
    q = tk_quant.per_token_cast(x, fmt, bk, None, col, round_sf, packed)
    _poison_allocator()
    y = tk_quant.per_token_cast_back(q, out_fmt, bk)
    assert_equal(y, reference.cast_back(q, out_fmt, (1, bk)))
    if t:
        assert calc_diff(x, y) < (2e-2 if fmt == "e2m1" else 1e-3)
    assert_equal(tk_quant.per_token_cast_back(q, out_fmt, bk), y)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4001])
@pytest.mark.parametrize("h", [576, 7168])
@pytest.mark.parametrize("block", [(128, 1), (128, 128), (32, 32), (1, 16)])
@pytest.mark.parametrize("round_sf", [False, True])
@pytest.mark.parametrize("out_fmt", ["fp32", "bf16"])
def test_gpu_cast_back_blocks(t, h, block, round_sf, out_fmt):
    x = torch.randn(t, h, device=CUDA)
    q = reference.cast(x, "e4m3", block, round_sf=round_sf)
    out = torch.full((t, h), float("nan"), device=CUDA, dtype=torch.float32 if out_fmt == "fp32" else torch.bfloat16)
    y = tk_quant.cast_back(q, out_fmt, block, out=out)
    assert_equal(y, reference.cast_back(q, out_fmt, block))


@pytest.mark.gpu
def test_gpu_more_than_2_31_elements():
    """A cast and its cast back over more than 2**31 elements (299,594 x 7,168). Both kernels take the output as a
    flat view, whose length TileLang's host code reads as int32 (it wraps and is only checked there; the device
    indices are 64-bit). Rows are independent, so the reference runs on the last rows only."""
    t, h = 2**31 // 7168 + 2, 7168
    x = torch.randn(t, h, device=CUDA, dtype=torch.bfloat16)
    d, s = tk_quant.per_token_cast(x, "e4m3", 128)
    tail = slice(t - 64, t)
    ref_d, ref_s = reference.cast(x[tail], "e4m3", (1, 128))
    assert_equal(d[tail], ref_d)
    assert_equal(s[tail], ref_s)
    y = tk_quant.per_token_cast_back((d, s), "bf16", 128)
    assert_equal(y[tail], reference.cast_back((ref_d, ref_s), "bf16", (1, 128)))


@pytest.mark.gpu
def test_gpu_strided_data_and_e4m3_sf():
    x = torch.randn(1000, 4096, device=CUDA, dtype=torch.bfloat16)
    d, s = reference.cast(x, "e2m1", (1, 16), use_e4m3_sf=True)
    big = torch.zeros(1000, 4096, dtype=torch.int8, device=CUDA)
    big[:, :2048] = d
    strided = big[:, :2048]
    assert_equal(tk_quant.cast_back((strided, s), "bf16", (1, 16)), reference.cast_back((d, s), "bf16", (1, 16)))


@pytest.mark.gpu
def test_gpu_opcheck_compile_and_graph():
    from tk_quant.cast_back import _cast_back_op

    x = torch.randn(257, 2048, device=CUDA)
    q = reference.cast(x, "e2m1", (1, 128), round_sf=True, use_tma_aligned_col_major_sf=True, use_packed_ue8m0=True)
    out = torch.empty(257, 2048, device=CUDA, dtype=torch.bfloat16)
    opcheck(_cast_back_op.op, (q[0], q[1], out, 1, 128, ""))

    def f(d, s):
        return tk_quant.per_token_cast_back((d, s), "bf16", 128)

    assert_equal(torch.compile(f, fullgraph=True)(*q), f(*q))
    d, s = q[0].clone(), q[1]
    replay, gy = capture_cuda_graph(lambda: f(d, s))
    d.copy_(reference.cast(torch.randn_like(x), "e2m1", (1, 128))[0])
    replay()
    assert_equal(gy, f(d, s))
