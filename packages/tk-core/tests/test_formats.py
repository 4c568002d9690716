"""Number formats against float64 arithmetic and exhaustive code tables."""

import itertools
import math
import struct

import pytest
import torch

from tk_core import formats


def f32(v: float) -> float:
    """Rounds a Python float to float32."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


# --- e4m3 -----------------------------------------------------------------------------------------


def all_e4m3_values() -> list[float]:
    """The 254 finite e4m3fn values from the format definition (s1 e4 m3, bias 7, no inf)."""
    values = []
    for s, e, m in itertools.product((1, -1), range(16), range(8)):
        if e == 15 and m == 7:
            continue  # NaN
        v = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        values.append(s * v)
    return values


def nearest_even_on_grid(v: float, grid: list[float], max_value: float) -> float:
    """RNE onto a sorted grid of non-negative magnitudes (ties to the value with even mantissa/code)."""
    a = min(abs(v), max_value)
    best = min(range(len(grid)), key=lambda i: (abs(grid[i] - a), i % 2))
    return math.copysign(grid[best], v)


def test_e4m3_round_trip_every_code():
    vals = torch.tensor(all_e4m3_values(), dtype=torch.float32)
    assert torch.equal(formats.encode_e4m3(vals).float(), vals)


def test_e4m3_rne_and_saturation_against_float64():
    grid = sorted({abs(v) for v in all_e4m3_values()})
    xs = torch.randn(20000, dtype=torch.float64) * torch.exp2(torch.randint(-12, 10, (20000,)).double())
    xs = torch.cat([xs, torch.tensor([1e9, -1e9, 448.0, 464.0, 480.0, -500.0])]).float()
    got = formats.encode_e4m3(xs).float()
    # mantissa ties sit at odd midpoints; the grid index parity is the mantissa parity
    want = torch.tensor([nearest_even_on_grid(v, grid, 448.0) for v in xs.tolist()])
    assert torch.equal(got, want)
    assert formats.encode_e4m3(torch.tensor([float("nan")])).float().isnan().all()


# --- e2m1 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "v,code",
    [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6), (7.0, 7), (float("inf"), 7),
     (-0.0, 8), (-0.3, 9), (-6.0, 15), (float("nan"), 7), (2**-149, 0)],
)
def test_e2m1_encode_hand_cases(v, code):
    assert formats.encode_e2m1(torch.tensor([v])).item() == code


def test_e2m1_encode_matches_float64_rne():
    grid = list(formats.E2M1_VALUES)
    xs = (torch.rand(20000, dtype=torch.float64) * 16 - 8).float()
    codes = formats.encode_e2m1(xs)
    want = torch.tensor([nearest_even_on_grid(v, grid, 6.0) for v in xs.tolist()])
    assert torch.equal(formats.decode_e2m1(codes), want)


def test_e2m1_pack_round_trip_and_nibble_order():
    codes = torch.randint(0, 16, (7, 10), dtype=torch.uint8)
    packed = formats.pack_e2m1(codes)
    assert packed.dtype == torch.int8 and packed.shape == (7, 5)
    assert torch.equal(formats.unpack_e2m1(packed), codes)
    b = packed.view(torch.uint8)
    assert torch.equal(b & 0xF, codes[:, 0::2]) and torch.equal(b >> 4, codes[:, 1::2])
    with pytest.raises(ValueError, match="pack_e2m1: codes must be at least 1-D with a last dimension divisible by 2"):
        formats.pack_e2m1(torch.zeros(3, dtype=torch.uint8))


def test_e2m1_decode_every_code():
    want = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    want = want + [-v for v in want]
    got = formats.decode_e2m1(torch.arange(16))
    assert got.tolist() == want
    assert torch.equal(torch.signbit(got[8]), torch.tensor(True))


# --- e5m6 -----------------------------------------------------------------------------------------


def e5m6_decode_f64(code: int) -> float:
    s, e, m = code >> 11 & 1, code >> 6 & 0x1F, code & 0x3F
    if e == 31:
        return math.copysign(math.inf if m == 0 else math.nan, -1 if s else 1)
    v = m / 64 * 2.0**-14 if e == 0 else (1 + m / 64) * 2.0 ** (e - 15)
    return -v if s else v


def test_e5m6_decode_every_code():
    codes = torch.arange(4096, dtype=torch.int32)
    got = formats.decode_e5m6(codes).double().tolist()
    want = [e5m6_decode_f64(c) for c in range(4096)]
    for g, w in zip(got, want):
        assert (math.isnan(g) and math.isnan(w)) or g == w


def test_e5m6_encode_is_rne_in_normal_range():
    finite = [c for c in range(4096) if (c >> 6 & 0x1F) not in (0, 31)]
    grid = sorted({abs(e5m6_decode_f64(c)) for c in finite})
    xs = torch.randn(20000, dtype=torch.float64) * torch.exp2(torch.randint(-12, 15, (20000,)).double())
    xs = xs.float().clamp(-65024, 65024)
    xs = xs[xs.abs() >= 2**-14]
    got = formats.decode_e5m6(formats.encode_e5m6(xs))
    want = torch.tensor([nearest_even_on_grid(v, grid, 65024.0) for v in xs.tolist()])
    assert torch.equal(got, want)


def test_e5m6_encode_exact_codes_round_trip():
    codes = torch.tensor([c for c in range(4096) if (c >> 6 & 0x1F) != 31], dtype=torch.int32)
    assert torch.equal(formats.encode_e5m6(formats.decode_e5m6(codes)), codes)


def test_e5m6_pack_layout_and_round_trip():
    codes = torch.randint(0, 4096, (3, 16), dtype=torch.int32)
    packed = formats.pack_e5m6(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 24)
    assert torch.equal(formats.unpack_e5m6(packed), codes)
    h = codes[0, :8].tolist()
    bits = "".join(f"{c:012b}" for c in h)
    words = [int(bits[i : i + 32], 2) for i in (0, 32, 64)]
    assert list(struct.unpack("<3I", bytes(packed[0, :12].tolist()))) == words


# --- ue8m0 and the scale rule ---------------------------------------------------------------------


def test_ue8m0_round_trip_and_packing():
    e = torch.randint(1, 255, (5, 7), dtype=torch.uint8)
    sf = formats.decode_ue8m0(e)
    assert torch.equal(sf.double(), torch.exp2(e.double() - 127))
    assert torch.equal(formats.encode_ue8m0(sf), e)
    words = formats.pack_ue8m0(e)
    assert words.dtype == torch.int32 and words.shape == (5, 2)
    assert torch.equal(formats.unpack_ue8m0(words, 7), e)
    assert torch.equal(words.view(torch.uint8)[:, 7], torch.zeros(5, dtype=torch.uint8))
    assert formats.decode_ue8m0(torch.tensor([0], dtype=torch.uint8)).item() == 0.0


def test_ue8m0_int8_bytes_decode_as_unsigned():
    e = torch.tensor([-1, -2, 127, 1], dtype=torch.int8)  # 0xFF, 0xFE: exponents 255 and 254
    want = formats.decode_ue8m0(e.view(torch.uint8))
    assert torch.equal(formats.decode_ue8m0(e), want) and want[1].item() == 2.0**127


def test_reinterpret_keeps_0d_and_rejects_uneven_bytes():
    x = torch.tensor(1.0)
    bits = formats.reinterpret(x, torch.int32)
    assert bits.shape == () and bits.item() == 0x3F800000
    assert formats.encode_e2m1(torch.tensor(-1.5)).shape == ()
    with pytest.raises(ValueError, match="reinterpret: x must be at least 1-D to change the element size to 1 bytes"):
        formats.reinterpret(x, torch.uint8)
    with pytest.raises(ValueError, match=r"last dimension of a multiple of 4 bytes, got shape \(2, 3\) of uint8"):
        formats.reinterpret(torch.zeros(2, 3, dtype=torch.uint8), torch.int32)
    with pytest.raises(TypeError, match="reinterpret: x must be a torch.Tensor, got list"):
        formats.reinterpret([1.0], torch.int32)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: formats.pack_e2m1(torch.tensor(3)), r"pack_e2m1: codes must be at least 1-D .* got shape \(\)"),
        (lambda: formats.pack_e5m6(torch.zeros(12)), "pack_e5m6: codes must be .* divisible by 8, got shape"),
        (lambda: formats.pack_ue8m0(torch.tensor(3)), r"pack_ue8m0: e must be at least 1-D"),
        (lambda: formats.unpack_e5m6(torch.zeros(2, 13, dtype=torch.uint8)), "unpack_e5m6: packed must be .* by 12"),
        (lambda: formats.unpack_e2m1(torch.tensor(3, dtype=torch.int8)), "unpack_e2m1: packed must be at least 1-D"),
        (lambda: formats.unpack_ue8m0(torch.zeros(2, 2, dtype=torch.int32), 9),
         r"unpack_ue8m0: n must be a count with ceil\(n / 4\) == 2 \(words' last dimension\), got 9"),
        (lambda: formats.unpack_ue8m0(torch.zeros(2, 2, dtype=torch.int32), 4), "got 4"),
    ],
)
def test_packing_rejects_bad_shapes(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: formats.unpack_e5m6(torch.zeros(12, dtype=torch.int32)), "unpack_e5m6: packed must be of dtype uint8"),
        (lambda: formats.unpack_e2m1(torch.zeros(4, dtype=torch.float32)),
         "unpack_e2m1: packed must be of dtype int8 or uint8, got float32"),
        (lambda: formats.unpack_ue8m0(torch.zeros(2, dtype=torch.float32), 8), "unpack_ue8m0: words must be of dtype int32"),
    ],
)
def test_unpacking_rejects_other_dtypes(call, message):  # fp32 was reinterpreted byte by byte
    with pytest.raises(TypeError, match=message):
        call()


def test_pow2_exact_over_whole_range():
    k = torch.arange(-160, 140)
    got = formats.pow2(k).double()
    want = torch.tensor([0.0 if i < -149 else math.inf if i > 127 else 2.0**i for i in k.tolist()], dtype=torch.float64)
    assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1", "e5m6"])
@pytest.mark.parametrize("round_sf", [False, True])
def test_compute_scales_against_float64(fmt, round_sf):
    q = formats.FORMAT_MAX[fmt]
    c_min = f32(1e-4)
    amax = torch.cat([torch.rand(4000) * 1000, torch.tensor([0.0, 1e-30, 448.0, 6.0, 2.0**-100])]).float()
    sf, sf_inv = formats.compute_scales(amax, q, c_min, round_sf)
    for a, s, si in zip(amax.tolist(), sf.tolist(), sf_inv.tolist()):
        a = max(a, c_min)
        if round_sf:
            k = math.ceil(math.log2(f32(a / q)))
            assert s == 2.0**k and si == 2.0**-k
            assert a * si <= q  # no saturation needed
        else:
            assert s == f32(a / q) and si == f32(q / a)


def test_compute_scales_e2m1_floor_is_2_pow_minus_126():
    sf, sf_inv = formats.compute_scales(torch.zeros(3), 6.0, 6.0 * 2.0**-126, True)
    assert sf.tolist() == [2.0**-126] * 3 and sf_inv.tolist() == [2.0**126] * 3


# --- stochastic rounding --------------------------------------------------------------------------


def lowbias32(x: int) -> int:
    """The hash of ``formats.hash32`` in Python integers."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_hash32_and_stochastic_bits_match_python_integers():
    xs = torch.randint(0, 2**32, (2000,), dtype=torch.int64)
    assert formats.hash32(xs).tolist() == [lowbias32(x) for x in xs.tolist()]
    rows, cols = torch.randint(0, 10**6, (500,)), torch.randint(0, 2**20, (500,))
    for seed in (0, 1, 2**32 - 1):
        got = formats.stochastic_bits(seed, rows, cols).tolist()
        want = [(lowbias32(lowbias32(r + seed * 0x9E3779B9) + c // 2) >> (16 * (c % 2))) & 0xFFFF
                for r, c in zip(rows.tolist(), cols.tolist())]
        assert got == want and all(0 <= b < 2**16 for b in got)
    assert not torch.equal(formats.stochastic_bits(1, rows, cols), formats.stochastic_bits(2, rows, cols))


@pytest.mark.parametrize("rows,cols", [(0, 0), (0, 7), (3, 0), (1, 1), (5, 7), (33, 577), (2, 7168)])
def test_stochastic_bits_grid_equals_elementwise(rows, cols):
    for seed in (0, 12, 2**31, 2**32 - 1):
        grid = formats.stochastic_bits_grid(seed, rows, cols)
        each = formats.stochastic_bits(seed, torch.arange(rows)[:, None], torch.arange(cols)[None, :])
        assert grid.shape == (rows, cols) and grid.dtype == torch.int64
        assert torch.equal(grid, each.expand(rows, cols))


def sr_grid(fmt: str) -> list[float]:
    """Non-negative grid magnitudes of ``fmt``, one binade past the largest value (the unsaturated neighbours)."""
    if fmt == "e2m1":
        return list(formats.E2M1_VALUES) + [8.0]
    return sorted({abs(v) for v in all_e4m3_values()}) + [480.0, 512.0]


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_round_stochastic_against_float64_neighbours(fmt):
    top = formats.FORMAT_MAX[fmt]
    grid = sr_grid(fmt)
    n = 20000
    ys = torch.rand(n, dtype=torch.float64) * torch.exp2(torch.randint(-14, int(math.log2(top)) + 1, (n,)).double())
    ys = torch.cat([ys, torch.tensor(grid[:-1]), torch.tensor([0.0, 1e-30, 2.0**-10, top])])
    ys = (ys.clamp(max=top) * torch.where(torch.rand(ys.numel()) < 0.5, -1.0, 1.0)).float()
    r = torch.randint(0, 2**16, ys.shape, dtype=torch.int64)
    got = formats.round_stochastic(ys, fmt, r).tolist()
    emin = 2.0 ** {"e4m3": -6, "e2m1": 0}[fmt]
    for y, rb, g in zip(ys.tolist(), r.tolist(), got):
        a = abs(y)
        if a < emin:  # the definition's one rounding: fl32(|y| + 2**emin)
            a = f32(a + emin) - emin
        i = max(k for k, v in enumerate(grid) if v <= a)
        lo, hi = grid[i], grid[min(i + 1, len(grid) - 1)]
        frac_bits = math.floor((a - lo) / (hi - lo) * 2**16) if hi > lo else 0
        want = hi if rb + frac_bits >= 2**16 else lo
        assert g == math.copysign(want, y), (y, rb, g, want)


def test_round_stochastic_bf16_against_float64_neighbours():
    n = 20000
    ys = torch.randn(n, dtype=torch.float64) * torch.exp2(torch.randint(-140, 120, (n,)).double())
    ys = torch.cat([ys, torch.tensor([0.0, 2.0**-149, 3.0 * 2.0**-130, 1.0, -2.0**-126])]).float()
    r = torch.randint(0, 2**16, ys.shape, dtype=torch.int64)
    got = formats.round_stochastic(ys, "bf16", r).tolist()
    for y, rb, g in zip(ys.tolist(), r.tolist(), got):
        a = abs(y)  # a float32 value: its float64 is exact
        q = 2.0 ** (max(math.frexp(a)[1] - 1, -126) - 7) if a else 2.0**-133
        lo = math.floor(a / q) * q  # exact: float32 values have at most 24 significant bits
        frac_bits = math.floor((a - lo) / q * 2**16)
        assert g == math.copysign(lo + q if rb + frac_bits >= 2**16 else lo, y), (y, rb, g)


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1", "bf16"])
def test_round_stochastic_is_unbiased_and_keeps_grid_values(fmt):
    ys = torch.tensor([0.3, 1.1, 2.7, 5.1, -0.01, 0.002] + ([100.0, 300.0, 0.017] if fmt != "e2m1" else []))
    r = torch.arange(0, 2**16, 2**4)  # a uniform grid of the random bits
    out = formats.round_stochastic(ys[:, None].expand(-1, r.numel()), fmt, r[None, :])
    mean = out.double().mean(1)
    assert torch.allclose(mean, ys.double(), rtol=0, atol=float(ys.abs().max()) * 2.0**-10)
    for v in sr_grid(fmt)[:-1] if fmt != "bf16" else [0.0, 1.0, 1.0078125, 3.0 * 2.0**-133, 2.0**100]:
        assert torch.equal(formats.round_stochastic(torch.full((64,), v), fmt, torch.randint(0, 2**16, (64,))), torch.full((64,), v))
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0])
    got = formats.round_stochastic(special, fmt, torch.full((4,), 2**16 - 1))
    assert got[:2].tolist() == [float("inf"), float("-inf")] and got[2].isnan() and str(got[3].item()) == "-0.0"
    with pytest.raises(ValueError, match="round_stochastic: fmt must be one of"):
        formats.round_stochastic(ys, "e5m6", r[:1])
