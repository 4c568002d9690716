"""Number formats of the project, in plain PyTorch (CPU or GPU), bit-exact.

| format | storage | max | notes |
| --- | --- | --- | --- |
| e4m3 | ``torch.float8_e4m3fn`` | 448 | RNE, saturating; NaN stays NaN |
| e2m1 | 4-bit codes, two per ``int8`` byte, element ``2j`` in the low nibble of byte ``j`` | 6 | RNE on the code grid |
| e5m6 | 12-bit codes (the top 12 bits of an fp16), eight per three ``uint32`` words | 65024 | |
| ue8m0 | one exponent byte ``e``, value ``2**(e - 127)``; four per ``int32`` (byte ``j`` little-endian) | | |

The scale rule (``compute_scales``) turns a block's amax into the dequantization scale ``sf`` and the
quantization multiplier ``sf_inv`` exactly as the kernels do, so references built on it compare bits.

Stochastic rounding (``round_stochastic``, e4m3 and e2m1) takes its random bits from a hash of the element's
position and a seed (``stochastic_bits``): the same call gives the same bits on any device, so the kernels that
round stochastically are compared bit for bit with their references, and no generator state is involved.
"""

import torch

from . import checks

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E5M6_MAX = 65024.0
FORMAT_MAX = {"e4m3": E4M3_MAX, "e2m1": E2M1_MAX, "e5m6": E5M6_MAX}

# Magnitudes of the eight e2m1 codes and the midpoints between neighbouring codes.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

