"""per_channel_cast, per_channel_cast_fused, per_channel_cast_and_transpose: cpu, compile, gpu tiers."""

import pytest
import torch

from tk_core import config
from tk_core.formats import compute_scales, encode_e4m3
from tk_core.jit import ARCHS
from tk_core.testing import assert_equal, capture_cuda_graph, opcheck
from tk_quant import reference
from tk_quant.per_channel_cast import (
    launch_config,
    per_channel_cast,
    per_channel_cast_,
    per_channel_cast_and_transpose,
    per_channel_cast_fused,
    per_channel_cast_fused_,
    per_channel_cast_kernel,
)


def _f64_per_channel(v, bm, round_sf):
    t, h = v.shape
    nm = -(-t // bm)
    a = torch.stack([v[i * bm:(i + 1) * bm].double().abs().amax(0) for i in range(nm)]).float()
    sf, sf_inv = compute_scales(a, 448.0, 1e-4, round_sf)
    return encode_e4m3(v.float() * sf_inv.repeat_interleave(bm, 0)[:t]), sf


# --- cpu tier ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("round_sf", [False, True])
def test_per_channel_cast_cpu(round_sf):
    x = torch.randn(300, 128, dtype=torch.bfloat16)
    out, sf = per_channel_cast(x, "e4m3", 128, round_sf)
    r = _f64_per_channel(x, 128, round_sf)
    assert_equal(out, r[0]) and assert_equal(sf, r[1])


@pytest.mark.parametrize("bm", [32, 128])
def test_and_transpose_cpu(bm):
    x = torch.randn(256, 64, dtype=torch.bfloat16)
    out, sf = per_channel_cast_and_transpose(x, "e4m3", bm, True)
    r = _f64_per_channel(x, bm, True)
    assert_equal(out, r[0].t().contiguous()) and assert_equal(sf, r[1])


@pytest.mark.parametrize("quant", [False, True])
def test_fused_cpu(quant):
    x = torch.randn(200, 256, dtype=torch.bfloat16)
    pos = torch.randint(-1, 200, (160,), dtype=torch.int32)
    v = x.float()
    xin = x
    if quant:
        xin = reference.cast(x, "e4m3", (1, 128))
        v = xin[0].float() * xin[1].repeat_interleave(128, 1)
    g = torch.where((pos >= 0)[:, None], v[pos.clamp(min=0).long()], torch.zeros(()))
    out, sf = per_channel_cast_fused(xin, "e4m3", 128, False, 128 if quant else None, pos)
    r = _f64_per_channel(g, 128, False)
    assert_equal(out, r[0]) and assert_equal(sf, r[1])


def test_fused_out_of_range_index():
    x = torch.randn(16, 64)
    pos = torch.tensor([0, 16, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="pos_to_token must be indices < num_tokens=16"):
        per_channel_cast_fused(x, "e4m3", 128, pos_to_token=pos)
    cnt = torch.zeros(1, dtype=torch.int32)
    out, _ = per_channel_cast_fused(x, "e4m3", 128, pos_to_token=pos, check=False, error_count=cnt)
    assert cnt.item() == 1 and out[1].float().abs().sum() == 0


@pytest.mark.parametrize(
    "fn, kwargs, exc, msg",
    [
        (per_channel_cast, dict(fmt="e2m1"), ValueError, "fmt must be one of"),
        (per_channel_cast, dict(num_per_tokens=32), ValueError, "num_per_tokens must be one of"),
        (per_channel_cast, dict(x=torch.randn(4, 96)), ValueError, "multiple of 64"),
        (per_channel_cast, dict(x=torch.randn(4, 64, dtype=torch.float16)), TypeError, "x must be of dtype"),
        (per_channel_cast_and_transpose, dict(x=torch.randn(8, 64, dtype=torch.bfloat16)), ValueError, "multiple of 16"),
        (per_channel_cast_and_transpose, dict(x=torch.randn(16, 64)), TypeError, "x must be of dtype bfloat16"),
        (per_channel_cast_fused, dict(num_per_channels=128), ValueError, "num_per_channels must be None"),
        (per_channel_cast_fused, dict(pos_to_token=torch.zeros(4, dtype=torch.int64)), TypeError, "pos_to_token must be of dtype"),
        (per_channel_cast, dict(num_per_tokens=128.0), TypeError, r"num_per_tokens must be one of \(128,\), got 128.0 \(float\)"),
        (per_channel_cast_and_transpose, dict(num_per_tokens=32.0), TypeError, r"num_per_tokens must be one of \(32, 128\), got 32.0"),
        (per_channel_cast_fused, dict(num_per_tokens=128.0), TypeError, r"num_per_tokens must be one of \(128,\), got 128.0"),
        (per_channel_cast, dict(round_sf="no"), TypeError, "per_channel_cast: round_sf must be a bool, got 'no'"),
        (per_channel_cast_and_transpose, dict(round_sf=1), TypeError, "round_sf must be a bool, got 1"),
        (per_channel_cast_fused, dict(round_sf="False"), TypeError, "round_sf must be a bool, got 'False'"),
        (per_channel_cast_fused, dict(check="no"), TypeError, "per_channel_cast_fused: check must be a bool, got 'no'"),
    ],
)
def test_validation(fn, kwargs, exc, msg):
    args = dict(x=torch.randn(16, 64, dtype=torch.bfloat16), fmt="e4m3", num_per_tokens=128)
    args.update(kwargs)
    with pytest.raises(exc, match=msg):
        fn(**args)


def test_fused_quant_input_validation():
    q = reference.cast(torch.randn(256, 128), "e4m3", (1, 128))
    with pytest.raises(TypeError, match=r"num_per_channels must be one of \(128,\), got 128.0 \(float\)"):
        per_channel_cast_fused(q, "e4m3", 128, False, 128.0)
    with pytest.raises(ValueError, match="num_per_channels must be 128 for a QuantTensor input, got None"):
        per_channel_cast_fused(q, "e4m3", 128)
    with pytest.raises(TypeError, match=r"per_channel_cast_fused: x\[0\] \(data\) must be of dtype float8_e4m3fn, got float32"):
        per_channel_cast_fused((q[0].float(), q[1]), "e4m3", 128, False, 128)


def test_fused_error_count_device():
    # a counter on another device than x: rejected (a meta tensor stands in for it on a CPU-only machine)
    x = torch.randn(16, 64)
    cnt = torch.zeros(1, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="per_channel_cast_fused: error_count must be on device cpu, got device meta"):
        per_channel_cast_fused(x, "e4m3", 128, pos_to_token=torch.zeros(4, dtype=torch.int32), check=False, error_count=cnt)


# --- compile tier -------------------------------------------------------------------------------------

_P = dict(in_dtype="bfloat16", hidden=7168, bm=128, round_sf=False, gather=False, quant_in=False, transpose=False)
COMPILE_VARIANTS = [
    _P,
    dict(_P, round_sf=True),
    dict(_P, bm=32, round_sf=True, transpose=True),
    dict(_P, bm=128, round_sf=True, transpose=True),
    dict(_P, bm=128, transpose=True),
    dict(_P, in_dtype="float32", hidden=576, gather=True),
    dict(_P, gather=True, count_slots=True),
    dict(_P, in_dtype="float8_e4m3fn", quant_in=True, round_sf=True),
    dict(_P, in_dtype="float8_e4m3fn", hidden=2048, quant_in=True, gather=True),
]


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("params", COMPILE_VARIANTS, ids=lambda p: "-".join(str(v) for v in p.values()))
def test_compiles(arch, params):
    from tk_core.testing.compile_check import assert_compiles

    # with the tile order and the CTAs per SM the ops take on this arch (the register cap, hence the spill check,
    # depends on them)
    p = params
    dynamic, call_free, min_blocks, _ = launch_config(p["in_dtype"], arch, p["bm"], p["round_sf"], p["gather"],
                                                      p["transpose"], config.get_amax_clamp("e4m3"))
    src = assert_compiles(per_channel_cast_kernel, arch, min_blocks=min_blocks, dynamic=dynamic,
                          call_free_div=call_free, **params)
    assert "__fdividef" not in src and "__frcp" not in src
    # e4m3 input: widened four values per call (the helper's definition and its calls), not by TileLang's cast
    assert (src.count("tk_e4m3x4_to_f32(") > 1) == bool(params.get("quant_in"))


# --- gpu tier -----------------------------------------------------------------------------------------

gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("t", [0, 16, 200, 8064])
@pytest.mark.parametrize("h", [576, 7168])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("round_sf", [False, True])
def test_per_channel_cast_gpu(t, h, in_dtype, round_sf):
    x = torch.randn(t, h, device="cuda").to(in_dtype)
    out = torch.full((t, h), float("nan"), device="cuda").to(torch.float8_e4m3fn)
    sf = torch.full((-(-t // 128), h), float("nan"), device="cuda")
    if t:
        per_channel_cast_(x, out, sf, 128, round_sf, False, 1e-4)
    ref = reference.cast(x, "e4m3", (128, 1), round_sf=round_sf)
    assert_equal(out, ref[0]) and assert_equal(sf, ref[1])
    again = per_channel_cast(x, "e4m3", 128, round_sf)
    assert_equal(again[0], out) and assert_equal(again[1], sf)


@gpu
@pytest.mark.parametrize("t", [0, 16, 208, 8064])
@pytest.mark.parametrize("h", [576, 7168])
@pytest.mark.parametrize("bm", [32, 128])
@pytest.mark.parametrize("round_sf", [False, True])
def test_and_transpose_gpu(t, h, bm, round_sf):
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    out = torch.full((h, t), float("nan"), device="cuda").to(torch.float8_e4m3fn)
    sf = torch.full((-(-t // bm), h), float("nan"), device="cuda")
    if t:
        per_channel_cast_(x, out, sf, bm, round_sf, True, 1e-4)
    ref = reference.cast(x, "e4m3", (bm, 1), round_sf=round_sf)
    assert_equal(out, ref[0].t().contiguous()) and assert_equal(sf, ref[1])
    again = per_channel_cast_and_transpose(x, "e4m3", bm, round_sf)
    assert_equal(again[0], out) and assert_equal(again[1], sf)


@gpu
@pytest.mark.parametrize("floor", [None, 2.0**-120])
def test_unrounded_scales_over_the_exponent_range(floor):
    """Unrounded scales of channels scaled by 2**-126 .. 2**126 (and zero channels) equal the reference's bits: with
    the default amax floor the launch divides by ``_tl.SCALE_DIV`` on sm_90a; a floor below ``SCALE_DIV_MIN`` takes the
    IEEE division (the quotients of tiny maxima are subnormal)."""
    x = torch.randn(256, 576, device="cuda")
    x *= torch.pow(2.0, torch.linspace(-126, 126, 576, device="cuda").round())
    x[:, ::37] = 0
    x = x.to(torch.bfloat16)
    default_floor = config.get_amax_clamp("e4m3")
    if floor is not None:
        config.set_amax_clamp("e4m3", floor)
    try:
        for bm, transpose in ((128, False), (32, True), (128, True)):
            fn = per_channel_cast_and_transpose if transpose else per_channel_cast
            out, sf = fn(x, "e4m3", bm, False)
            ref = reference.cast(x, "e4m3", (bm, 1), round_sf=False)
            assert_equal(out, ref[0].t().contiguous() if transpose else ref[0]) and assert_equal(sf, ref[1])
    finally:
        config.set_amax_clamp("e4m3", default_floor)


@gpu
def test_and_transpose_tile_counters():
    """The transposed cast's dynamic tile order (``launch_config``: every bf16 launch but bm 128 with IEEE-divided
    scales): every launch leaves its counters at zero, each stream has its own (launches on two streams run side by
    side), any grid (``set_num_sms``) works on them, and a CUDA graph capture takes a fresh zeroed pair per call whose
    fill each replay repeats."""
    from tk_quant.per_channel_cast import _TILE_COUNTERS

    xs = [torch.randn(t, h, device="cuda", dtype=torch.bfloat16) for t, h in ((16, 576), (208, 7168), (4096, 7168))]
    refs = [reference.cast(x, "e4m3", (32, 1), round_sf=True) for x in xs]
    streams = [torch.cuda.Stream() for _ in range(2)]
    results = []
    for num_sms in (None, 20):
        config.set_num_sms(num_sms)
        try:
            for s in streams:
                s.wait_stream(torch.cuda.current_stream())
            for _ in range(3):
                for i, x in enumerate(xs):
                    for s in streams:
                        with torch.cuda.stream(s):
                            results.append((i, per_channel_cast_and_transpose(x, "e4m3", 32, True)))
            torch.cuda.synchronize()
        finally:
            config.set_num_sms(None)
    for i, (out, sf) in results:
        assert_equal(out, refs[i][0].t().contiguous()) and assert_equal(sf, refs[i][1])
    keys = {(torch.cuda.current_device(), s.cuda_stream) for s in streams}
    assert keys <= set(_TILE_COUNTERS)
    assert all(not c.any() for c in _TILE_COUNTERS.values())

    x = xs[2]
    replay, (out, sf) = capture_cuda_graph(lambda: per_channel_cast_and_transpose(x, "e4m3", 128, True))
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        replay()
        ref = reference.cast(x, "e4m3", (128, 1), round_sf=True)
        assert_equal(out, ref[0].t().contiguous()) and assert_equal(sf, ref[1])


@gpu
@pytest.mark.parametrize("t,t_out", [(0, 0), (4096, 4096), (300, 1000), (4001, 4096)])
@pytest.mark.parametrize("h", [2048, 7168])
@pytest.mark.parametrize("quant", [False, True])
@pytest.mark.parametrize("round_sf", [False, True])
def test_fused_gpu(t, t_out, h, quant, round_sf):
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    xin = reference.cast(x, "e4m3", (1, 128)) if quant else x
    pos = None if t == t_out else torch.randint(-1, t, (t_out,), device="cuda", dtype=torch.int32)
    ref = reference.per_channel_cast_fused(xin, 128, 128 if quant else None, round_sf, pos)
    out, sf = per_channel_cast_fused(xin, "e4m3", 128, round_sf, 128 if quant else None, pos)
    assert_equal(out, ref[0]) and assert_equal(sf, ref[1])
    again = per_channel_cast_fused(xin, "e4m3", 128, round_sf, 128 if quant else None, pos)
    assert_equal(again[0], out) and assert_equal(again[1], sf)
    if pos is not None and t_out:
        bad = pos.clone()
        bad[7] = t
        with pytest.raises(ValueError, match="indices out of range"):
            per_channel_cast_fused(xin, "e4m3", 128, round_sf, 128 if quant else None, bad)


@gpu
@pytest.mark.parametrize("quant", [False, True])
def test_fused_gather_error_counts(quant):
    t, t_out, h = 300, 4096, 2048
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    xin = reference.cast(x, "e4m3", (1, 128)) if quant else x
    npc = 128 if quant else None
    pos = torch.randint(-1, t, (t_out,), device="cuda", dtype=torch.int32)
    bad = pos.clone()
    bad[::7] = t + 5  # bad rows in every tile row: many CTAs count (check=True: one host word per CTA)
    n = len(range(0, t_out, 7))
    cnt = torch.full((1,), 5, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match=f"{n} indices out of range"):
        per_channel_cast_fused(xin, "e4m3", 128, False, npc, bad, error_count=cnt)
    assert cnt.item() == 5 + n  # this call's count, added
    per_channel_cast_fused(xin, "e4m3", 128, False, npc, bad, check=False, error_count=cnt)
    assert cnt.item() == 5 + 2 * n
    out, sf = per_channel_cast_fused(xin, "e4m3", 128, False, npc, pos)  # clean again: the host words were zeroed
    ref = reference.per_channel_cast_fused(xin, 128, npc, False, pos)
    assert_equal(out, ref[0]) and assert_equal(sf, ref[1])
    out, sf = per_channel_cast_fused(xin, "e4m3", 128, False, npc, bad, check=False)  # counts to scratch: no error
    ref = reference.per_channel_cast_fused(xin, 128, npc, False, bad)
    assert_equal(out, ref[0]) and assert_equal(sf, ref[1])


@gpu
def test_fused_error_count_on_another_device():
    x = torch.randn(16, 64, device="cuda")
    pos = torch.zeros(4, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="error_count must be on device cuda:0, got device cpu"):
        per_channel_cast_fused(x, "e4m3", 128, pos_to_token=pos, check=False, error_count=torch.zeros(1, dtype=torch.int32))


@gpu
def test_opcheck_compile_graph():
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(256, 512, device="cuda", dtype=torch.float8_e4m3fn)
    sf = torch.empty(16, 256, device="cuda")
    opcheck(per_channel_cast_.op, (x, out, sf, 32, True, True, 1e-4))
    pos = torch.randint(-1, 512, (384,), device="cuda", dtype=torch.int32)
    for gather, slots in ((None, False), (pos, True)):  # no error_count: none needed / the counts go to scratch
        t_out = x.shape[0] if gather is None else pos.shape[0]
        out2 = torch.empty(t_out, 256, device="cuda", dtype=torch.float8_e4m3fn)
        opcheck(per_channel_cast_fused_.op, (x, None, gather, out2, sf[: t_out // 128], None, False, 1e-4, slots))
    ref = per_channel_cast_and_transpose(x, "e4m3", 32, True)
    got = torch.compile(lambda v: per_channel_cast_and_transpose(v, "e4m3", 32, True), fullgraph=True)(x)
    assert_equal(got[0], ref[0]) and assert_equal(got[1], ref[1])
    ref2 = per_channel_cast_fused(x, "e4m3", 128, pos_to_token=pos)
    got2 = torch.compile(lambda v, p: per_channel_cast_fused(v, "e4m3", 128, pos_to_token=p, check=False), fullgraph=True)(x, pos)
    assert_equal(got2[0], ref2[0]) and assert_equal(got2[1], ref2[1])
    replay, (res, res2) = capture_cuda_graph(
        lambda: (per_channel_cast(x, "e4m3", 128, False), per_channel_cast_fused(x, "e4m3", 128, pos_to_token=pos, check=False))
    )
    replay()
    ref3 = per_channel_cast(x, "e4m3", 128, False)
    assert_equal(res[0], ref3[0]) and assert_equal(res2[0], ref2[0])
