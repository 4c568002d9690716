"""TileLang building blocks shared by the per-block, lossless and per-channel kernels of tk-quant.

These are trace-time helpers: each returns TIR expressions (or emits statements) inside a
``T.prim_func``. They implement, bit for bit, the conversions of ``tk_core.formats``:

- ``scale_rule``: ``A' = max(amax, c_min)``; ``sf = A'/Q`` and ``sf_inv = Q/A'`` (two IEEE divisions, or with
  ``call_free`` the same quotients by ``SCALE_DIV``), or, with ``round_sf``, ``k = ((bits(A'/Q) - 1) >> 23) -
  126``, ``sf = 2**k``, ``sf_inv = 2**-k`` (``pow2`` handles the subnormal and overflow ends exactly like
  ``tk_core.formats.pow2``).
- ``encode_e2m1``: RNE on the e2m1 code grid, saturating at 6, NaN -> 7, sign bit copied (software, so
  sm_90a and sm_100a agree and match the reference).
- ``sf_offset``: the element offset of scale block ``(m, k)`` in the flat storage of an SF layout.
- ``row_key`` / ``pair_bits`` / ``element_bits`` / ``round_stochastic``: ``tk_core.formats.stochastic_bits`` (one
  hash per column pair; uint32 arithmetic wraps as the reference's masks do) and ``round_stochastic``; ``stochastic_code_e2m1``:
  ``encode_e2m1(round_stochastic(y, "e2m1", r))`` in one step.
- ``store_cta_count``: a CTA's error count into its slot (the per-CTA error slots of the lossless and gathering
  per-channel casts).
- ``tile_grid`` / ``tile_ids``: a grid of column tiles x row tiles that also takes more than 65,535 row tiles.
"""

import tilelang.language as T
import torch

from tk_core.checks import MAX_GRID_YZ
from tk_core.ptx import DIV_FAST, RCP_FAST

FORMAT_MAX = {"e4m3": 448.0, "e2m1": 6.0}


def pow2(k):
    """Exactly ``2**k`` (float32) for an int32 expression ``k``."""
    bits = T.if_then_else(
        k > 127,
        T.int32(0x7F800000),
        T.if_then_else(
            k >= -126,
            T.shift_left(k + 127, 23),
            T.if_then_else(k >= -149, T.shift_left(T.int32(1), T.max(k + 149, 0)), T.int32(0)),
        ),
    )
    return T.reinterpret(bits, "float32")


# ``A'/Q`` and ``Q/A'`` correctly rounded without nvcc's division, whose inline fast path comes with a call of a
# slow-path routine: its calling convention pins registers (the dynamic transposed per-channel kernel spilled 12 bytes
# for it). ``A' = m * 2**e`` with ``m`` in [1, 2). Each quotient of ``m`` is ``tk_core.ptx``'s
# ``tk_quotient_from_rcp`` (Markstein's correction) from a correctly rounded reciprocal, ``RN(1/Q)`` a constant and
# ``RN(1/m)`` by ``tk_rcp_fast``: ``q = RN(m * RN(1/Q))`` is within an ulp of ``m/Q``, so ``r = m - q Q`` is exact and
# ``RN(q + r RN(1/Q))`` is the IEEE quotient; the same for ``Q/m``. The results are then moved by ``2**+-e`` in the
# exponent field, exact while both are normal: for ``A'`` from ``SCALE_DIV_MIN`` up (``Q`` in [1, 2**16]); +inf and
# NaN pass as the division gives them. The kernel's prelude must contain ``SCALE_DIV``; callers take it only when the
# amax floor is at least ``SCALE_DIV_MIN``. A gpu test compares every significand with ``/``.
SCALE_DIV = RCP_FAST + DIV_FAST + r"""
__device__ __forceinline__ float tk_scale_mant(float a) {
  return __uint_as_float((__float_as_uint(a) & 0x007fffffu) | 0x3f800000u);
}
__device__ __forceinline__ unsigned tk_scale_exp(float a) {
  return ((__float_as_uint(a) >> 23) - 127u) << 23;
}
__device__ __forceinline__ float tk_scale_quot(float a, float c, float rc) {
  const float s = __uint_as_float(__float_as_uint(tk_quotient_from_rcp(tk_scale_mant(a), c, rc)) + tk_scale_exp(a));
  return __float_as_uint(a) >= 0x7f800000u ? a : s;
}
__device__ __forceinline__ float tk_scale_recip(float c, float a) {
  const float m = tk_scale_mant(a);
  const float s = __uint_as_float(__float_as_uint(tk_quotient_from_rcp(c, m, tk_rcp_fast(m))) - tk_scale_exp(a));
  return __float_as_uint(a) >= 0x7f800000u ? (a == a ? 0.0f : a) : s;
}
"""
SCALE_DIV_MIN = 2.0**-100


