"""TileLang building blocks shared by the per-block, lossless and per-channel kernels of tk-quant.

These are trace-time helpers: each returns TIR expressions (or emits statements) inside a
``T.prim_func``. They implement, bit for bit, the conversions of ``tk_core.formats``:

- ``scale_rule``: ``A' = max(amax, c_min)``; ``sf = A'/Q`` and ``sf_inv = Q/A'`` (two IEEE divisions),
  or, with ``round_sf``, ``k = ((bits(A'/Q) - 1) >> 23) - 126``, ``sf = 2**k``, ``sf_inv = 2**-k``
  (``pow2`` handles the subnormal and overflow ends exactly like ``tk_core.formats.pow2``).
- ``encode_e2m1``: RNE on the e2m1 code grid, saturating at 6, NaN -> 7, sign bit copied (software, so
  sm_90a and sm_100a agree and match the reference).
- ``sf_offset``: the element offset of scale block ``(m, k)`` in the flat storage of an SF layout.
"""

import tilelang.language as T

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


def scale_rule(amax, clamp_min, fmt_max: float, round_sf: bool):
    """``(sf, sf_inv)`` of a block with absolute maximum ``amax`` (float32 expressions)."""
    a = T.max(amax, clamp_min)
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