def reinterpret(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bytes of ``x`` (made contiguous) viewed as ``dtype``; the last dimension scales with the
    element sizes (its byte count must divide by the new element size). Works for any strides of size-1
    dimensions and for empty tensors; a 0-d tensor stays 0-d between dtypes of one size."""
    checks.check_tensor("reinterpret", "x", x)
    size = torch.empty((), dtype=dtype).element_size()
    if x.dim() == 0:
        if x.element_size() != size:
            checks.fail("reinterpret", "x", f"at least 1-D to change the element size to {size} bytes", "a 0-d tensor")
        return x.view(dtype)
    if x.shape[-1] * x.element_size() % size:
        checks.fail("reinterpret", "x", f"a last dimension of a multiple of {size} bytes", f"shape {tuple(x.shape)} "
                    f"of {checks.dtype_name(x.dtype)}")
    last = x.shape[-1] * x.element_size() // size
    x = x.contiguous()
    if x.dim() and x.stride(-1) != 1:  # a size-1 last dimension may carry any stride
        x = x.clone(memory_format=torch.contiguous_format)
    return x.flatten().view(dtype).view(*x.shape[:-1], last)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The int32 bit pattern of a float32 tensor."""
    return reinterpret(x.float(), torch.int32)


def _from_bits(bits: torch.Tensor) -> torch.Tensor:
    return reinterpret(bits.to(torch.int32), torch.float32)


def pow2(k: torch.Tensor) -> torch.Tensor:
    """Exactly ``2**k`` in float32 for integer ``k`` (subnormals below 2**-126, inf above 2**127)."""
    k = k.to(torch.int32)
    normal = torch.clamp(k + 127, 1, 254) << 23
    subnormal = torch.ones_like(k) << torch.clamp(k + 149, 0, 22)
    bits = torch.where(k >= -126, normal, subnormal)
    bits = torch.where(k > 127, torch.full_like(k, 0x7F800000), bits)
    bits = torch.where(k < -149, torch.zeros_like(k), bits)
    return _from_bits(bits)


# --- e4m3 -----------------------------------------------------------------------------------------


def encode_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float32 -> e4m3 with round-to-nearest-even, saturating finite values (and inf) to +-448."""
    return torch.clamp(x.float(), -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


# --- e2m1 -----------------------------------------------------------------------------------------


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """float32 -> e2m1 codes (uint8, 0..15): RNE on the code grid, saturating at +-6.

    Ties go to the even code (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4). The sign bit
    is copied, so -0 encodes as 8. NaN encodes as 6 with the input's sign.
    """
    x = x.float()
    a = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for i, mid in enumerate(_E2M1_MIDPOINTS):
        up = (a > mid) | (a == mid) if i % 2 else a > mid
        code += up.to(torch.uint8)
    code = torch.where(torch.isnan(x), torch.full_like(code, 7), code)
    sign = (_bits(x) < 0).to(torch.uint8) << 3
    return code | sign


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (any integer dtype, low 4 bits used) -> float32."""
    c = codes.to(torch.int32) & 0xF
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = table[c & 7]
    return torch.where(c >= 8, -mag, mag)


def _check_last_dim(op: str, arg: str, x: torch.Tensor, multiple: int) -> None:
    checks.check_tensor(op, arg, x)
    if x.dim() == 0 or x.shape[-1] % multiple:
        checks.fail(op, arg, f"at least 1-D with a last dimension divisible by {multiple}", f"shape {tuple(x.shape)}")


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``(..., 2K)`` -> int8 ``(..., K)``: element ``2j`` in the low nibble of byte ``j``."""
    _check_last_dim("pack_e2m1", "codes", codes, 2)
    c = codes.to(torch.uint8) & 0xF
    return reinterpret(c[..., 0::2] | (c[..., 1::2] << 4), torch.int8)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """int8/uint8 ``(..., K)`` -> codes uint8 ``(..., 2K)`` (low nibble first)."""
    checks.check_dtype("unpack_e2m1", "packed", packed, (torch.int8, torch.uint8))
    _check_last_dim("unpack_e2m1", "packed", packed, 1)
    b = reinterpret(packed, torch.uint8)
    return torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)


# --- e5m6 -----------------------------------------------------------------------------------------


def _fp16_bits_round_toward_zero(y: torch.Tensor) -> torch.Tensor:
    """float32 -> IEEE fp16 bit pattern (int32, 0..0xFFFF) rounded toward zero, as CUDA's RZ does."""
    bits = _bits(y)
    sign = (bits >> 16) & 0x8000
    exp = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    e = exp - 112  # fp16 biased exponent
    normal = (e << 10) | (mant >> 13)
    shift = torch.clamp(14 - e, 0, 31)
    subnormal = torch.where(shift > 24, torch.zeros_like(mant), (mant | 0x800000) >> shift)
    mag = torch.where(e >= 1, normal, subnormal)
    mag = torch.where(exp == 0, torch.zeros_like(mag), mag)
    mag = torch.where(e >= 31, torch.full_like(mag, 0x7BFF), mag)  # RZ overflow: largest finite
    mag = torch.where(exp == 0xFF, torch.where(mant != 0, 0x7E00, 0x7C00), mag)
    return sign | mag


def encode_e5m6(y: torch.Tensor) -> torch.Tensor:
    """float32 -> 12-bit e5m6 codes (int32): truncate to fp16 toward zero, keep the top 12 bits, then
    round half-to-even on the 17 fp32 bits below them (a carry into the exponent is intended).

    Exact RNE for results in the fp16 normal range; for fp16-subnormal results the rounding decision
    reads fp32 bits that do not line up with the dropped ones, as in the original kernels.
    """
    y = y.float()
    code = _fp16_bits_round_toward_zero(y) >> 4
    rest = _bits(y) & 0x1FFFF
    return code + (((code & 1) + rest) > 0x10000).to(torch.int32)


def decode_e5m6(codes: torch.Tensor) -> torch.Tensor:
    """12-bit e5m6 codes -> float32 (exact): the code is the top 12 bits of an fp16."""
    h = (codes.to(torch.int32) & 0xFFF) << 4
    h = torch.where(h >= 0x8000, h - 0x10000, h).to(torch.int16)
    return reinterpret(h, torch.float16).float()


def pack_e5m6(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``(..., 8G)`` -> uint8 ``(..., 12G)``: each 8 codes become 3 little-endian uint32 words,
    ``w0 = h0<<20 | h1<<8 | h2>>4``, ``w1 = (h2&0xF)<<28 | h3<<16 | h4<<4 | h5>>8``,
    ``w2 = (h5&0xFF)<<24 | h6<<12 | h7``."""
    _check_last_dim("pack_e5m6", "codes", codes, 8)
    h = (codes.to(torch.int64) & 0xFFF).unflatten(-1, (-1, 8)).unbind(-1)
    w0 = (h[0] << 20) | (h[1] << 8) | (h[2] >> 4)
    w1 = ((h[2] & 0xF) << 28) | (h[3] << 16) | (h[4] << 4) | (h[5] >> 8)
    w2 = ((h[5] & 0xFF) << 24) | (h[6] << 12) | h[7]
    words = torch.stack((w0, w1, w2), dim=-1).flatten(-2)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return reinterpret(words, torch.uint8)


def unpack_e5m6(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``(..., 12G)`` -> codes int32 ``(..., 8G)``; the inverse of ``pack_e5m6``."""
    checks.check_dtype("unpack_e5m6", "packed", packed, torch.uint8)
    _check_last_dim("unpack_e5m6", "packed", packed, 12)
    w = reinterpret(packed, torch.int32).to(torch.int64) & 0xFFFFFFFF
    w0, w1, w2 = w.unflatten(-1, (-1, 3)).unbind(-1)
    h = (
        w0 >> 20,
        (w0 >> 8) & 0xFFF,
        ((w0 & 0xFF) << 4) | (w1 >> 28),
        (w1 >> 16) & 0xFFF,
        (w1 >> 4) & 0xFFF,
        ((w1 & 0xF) << 8) | (w2 >> 24),
        (w2 >> 12) & 0xFFF,
        w2 & 0xFFF,
    )
    return torch.stack(h, dim=-1).flatten(-2).to(torch.int32)


# --- stochastic rounding -------------------------------------------------------------------------

SR_BITS = 16  # random bits per element
SR_FORMATS = ("e4m3", "e2m1", "bf16")
# (mantissa bits, smallest normal exponent) of the formats that round stochastically
_SR_GRID = {"e4m3": (3, -6), "e2m1": (1, 0), "bf16": (7, -126)}
_GOLDEN = 0x9E3779B9
_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x`` in ``[0, 2**32)`` (every partial product below 2**48)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """An avalanching 32-bit integer hash (Wellons' "lowbias32") of int64 ``x`` taken mod 2**32; int64 result."""
    x = x.to(torch.int64) & _MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def int32_bits(v: int) -> int:
    """An unsigned 32-bit value as the int32 of the same bits (kernels take int32 scalars; torch.compile's Triton
    code adds Python constants to int32 indices, where a constant of 2**31 or more does not compile)."""
    return v - 2**32 if v >= 2**31 else v


def _row_keys(seed: int, rows: torch.Tensor) -> torch.Tensor:
    """``hash32(row + seed * 0x9E3779B9)``; the seed term as a signed 32-bit constant (hash32 reduces mod 2**32)."""
    return hash32(rows.to(torch.int64) + int32_bits(seed * _GOLDEN & _MASK32))


def stochastic_bits(seed: int, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``SR_BITS`` random bits (int64) for the elements at ``(rows, cols)`` (broadcast) of a 2-D tensor, one hash
    per pair of columns: ``h = hash32(hash32(row + seed * 0x9E3779B9) + col // 2)`` in 32-bit unsigned arithmetic;
    an even column takes the low 16 bits of ``h``, an odd one the high 16."""
    cols = cols.to(torch.int64)
    return (hash32(_row_keys(seed, rows) + (cols >> 1)) >> (16 * (cols & 1))) & 0xFFFF


def stochastic_bits_grid(seed: int, rows: int, cols: int, device=None) -> torch.Tensor:
    """``stochastic_bits(seed, i, j)`` for every element ``(i, j)`` of a ``(rows, cols)`` grid (int64), with one hash per
    column pair instead of one per element and the row keys hashed once per row: what the references use."""
    row_keys = _row_keys(seed, torch.arange(rows, device=device))[:, None]
    pairs = hash32(row_keys + torch.arange((cols + 1) // 2, device=device))
    return torch.stack((pairs & 0xFFFF, pairs >> 16), dim=-1).view(rows, 2 * pairs.shape[1])[:, :cols]


def round_stochastic(y: torch.Tensor, fmt: str, r: torch.Tensor) -> torch.Tensor:
    """float32 ``y`` rounded to a neighbour on ``fmt``'s grid (without saturation; encode the result with
    ``encode_e4m3`` / ``encode_e2m1`` / ``.to(torch.bfloat16)``, which are then exact but for saturation or
    overflow), away from zero with the probability of its fractional position between them, to ``SR_BITS`` bits.

    With ``m`` mantissa bits and smallest normal exponent ``emin`` (e4m3: 3, -6; e2m1: 1, 0; bf16: 7, -126) the
    grid spacing in a binade is one unit of the float32's bit ``23 - m``. So ``t = |y|`` (below ``2**emin``:
    ``t = fl32(|y| + 2**emin)``, which puts the subnormal grid on those bits) gets ``r << (7 - m)`` added to its
    bits, and the ``23 - m`` low bits are cleared (a carry moves to the next grid value, also across binades); then
    ``2**emin`` is subtracted again where it was added (exactly). The sign is kept (``-0`` too); inf and NaN
    pass through. Every step is exact or a single float32 rounding, so kernels reproduce it bit for bit.
    """
    if fmt not in _SR_GRID:
        raise ValueError(f"round_stochastic: fmt must be one of {SR_FORMATS}, got {fmt!r}")
    mbits, emin = _SR_GRID[fmt]
    y = y.float()
    a = y.abs()
    small = a < 2.0**emin
    t = torch.where(small, a + 2.0**emin, a)
    dropped = 23 - mbits
    bits = (_bits(t) + (r.to(torch.int32) << (dropped - SR_BITS))) & ~((1 << dropped) - 1)
    mag = torch.where(small, _from_bits(bits) - 2.0**emin, _from_bits(bits))
    return torch.where(torch.isfinite(y), torch.copysign(mag, y), y)


# --- ue8m0 ----------------------------------------------------------------------------------------


def encode_ue8m0(sf: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales -> exponent bytes (uint8): the float's bits ``>> 23``."""
    return (_bits(sf) >> 23 & 0xFF).to(torch.uint8)


def decode_ue8m0(e: torch.Tensor) -> torch.Tensor:
    """Exponent bytes (uint8, or int8 read as its unsigned byte) -> float32 with bit pattern ``e << 23``
    (byte 0 decodes to 0.0)."""
    return _from_bits((e.to(torch.int32) & 0xFF) << 23)


def pack_ue8m0(e: torch.Tensor) -> torch.Tensor:
    """uint8 ``(..., N)`` -> int32 ``(..., ceil(N/4))``; byte ``j`` of word ``c`` is ``e[..., 4c+j]``,
    unused bytes are zero."""
    _check_last_dim("pack_ue8m0", "e", e, 1)
    n = e.shape[-1]
    pad = -n % 4
    e = torch.nn.functional.pad(e.to(torch.uint8), (0, pad)) if pad else e.to(torch.uint8)
    return reinterpret(e, torch.int32)


def unpack_ue8m0(words: torch.Tensor, n: int) -> torch.Tensor:
    """int32 ``(..., ceil(n/4))`` -> uint8 ``(..., n)``."""
    checks.check_dtype("unpack_ue8m0", "words", words, torch.int32)
    _check_last_dim("unpack_ue8m0", "words", words, 1)
    if n < 0 or (n + 3) // 4 != words.shape[-1]:  # no isinstance: n may be a SymInt under torch.compile
        checks.fail("unpack_ue8m0", "n", f"a count with ceil(n / 4) == {words.shape[-1]} (words' last dimension)", n)
    return reinterpret(words, torch.uint8)[..., :n]


# --- the scale rule -------------------------------------------------------------------------------


def compute_scales(amax: torch.Tensor, fmt_max: float, clamp_min: float, round_sf: bool):
    """amax (float32) -> ``(sf, sf_inv)``, the dequantization scale and the quantization multiplier.

    ``A = max(amax, clamp_min)``. Without rounding ``sf = A / Q`` and ``sf_inv = Q / A`` (two correctly
    rounded divisions; ``sf_inv`` is not ``1/sf``). With rounding ``sf = 2**k``, ``sf_inv = 2**-k`` where
    ``k = ceil(log2(A / Q))``, taken from the float's bits as ``((bits - 1) >> 23) - 126``.
    """
    a = torch.clamp_min(amax.float(), clamp_min)
    # A tensor divisor: on CUDA ``tensor / python_scalar`` is computed as ``tensor * fl(1/scalar)`` (torch's
    # div_true "CPU scalar" optimization), which is not the correctly rounded division the kernels do.
    s0 = a / torch.full_like(a, fmt_max)
    if not round_sf:
        # A tensor numerator: ``scalar / tensor`` in torch is ``reciprocal(tensor) * scalar``, rounded twice.
        return s0, torch.full_like(a, fmt_max) / a
    k = ((_bits(s0) - 1) >> 23) - 126
    return pow2(k), pow2(-k)