def rn_reciprocal(c: float) -> float:
    """``1/c`` rounded to the nearest float32 (a float32 division: IEEE, so correctly rounded)."""
    return float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(c, dtype=torch.float32))


def scale_rule(amax, clamp_min, fmt_max: float, round_sf: bool, call_free: bool = False):
    """``(sf, sf_inv)`` of a block with absolute maximum ``amax`` (float32 expressions); ``call_free``: the
    quotients by ``SCALE_DIV`` (the amax floor ``clamp_min`` must be at least ``SCALE_DIV_MIN``)."""
    a = T.max(amax, clamp_min)
    if not round_sf and call_free:
        q = T.float32(fmt_max)
        rc = T.float32(rn_reciprocal(fmt_max))
        return T.call_extern("float32", "tk_scale_quot", a, q, rc), T.call_extern("float32", "tk_scale_recip", q, a)
    s0 = a / T.float32(fmt_max)
    if not round_sf:
        return s0, T.float32(fmt_max) / a
    k = T.shift_right(T.reinterpret(s0, "int32") - 1, 23) - 126
    return pow2(k), pow2(-k)


def ue8m0_byte(sf):
    """The UE8M0 exponent byte of a power-of-two float32 scale: ``bits >> 23``."""
    return T.cast(T.bitwise_and(T.shift_right(T.reinterpret(sf, "int32"), 23), 0xFF), "uint8")


def _ge(a, b):
    return T.if_then_else(a >= b, 1, 0)


def _gt(a, b):
    return T.if_then_else(a > b, 1, 0)


def encode_e2m1(v):
    """float32 -> e2m1 code (int32, 0..15), as ``tk_core.formats.encode_e2m1``."""
    a = T.abs(v)
    mag = (
        _gt(a, T.float32(0.25))
        + _ge(a, T.float32(0.75))
        + _gt(a, T.float32(1.25))
        + _ge(a, T.float32(1.75))
        + _gt(a, T.float32(2.5))
        + _ge(a, T.float32(3.5))
        + _gt(a, T.float32(5.0))
    )
    mag = T.if_then_else(T.isnan(v), 7, mag)
    sign = T.bitwise_and(T.shift_right(T.reinterpret(v, "int32"), 28), 8)
    return T.bitwise_or(mag, sign)


