"""Per-token casts: one scale per ``(1, bk)`` group of a row (``bk = num_per_channels``).

Math (plain input ``x``, bf16 or fp32 ``(T, H)``, widened to fp32): for row ``t`` and group ``g``
(columns ``[g*bk, min((g+1)*bk, H))``) ``A = max |x|`` (NaN ignored), then the scale rule of
``tk_core.formats.compute_scales`` with ``Q = 448`` (e4m3), ``6`` (e2m1) or ``65024`` (e5m6) and the
floor ``tk_core.config.get_amax_clamp(fmt)``: ``sf = A'/Q, sf_inv = Q/A'`` (two IEEE divisions) or, with
``round_sf``, ``sf = 2**k, sf_inv = 2**-k`` with ``k = ceil(log2(A'/Q))``. ``out = convert(x * sf_inv)``:
e4m3 RNE saturating to +-448, e2m1 RNE on the code grid saturating at 6 (NaN -> 6), e5m6 per
``tk_core.formats.encode_e5m6``. With ``use_e4m3_sf`` (NVFP4 style, e.g. ``bk = 16``) the scale is stored
as ``sf = e4m3(A'/Q)`` and ``sf_inv = 1/float(sf)`` (floor ``get_amax_clamp(fmt + '_e4m3sf')``).

QuantTensor input ``(data, s_in)`` (e4m3 ``(T, H)`` or packed e2m1 int8 ``(T, H/2)``, block
``x_block_size = (bm_in, bk_in)``, SF in any layout): ``A = max |decode(data) * s_in|`` and
``out = convert(decode(data) * (s_in * sf_inv))`` (kernel order; the reference uses the same order).

Shapes and layouts: ``H % 16 == 0``; ``bk`` in {16, 32, 64, 128} or ``bk == H`` (one scale per row; plain
input only); partial last groups use their valid columns. ``x`` may have any row stride (unit inner
stride). Outputs: data e4m3 ``(T, H)``, int8 ``(T, H/2)`` (element ``2j`` in the low nibble of byte ``j``) or,
for e5m6, uint8 ``(T, 3H/2)`` (plain input, ``H % bk == 0``); SF of logical shape ``(T, ceil(H/bk))`` row-major fp32,
TMA-aligned column-major fp32 (``use_tma_aligned_col_major_sf``) or packed UE8M0 int32
``(T, ceil(ceil(H/bk)/4))`` column-major (needs col-major and ``round_sf``), or float8_e4m3fn with
``use_e4m3_sf`` (row- or column-major). ``T == 0`` returns empty tensors without a launch.

Stochastic rounding (``stochastic_rounding=True``, e4m3 and e2m1 data): ``out = convert(round_stochastic(x *
sf_inv, r))`` with ``tk_core.formats.round_stochastic`` and the 16 bits ``r = stochastic_bits(seed, row, col)`` of
each element's position in ``(T, H)``; the scales are those of the round-to-nearest cast. One hash per column
pair and about 16 SASS per element more for e4m3, 32 for e2m1 (PERF-NOTES, session 13).

Variants: ``per_token_cast_with_sf_only`` returns only the SF (no data buffer); ``per_token_cast_with_
precomputed_sf(x, ..., sf)`` casts with a given SF of any layout, ``out = convert(x * (1/sf))``;
``per_token_cast_and_cast_back(x, ...)`` fake-quantizes ``x`` in place (the cast decoded back, in one pass).

Errors: TypeError for wrong types/dtypes, ValueError for bad fmt, ``num_per_channels``, shapes,
layout-flag combinations (packed without col-major or ``round_sf``; e4m3 scales with ``round_sf``),
mismatched ``out=`` tensors. CPU tensors run ``tk_quant.reference.cast`` / ``cast_to_e5m6``.

Kernel: registers only, no shared memory except the cross-warp amax of one-scale-per-row casts. Each
thread owns 16 consecutive elements (16-byte vector loads and stores); the ``bk/16`` threads of a group
reduce the amax with warp shuffles. Rows of a one-scale-per-row cast are spread over ``32*W`` lanes; their
e5m6 words (24 bytes per lane) are staged per warp in shared memory and stored as coalesced 16-byte chunks.
The token count and all strides are runtime values (no recompile per batch size).
"""

import tilelang.language as T
import torch

from tk_core.checks import check_bool, check_dtype, check_ndim, check_positive_int, fail
from tk_core.formats import int32_bits
from tk_core.jit import MAX_SMEM_PER_BLOCK, blocks_per_sm, kernel
from tk_core.layout import ceil_div, sf_to_row_major, vector_aligned
from tk_core.library import device_op

from . import _tl, reference
from ._tl import ue8m0_byte
from .common import (
    FMT_MAX,
    alloc_sf_out,
    amax_clamp,
    check_quant_input,
    data_from_reference,
    data_out,
    scratch,
    sf_kernel_args,
    sf_kind,
    sf_out_layout,
    stochastic_seed,
)

V = 16  # elements per thread
_PASS = {"tl.disable_safe_memory_legalize": True}
_IN_DTYPE = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float8_e4m3fn: "float8_e4m3fn", torch.int8: "int8"}
_SF_DTYPE = {None: "uint8", "fp32": "float32", "packed": "uint8", "e4m3": "float8_e4m3fn"}


def _row_geometry(hidden: int):
    """Lanes per row ``32*W``, vectors per lane ``NPT`` and rows per CTA ``R`` of one-scale-per-row casts."""
    nvr = hidden // V
    w = min(32, max(1, ceil_div(nvr, 32 * 2)))  # at most 2 vectors per lane: registers stay low
    npt = ceil_div(nvr, 32 * w)
    r = max(1, 256 // (32 * w))
    return w, npt, r


# --- device-side helpers (trace time) ------------------------------------------------------------


def _decode_e2m1(byte, hi):
    """One nibble (``hi`` = 0 low, 1 high) of an int32 byte value -> float32, exactly.

    The nibble ``s e1 e0 m`` is placed as sign, exponent bits 24..23 and mantissa bit 22 of a float32; that
    float is ``2**(e-127) * (1 + m/2)`` (or the denormal ``m * 2**-127``), so times ``2**126`` it is the e2m1
    value (denormals are not flushed: no fast math)."""
    n = T.bitwise_and(T.shift_right(byte, 4 * hi), 0xF)
    bits = T.bitwise_or(T.shift_left(T.bitwise_and(n, 7), 22), T.shift_left(T.bitwise_and(n, 8), 28))
    return T.reinterpret(bits, "float32") * T.float32(2.0**126)


def _encode_e2m1(y):
    """float32 -> e2m1 code (uint32 0..15): RNE on the code grid, saturating at 6, NaN -> 7, sign copied."""
    a = T.min(T.abs(y), T.float32(6.0))  # fminf(NaN, 6) = 6
    bits = T.reinterpret(a, "int32")
    normal = T.shift_right(bits + 0x1FFFFF + T.bitwise_and(T.shift_right(bits, 22), 1), 22) - 252
    # RNE(2a) for a < 1 without the conversion pipe: 2a + 2**23 rounds once, at integer spacing (exact RNE)
    sub = T.reinterpret(T.call_extern("float32", "__fmaf_rn", a, T.float32(2.0), T.float32(2.0**23)), "int32") - 0x4B000000
    mag = T.if_then_else(a < T.float32(1.0), sub, normal)
    sign = T.bitwise_and(T.shift_right(T.reinterpret(y, "int32"), 28), 8)
    return T.cast(T.bitwise_or(mag, sign), "uint32")


# Two fp32 -> fp16 conversions toward zero in one instruction (``a`` to the high half, ``b`` to the low half):
# half the conversion-pipe work of two ``__float2half_rz``, with the same results.
_F16X2_RZ = r"""
__device__ __forceinline__ unsigned tk_f16x2_rz(float a, float b) {
  unsigned d;
  asm("cvt.rz.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(a), "f"(b));
  return d;
}
"""


def _e5m6_round(c, y):
    """The e5m6 code of ``y`` from ``c`` = the top 12 bits of ``fp16_rz(y)``, as ``tk_core.formats.encode_e5m6``."""
    r = T.bitwise_and(T.reinterpret(y, "uint32"), T.uint32(0x1FFFF))
    return T.bitwise_and(c + T.if_then_else(T.bitwise_and(c, T.uint32(1)) + r > T.uint32(0x10000), T.uint32(1), T.uint32(0)), T.uint32(0xFFF))


def _e5m6_top12(h2, i: int):
    """The top 12 bits of fp16 ``i`` (0 low, 1 high) of an f16x2 word."""
    return T.shift_right(h2, 20) if i else T.bitwise_and(T.shift_right(h2, 4), T.uint32(0xFFF))


def _pow2(k):
    """Exactly ``2**k`` (float32) for an int32 ``k``, as ``_tl.pow2`` but branch-free: ``2**a * 2**b`` with
    ``a + b = k`` and both factors normal; the one rounding of the product gives the subnormals, 0 and inf."""
    kc = T.min(T.max(k, -252), 254)
    a = T.shift_right(kc, 1)
    return T.reinterpret(T.shift_left(a + 127, 23), "float32") * T.reinterpret(T.shift_left(kc - a + 127, 23), "float32")


def _load_sf(kind: str, buf, m, k, s0, s1):
    """The float32 scale of block ``(m, k)`` of an SF passed as flat storage with strides ``(s0, s1)``."""
    if kind == "packed":
        byte = buf[4 * (m * s0 + (k // 4) * s1) + k % 4]
        return T.reinterpret(T.shift_left(T.cast(byte, "int32"), 23), "float32")
    return T.cast(buf[m * s0 + k * s1], "float32")


@kernel(pass_configs=_PASS)
def per_token_cast_kernel(
    in_dtype: str,
    fmt: str,
    hidden: int,
    bk: int,
    round_sf: bool,
    mode: str = "cast",  # "cast" | "sf_only" | "cast_only" | "fake" (the cast decoded back into X, in place)
    sf_out: str = "fp32",  # "fp32" | "packed" | "e4m3"
    in_sf: str | None = None,  # kind of the input SF (QuantTensor input) or of the given SF (cast_only)
    in_bm: int = 1,
    in_bk: int = 16,
    threads: int = 256,
    stage: bool = True,  # e5m6, one scale per row: store through shared memory (see below)
    min_blocks: int = 0,  # CTAs per SM the staged kernel's registers must allow (0: a 56-register cap)
    stochastic: bool = False,  # stochastic rounding of the data (e4m3, e2m1), bits from the runtime ``seed``
):
    t = T.dynamic("num_tokens")
    xs = T.dynamic("x_stride")
    nxsf, ny, nsf = T.dynamic("nxsf"), T.dynamic("ny"), T.dynamic("nsf")
    quant_in = in_dtype in ("float8_e4m3fn", "int8")
    hp = hidden // 2 if in_dtype == "int8" else hidden  # physical input row length
    vin = V // 2 if in_dtype == "int8" else V  # physical input elements per thread
    lw = {"float32": 4, "bfloat16": 8, "float8_e4m3fn": 16, "int8": 8}[in_dtype]  # elements per vector load
    out_dtype = {"e4m3": "float8_e4m3fn", "e2m1": "int32", "e5m6": "int32"}[fmt]
    row_len = {"e4m3": hidden, "e2m1": hidden // 8, "e5m6": hidden * 3 // 8}[fmt]  # output row, elements
    vout = {"e4m3": V, "e2m1": 2, "e5m6": 6}[fmt]
    ow = {"e4m3": 16, "e2m1": 2, "e5m6": 2}[fmt]  # elements per vector store
    fmax = FMT_MAX[fmt]
    gv = bk // V
    row_mode = gv > 32 or gv & (gv - 1) != 0  # a group must be a power-of-two run of lanes in one warp
    nk = ceil_div(hidden, bk)
    if row_mode:
        w, npt, r = _row_geometry(hidden)
        threads = 32 * w * r
        grid_x = lambda n: T.ceildiv(n, r)  # noqa: E731
    else:
        npt = 1
        nv = ceil_div(hidden // V, gv) * gv  # vectors per row, padded to whole groups
        grid_x = lambda n: T.ceildiv(n * nv, threads)  # noqa: E731
    write_data = mode != "sf_only"
    write_sf = mode not in ("cast_only", "fake")
    fake = mode == "fake"
    assert not fake or (fmt != "e5m6" and not quant_in)
    # e5m6 rows: a lane's 6 words (24 B) go through shared memory so the warp stores its 768 B as 16-byte
    # chunks, lane l on chunk l (coalesced); 8-byte stores at a 24-byte lane stride cost 3x the store sectors.
    # Needs 16-byte aligned rows (H % 32 == 0), which also makes every warp's valid words whole chunks, and rows
    # whose staged words fit in a CTA's shared memory (H < 147,488: wider rows take the 8-byte stores).
    stage_words = r * w * (npt * 32 * vout + 1) if row_mode else 0  # the staged words, then one amax per warp
    stage = (stage and row_mode and fmt == "e5m6" and write_data and hidden % 32 == 0
             and 4 * stage_words <= MAX_SMEM_PER_BLOCK)
    assert not (stochastic and fmt == "e5m6")
    prelude = (_F16X2_RZ if fmt == "e5m6" else "") + (_tl.ROUND_STOCHASTIC if stochastic else "") or None

    def narrowed(y, bits, i):
        """The value the conversion of ``y`` (element ``i`` of a thread's vector) rounds: ``y`` itself, or its
        stochastic rounding."""
        return _tl.round_stochastic(y, fmt, _tl.element_bits(bits, i)) if stochastic else y

    def e2m1_code(y, bits, i):
        """The e2m1 code (uint32) of ``y``, element ``i`` of a thread's vector: round to nearest even, or
        stochastic rounding fused with the encoding (``_tl.stochastic_code_e2m1``)."""
        return _tl.stochastic_code_e2m1(y, _tl.element_bits(bits, i)) if stochastic else _encode_e2m1(y)

    @T.prim_func
    def main(
        X: T.StridedTensor((t, hp), (xs, 1), in_dtype),
        XSF: T.Tensor((nxsf,), _SF_DTYPE[in_sf]),
        Y: T.Tensor((ny,), out_dtype),
        SF: T.Tensor((nsf,), _SF_DTYPE[sf_out]),
        xs0: T.int32,
        xs1: T.int32,
        s0: T.int32,
        s1: T.int32,
        clamp_min: T.float32,
        seed: T.int32,
    ):
        with T.Kernel(grid_x(t), threads=threads, prelude=prelude) as bx:
            T.assume(xs % lw == 0)
            if stage:
                # at most 56 registers (5 CTAs of 224 threads per SM, 35 warps, no spills): more rows in flight to
                # overlap one CTA's load -> amax -> encode -> store phases with another's; left alone: 74 (3 CTAs)
                T.annotate_min_blocks_per_sm(min_blocks or blocks_per_sm(threads, 56))
            tx = T.get_thread_binding()
            xr = T.alloc_local((npt, vin), in_dtype)
            xv = T.alloc_local((npt, V), "float32")
            mul = T.alloc_local((npt,), "float32")
            amax = T.alloc_var("float32")
            sf = T.alloc_var("float32")
            sf_inv = T.alloc_var("float32")
            if row_mode:
                if stage:
                    # one buffer: each warp's staged words, then the cross-warp amax (float bits). As two buffers
                    # TileLang may overlap them, and a fast warp's staging would race a slow warp's amax reads.
                    st = T.alloc_shared((stage_words,), "int32")
                else:
                    red = T.alloc_shared((r * w,), "float32")
                lane = tx % (32 * w)
                row = bx * r + tx // (32 * w)
            else:
                g = bx * threads + tx
                # int32 row and vector-in-row: left as expressions they are widened to int64 (64-bit div/mod)
                rq = T.alloc_local((2,), "int32")
                rq[0] = T.truncdiv(g, nv)
                rq[1] = g - rq[0] * nv
                row = rq[0]
                gq = rq[1]
            amax = 0.0
            for p in T.unroll(npt):
                if row_mode:
                    col = (lane + p * 32 * w) * V
                else:
                    col = gq * V
                mul[p] = 1.0
                if row < t and col < hidden:
                    for j in T.unroll(vin // lw):
                        for i in T.vectorized(lw):
                            xr[p, j * lw + i] = X[row, col * vin // V + j * lw + i]
                    if in_dtype == "int8":
                        for i in T.unroll(V):
                            xv[p, i] = _decode_e2m1(T.cast(xr[p, i // 2], "int32"), i % 2)
                    else:
                        for i in T.unroll(V):
                            xv[p, i] = T.cast(xr[p, i], "float32")
                    if quant_in:
                        mul[p] = _load_sf(in_sf, XSF, row // in_bm, col // in_bk, xs0, xs1)
                    for i in T.unroll(V):
                        amax = T.max(amax, T.abs(xv[p, i]) * mul[p])
                else:
                    for i in T.unroll(V):
                        xv[p, i] = 0.0
            # amax over the group: shuffles within the group's lanes, then across warps (row mode)
            if row_mode:
                for s in T.unroll(5):
                    amax = T.max(amax, T.shfl_xor(amax, 1 << s))
                if w > 1:
                    if tx % 32 == 0:
                        if stage:
                            st[r * w * npt * 32 * vout + tx // 32] = T.reinterpret(amax, "int32")
                        else:
                            red[tx // 32] = amax
                    T.sync_threads()
                    for q in T.unroll(w):
                        if stage:
                            amax = T.max(amax, T.reinterpret(st[r * w * npt * 32 * vout + (tx // (32 * w)) * w + q], "float32"))
                        else:
                            amax = T.max(amax, red[(tx // (32 * w)) * w + q])
            else:
                for s in T.unroll(gv.bit_length() - 1):
                    amax = T.max(amax, T.shfl_xor(amax, 1 << s))
            # the scale rule
            if mode == "cast_only":
                sf = 1.0
                if row < t:
                    sf = _load_sf(in_sf, XSF, row, T.truncdiv(gq * V, bk), xs0, xs1)
                sf_inv = T.float32(1.0) / sf
            elif sf_out == "e4m3":
                sf = T.cast(T.cast(T.max(amax, clamp_min) / T.float32(fmax), "float8_e4m3fn"), "float32")
                sf_inv = T.float32(1.0) / sf
            elif round_sf:
                kexp = T.shift_right(T.reinterpret(T.max(amax, clamp_min) / T.float32(fmax), "int32") - 1, 23) - 126
                sf = _pow2(kexp)
                sf_inv = _pow2(-kexp)
            else:
                sf = T.max(amax, clamp_min) / T.float32(fmax)
                sf_inv = T.float32(fmax) / T.max(amax, clamp_min)
            if write_sf:
                if row_mode:
                    if row < t and lane == 0:
                        if sf_out == "packed":
                            SF[4 * row * s0] = ue8m0_byte(sf)
                        else:
                            SF[row * s0] = T.cast(sf, _SF_DTYPE[sf_out])
                else:
                    kk = T.truncdiv(gq, gv)
                    if row < t and T.truncmod(gq, gv) == 0 and kk < nk:
                        if sf_out == "packed":
                            SF[4 * (row * s0 + (kk // 4) * s1) + kk % 4] = ue8m0_byte(sf)
                        else:
                            SF[row * s0 + kk * s1] = T.cast(sf, _SF_DTYPE[sf_out])
            if write_data:
                yv = T.alloc_local((npt, vout), out_dtype)
                key = T.alloc_local((1,), "uint32")
                pbits = T.alloc_local((V // 2,), "uint32")  # the random bits of a vector's column pairs
                if stochastic:
                    key[0] = _tl.row_key(row, seed)
                for p in T.unroll(npt):
                    if row_mode:
                        col = (lane + p * 32 * w) * V
                    else:
                        col = gq * V
                    m = mul[p] * sf_inv
                    if stochastic:
                        for j in T.unroll(V // 2):
                            pbits[j] = _tl.pair_bits(key[0], T.shift_right(col, 1) + j)
                    if fmt == "e4m3":
                        for i in T.unroll(V):
                            yv[p, i] = T.cast(narrowed(xv[p, i] * m, pbits, i), "float8_e4m3fn")
                    elif fmt == "e2m1":
                        c = T.alloc_local((V,), "uint32")
                        for i in T.unroll(V):
                            c[i] = T.shift_left(e2m1_code(xv[p, i] * m, pbits, i), 4 * (i % 8))
                        for j in T.unroll(2):
                            yv[p, j] = T.reinterpret(
                                T.bitwise_or(
                                    T.bitwise_or(T.bitwise_or(c[j * 8], c[j * 8 + 1]), T.bitwise_or(c[j * 8 + 2], c[j * 8 + 3])),
                                    T.bitwise_or(T.bitwise_or(c[j * 8 + 4], c[j * 8 + 5]), T.bitwise_or(c[j * 8 + 6], c[j * 8 + 7])),
                                ),
                                "int32",
                            )
                    else:
                        c = T.alloc_local((V,), "uint32")
                        h2 = T.alloc_local((V // 2,), "uint32")
                        for i in T.unroll(V // 2):
                            h2[i] = T.call_extern("uint32", "tk_f16x2_rz", xv[p, 2 * i + 1] * m, xv[p, 2 * i] * m)
                        for i in list(range(V)):  # a Python loop: ``i % 2`` picks the half while tracing
                            c[i] = _e5m6_round(_e5m6_top12(h2[i // 2], i % 2), xv[p, i] * m)
                        for j in T.unroll(2):
                            b = j * 8
                            yv[p, j * 3] = T.reinterpret(
                                T.bitwise_or(T.bitwise_or(T.shift_left(c[b], 20), T.shift_left(c[b + 1], 8)), T.shift_right(c[b + 2], 4)),
                                "int32",
                            )
                            yv[p, j * 3 + 1] = T.reinterpret(
                                T.bitwise_or(
                                    T.bitwise_or(T.shift_left(T.bitwise_and(c[b + 2], T.uint32(0xF)), 28), T.shift_left(c[b + 3], 16)),
                                    T.bitwise_or(T.shift_left(c[b + 4], 4), T.shift_right(c[b + 5], 8)),
                                ),
                                "int32",
                            )
                            yv[p, j * 3 + 2] = T.reinterpret(
                                T.bitwise_or(
                                    T.bitwise_or(T.shift_left(T.bitwise_and(c[b + 5], T.uint32(0xFF)), 24), T.shift_left(c[b + 6], 12)),
                                    c[b + 7],
                                ),
                                "int32",
                            )
                    if stage:
                        for j in T.unroll(vout // ow):
                            for i in T.vectorized(ow):
                                st[(tx // 32 * npt + p) * 32 * vout + tx % 32 * vout + j * ow + i] = yv[p, j * ow + i]
                    elif fake:
                        if row < t and col < hidden:
                            # ``cast_back``: the decoded value times the scale, rounded to the input dtype
                            for i in T.unroll(V):
                                if fmt == "e4m3":
                                    xr[p, i] = T.cast(T.cast(yv[p, i], "float32") * sf, in_dtype)
                                else:
                                    xr[p, i] = T.cast(_decode_e2m1(T.shift_right(yv[p, i // 8], 4 * (i % 8)), 0) * sf, in_dtype)
                            for j in T.unroll(vin // lw):
                                for i in T.vectorized(lw):
                                    X[row, col + j * lw + i] = xr[p, j * lw + i]
                    elif row < t and col < hidden:
                        for j in T.unroll(vout // ow):
                            for i in T.vectorized(ow):
                                Y[row * row_len + col * vout // V + j * ow + i] = yv[p, j * ow + i]
                if stage:  # (TileLang inserts the barrier between the staging writes and these reads)
                    for p in T.unroll(npt):
                        wbase = (lane - tx % 32 + p * 32 * w) * vout  # the warp's first word in the row
                        for k in T.unroll(2):  # 48 chunks of 4 words: lanes 0-31, then 0-15
                            cidx = k * 32 + tx % 32
                            if row < t and cidx < 32 * vout // 4 and wbase + cidx * 4 < row_len:
                                for i in T.vectorized(4):
                                    Y[row * row_len + wbase + cidx * 4 + i] = st[(tx // 32 * npt + p) * 32 * vout + cidx * 4 + i]

    return main


# --- device op -----------------------------------------------------------------------------------


@device_op("tk_quant::per_token_cast", mutates_args=("out", "out_sf"))
def _per_token_cast_op(
    x: torch.Tensor,
    x_sf: torch.Tensor | None,
    out: torch.Tensor | None,
    out_sf: torch.Tensor | None,
    fmt: str,
    num_per_channels: int,
    x_bm: int,
    x_bk: int,
    round_sf: bool,
    kind: str,
    clamp_min: float,
    stochastic: bool,
    seed: int,
) -> None:
    # ``kind`` is the kernel's mode; an op argument named ``mode`` clashes with torch.compile's
    # auto-functionalization.
    x = vector_aligned(x, 8 if x.dtype == torch.int8 else 16)
    hidden = 2 * x.shape[1] if x.dtype == torch.int8 else x.shape[1]
    in_sf = sf_kind(x_sf) if x_sf is not None else None
    params = dict(in_dtype=_IN_DTYPE[x.dtype], fmt=fmt, hidden=hidden, bk=num_per_channels, round_sf=round_sf, mode=kind)
    if stochastic:
        params["stochastic"] = True
    if out_sf is not None:
        params["sf_out"] = sf_kind(out_sf)
    if in_sf is not None:
        params.update(in_sf=in_sf, in_bm=x_bm, in_bk=x_bk)
    k = per_token_cast_kernel.get(x.device, **params)
    xsf, xs0, xs1 = sf_kernel_args(x_sf) if x_sf is not None else (scratch(x.device, torch.uint8), 0, 0)
    if out_sf is not None:
        sf, s0, s1 = sf_kernel_args(out_sf)
    else:  # cast_only writes no SF; the kernel's (unused) SF argument is float32
        sf, s0, s1 = scratch(x.device, torch.float32), 0, 0
    if out is None:
        y = scratch(x.device, torch.float8_e4m3fn if fmt == "e4m3" else torch.int32)
    else:
        y = out.view(-1) if fmt == "e4m3" else out.view(-1).view(torch.int32)
    k(x, xsf, y, sf, xs0, xs1, s0, s1, clamp_min, int32_bits(seed))


@device_op("tk_quant::per_token_cast_and_cast_back_", mutates_args=("x",))
def _fake_quant_op(x: torch.Tensor, fmt: str, num_per_channels: int, round_sf: bool, e4m3_sf: bool, clamp_min: float) -> None:
    # In place; a row stride the 16-byte vectors cannot take runs on an aligned copy that is copied back.
    xa = vector_aligned(x, 16)
    k = per_token_cast_kernel.get(x.device, in_dtype=_IN_DTYPE[x.dtype], fmt=fmt, hidden=x.shape[1], bk=num_per_channels,
                                  round_sf=round_sf, mode="fake", sf_out="e4m3" if e4m3_sf else "fp32")
    y = scratch(x.device, torch.float8_e4m3fn if fmt == "e4m3" else torch.int32)
    sf = scratch(x.device, torch.float8_e4m3fn if e4m3_sf else torch.float32)  # (unused: no SF is written)
    k(xa, scratch(x.device, torch.uint8), y, sf, 0, 0, 0, 0, clamp_min, 0)
    if xa is not x:
        x.copy_(xa)


# --- public API ----------------------------------------------------------------------------------

_OPS = ("per_token_cast", "per_token_cast_with_sf_only", "per_token_cast_with_precomputed_sf")


def _check_common(op, x, fmt, num_per_channels, x_block_size, col, round_sf, packed, use_e4m3_sf, fmts):
    if fmt not in fmts:
        fail(op, "fmt", f"one of {fmts}", repr(fmt))
    check_positive_int(op, "num_per_channels", num_per_channels)
    quant = isinstance(x, (tuple, list))
    if quant:
        q = check_quant_input(op, x, x_block_size)
        t, h, device = q.t, q.h, q.data.device
        if q.block[1] % V:
            fail(op, "x_block_size", f"(bm, bk) with bk a multiple of {V}", tuple(x_block_size))
    else:
        q = None
        if not isinstance(x, torch.Tensor):
            fail(op, "x", "a torch.Tensor or a QuantTensor (data, sf)", type(x).__name__, TypeError)
        check_dtype(op, "x", x, (torch.float32, torch.bfloat16))
        check_ndim(op, "x", x, 2)
        if x.shape[1] > 1 and x.stride(1) != 1:
            fail(op, "x", "unit-stride in its last dimension", f"strides {tuple(x.stride())}")
        if x_block_size is not None:
            fail(op, "x_block_size", "None for a plain tensor input", repr(x_block_size))
        t, h, device = x.shape[0], x.shape[1], x.device
    if h % V:
        fail(op, "hidden", f"a multiple of {V}", h)
    if num_per_channels != h and num_per_channels not in (16, 32, 64, 128):
        fail(op, "num_per_channels", f"one of (16, 32, 64, 128) or the hidden size {h}", num_per_channels)
    if quant and num_per_channels == h and h > 128:
        fail(op, "num_per_channels", "at most 128 for a QuantTensor input (one scale per row needs a plain input)", num_per_channels)
    layout = sf_out_layout(op, col, packed, round_sf, use_e4m3_sf)
    return q, t, h, device, layout


def per_token_cast(
    x,
    fmt: str,
    num_per_channels: int,
    x_block_size=None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
    use_e4m3_sf: bool = False,
    out: torch.Tensor | None = None,
    stochastic_rounding: bool = False,
    seed: int | None = None,
):
    """Quantizes ``x`` (bf16/fp32 ``(T, H)`` or a QuantTensor) per ``(1, num_per_channels)`` group.

    Returns ``(data, sf)``; see the module docstring for the math, shapes, layouts and errors.
    ``fmt='e5m6'`` needs a plain input (``tk_quant.per_token_cast_e5m6``).
    ``out`` (optional) is a preallocated contiguous data output.
    ``stochastic_rounding`` (e4m3, e2m1): the data rounds to a grid neighbour of ``x * sf_inv`` at random, up in
    magnitude with probability equal to the fractional distance (``tk_core.formats.round_stochastic``; the
    scales are unchanged). The bits come from the element's position and ``seed`` (an int in ``[0, 2**32)``;
    ``None`` draws one per call from torch's default CPU generator, so pass an int under ``torch.compile`` or
    CUDA graphs, and vary it per step): the same seed gives the same bits on every device.
    """
    op = "per_token_cast"
    seed = stochastic_seed(op, fmt, stochastic_rounding, seed)
    if fmt == "e5m6":
        from .per_token_cast_e5m6 import per_token_cast_to_e5m6

        if isinstance(x, (tuple, list)):
            fail(op, "x", "a bf16/fp32 tensor for fmt='e5m6'", "a QuantTensor")
        if x_block_size is not None:
            fail(op, "x_block_size", "None for a plain tensor input", repr(x_block_size))
        check_bool(op, "use_e4m3_sf", use_e4m3_sf)
        if use_e4m3_sf:
            fail(op, "use_e4m3_sf", "False for fmt='e5m6'", True)
        return per_token_cast_to_e5m6(x, num_per_channels, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0, out=out)
    q, t, h, device, layout = _check_common(
        op, x, fmt, num_per_channels, x_block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0,
        use_e4m3_sf, ("e4m3", "e2m1", "e5m6"),
    )
    if device.type != "cuda":
        data, sf = reference.cast(x, fmt, (1, num_per_channels), None, x_block_size, round_sf,
                                  use_tma_aligned_col_major_sf, use_packed_ue8m0, use_e4m3_sf, stochastic_seed=seed)
        return data_from_reference(op, out, data, fmt, t, h, device), sf
    data = data_out(op, out, fmt, t, h, device)
    sf = alloc_sf_out(t, ceil_div(h, num_per_channels), layout, device, e4m3_sf=use_e4m3_sf)
    if t:
        xd, xsf = (q.data, q.sf) if q is not None else (x, None)
        bm, bk = q.block if q is not None else (1, V)
        _per_token_cast_op(xd, xsf, data, sf, fmt, num_per_channels, bm, bk, bool(round_sf), "cast",
                           amax_clamp(fmt, use_e4m3_sf), seed is not None, seed or 0)
    return data, sf


def per_token_cast_and_cast_back(
    x: torch.Tensor, fmt: str, num_per_channels: int, round_sf: bool = False, use_e4m3_sf: bool = False
) -> torch.Tensor:
    """In-place fake quantization (TileKernels 2.1.0's ``per_token_cast_and_cast_back``): every value of bf16/fp32
    ``x (T, H)`` (any row stride, unit inner stride) becomes ``cast_back(per_token_cast(x, fmt, num_per_channels,
    round_sf=round_sf, use_e4m3_sf=use_e4m3_sf))``: its e4m3 / e2m1 value times its group's scale, rounded to
    ``x``'s dtype, in one pass (no quantized tensor is stored). Returns ``x``. Reference:
    ``reference.per_token_cast_and_cast_back``."""
    op = "per_token_cast_and_cast_back"
    if isinstance(x, (tuple, list)):
        fail(op, "x", "a bf16/fp32 tensor (modified in place)", "a QuantTensor", TypeError)
    _, t, h, device, _ = _check_common(op, x, fmt, num_per_channels, None, False, round_sf, False, use_e4m3_sf,
                                       ("e4m3", "e2m1"))
    if device.type != "cuda":
        return x.copy_(reference.per_token_cast_and_cast_back(x, fmt, num_per_channels, round_sf, use_e4m3_sf))
    if t:
        _fake_quant_op(x, fmt, num_per_channels, bool(round_sf), bool(use_e4m3_sf), amax_clamp(fmt, use_e4m3_sf))
    return x


def per_token_cast_with_sf_only(
    x,
    fmt: str,
    num_per_channels: int,
    x_block_size=None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
    use_e4m3_sf: bool = False,
) -> torch.Tensor:
    """Only the SF that ``per_token_cast`` would return (plain input; no data buffer is allocated)."""
    op = "per_token_cast_with_sf_only"
    if isinstance(x, (tuple, list)):
        fail(op, "x", "a bf16/fp32 tensor (QuantTensor input is not supported here)", "a QuantTensor", TypeError)
    q, t, h, device, layout = _check_common(
        op, x, fmt, num_per_channels, x_block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0,
        use_e4m3_sf, ("e4m3", "e2m1"),
    )
    if device.type != "cuda":
        return reference.cast(x, fmt, (1, num_per_channels), None, None, round_sf,
                              use_tma_aligned_col_major_sf, use_packed_ue8m0, use_e4m3_sf)[1]
    sf = alloc_sf_out(t, ceil_div(h, num_per_channels), layout, device, e4m3_sf=use_e4m3_sf)
    if t:
        _per_token_cast_op(x, None, None, sf, fmt, num_per_channels, 1, V, bool(round_sf), "sf_only",
                           amax_clamp(fmt, use_e4m3_sf), False, 0)
    return sf


def per_token_cast_with_precomputed_sf(
    x,
    fmt: str,
    num_per_channels: int,
    sf: torch.Tensor,
    x_block_size=None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
    out: torch.Tensor | None = None,
    stochastic_rounding: bool = False,
    seed: int | None = None,
) -> torch.Tensor:
    """Casts a plain input with a given SF (dequant scales, any layout: fp32 row/col, packed UE8M0, e4m3):
    ``out = convert(x * (1/sf))``. The layout flags are accepted for signature compatibility and checked
    for consistency only; the SF's own dtype and strides define its layout. ``stochastic_rounding`` and
    ``seed`` as in ``per_token_cast``. Returns the data."""
    op = "per_token_cast_with_precomputed_sf"
    seed = stochastic_seed(op, fmt, stochastic_rounding, seed)
    if isinstance(x, (tuple, list)):
        fail(op, "x", "a bf16/fp32 tensor (QuantTensor input is not supported here)", "a QuantTensor", TypeError)
    q, t, h, device, _ = _check_common(
        op, x, fmt, num_per_channels, x_block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0,
        False, ("e4m3", "e2m1"),
    )
    if num_per_channels not in (16, 32, 64, 128):
        fail(op, "num_per_channels", "one of (16, 32, 64, 128) (one scale per row is not supported here)", num_per_channels)
    nk = ceil_div(h, num_per_channels)
    check_dtype(op, "sf", sf, (torch.float32, torch.int32, torch.float8_e4m3fn))
    want = (t, ceil_div(nk, 4)) if sf.dtype == torch.int32 else (t, nk)
    if sf.dim() != 2 or tuple(sf.shape) != want or sf.device != device:
        fail(op, "sf", f"of shape {want} on {device}", f"shape {tuple(sf.shape)} on {sf.device}")
    if device.type != "cuda":
        data = reference.cast(x, fmt, (1, num_per_channels), sf, stochastic_seed=seed)
        return data_from_reference(op, out, data, fmt, t, h, device)
    data = data_out(op, out, fmt, t, h, device)
    if t:
        # The kernel reads dequant scales as row-major fp32; any other layout is decoded first.
        sf = sf_to_row_major(sf, nk)
        _per_token_cast_op(x, sf, data, None, fmt, num_per_channels, 1, num_per_channels, False, "cast_only", 0.0,
                           seed is not None, seed or 0)
    return data