def sf_offset(layout: str, m, k, nm, nk: int):
    """Offset of block ``(m, k)`` in the flat SF storage (elements; bytes for ``packed``).

    row: ``m * nk + k``; col: ``k * align(nm, 4) + m``; packed (uint8 view of the int32 storage
    ``(ceil(nk/4), align(nm, 4))``): ``(k // 4) * 4 * align(nm, 4) + 4 * m + k % 4``.
    """
    if layout == "row":
        return m * nk + k
    nm4 = T.ceildiv(nm, 4) * 4
    if layout == "col":
        return k * nm4 + m
    return (k // 4) * (4 * nm4) + 4 * m + k % 4


def _hash32(x):
    """``tk_core.formats.hash32`` of a uint32 expression."""
    x = T.bitwise_xor(x, T.shift_right(x, 16)) * T.uint32(0x7FEB352D)
    x = T.bitwise_xor(x, T.shift_right(x, 15)) * T.uint32(0x846CA68B)
    return T.bitwise_xor(x, T.shift_right(x, 16))


def row_key(row, seed):
    """The per-row half of ``stochastic_bits``: ``hash32(row + seed * 0x9E3779B9)`` (``seed`` an int32 scalar
    holding the seed's low 32 bits)."""
    return _hash32(T.cast(row, "uint32") + T.reinterpret(seed, "uint32") * T.uint32(0x9E3779B9))


def pair_bits(key, col_pair):
    """The 32 random bits of the column pair ``col_pair`` (columns ``2 col_pair`` and ``2 col_pair + 1``) of the
    row with ``row_key`` ``key``: the even column's ``stochastic_bits`` are the low 16, the odd one's the high 16."""
    return _hash32(key + T.cast(col_pair, "uint32"))


def element_bits(pair_words, i):
    """The 16 random bits of element ``i`` of a run of columns that starts at an even column, from
    ``pair_words[j]`` = ``pair_bits`` of its column pair ``j`` (the even column's are the low 16)."""
    return T.bitwise_and(T.shift_right(pair_words[i // 2], 16 * (i % 2)), T.uint32(0xFFFF))


# ``tk_core.formats.round_stochastic`` as device functions (TileLang lowers ``if_then_else`` to branches; these are
# selects). ``__fadd_rn`` / ``__fsub_rn`` keep the one rounding of ``|y| + 2**emin`` out of FMA contraction.
ROUND_STOCHASTIC = r"""
template <int DROPPED>
__device__ __forceinline__ float tk_round_stochastic(float y, unsigned r, float lo) {
  const float a = fabsf(y);
  const bool small = a < lo;
  const float t = small ? __fadd_rn(a, lo) : a;
  const float m = __uint_as_float((__float_as_uint(t) + (r << (DROPPED - 16))) & (0xFFFFFFFFu << DROPPED));
  const float mag = small ? __fsub_rn(m, lo) : m;
  return (__float_as_uint(y) & 0x7F800000u) != 0x7F800000u ? copysignf(mag, y) : y;
}
__device__ __forceinline__ float tk_round_stochastic_e4m3(float y, unsigned r) {
  return tk_round_stochastic<20>(y, r, 0x1p-6f);
}
__device__ __forceinline__ float tk_round_stochastic_e2m1(float y, unsigned r) {
  return tk_round_stochastic<22>(y, r, 1.0f);
}
__device__ __forceinline__ float tk_round_stochastic_bf16(float y, unsigned r) {
  return tk_round_stochastic<16>(y, r, 0x1p-126f);
}
// The e2m1 code of tk_round_stochastic_e2m1(y, r) without the general encoder: the rounded magnitude's bits
// above the one kept mantissa bit index the code grid directly (|y| < 1 through |y| + 1, whose exponent is 127).
// Codes past 6, inf and NaN saturate to 7 as the encoder's; the sign bit is copied.
__device__ __forceinline__ unsigned tk_stochastic_code_e2m1(float y, unsigned r) {
  const float a = fabsf(y);
  const bool small = a < 1.0f;
  const unsigned m = (__float_as_uint(small ? __fadd_rn(a, 1.0f) : a) + (r << 6)) >> 22;
  return min(m - (small ? 254u : 252u), 7u) | ((__float_as_uint(y) >> 28) & 8u);
}
"""


def round_stochastic(y, fmt: str, r):
    """``tk_core.formats.round_stochastic`` of the float32 expression ``y`` with the 16 random bits ``r`` (uint32;
    the kernel's prelude must contain ``ROUND_STOCHASTIC``)."""
    return T.call_extern("float32", f"tk_round_stochastic_{fmt}", y, r)


def stochastic_code_e2m1(y, r):
    """``encode_e2m1(round_stochastic(y, "e2m1", r))`` (uint32 code 0..15) in about a third of the instructions
    (the prelude must contain ``ROUND_STOCHASTIC``)."""
    return T.call_extern("uint32", "tk_stochastic_code_e2m1", y, r)


@T.macro
def store_cta_count(err, bid, count, warp_sums, tx, warps: int, zero_counts: bool):
    """The CTA's sum of the threads' int32 ``count[0]`` into ``err[bid]`` (``count[0]`` is clobbered): a warp
    butterfly, one shared word per warp (``warp_sums``), thread 0 adds the warps in order. With ``zero_counts``
    False only a nonzero sum is written (the slots are zeroed host words, ``tk_core.hostmem``).

    It starts with a barrier: TileLang places ``warp_sums`` on the bytes of the kernel's other shared buffers (their
    lifetimes end before it is written, by its analysis), and its sync planner did not order a slow warp's last read
    of those buffers before a fast warp's write here (the lossless cast's block-maximum partials of 2-D output blocks
    had no barrier between their last read and this write: it counted a barrier inside a conditional block that a
    CTA's last loop iteration skips). Callers declare that overlay in their factory's ``shared_aliases``."""
    T.sync_threads()
    for off in (16, 8, 4, 2, 1):
        count[0] += T.shfl_xor(count[0], off)
    if tx % 32 == 0:
        warp_sums[tx // 32] = count[0]
    T.sync_threads()
    if tx == 0:
        for w in T.serial(1, warps):
            count[0] += warp_sums[w]
        if zero_counts or count[0] != 0:
            err[bid] = count[0]


def grid_params(row_tiles: int) -> dict:
    """The kernel parameter a launch of ``row_tiles`` row tiles adds: ``linear_grid=True`` past ``MAX_GRID_YZ``,
    else none (so the kernels of launches that fit keep the keys they are compiled and precompiled under)."""
    return {"linear_grid": True} if row_tiles > MAX_GRID_YZ else {}


def tile_grid(col_tiles: int, row_tiles, linear: bool, **kernel_args):
    """``T.Kernel`` over ``col_tiles`` x ``row_tiles`` CTAs, column tiles fastest; ``tile_ids`` names a CTA's tiles.
    A grid's y extent stops at ``MAX_GRID_YZ`` (about 2.1 M tokens in 32-row tiles), so ``linear`` (see
    ``grid_params``) lays the same CTAs in the same order along x. Only those launches take it: the division
    costs registers (the 128-row per-block cast 80 -> 84 on sm_90a, one CTA per SM fewer)."""
    if linear:
        return T.Kernel(row_tiles * col_tiles, **kernel_args)
    return T.Kernel(col_tiles, row_tiles, **kernel_args)


def tile_ids(ids, col_tiles: int, linear: bool):
    """``(column tile, row tile)`` of the CTA, from the binding of ``tile_grid``'s frame."""
    return (ids % col_tiles, ids // col_tiles) if linear else ids
