"""Fused SwiGLU + FP8 (e4m3) quantization: forward with per-token cast, forward with per-channel cast
(optionally transposed), and backward with per-token cast of the input gradient.

SwiGLU convention: a row of ``x`` is ``[g | u]`` (gate in the first ``H`` columns, value in the last ``H``).
All math is float32, evaluated in this order (IEEE division, precise ``expf``, no fast math)::

    clamp (optional, value c > 0):  g <- (g > c ? c : g),   u <- (u > c ? c : (u < -c ? -c : u))
    act = g / (1 + exp(-g)) * u                      # ((g / t) * u) with t = 1 + exp(-g)

Scales follow the sf rule of ``tk_core.formats.compute_scales`` (``A' = max(amax, c_min)``; ``sf = A'/448``,
``sf_inv = 448/A'``, or powers of two with ``round_sf``); ``q = e4m3(v * sf_inv)`` (RNE, saturating).

``swiglu_forward_and_per_token_cast(x (E, 2H), ...) -> (out e4m3 (E, H), sf)``
    Per expanded (MoE fused-layout) row ``p``: ``v = act * w_p`` with ``w_p = topk_weights.flat[
    pos_to_token_topk[p]]`` (0 for padding rows, ``pos_to_token_topk < 0``), or ``topk_weights[p]`` for 1-D
    per-row weights, or no weight. ``v`` is cast per token with ``num_per_channels`` columns per scale
    (32, 64, 128, or ``H`` = one scale per row, row-major SF only); ``sf`` in any layout of
    ``tk_core.layout`` (row-major fp32, TMA-aligned col-major fp32, packed UE8M0). Rows with
    ``pos_to_expert < 0`` are not computed: their data and scales are written as zeros (UE8M0 byte 0).
    ``clamped_count`` (int64, length 3 or 4) is *added to*: ``[0] += #{g > c}``, ``[1] += #{u > c}``,
    ``[2] += #{u < -c}`` (before clamping) and ``[3] += H * #rows`` over the computed rows only; integer
    atomics, so the counts are exact and deterministic. ``sf_clamp_min`` overrides ``c_min``
    (``tk_core.config.get_amax_clamp('e4m3')``). The clamp value and ``c_min`` are runtime arguments.

``swiglu_forward_and_per_channel_cast_and_transpose(x (T, 2H) bf16, ...) -> (out, sf fp32 (T/bm, H))``
    ``a = bf16(act)`` (RNE), then one scale per ``bm = num_per_tokens`` consecutive tokens of a column:
    ``q[t, j] = e4m3(a[t, j] * sf_inv[t // bm, j])``; ``out`` is ``(H, T)`` (transposed) or ``(T, H)``
    with ``without_transpose``. The clamp is applied in float32 to the widened bf16 inputs.

``swiglu_backward_and_per_token_cast((x_fp8 (E, 2H), x_sf (E, 2H/bk)), grad_out (E, H) bf16, weight
(N, K) fp32, pos_to_token_topk (E,), token_topk_to_pos (N, K), num_per_channels, ...)``
    ``-> (out bf16 (E, H), (x_grad_fp8 (E, 2H), sf), x_grad bf16 (E, 2H), weight_grad fp32 (N, K))``.
    With ``w = weight.flat[idx]`` (0 for ``idx = pos_to_token_topk[p] < 0``), ``g, u = x_fp8 * x_sf``:
    ``s = 1 / t``, ``out = bf16(act * w)``, ``gws = (grad * w) * s``,
    ``dg = (gws * u) * fma(g, 1 - s, 1)`` (one rounding, ``__fmaf_rn``), ``du = gws * g``, both 0 where the
    clamp was active, ``x_grad = bf16([dg | du])`` and the per-token cast of the float32 ``[dg | du]``.
    ``weight_grad.flat[idx] = sum_j fl(grad[p, j] * act[p, j])`` in a fixed order (each lane of a warp sums
    its columns sequentially, a xor butterfly over the 32 lanes, then the warps of the row in order; see
    ``reference.wgrad_dot``), so it is deterministic and bit-exact; every other entry of ``weight_grad`` is 0
    (also when ``E == 0``).

Errors: ``TypeError`` for wrong types/dtypes, ``ValueError`` for shapes, sizes, flags and values, naming
the op and argument. ``E == 0`` / ``T == 0`` allocate the outputs and launch nothing (``weight_grad`` is
zeros). CPU tensors run ``tk_quant.reference``.

Kernels: the per-token kernels give each warp 256-column chunks of one row (forward: ``fwd_token_chunks(H)``
consecutive chunks per warp, all loaded before the math, or the whole row with one scale per row; backward:
one CTA per row, ``reference.wgrad_spans(H)`` spans of two chunks per warp); each lane owns 8 consecutive
columns of every chunk (16-byte bf16 loads, 8-byte e4m3 stores); the group amax is a xor-shuffle reduction
over the ``bk/8`` lanes of a group. The divisions take ``tk_core.ptx``'s fast paths (the IEEE results, without
the per-division range check) for every 8-column chunk whose values lie in their range: the forwards and the
backward without a preload pipeline. The per-channel kernel tiles ``bm`` tokens x 64 or 128 columns over 128
(bm = 32) or 256 threads; the column amax is reduced with shuffles
and one shared-memory exchange, after which one thread per column computes its scale once and shares
``sf_inv`` through shared memory; the transposed store goes through a shared-memory tile.
The token count is dynamic (no recompile per batch); ``H``, ``bk``/``bm``, the SF layout, ``round_sf`` and
whether a clamp (and counting) is on are compile-time, and the forward kernels' clamp form: NaN-propagating
min/max on the loaded bf16 pairs when the clamp value is a bf16 value, else on the widened float32 values (see
``NAN_CLAMP_BF16``; the value itself stays a runtime argument).
"""

import math
import struct

import tilelang.language as T
import torch

from tk_core import checks
from tk_core.config import get_amax_clamp
from tk_core.jit import arch_of, blocks_per_sm, kernel
from tk_core.layout import align, ceil_div
from tk_core.library import device_op
from tk_core.ptx import (
    DIV_FAST,
    DIV_SILU_BF16_ARCHS,
    EXP_SILU_BF16,
    EXP_SILU_BF16_LO,
    FAST_DIV_HI,
    FAST_DIV_LO,
    RCP_FAST,
    div_fast,
    div_silu_bf16,
    fast_div_key,
    fast_div_ok,
    one_plus_exp_neg_bf16,
    rcp_fast,
)

from . import _tl
from .common import scratch, sf_out_layout
from .per_block_cast import alloc_sf_storage
from .reference import wgrad_spans

E4M3_MAX = 448.0
# Lane l of a warp owns columns it*SPAN + c*256 + l*8 + i (c < U, i < VEC) of its spans it; the backward's
# weight-grad dot product adds its products in (it, c, i) order, xor-butterflies over the lanes, then adds the
# warps' sums in warp order: ``reference.wgrad_dot`` mirrors exactly this order, so change both together.
VEC = 8  # columns per lane and chunk
U = 2  # chunks per lane and iteration
SPAN = 32 * VEC * U  # columns per warp iteration
_IN_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
GROUPS = (32, 64, 128)
CLAMP_MODES = ("none", "clamp", "count")  # count = clamp + clamp counting
# Every global access below is guarded explicitly (rows < E, tails, index ranges), so TileLang's automatic
# per-element bounds checks, which would also block 16-byte vectorization, are switched off.
_PASS_CONFIGS = {"tl.disable_safe_memory_legalize": True}


def _group_offsets(lanes: int) -> list[int]:
    return [o for o in (1, 2, 4, 8, 16) if o < lanes]


def _swiglu(g, u, clamp_on: bool, c):
    """``(g', u', cg, cu)`` as TIR expressions: the clamped inputs and whether the clamp was active on each
    (None without a clamp). ``u'`` is ``|u| > c ? copysign(c, u) : u``, equal bit for bit to
    ``u > c ? c : (u < -c ? -c : u)`` (c > 0, NaN kept) but one flat select: nvcc compiled the nested form
    to a branch per element (a BSSY/BSYNC region each, which cost the per-channel kernel ~20%)."""
    if not clamp_on:
        return g, u, None, None
    cg, cu = g > c, T.abs(u) > c
    return T.if_then_else(cg, c, g), T.if_then_else(cu, T.copysign(c, u), u), cg, cu


# Clamp implementations (``clamp_impl`` of the forward kernels; ``_swiglu`` is "select"). The clamp as
# NaN-propagating min/max (sm_80+): ``min.NaN(g, c)`` is ``g > c ? c : g`` and ``min.NaN(max.NaN(u, -c), c)`` is
# ``|u| > c ? copysign(c, u) : u`` for every non-NaN input (c > 0; -0 and +-c kept), and NaN stays NaN (the
# canonical one: every NaN reaches the outputs through float arithmetic, which canonicalizes it anyway). "nan":
# on the widened float32 values, one instruction per select instead of a compare and a select (and a LOP3 for the
# sign). "bf16": on the loaded bf16 pairs before widening, 1.5 instructions per element; exact only when ``c`` is
# a bf16 value (then ``min(g, c)`` of a bf16 ``g`` is a bf16 value, and widening commutes with min/max), which
# the launchers check on the host (``clamp_impl_for``); ``c2`` holds ``c``'s bf16 bits in both halves.
NAN_CLAMP_BF16 = r"""
__device__ __forceinline__ void tk_clamp_bf16x2(void* g, void* u, unsigned c2) {
  unsigned* gp = reinterpret_cast<unsigned*>(g);
  unsigned* up = reinterpret_cast<unsigned*>(u);
  unsigned gw = *gp, uw = *up;
  asm("min.NaN.bf16x2 %0, %1, %2;" : "=r"(gw) : "r"(gw), "r"(c2));
  asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(uw) : "r"(uw), "r"(c2 | 0x80008000u));
  asm("min.NaN.bf16x2 %0, %1, %2;" : "=r"(uw) : "r"(uw), "r"(c2));
  *gp = gw;
  *up = uw;
}
"""
CLAMP_IMPLS = ("select", "nan", "bf16")
# bf16 -> float32 of an element of a loaded bf16 pair from the 32-bit word: one shift (low half) or one AND (high
# half); the bf16 conversion operator extracts the 16-bit half first (PRMT + shift for a high half).
BF16_WORDS = r"""
__device__ __forceinline__ float tk_bf16_lo(const void* p) {
  return __uint_as_float(*reinterpret_cast<const unsigned*>(p) << 16);
}
__device__ __forceinline__ float tk_bf16_hi(const void* p) {
  return __uint_as_float(*reinterpret_cast<const unsigned*>(p) & 0xffff0000u);
}
"""
NAN_CLAMP = r"""
__device__ __forceinline__ float tk_min_nan(float a, float b) {
  float d;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}
__device__ __forceinline__ float tk_max_nan(float a, float b) {
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}
"""


def _swiglu_nan(g, u, c):
    """``_swiglu``'s clamped inputs through ``NAN_CLAMP`` (the kernel's prelude must contain it), without the
    predicates."""
    return (
        T.call_extern("float32", "tk_min_nan", g, c),
        T.call_extern("float32", "tk_min_nan", T.call_extern("float32", "tk_max_nan", u, -c), c),
    )


def _widen(buf, c, i, words: bool):
    """``buf[c, i]`` (16-bit) as float32; ``words``: bf16 through ``BF16_WORDS`` (the kernel's prelude must contain
    it), ``i`` the variable of an explicitly unrolled loop (so the choice of half folds)."""
    if not words:
        return T.cast(buf[c, i], "float32")
    odd = T.truncmod(i, 2)
    p = T.address_of(buf[c, i - odd])
    return T.if_then_else(
        odd == 0, T.call_extern("float32", "tk_bf16_lo", p), T.call_extern("float32", "tk_bf16_hi", p)
    )


def _clamp_bf16x2(g_address, u_address, c2):
    """Clamps the bf16 pair at ``g_address`` (gate) and the one at ``u_address`` (value) in place through
    ``NAN_CLAMP_BF16`` (the kernel's prelude must contain it)."""
    return T.evaluate(T.call_extern("handle", "tk_clamp_bf16x2", g_address, u_address, c2))


def _bf16_pair(c):
    """``c``'s bf16 bits (``c`` a bf16 value) in both halves of a uint32."""
    return T.shift_right(T.reinterpret(c, "uint32"), 16) * T.uint32(0x10001)


# The forward kernels' clamp implementation (benchmarks/sweep_swiglu.py compares them); "bf16" falls back to
# "nan" where it would not be exact. Static SASS of the fast path (one thread's 16 / 32 elements; the kernels are
# issue-bound): per-token with counts 764 (select) / 677 ("nan") / 654 ("bf16"); per-channel 1039 / 905 / 859,
# against 883 for the per-channel kernel without a clamp.
CLAMP_IMPL = "bf16"


def clamp_impl_for(x_dtype: torch.dtype, clamp_value: float | None) -> str:
    """``CLAMP_IMPL``, with "bf16" only for bf16 rows and a clamp value that is a bf16 value (0.5, 7.0, ...)."""
    if CLAMP_IMPL == "bf16":
        exact = clamp_value is not None and float(torch.tensor(clamp_value).bfloat16()) == clamp_value
        return "bf16" if exact and x_dtype == torch.bfloat16 else "nan"
    return CLAMP_IMPL


def _pow2(k):
    """``_tl.pow2(k)`` bit for bit, branch-free (nvcc turned the nested selects into branches): ``2**a * 2**b``
    with ``a`` and ``b = k - a`` clamped to the normal exponents rounds like ``2**k`` itself (exact down to
    ``2**-149``, 0 from ``2**-150`` on by ties-to-even, inf from ``2**128`` on)."""
    a = T.max(T.min(k, 127), -126)
    b = T.max(T.min(k - a, 127), -126)
    return T.reinterpret(T.shift_left(a + 127, 23), "float32") * T.reinterpret(T.shift_left(b + 127, 23), "float32")


def _scale_rule(amax, clamp_min, fmt_max: float, round_sf: bool):
    """``_tl.scale_rule`` with the branch-free ``_pow2``."""
    if not round_sf:
        return _tl.scale_rule(amax, clamp_min, fmt_max, round_sf)
    return _pow2_scales(T.max(amax, clamp_min), fmt_max)


def _pow2_scales(a, fmt_max: float):
    """``(sf, sf_inv)`` of the rounded scale rule for the floored amax ``a``: ``sf = 2**k``, ``k`` the exponent of
    ``RN(a / fmt_max)`` rounded up."""
    s0 = a / T.float32(fmt_max)
    k = T.shift_right(T.reinterpret(s0, "int32") - 1, 23) - 126
    return _pow2(k), _pow2(-k)


def pow2_scale_constants(fmt_max: float) -> tuple[int, int, int]:
    """``(p, round_up, lo_bits)`` of ``_pow2_scales_from_bits`` for ``fmt_max = F * 2**p`` (``F`` in [1, 2),
    ``p >= 2``): ``k = ((bits(a) + round_up) >> 23) - 127 - p`` for ``bits(a)`` in [``lo_bits``, ``0x7F800000``)."""
    def f32_bits(v: float) -> int:
        return struct.unpack("<I", struct.pack("<f", v))[0]

    fmt_bits = f32_bits(fmt_max)
    p = (fmt_bits >> 23) - 127
    if p < 2:  # then k could reach 127 and 2**-k leave the normal range
        raise ValueError(f"pow2_scale_constants: fmt_max must be at least 4, got {fmt_max}")
    return p, 0x7FFFFF - (fmt_bits & 0x7FFFFF), f32_bits(fmt_max * 2.0**-125)


def _pow2_scales_from_bits(a, fmt_max: float):
    """``(in_range, sf, sf_inv)``: ``_pow2_scales(a, fmt_max)`` from the bits of ``a`` alone, without the division,
    for ``a`` in [``fmt_max * 2**-125``, inf) (``in_range``; other ``a`` need ``_pow2_scales``). With
    ``fmt_max = F * 2**p`` and ``a = M * 2**e`` (``F``, ``M`` in [1, 2)): ``RN(a / fmt_max) <= 2**j`` exactly when
    ``a <= fmt_max * 2**j`` (the midpoint above ``2**j`` rounds down to it, and ``fmt_max * 2**j * (1 + 2**-24)`` lies
    below the next float after ``fmt_max * 2**j``), so ``k = e - p + (M > F)``: the exponent field of ``a``, plus
    one when its significand field exceeds ``F``'s (``pow2_scale_constants``). In range ``RN(a / fmt_max)`` is
    normal and finite and ``k`` lies in [-125, 126], so ``2**k`` and ``2**-k`` are bare exponent fields. Checked
    against the division for every float32 ``a`` in range at 448 (PERF-NOTES, session 42) and on every exponent in
    ``tests/test_swiglu.py``."""
    p, round_up, lo = pow2_scale_constants(fmt_max)
    bits = T.reinterpret(a, "uint32")
    t = T.reinterpret(T.shift_right(bits + T.uint32(round_up), 23), "int32")
    return (
        bits - T.uint32(lo) < T.uint32(0x7F800000 - lo),
        T.reinterpret(T.shift_left(t - p, 23), "float32"),
        T.reinterpret(T.shift_left(254 + p - t, 23), "float32"),
    )


def _sf_value(layout: str, s):
    """The stored form of scale ``s``: the UE8M0 byte for packed, else the float."""
    return _tl.ue8m0_byte(s) if layout == "packed" else s


# --- forward + per-token cast ---------------------------------------------------------------------

# Clamp counting on bf16 pairs (the loaded words, before widening): per pair, ``set.gt`` gives 1.0 or 0.0 in each
# half and ``add`` accumulates (counts <= 256 per half are exact in bf16): ~3 instructions per element for the three
# counts, against ~7 for predicate selects and integer adds. For bf16 ``x`` and ``c > 0``, ``x > c`` equals
# ``x > c'`` with ``c'`` = ``c`` truncated to bf16 (no bf16 lies in ``(c', c]``); NaN compares false in both.
# ``acc`` holds ``#{g > c}``, ``#{u > c}``, ``#{|u| > c}`` (``#{u < -c}`` is the difference of the last two);
# ``tk_clamp_count2_lt`` counts ``#{u < -c}`` itself (``set.lt`` against ``-c'``, the same argument mirrored), one
# instruction per pair fewer.
_CLAMP_COUNT = r"""
__device__ __forceinline__ unsigned tk_count_gt_bf16x2(unsigned acc, unsigned x, unsigned c) {
  unsigned m;
  asm("set.gt.bf16x2.bf16x2 %0, %1, %2;" : "=r"(m) : "r"(x), "r"(c));
  asm("add.rn.bf16x2 %0, %1, %2;" : "=r"(acc) : "r"(acc), "r"(m));
  return acc;
}
__device__ __forceinline__ void tk_clamp_count2(unsigned* acc, const void* g, const void* u, unsigned c2) {
  const unsigned gw = *reinterpret_cast<const unsigned*>(g), uw = *reinterpret_cast<const unsigned*>(u);
  acc[0] = tk_count_gt_bf16x2(acc[0], gw, c2);
  acc[1] = tk_count_gt_bf16x2(acc[1], uw, c2);
  acc[2] = tk_count_gt_bf16x2(acc[2], uw & 0x7fff7fffu, c2);
}
__device__ __forceinline__ void tk_clamp_count2_lt(unsigned* acc, const void* g, const void* u, unsigned c2) {
  const unsigned gw = *reinterpret_cast<const unsigned*>(g), uw = *reinterpret_cast<const unsigned*>(u);
  unsigned m;
  acc[0] = tk_count_gt_bf16x2(acc[0], gw, c2);
  acc[1] = tk_count_gt_bf16x2(acc[1], uw, c2);
  asm("set.lt.bf16x2.bf16x2 %0, %1, %2;" : "=r"(m) : "r"(uw), "r"(c2 ^ 0x80008000u));
  asm("add.rn.bf16x2 %0, %1, %2;" : "=r"(acc[2]) : "r"(acc[2]), "r"(m));
}
"""
# The same three counts from integer masks (``set.u32.bf16x2``: 0xFFFF in each true half) subtracted from 32-bit
# words, which ptxas adds two per IADD3: a word holds n_lo + 2**16 (n_hi - n_lo) for the counts n_lo / n_hi of its
# low / high halves.
_CLAMP_COUNT_INT = r"""
__device__ __forceinline__ void tk_clamp_count2_int(unsigned* acc, const void* g, const void* u, unsigned c2) {
  const unsigned gw = *reinterpret_cast<const unsigned*>(g), uw = *reinterpret_cast<const unsigned*>(u);
  unsigned mg, mu, ml;
  asm("set.gt.u32.bf16x2 %0, %1, %2;" : "=r"(mg) : "r"(gw), "r"(c2));
  asm("set.gt.u32.bf16x2 %0, %1, %2;" : "=r"(mu) : "r"(uw), "r"(c2));
  asm("set.lt.u32.bf16x2 %0, %1, %2;" : "=r"(ml) : "r"(uw), "r"(c2 ^ 0x80008000u));
  acc[0] -= mg;
  acc[1] -= mu;
  acc[2] -= ml;
}
"""


# The fast division's gate on a chunk of 8 bf16 gates (4 loaded words) where g is a bf16 value: every |g| in
# [lo, hi] (the bounds as bf16 pairs ``lo2``, ``hi2``; NaN fails). The absolute values' maximum and minimum by
# max.NaN / min.NaN on the pairs (ptxas merges two into one 3-input VHMNMX), then one compare per bound: ~12
# instructions per chunk against ~18 for the float32 keys (``fast_div_key`` per element).
_GATE_RANGE_BF16 = r"""
__device__ __forceinline__ unsigned tk_bf16x8_in_range(const void* g, unsigned lo2, unsigned hi2) {
  const unsigned* w = reinterpret_cast<const unsigned*>(g);
  unsigned mx = w[0] & 0x7fff7fffu, mn = mx, le, ge;
#pragma unroll
  for (int i = 1; i < 4; ++i) {
    const unsigned a = w[i] & 0x7fff7fffu;
    asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(mx) : "r"(mx), "r"(a));
    asm("min.NaN.bf16x2 %0, %1, %2;" : "=r"(mn) : "r"(mn), "r"(a));
  }
  asm("set.le.u32.bf16x2 %0, %1, %2;" : "=r"(le) : "r"(mx), "r"(hi2));
  asm("set.ge.u32.bf16x2 %0, %1, %2;" : "=r"(ge) : "r"(mn), "r"(lo2));
  return (le & ge) == 0xffffffffu;
}
"""


def _act(g, u, w, weighted: bool, fast: bool, short: bool = False, short_exp: bool = False):
    """``g / (1 + exp(-g)) * u`` (times ``w`` if ``weighted``), with the division of ``tk_div_fast`` if ``fast``
    (``tk_div_silu_bf16`` if also ``short``, and ``1 + exp(-g)`` by ``tk_one_plus_exp_neg_bf16`` if also
    ``short_exp``: bf16 ``g`` only)."""
    t = one_plus_exp_neg_bf16(g) if fast and short_exp else T.float32(1) + T.exp(-g)
    q = (div_silu_bf16(g, t) if short else div_fast(g, t)) if fast else g / t
    a = q * u
    return a * w if weighted else a


def fwd_token_chunks(hidden: int, in_dtype: str = "bfloat16") -> int:
    """256-column chunks per warp of the forward per-token kernel: 2 when they tile ``H`` exactly, else 1.
    Measured on the H200 anchor (H = 3584): 2 chunks at 10 CTAs per SM (48 registers) beat 7 chunks at 5 CTAs
    (94 registers) by 6-18 %: more warps hide the latency of each warp's load-math-store chain better than
    fewer warps with more elements each amortise their setup. The launcher also pairs the scale rules of the 2
    chunks (``pair_scales``, another 4-5 %)."""
    if hidden % 256:
        return U
    return 2 if (hidden // 256) % 2 == 0 else 1


def fwd_token_min_blocks(in_dtype: str, clamp_mode: str, weighted: bool) -> int:
    """CTAs per SM the forward per-token kernel's registers are capped for: 10 (48 registers) for bf16 rows, the
    unweighted clamp-count kernel included since it takes the lean parameters (48 registers without a spill, +2.1 %
    on the H100 over 9: PERF-NOTES session 42); 9 (56) for the weighted count kernel, which spills 8 bytes at 48 on
    sm_90a (the count kernel before the lean parameters spilled 12 there, and 9 measured 0.8-1.6 % faster than 10:
    session 37); float32 rows hold twice the loaded registers and keep ptxas's own choice."""
    if in_dtype != "bfloat16":
        return 1
    return 9 if clamp_mode == "count" and weighted else 10


@kernel(pass_configs=_PASS_CONFIGS)
def swiglu_fwd_token_kernel(
    in_dtype: str,
    hidden: int,
    group: int,
    layout: str,
    round_sf: bool,
    clamp_mode: str,
    warps: int = 4,
    chunks: int = U,
    pair_scales: bool = False,
    fast_div: bool = True,
    weighted: bool = True,
    min_blocks: int = 1,
    pack_counts: bool = True,
    clamp_impl: str = "nan",
    widen_words: bool = True,
    short_div: bool = False,
    short_exp: bool = False,
    load_order: str = "row",
    int_counts: bool = False,
    int_scale: bool = False,
    sf_index32: bool = False,
    redux_counts: bool = False,
    bf16_keys: bool = False,
):
    """One warp per (row, ``chunks`` x 256-column span) when the groups fit in a chunk (no per-row wave tail,
    all loads independent and issued before the math); one warp per row, two passes, ``U`` chunks per span,
    with one scale per row (``group == H``). Each chunk is finished (amax, scale, store) right after its math,
    so only the loaded inputs of the later chunks stay live. ``pair_scales``: chunks ``2p`` and ``2p+1`` are
    finished together and their scale rules (~35 instructions, an IEEE division among them) run once: the lanes
    with bit ``b = lanes_per_group / 2`` set evaluate chunk ``2p+1``'s, the others chunk ``2p``'s, and one xor
    shuffle by ``b`` (within the group) hands each lane the other one. ``fast_div``: ``tk_div_fast`` for the chunks
    whose gates allow it (see ``tk_core.ptx.DIV_FAST``). ``weighted=False`` (no weights, ``wmode == 0``) drops the
    multiplication by 1. ``min_blocks``: CTAs per SM the registers must allow. Clamp counts: ``_CLAMP_COUNT`` for bf16
    inputs (one span per warp), else predicate adds; ``#{u < -c}`` is ``#{|u| > c} - #{u > c}`` either way.
    ``pack_counts``: the three counts and the row flag of a lane go into one int32 (10-bit fields: a warp counts at
    most 32 * 16 elements of its span), so the warp reduction is one xor-shuffle chain instead of four, and the bf16
    counting takes ``#{u < -c}`` directly (``tk_clamp_count2_lt``); ``int_counts`` (with it) takes the three
    counts as integer masks, two per add (``_CLAMP_COUNT_INT``). ``int_scale`` (``round_sf``): the scale rule from
    the amax's bits (``_pow2_scales_from_bits``), the division only out of its range; ``sf_index32``: the scale's
    offset of the paired chunks in int32 (the launcher: where the scale storage has fewer than 2**31 elements);
    ``redux_counts`` (with ``pack_counts``): the warp's packed counts summed by one ``redux.sync``; ``bf16_keys``
    (where g is a bf16 value): the fast division's gate on the loaded pairs (``_GATE_RANGE_BF16``). The launcher
    takes all five (~613 -> ~543 instructions per warp of the count kernel on the path taken; H100: the count lines
    +2.1 % with 10 CTAs per SM, the others +0.3 %; PERF-NOTES session 42).
    ``clamp_impl``: see ``NAN_CLAMP_BF16`` ("nan" and "bf16" only where no clamp predicate is needed: the bf16
    counting reads the raw words before the clamp).
    ``widen_words``: bf16 inputs widened through ``BF16_WORDS``. ``short_div``: where g is a bf16 value (bf16 inputs
    without a clamp or with the "bf16" clamp), the fast chunks divide by ``tk_div_silu_bf16`` (launchers: on
    ``tk_core.ptx.DIV_SILU_BF16_ARCHS``); ``short_exp``: and take ``1 + exp(-g)`` from ``tk_one_plus_exp_neg_bf16``
    (one instruction per element fewer; chunks with some |g| below 2**-16 then take the IEEE path).
    ``load_order`` (one span per warp; row-mode warps always load in the row's branch): where a warp issues its
    span's loads. "row": in the row's branch, after the row's ``pos_to_expert`` test; "early": before that test,
    so that a warp does not wait for two memory latencies in series (a padding row's loads are wasted: < 1 % of
    the rows at 16-row alignment); "early_if_pe": before the test when ``has_pe``, in the row's branch otherwise
    (two load sites: the same loads, scheduled differently by nvcc). The launcher: "row" without
    ``pos_to_expert`` (the early loads measured 3 % slower there), with it "early" for the clamp-count kernel and
    "early_if_pe" otherwise (+0.7 % over "early"; "early" +1 % and +3.3 % with counts over "row"; PERF-NOTES,
    session 16)."""
    H = hidden
    E = T.dynamic("num_rows")
    n_pe = T.dynamic("n_pe")
    n_idx = T.dynamic("n_idx")
    n_w = T.dynamic("n_w")
    n_cnt = T.dynamic("n_cnt")
    sf_len = T.dynamic("sf_len")
    row_mode = group > 128
    UC = U if row_mode else chunks
    span = 32 * VEC * UC
    nk = H // group
    iters = ceil_div(H, span)
    tail = H % span != 0
    offsets = _group_offsets(32 if row_mode else group // VEC)
    sf_dtype = "uint8" if layout == "packed" else "float32"
    nk_pad = align(nk, 4) - nk if layout == "packed" else 0
    clamp_on = clamp_mode != "none"
    count = clamp_mode == "count"
    split = not row_mode
    wpr = iters if split else 1  # warps per row
    pair = pair_scales and split
    b = group // VEC // 2  # partner-lane bit within a group
    packed_cnt = count and split and in_dtype == "bfloat16"  # at most 64 elements per lane: bf16-exact counts
    lt_cnt = packed_cnt and pack_counts
    int_cnt = lt_cnt and int_counts
    count_fn = "tk_clamp_count2_int" if int_cnt else ("tk_clamp_count2_lt" if lt_cnt else "tk_clamp_count2")
    pack = pack_counts and count and split and 32 * UC * VEC < 1024
    free = clamp_on and (packed_cnt or not count)  # no clamp predicate needed
    use_nan = free and clamp_impl == "nan"
    use_b16 = free and clamp_impl == "bf16" and in_dtype == "bfloat16"
    words = widen_words and in_dtype == "bfloat16"
    short = short_div and fast_div and in_dtype == "bfloat16" and (not clamp_on or use_b16)  # g is a bf16 value
    sexp = short and short_exp
    key_lo = EXP_SILU_BF16_LO if sexp else FAST_DIV_LO
    bkeys = bf16_keys and short
    gate_lo2, gate_hi2 = ((key_lo >> 16) * 0x10001, (FAST_DIV_HI >> 16) * 0x10001)  # the bounds as bf16 pairs
    prelude = (
        (DIV_FAST if fast_div else "")
        + (EXP_SILU_BF16 if sexp else "")
        + ((_CLAMP_COUNT_INT if int_cnt else _CLAMP_COUNT) if packed_cnt else "")
        + (NAN_CLAMP if use_nan else "")
        + (NAN_CLAMP_BF16 if use_b16 else "")
        + (BF16_WORDS if words else "")
        + (_GATE_RANGE_BF16 if bkeys else "")
    ) or None

    def in_range(col):
        return col < H if tail else True

    def row_of(gw):
        return T.truncdiv(gw, wpr) if split else gw

    def span_of(gw):
        return T.truncmod(gw, wpr) if split else 0

    assert load_order in ("row", "early", "early_if_pe"), load_order
    early = load_order != "row" and split  # the span's loads may go before the pos_to_expert test

    iscale = int_scale and round_sf

    @T.macro
    def scale_rule_into(dst, amax, clamp_min):
        """``dst[0], dst[1] = _scale_rule(amax, ...)``; with ``int_scale`` from the floored amax's bits where they
        suffice (``_pow2_scales_from_bits``), the division otherwise."""
        if iscale:
            a = T.max(amax, clamp_min)
            in_range, s_bits, si_bits = _pow2_scales_from_bits(a, E4M3_MAX)
            if in_range:
                dst[0] = s_bits
                dst[1] = si_bits
            else:
                s, si = _pow2_scales(a, E4M3_MAX)
                dst[0] = s
                dst[1] = si
        else:
            s, si = _scale_rule(amax, clamp_min, E4M3_MAX, round_sf)
            dst[0] = s
            dst[1] = si

    @T.macro
    def load_span(x, xg, xu, row, it, lane):
        """The gate and up halves of span ``it`` of ``row`` (zeros past ``H``)."""
        for c in T.unroll(UC):
            col = it * span + c * (32 * VEC) + lane * VEC
            if in_range(col):
                for i in T.vectorized(VEC):
                    xg[c, i] = x[row, col + i]
                for i in T.vectorized(VEC):
                    xu[c, i] = x[row, H + col + i]
            else:
                for i in T.vectorized(VEC):
                    xg[c, i] = T.cast(0, in_dtype)
                for i in T.vectorized(VEC):
                    xu[c, i] = T.cast(0, in_dtype)

    @T.prim_func
    def main(
        x: T.Tensor((E, 2 * H), in_dtype),
        pos_to_expert: T.Tensor((n_pe,), "int32"),
        pos_to_token_topk: T.Tensor((n_idx,), "int32"),
        weights: T.Tensor((n_w,), "float32"),
        out: T.Tensor((E, H), "float8_e4m3fn"),
        sf: T.Tensor((sf_len,), sf_dtype),
        counts: T.Tensor((n_cnt,), "int64"),
        clamp: T.float32,
        clamp_min: T.float32,
        has_pe: T.int32,
        wmode: T.int32,
    ):
        with T.Kernel(T.ceildiv(E * wpr, warps), threads=warps * 32, prelude=prelude) as bx:
            if min_blocks > 1:
                T.annotate_min_blocks_per_sm(min_blocks)
            tx = T.get_thread_binding()
            lane = tx % 32
            gw0 = bx * warps + tx // 32
            # int32 (row, first span) of the warp: buffer indices are widened to int64, which made the division a
            # 64-bit one in every index
            ri = T.alloc_local((2,), "int32")
            xg = T.alloc_local((UC, VEC), in_dtype)
            xu = T.alloc_local((UC, VEC), in_dtype)
            v = T.alloc_local((UC, VEC), "float32")
            am = T.alloc_local((UC,), "float32")
            rm = T.alloc_local((1,), "float32")
            wv = T.alloc_local((1,), "float32")
            st = T.alloc_local((1,), "int32")
            cnt = T.alloc_local((4,), "int32")
            red = T.alloc_shared((warps, 4), "int32")
            sp = T.alloc_local((3,), "float32")  # sf, sf_inv; pair: then the partner's sf_inv
            sq = T.alloc_local((2,), "float32")  # pair: the two chunks' sf_inv
            so = T.alloc_local((1,), "int32")  # sf_index32: the scale's offset
            gs = T.alloc_local((VEC,), "float32")  # fast_div: the chunk's clamped g and u
            us = T.alloc_local((VEC,), "float32")
            dm = T.alloc_local((1,), "uint32")
            cb = T.alloc_local((3,), "uint32")  # packed_cnt: bf16x2 counts
            c2 = T.alloc_local((1,), "uint32")
            for i in T.unroll(4):
                cnt[i] = 0
            ri[0] = row_of(gw0)
            ri[1] = span_of(gw0)
            row = ri[0]
            it0 = ri[1]  # this warp's first span: it0 + j, j < spans
            st[0] = 0
            if row < E:
                if early:
                    if load_order == "early" or has_pe != 0:
                        load_span(x, xg, xu, row, it0, lane)
                st[0] = 1
                if has_pe != 0:
                    if pos_to_expert[row] < 0:
                        st[0] = 2
            if st[0] == 1:
                wv[0] = T.float32(1)
                if wmode == 1:
                    idx = pos_to_token_topk[row]
                    if idx >= 0 and idx < n_w:
                        wv[0] = weights[idx]
                    else:
                        wv[0] = T.float32(0)
                elif wmode == 2:
                    wv[0] = weights[row]
                cnt[3] = T.if_then_else(lane + it0 == 0, 1, 0)  # the row's first warp, lane 0
                if packed_cnt:
                    c2[0] = T.shift_right(T.reinterpret(clamp, "uint32"), 16) * T.uint32(0x10001)
                    for k in T.unroll(3):
                        cb[k] = T.uint32(0)
                rm[0] = T.float32(0)
                for ph in T.serial(2 if row_mode else 1):
                    for j in T.serial(iters // wpr):
                        it = it0 + j
                        if not early:
                            load_span(x, xg, xu, row, it, lane)
                        elif load_order == "early_if_pe":
                            if has_pe == 0:
                                load_span(x, xg, xu, row, it, lane)
                        if packed_cnt:
                            for c in T.unroll(UC):
                                for k in T.unroll(VEC // 2):
                                    T.evaluate(
                                        T.call_extern(
                                            "handle",
                                            count_fn,
                                            T.address_of(cb[0]),
                                            T.address_of(xg[c, 2 * k]),
                                            T.address_of(xu[c, 2 * k]),
                                            c2[0],
                                        )
                                    )
                        if use_b16:
                            for c in T.unroll(UC):
                                for k in T.unroll(VEC // 2):
                                    _clamp_bf16x2(
                                        T.address_of(xg[c, 2 * k]), T.address_of(xu[c, 2 * k]), _bf16_pair(clamp)
                                    )
                        for c in T.unroll(UC, explicit=True):  # the pairing below needs constant c
                            col = it * span + c * (32 * VEC) + lane * VEC
                            am[c] = T.float32(0)
                            dm[0] = T.uint32(0)
                            if bkeys:
                                dm[0] = T.call_extern(
                                    "uint32", "tk_bf16x8_in_range", T.address_of(xg[c, 0]), T.uint32(gate_lo2),
                                    T.uint32(gate_hi2)
                                )
                            for i in T.unroll(VEC, explicit=words):
                                g0 = _widen(xg, c, i, words)
                                u0 = _widen(xu, c, i, words)
                                if use_nan:
                                    g1, u1 = _swiglu_nan(g0, u0, clamp)
                                elif use_b16:
                                    g1, u1 = g0, u0
                                else:
                                    g1, u1, cg, cu = _swiglu(g0, u0, clamp_on, clamp)
                                if count and not packed_cnt:
                                    if ph == 0:
                                        cnt[0] += T.if_then_else(cg, 1, 0)
                                        cnt[1] += T.if_then_else(u0 > clamp, 1, 0)
                                        cnt[2] += T.if_then_else(cu, 1, 0)
                                if fast_div:
                                    gs[i] = g1
                                    us[i] = u1
                                    if not bkeys:
                                        dm[0] = T.max(dm[0], fast_div_key(g1, key_lo))
                                else:
                                    v[c, i] = _act(g1, u1, wv[0], weighted, False)
                            if fast_div:
                                if (dm[0] != T.uint32(0)) if bkeys else fast_div_ok(dm[0], key_lo):
                                    for i in T.unroll(VEC):
                                        v[c, i] = _act(gs[i], us[i], wv[0], weighted, True, short, sexp)
                                else:
                                    for i in T.unroll(VEC):
                                        v[c, i] = _act(gs[i], us[i], wv[0], weighted, False)
                            for i in T.unroll(VEC):
                                am[c] = T.max(am[c], T.abs(v[c, i]))
                            if row_mode:
                                rm[0] = T.max(rm[0], am[c])
                            else:
                                for off in offsets:
                                    am[c] = T.max(am[c], T.shfl_xor(am[c], off))
                                if pair and c % 2 == 1:
                                    hi = T.bitwise_and(lane, b) != 0
                                    scale_rule_into(sp, T.if_then_else(hi, am[c], am[c - 1]), clamp_min)
                                    sp[2] = T.shfl_xor(sp[1], b)
                                    sq[0] = T.if_then_else(hi, sp[2], sp[1])  # chunk c-1's sf_inv
                                    sq[1] = T.if_then_else(hi, sp[1], sp[2])  # chunk c's
                                    for k in T.unroll(2, explicit=True):
                                        col_c = it * span + (c - 1 + k) * (32 * VEC) + lane * VEC
                                        if in_range(col_c):
                                            for i in T.vectorized(VEC):
                                                out[row, col_c + i] = T.cast(v[c - 1 + k, i] * sq[k], "float8_e4m3fn")
                                    # the group's first lane stores chunk c-1's scale, its lane b chunk c's
                                    col_s = it * span + (c - 1) * (32 * VEC) + (lane - T.bitwise_and(lane, b)) * VEC
                                    col_s = T.if_then_else(hi, col_s + 32 * VEC, col_s)
                                    if T.truncmod(lane, b) == 0 and in_range(col_s):
                                        if sf_index32:
                                            so[0] = _tl.sf_offset(layout, row, col_s // group, E, nk)
                                            sf[so[0]] = _sf_value(layout, sp[0])
                                        else:
                                            sf[_tl.sf_offset(layout, row, col_s // group, E, nk)] = _sf_value(
                                                layout, sp[0]
                                            )
                                elif not pair or c == UC - 1:
                                    scale_rule_into(sp, am[c], clamp_min)
                                    s, si = sp[0], sp[1]
                                    if in_range(col):
                                        for i in T.vectorized(VEC):
                                            out[row, col + i] = T.cast(v[c, i] * si, "float8_e4m3fn")
                                        if col % group == 0:
                                            sf[_tl.sf_offset(layout, row, col // group, E, nk)] = _sf_value(layout, s)
                        if row_mode:
                            if ph == 1:
                                scale_rule_into(sp, rm[0], clamp_min)
                                s, si = sp[0], sp[1]
                                for c in T.unroll(UC):
                                    col = it * span + c * (32 * VEC) + lane * VEC
                                    if in_range(col):
                                        for i in T.vectorized(VEC):
                                            out[row, col + i] = T.cast(v[c, i] * si, "float8_e4m3fn")
                    if row_mode:
                        if ph == 0:
                            for off in offsets:
                                rm[0] = T.max(rm[0], T.shfl_xor(rm[0], off))
                            if lane == 0:
                                scale_rule_into(sp, rm[0], clamp_min)
                                sf[_tl.sf_offset(layout, row, 0, E, nk)] = _sf_value(layout, sp[0])
            if st[0] == 2:
                for j in T.serial(iters // wpr):
                    it = it0 + j
                    for c in T.unroll(UC):
                        col = it * span + c * (32 * VEC) + lane * VEC
                        if in_range(col):
                            for i in T.vectorized(VEC):
                                out[row, col + i] = T.cast(T.float32(0), "float8_e4m3fn")
                            if col % group == 0:
                                sf[_tl.sf_offset(layout, row, col // group, E, nk)] = _sf_value(layout, T.float32(0))
            if nk_pad > 0:
                if st[0] != 0:
                    if lane + it0 == 0:
                        for z in T.unroll(nk_pad):
                            sf[_tl.sf_offset(layout, row, nk + z, E, nk)] = T.uint8(0)
            if count:
                if packed_cnt:
                    if st[0] == 1:
                        for k in T.unroll(3):
                            if int_cnt:
                                # cb = n_lo + 2**16 (n_hi - n_lo) for the counts of the low / high halves (< 2**15)
                                lo = T.cast(T.bitwise_and(cb[k], T.uint32(0xFFFF)), "int32")
                                cnt[k] = 2 * lo + T.shift_right(T.reinterpret(cb[k], "int32") - lo, 16)
                            else:  # bf16 1.0 = 0x3F80; the sum of both halves (exact small integers)
                                cnt[k] = T.cast(
                                    T.reinterpret(T.shift_left(cb[k], 16), "float32")
                                    + T.reinterpret(T.bitwise_and(cb[k], T.uint32(0xFFFF0000)), "float32"),
                                    "int32",
                                )
                if not lt_cnt:
                    cnt[2] = cnt[2] - cnt[1]  # #{|u| > c} - #{u > c} = #{u < -c}
                if pack:
                    cnt[0] = cnt[0] + T.shift_left(cnt[1], 10) + T.shift_left(cnt[2], 20) + T.shift_left(cnt[3], 30)
                    if redux_counts:  # one redux.sync instead of five shuffles and adds
                        cnt[0] = T.call_extern("int32", "__reduce_add_sync", T.uint32(0xFFFFFFFF), cnt[0])
                    else:
                        for off in (16, 8, 4, 2, 1):
                            cnt[0] += T.shfl_xor(cnt[0], off)
                    if lane == 0:
                        red[tx // 32, 0] = cnt[0]
                else:
                    for k in T.unroll(4):
                        for off in (16, 8, 4, 2, 1):
                            cnt[k] += T.shfl_xor(cnt[k], off)
                    if lane == 0:
                        for k in T.unroll(4):
                            red[tx // 32, k] = cnt[k]
                T.sync_threads()
                if tx < 4:
                    tot = T.alloc_local((1,), "int64")
                    tot[0] = T.int64(0)
                    for w in T.unroll(warps):
                        if pack:
                            tot[0] += T.cast(T.bitwise_and(T.shift_right(red[w, 0], tx * 10), 1023), "int64")
                        else:
                            tot[0] += T.cast(red[w, tx], "int64")
                    if tx == 3:
                        tot[0] = tot[0] * T.int64(H)
                    if tx < n_cnt:
                        T.atomic_add(counts[tx], tot[0])

    return main


# --- backward + per-token cast --------------------------------------------------------------------


@kernel(pass_configs=_PASS_CONFIGS)
def swiglu_bwd_token_kernel(
    hidden: int,
    group: int,
    layout: str,
    round_sf: bool,
    clamp_on: bool,
    spans: int = 0,
    min_blocks: int = 1,
    preload: bool = True,
):
    """One CTA per row, one warp per ``spans`` consecutive 512-column spans (0: ``reference.wgrad_spans``;
    short-lived CTAs: no per-row wave tail); the warps' weight-grad sums are added in warp order through shared
    memory (``reference.wgrad_dot`` with the same ``spans``). ``min_blocks`` is lowered where the CTA's threads
    would leave fewer than ``BWD_REGISTERS`` registers each (rows wider than 7,168 columns at 4 CTAs per SM: at 8,192
    the 64-register cap of 4 CTAs spilled 56 bytes)."""
    H = hidden
    E = T.dynamic("num_rows")
    n_w = T.dynamic("n_w")
    sf_len = T.dynamic("sf_len")
    nk = 2 * H // group
    iters = ceil_div(H, SPAN)
    spans = spans or wgrad_spans(H)
    warps = ceil_div(iters, spans)
    min_blocks = min(min_blocks, blocks_per_sm(warps * 32, BWD_REGISTERS))
    ragged = H != warps * spans * SPAN
    # preload: a software pipeline over the warp's spans (double-buffered registers, unrolled) that issues span
    # j+1's loads before span j's math; nvcc does not hoist them over the stores by itself. Same math and order.
    lag = 1 if preload and spans > 1 else 0
    NB = 2 * U if lag else U
    span_loop = T.unroll if lag else T.serial

    def slot(j, c):
        return (j % 2) * U + c if lag else c

    offsets = _group_offsets(group // VEC)
    sf_dtype = "uint8" if layout == "packed" else "float32"
    nk_pad = align(nk, 4) - nk if layout == "packed" else 0

    def in_range(col):
        return col < H if ragged else True

    @T.macro
    def chunk_grads(qg, qu, gr, sfg, sfu, gk, tv, ov, dg, du, amg, amu, acc, wv, clamp, c, k, fast: bool):
        """Chunk c of span k: the SwiGLU, its gradients, the outputs and the chunk's amaxes. Without the pipeline
        (``lag`` 0) g before the clamp is in ``gk``, else it is widened here. ``fast``: the divisions go through
        ``rcp_fast`` / ``div_fast`` (the caller checked the range), else they are IEEE's."""
        for i in T.unroll(VEC):
            g0 = T.cast(qg[slot(k - lag, c), i], "float32") * sfg[slot(k - lag, c)] if lag else gk[i]
            u0 = T.cast(qu[slot(k - lag, c), i], "float32") * sfu[slot(k - lag, c)]
            g1, u1, cg, cu = _swiglu(g0, u0, clamp_on, clamp)
            tv[0] = g1
            tv[1] = u1
            tv[2] = T.float32(1) + T.exp(-tv[0])
            tv[3] = rcp_fast(tv[2]) if fast else T.float32(1) / tv[2]
            tv[4] = (div_fast(tv[0], tv[2]) if fast else tv[0] / tv[2]) * tv[1]
            gf = T.cast(gr[slot(k - lag, c), i], "float32")
            ov[c, i] = tv[4] * wv[0]
            acc[0] = acc[0] + T.fmul(gf, tv[4])
            tv[5] = gf * wv[0] * tv[3]
            dgv = tv[5] * tv[1] * T.fma(tv[0], T.float32(1) - tv[3], T.float32(1))
            duv = tv[5] * tv[0]
            if clamp_on:
                dg[c, i] = T.if_then_else(cg, T.float32(0), dgv)
                du[c, i] = T.if_then_else(cu, T.float32(0), duv)
            else:
                dg[c, i] = dgv
                du[c, i] = duv
            amg[c] = T.max(amg[c], T.abs(dg[c, i]))
            amu[c] = T.max(amu[c], T.abs(du[c, i]))

    @T.prim_func
    def main(
        x: T.Tensor((E, 2 * H), "float8_e4m3fn"),
        x_sf: T.Tensor((E, nk), "float32"),
        grad: T.Tensor((E, H), "bfloat16"),
        weights: T.Tensor((n_w,), "float32"),
        pos_to_token_topk: T.Tensor((E,), "int32"),
        out: T.Tensor((E, H), "bfloat16"),
        xq: T.Tensor((E, 2 * H), "float8_e4m3fn"),
        sf: T.Tensor((sf_len,), sf_dtype),
        x_grad: T.Tensor((E, 2 * H), "bfloat16"),
        weight_grad: T.Tensor((n_w,), "float32"),
        clamp: T.float32,
        clamp_min: T.float32,
    ):
        with T.Kernel(E, threads=warps * 32, prelude=None if lag else DIV_FAST + RCP_FAST) as row:
            if min_blocks > 1:
                T.annotate_min_blocks_per_sm(min_blocks)
            tx = T.get_thread_binding()
            lane = tx % 32
            wid = tx // 32
            qg = T.alloc_local((NB, VEC), "float8_e4m3fn")
            qu = T.alloc_local((NB, VEC), "float8_e4m3fn")
            gr = T.alloc_local((NB, VEC), "bfloat16")
            ov = T.alloc_local((U, VEC), "float32")
            dg = T.alloc_local((U, VEC), "float32")
            du = T.alloc_local((U, VEC), "float32")
            sfg = T.alloc_local((NB,), "float32")
            sfu = T.alloc_local((NB,), "float32")
            amg = T.alloc_local((U,), "float32")
            amu = T.alloc_local((U,), "float32")
            acc = T.alloc_local((1,), "float32")
            wv = T.alloc_local((1,), "float32")
            tv = T.alloc_local((6,), "float32")
            gk = T.alloc_local((VEC,), "float32")  # the chunk's g before the clamp
            km = T.alloc_local((1,), "uint32")
            red = T.alloc_shared((warps,), "float32")
            idx = pos_to_token_topk[row]
            if idx >= 0 and idx < n_w:
                wv[0] = weights[idx]
            else:
                wv[0] = T.float32(0)
            acc[0] = T.float32(0)
            for k in span_loop(spans + lag):
                if not lag or k < spans:
                    itl = wid * spans + k
                    for c in T.unroll(U):
                        col = itl * SPAN + c * (32 * VEC) + lane * VEC
                        if in_range(col):
                            for i in T.vectorized(VEC):
                                qg[slot(k, c), i] = x[row, col + i]
                            for i in T.vectorized(VEC):
                                qu[slot(k, c), i] = x[row, H + col + i]
                            for i in T.vectorized(VEC):
                                gr[slot(k, c), i] = grad[row, col + i]
                            sfg[slot(k, c)] = x_sf[row, col // group]
                            sfu[slot(k, c)] = x_sf[row, (H + col) // group]
                        else:
                            for i in T.vectorized(VEC):
                                qg[slot(k, c), i] = T.cast(T.float32(0), "float8_e4m3fn")
                            for i in T.vectorized(VEC):
                                qu[slot(k, c), i] = T.cast(T.float32(0), "float8_e4m3fn")
                            for i in T.vectorized(VEC):
                                gr[slot(k, c), i] = T.cast(T.float32(0), "bfloat16")
                            sfg[slot(k, c)] = T.float32(0)
                            sfu[slot(k, c)] = T.float32(0)
                if not lag or k >= lag:
                    it = wid * spans + k - lag
                    for c in T.unroll(U):
                        amg[c] = T.float32(0)
                        amu[c] = T.float32(0)
                        if lag:  # at its register cap the pipeline keeps the plain divisions (8 g more would spill)
                            chunk_grads(qg, qu, gr, sfg, sfu, gk, tv, ov, dg, du, amg, amu, acc, wv, clamp, c, k, False)
                        else:
                            # The chunk takes the divisions' fast paths when every clamped g lies in div_fast's range
                            # (``fast_div_ok``): a clamped g is g or the clamp value, so both are keyed. Then t < 2**93,
                            # in rcp_fast's range, and 1 / t and g / t share its reciprocal.
                            km[0] = fast_div_key(clamp) if clamp_on else T.uint32(0)
                            for i in T.unroll(VEC):
                                gk[i] = T.cast(qg[c, i], "float32") * sfg[c]
                                km[0] = T.max(km[0], fast_div_key(gk[i]))
                            if fast_div_ok(km[0]):
                                chunk_grads(qg, qu, gr, sfg, sfu, gk, tv, ov, dg, du, amg, amu, acc, wv, clamp, c, k, True)
                            else:
                                chunk_grads(qg, qu, gr, sfg, sfu, gk, tv, ov, dg, du, amg, amu, acc, wv, clamp, c, k, False)
                        for off in offsets:
                            amg[c] = T.max(amg[c], T.shfl_xor(amg[c], off))
                            amu[c] = T.max(amu[c], T.shfl_xor(amu[c], off))
                        col = it * SPAN + c * (32 * VEC) + lane * VEC
                        sg, sig = _tl.scale_rule(amg[c], clamp_min, E4M3_MAX, round_sf)
                        su, siu = _tl.scale_rule(amu[c], clamp_min, E4M3_MAX, round_sf)
                        if in_range(col):
                            for i in T.vectorized(VEC):
                                out[row, col + i] = T.cast(ov[c, i], "bfloat16")
                            for i in T.vectorized(VEC):
                                x_grad[row, col + i] = T.cast(dg[c, i], "bfloat16")
                            for i in T.vectorized(VEC):
                                x_grad[row, H + col + i] = T.cast(du[c, i], "bfloat16")
                            for i in T.vectorized(VEC):
                                xq[row, col + i] = T.cast(dg[c, i] * sig, "float8_e4m3fn")
                            for i in T.vectorized(VEC):
                                xq[row, H + col + i] = T.cast(du[c, i] * siu, "float8_e4m3fn")
                            if col % group == 0:
                                sf[_tl.sf_offset(layout, row, col // group, E, nk)] = _sf_value(layout, sg)
                                sf[_tl.sf_offset(layout, row, (H + col) // group, E, nk)] = _sf_value(layout, su)
            for off in (16, 8, 4, 2, 1):
                acc[0] = acc[0] + T.shfl_xor(acc[0], off)
            if lane == 0:
                red[wid] = acc[0]
            T.sync_threads()
            if tx == 0:
                acc[0] = red[0]
                for w in T.unroll(1, warps):
                    acc[0] = acc[0] + red[w]
                if idx >= 0 and idx < n_w:
                    weight_grad[idx] = acc[0]
                if nk_pad > 0:
                    for z in T.unroll(nk_pad):
                        sf[_tl.sf_offset(layout, row, nk + z, E, nk)] = T.uint8(0)

    return main


# --- forward + per-channel cast (+ transpose) -----------------------------------------------------

THREADS = 256
# Guards the register cliff (at 82 registers the bm=32 kernel dropped to 2 CTAs of 256 threads per SM, -35%):
# bm=32 needs 46 registers (5 CTAs), bm=128 94; a cap of 3 CTAs (80 registers) would make bm=128 spill.
MIN_BLOCKS = 2
# Launcher choices measured on the H200 (benchmarks/sweep_swiglu.py). Channel, bm=32: 128 threads and 6 CTAs
# per SM (58 registers) beat 256 x 2 by ~5%; bm=128 keeps 256 x 2 (94 registers).
CHANNEL_TUNING = {32: dict(threads=128, min_blocks=6), 128: dict(threads=THREADS, min_blocks=MIN_BLOCKS)}


# Registers per thread the backward's loops need without spills (sm_90a, both loops; ``bwd_tuning``).
BWD_REGISTERS = 72


def bwd_tuning(arch: str, clamp_on: bool) -> dict:
    """Backward kernel parameters. H200 without the clamp: the software pipeline at 4 CTAs per SM (72
    registers, no spill on sm_90a; sm_100a spills at that cap) was best (3,722 vs 3,613 GB/s). With the clamp:
    the plain loop with the chunk-gated fast divisions at 4 CTAs per SM (72 registers, no spill on either arch;
    session 8: 213.7 against 221.5 us at bk 128, 197.9 against 204.3 at bk 32). Without the cap that loop takes 92
    registers and 3 CTAs per SM and was 18 % slower; the pipeline spills at 4 CTAs."""
    if clamp_on:
        return dict(preload=False, min_blocks=4)
    return dict(preload=True, min_blocks=4 if arch == "sm_90a" else 1)


def channel_tile(hidden: int, bm: int, threads: int = THREADS) -> tuple[int, int, int]:
    """``(COLS, CL, RPT)``: columns per CTA, column lanes (8 columns each) and rows per thread."""
    cols = 128 if hidden % 128 == 0 else 64
    cl = cols // VEC
    return cols, cl, bm * cl // threads


# TileLang puts the scale words on the amax partials (thread tx writes sinv[tx] on red[0, tx], which only it
# reads) and the transposed tile on both, after the barrier its sync planner places behind the scale reads.
@kernel(pass_configs=_PASS_CONFIGS, shared_aliases=[("red", "sinv"), ("red", "tile"), ("sinv", "tile")])
def swiglu_fwd_channel_kernel(
    hidden: int,
    bm: int,
    round_sf: bool,
    transpose: bool,
    clamp_on: bool,
    threads: int = THREADS,
    min_blocks: int = MIN_BLOCKS,
    fast_div: bool = True,
    clamp_impl: str = "nan",
    widen_words: bool = True,
    short_div: bool = False,
    linear_grid: bool = False,
):
    """``linear_grid``: see ``_tl.tile_grid`` (launches of more than 65,535 token blocks).
    ``fast_div``: ``tk_div_fast`` for the 8-column row pieces whose gates allow it (see ``tk_core.ptx.DIV_FAST``).
    ``clamp_impl``: see ``NAN_CLAMP_BF16``. ``widen_words``: the inputs widened through ``BF16_WORDS``.
    ``short_div``: ``tk_div_silu_bf16`` instead where g is a bf16 value (no clamp, or the "bf16" clamp: the minimum of
    two bf16 values); launchers: on ``tk_core.ptx.DIV_SILU_BF16_ARCHS``. (``tk_one_plus_exp_neg_bf16``, which the
    per-token forward takes, measured 1 % slower here without a clamp: 75 registers instead of 72.)
    The column amax is taken over the float32 activations and rounded to bf16 once, at the scale rule: the amax of
    the bf16 activations, since rounding is monotonic (``max_t RN(|x_t|) = RN(max_t |x_t|)``, NaN ignored by both
    maxima), without widening every ``a`` back for it."""
    H = hidden
    NT = T.dynamic("num_tokens")
    nm = T.dynamic("nm")
    COLS, CL, RPT = channel_tile(H, bm, threads)
    WARPS = threads // 32
    offsets = [o for o in (1, 2, 4, 8, 16) if CL <= o < 32]
    PADC = COLS + 8  # row of the token-major staging tile (bytes): 8-byte aligned rows
    NCHUNK = COLS * bm // 16  # 16-byte chunks of the transposed tile
    NCH = ceil_div(NCHUNK, threads)  # per thread
    SEGS = bm // 16
    n_out = T.dynamic("n_out")
    out_shape = (n_out,) if transpose else (NT, H)  # transposed: flat (H * NT), row stride nt16 * 16
    use_nan = clamp_on and clamp_impl == "nan"
    use_b16 = clamp_on and clamp_impl == "bf16"
    short = short_div and fast_div and (not clamp_on or use_b16)  # g is a bf16 value
    prelude = (
        (DIV_FAST if fast_div else "")
        + (NAN_CLAMP if use_nan else "")
        + (NAN_CLAMP_BF16 if use_b16 else "")
        + (BF16_WORDS if widen_words else "")
    ) or None

    @T.macro
    def put_act(a, am, r, i, av):
        """Activation ``av`` (float32) of row ``r``, column ``i``: stored as bf16, and into the column amax."""
        a[r, i] = T.cast(av, "bfloat16")
        am[i] = T.max(am[i], T.abs(av))

    @T.prim_func
    def main(
        x: T.Tensor((NT, 2 * H), "bfloat16"),
        out: T.Tensor(out_shape, "float8_e4m3fn"),
        sf: T.Tensor((nm, H), "float32"),
        clamp: T.float32,
        clamp_min: T.float32,
        nt16: T.int32,
    ):
        with _tl.tile_grid(H // COLS, T.ceildiv(NT, bm), linear_grid, threads=threads, prelude=prelude) as ids:
            if min_blocks > 1:
                T.annotate_min_blocks_per_sm(min_blocks)
            bx, by = _tl.tile_ids(ids, H // COLS, linear_grid)
            tx = T.get_thread_binding()
            cl = tx % CL
            rl = tx // CL
            col = bx * COLS + cl * VEC
            xg = T.alloc_local((RPT, VEC), "bfloat16")
            xu = T.alloc_local((RPT, VEC), "bfloat16")
            a = T.alloc_local((RPT, VEC), "bfloat16")
            q = T.alloc_local((RPT, VEC), "float8_e4m3fn")
            am = T.alloc_local((VEC,), "float32")
            cm = T.alloc_local((1,), "float32")
            siv = T.alloc_local((VEC,), "float32")
            gs = T.alloc_local((VEC,), "float32")  # fast_div: one row piece's clamped g and u
            us = T.alloc_local((VEC,), "float32")
            dm = T.alloc_local((1,), "uint32")
            red = T.alloc_shared((WARPS, COLS), "float32")
            sinv = T.alloc_shared((COLS,), "float32")
            if transpose:
                tile = T.alloc_shared((bm, PADC), "float8_e4m3fn")
                col16 = T.alloc_local((16,), "float8_e4m3fn")
            for r in T.unroll(RPT):
                for i in T.vectorized(VEC):
                    xg[r, i] = x[by * bm + rl * RPT + r, col + i]
                for i in T.vectorized(VEC):
                    xu[r, i] = x[by * bm + rl * RPT + r, H + col + i]
            if use_b16:
                for r in T.unroll(RPT):
                    for k in T.unroll(VEC // 2):
                        _clamp_bf16x2(T.address_of(xg[r, 2 * k]), T.address_of(xu[r, 2 * k]), _bf16_pair(clamp))
            for i in T.unroll(VEC):
                am[i] = T.float32(0)
            for r in T.unroll(RPT):
                dm[0] = T.uint32(0)
                for i in T.unroll(VEC, explicit=widen_words):
                    if use_nan:
                        g1, u1 = _swiglu_nan(_widen(xg, r, i, widen_words), _widen(xu, r, i, widen_words), clamp)
                    elif use_b16:
                        g1, u1 = _widen(xg, r, i, widen_words), _widen(xu, r, i, widen_words)
                    else:
                        g1, u1, _, _ = _swiglu(
                            _widen(xg, r, i, widen_words), _widen(xu, r, i, widen_words), clamp_on, clamp
                        )
                    if fast_div:
                        gs[i] = g1
                        us[i] = u1
                        dm[0] = T.max(dm[0], fast_div_key(g1))
                    else:
                        put_act(a, am, r, i, _act(g1, u1, None, False, False))
                if fast_div:
                    if fast_div_ok(dm[0]):
                        for i in T.unroll(VEC):
                            put_act(a, am, r, i, _act(gs[i], us[i], None, False, True, short))
                    else:
                        for i in T.unroll(VEC):
                            put_act(a, am, r, i, _act(gs[i], us[i], None, False, False))
            for i in T.unroll(VEC):
                for off in offsets:
                    am[i] = T.max(am[i], T.shfl_xor(am[i], off))
            if tx % 32 < CL:
                for i in T.vectorized(VEC):
                    red[tx // 32, cl * VEC + i] = am[i]
            T.sync_threads()
            # one thread per column finishes its amax and runs the scale rule once (not once per row lane)
            if tx < COLS:
                cm[0] = red[0, tx]
                for w in T.unroll(1, WARPS):
                    cm[0] = T.max(cm[0], red[w, tx])
                cm[0] = T.cast(T.cast(cm[0], "bfloat16"), "float32")  # the amax of the bf16 activations
                s, si = _scale_rule(cm[0], clamp_min, E4M3_MAX, round_sf)
                sf[by, bx * COLS + tx] = s
                sinv[tx] = si
            T.sync_threads()
            for i in T.vectorized(VEC):
                siv[i] = sinv[cl * VEC + i]
            for r in T.unroll(RPT):
                for i in T.vectorized(VEC):
                    q[r, i] = T.cast(T.cast(a[r, i], "float32") * siv[i], "float8_e4m3fn")
            if not transpose:
                for r in T.unroll(RPT):
                    for i in T.vectorized(VEC):
                        out[by * bm + rl * RPT + r, col + i] = q[r, i]
            else:
                # token-major staging (8-byte conflict-free writes), then each thread gathers 16 tokens of
                # one column (byte reads along a column) into a 16-byte store of the transposed output
                for r in T.unroll(RPT):
                    for i in T.vectorized(VEC):
                        tile[rl * RPT + r, cl * VEC + i] = q[r, i]
                T.sync_threads()
                for k in T.unroll(NCH):
                    j = (tx + k * threads) // SEGS
                    seg = (tx + k * threads) % SEGS
                    if NCHUNK % threads == 0 or tx + k * threads < NCHUNK:
                        for i in T.unroll(16):
                            col16[i] = tile[seg * 16 + i, j]
                        for i in T.vectorized(16):
                            out[(bx * COLS + j) * (nt16 * 16) + by * bm + seg * 16 + i] = col16[i]

    return main


# --- device ops -----------------------------------------------------------------------------------


@device_op("tk_quant::swiglu_forward_and_per_token_cast_", mutates_args=("out", "sf_flat", "clamped_count"))
def swiglu_forward_and_per_token_cast_(
    x: torch.Tensor,
    pos_to_expert: torch.Tensor | None,
    pos_to_token_topk: torch.Tensor | None,
    topk_weights: torch.Tensor | None,
    out: torch.Tensor,
    sf_flat: torch.Tensor,
    clamped_count: torch.Tensor | None,
    group: int,
    layout: str,
    round_sf: bool,
    clamp_value: float | None,
    clamp_min: float,
) -> None:
    mode = "none" if clamp_value is None else ("clamp" if clamped_count is None else "count")
    h = x.shape[1] // 2
    k = swiglu_fwd_token_kernel.get(
        x.device,
        in_dtype=_IN_DTYPES[x.dtype],
        hidden=h,
        group=group,
        layout=layout,
        round_sf=round_sf,
        clamp_mode=mode,
        chunks=fwd_token_chunks(h, _IN_DTYPES[x.dtype]),
        min_blocks=fwd_token_min_blocks(_IN_DTYPES[x.dtype], mode, topk_weights is not None),
        pair_scales=True,
        weighted=topk_weights is not None,
        pack_counts=True,
        clamp_impl=clamp_impl_for(x.dtype, clamp_value),
        widen_words=True,
        short_div=arch_of(x.device) in DIV_SILU_BF16_ARCHS,
        short_exp=True,
        load_order="row" if pos_to_expert is None else ("early" if mode == "count" else "early_if_pe"),
        int_counts=True,
        int_scale=True,
        sf_index32=sf_flat.numel() < 2**31,
        redux_counts=True,
        bf16_keys=True,
    )
    # absent optional tensors: scratch (a view of x would pass its element count, which can exceed int32, for a
    # length the kernel never reads)
    i32 = scratch(x.device, torch.int32)
    wmode = 0 if topk_weights is None else (1 if pos_to_token_topk is not None else 2)
    k(
        x,
        i32 if pos_to_expert is None else pos_to_expert,
        i32 if pos_to_token_topk is None else pos_to_token_topk,
        scratch(x.device, torch.float32) if topk_weights is None else topk_weights.view(-1),
        out,
        sf_flat,
        scratch(x.device, torch.int64) if clamped_count is None else clamped_count,
        math.inf if clamp_value is None else clamp_value,
        clamp_min,
        int(pos_to_expert is not None),
        wmode,
    )


@device_op(
    "tk_quant::swiglu_backward_and_per_token_cast_",
    mutates_args=("out", "x_grad_fp8", "sf_flat", "x_grad", "weight_grad"),
)
def swiglu_backward_and_per_token_cast_(
    x: torch.Tensor,
    x_sf: torch.Tensor,
    grad_out: torch.Tensor,
    weight: torch.Tensor,
    pos_to_token_topk: torch.Tensor,
    out: torch.Tensor,
    x_grad_fp8: torch.Tensor,
    sf_flat: torch.Tensor,
    x_grad: torch.Tensor,
    weight_grad: torch.Tensor,
    group: int,
    layout: str,
    round_sf: bool,
    clamp_value: float | None,
    clamp_min: float,
) -> None:
    weight_grad.zero_()
    if x.shape[0] == 0:
        return
    k = swiglu_bwd_token_kernel.get(
        x.device,
        hidden=x.shape[1] // 2,
        group=group,
        layout=layout,
        round_sf=round_sf,
        clamp_on=clamp_value is not None,
        **bwd_tuning(arch_of(x.device), clamp_value is not None),
    )
    k(
        x,
        x_sf,
        grad_out,
        weight.view(-1),
        pos_to_token_topk,
        out,
        x_grad_fp8,
        sf_flat,
        x_grad,
        weight_grad.view(-1),
        math.inf if clamp_value is None else clamp_value,
        clamp_min,
    )


@device_op("tk_quant::swiglu_forward_and_per_channel_cast_and_transpose_", mutates_args=("out", "sf"))
def swiglu_forward_and_per_channel_cast_and_transpose_(
    x: torch.Tensor,
    out: torch.Tensor,
    sf: torch.Tensor,
    bm: int,
    round_sf: bool,
    transpose: bool,
    clamp_value: float | None,
    clamp_min: float,
) -> None:
    k = swiglu_fwd_channel_kernel.get(
        x.device,
        hidden=x.shape[1] // 2,
        bm=bm,
        round_sf=round_sf,
        transpose=transpose,
        clamp_on=clamp_value is not None,
        clamp_impl=clamp_impl_for(x.dtype, clamp_value),
        widen_words=True,
        short_div=arch_of(x.device) in DIV_SILU_BF16_ARCHS,
        **CHANNEL_TUNING[bm],
        **_tl.grid_params(ceil_div(x.shape[0], bm)),
    )
    k(
        x,
        out.view(-1) if transpose else out,
        sf,
        math.inf if clamp_value is None else clamp_value,
        clamp_min,
        x.shape[0] // 16,
    )


# --- public functions -----------------------------------------------------------------------------


def _check_clamp(op: str, value) -> float | None:
    if value is None:
        return None
    return checks.check_float(op, "swiglu_clamp_value", value, strict=True, kind="a float or None")


def _check_index(op: str, arg: str, t, n: int, device) -> None:
    checks.check_dtype(op, arg, t, torch.int32)
    checks.check_shape(op, arg, t, (n,))
    checks.check_contiguous(op, arg, t)
    checks.check_same_device(op, arg, t, device)


def _check_x(op: str, x, dtypes) -> int:
    checks.check_dtype(op, "x", x, dtypes)
    checks.check_ndim(op, "x", x, 2)
    checks.check_contiguous(op, "x", x)
    if x.shape[1] % 2:
        checks.fail(op, "x.shape[1]", "even ([gate | up] halves)", x.shape[1])
    return x.shape[1] // 2


def swiglu_forward_and_per_token_cast(
    x: torch.Tensor,
    fmt: str,
    num_per_channels: int,
    pos_to_token_topk: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    pos_to_expert: torch.Tensor | None = None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
    swiglu_clamp_value: float | None = None,
    clamped_count: torch.Tensor | None = None,
    sf_clamp_min: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU of ``x = [g | u]`` (bf16/fp32 ``(E, 2H)``, contiguous, ``H % 128 == 0``), optionally weighted,
    then a per-token e4m3 cast with ``num_per_channels`` columns per scale.

    - ``fmt``: ``'e4m3'``. ``num_per_channels``: 32, 64, 128, or ``H`` (one scale per row; row-major SF only).
    - ``pos_to_token_topk`` (int32 ``(E,)``) with ``topk_weights`` float32 ``(N, K)``: row ``p`` is multiplied
      by ``topk_weights.flat[pos_to_token_topk[p]]``, by 0 when the index is negative. ``topk_weights`` float32
      ``(E,)`` without ``pos_to_token_topk``: per-row weights.
    - ``pos_to_expert`` (int32 ``(E,)``): rows with a negative expert are skipped and written as zeros (data
      and scales).
    - ``swiglu_clamp_value`` (float > 0): clamp before the activation; ``clamped_count`` (int64 ``(3,)`` or
      ``(4,)``, same device) is incremented by the exact counts of ``g > c``, ``u > c``, ``u < -c`` (and
      ``H`` per computed row).
    - ``sf_clamp_min``: amax floor (default ``tk_core.config.get_amax_clamp('e4m3')``), at least ``448 * 2**-126``.

    Returns ``(out, sf)``: float8_e4m3fn ``(E, H)`` and the scales ``(E, ceil(H / bk))`` (packed: int32
    ``(E, ceil(nk / 4))``) in the layout of the flags. Bit-exact with
    ``tk_quant.reference.swiglu_forward_and_per_token_cast``. Raises ``TypeError``/``ValueError``.
    """
    op = "swiglu_forward_and_per_token_cast"
    h = _check_x(op, x, tuple(_IN_DTYPES))
    e = x.shape[0]
    checks.check_divisible(op, "hidden (x.shape[1] / 2)", h, 128)
    checks.check_one_of(op, "fmt", fmt, ("e4m3",))
    checks.check_one_of(op, "num_per_channels", num_per_channels, sorted(set(GROUPS) | {h}))
    layout = sf_out_layout(op, use_tma_aligned_col_major_sf, use_packed_ue8m0, round_sf)
    if num_per_channels > 128 and layout != "row":
        checks.fail(op, "use_tma_aligned_col_major_sf", "False with one scale per row (num_per_channels == H)", True)
    if pos_to_token_topk is not None:
        _check_index(op, "pos_to_token_topk", pos_to_token_topk, e, x.device)
        if topk_weights is None:
            checks.fail(op, "topk_weights", "given with pos_to_token_topk", None)
        checks.check_dtype(op, "topk_weights", topk_weights, torch.float32)
        checks.check_ndim(op, "topk_weights", topk_weights, 2)
        checks.check_contiguous(op, "topk_weights", topk_weights)
        checks.check_same_device(op, "topk_weights", topk_weights, x.device)
    elif topk_weights is not None:
        checks.check_dtype(op, "topk_weights", topk_weights, torch.float32)
        checks.check_shape(op, "topk_weights (per-row weights without pos_to_token_topk)", topk_weights, (e,))
        checks.check_contiguous(op, "topk_weights", topk_weights)
        checks.check_same_device(op, "topk_weights", topk_weights, x.device)
    if pos_to_expert is not None:
        _check_index(op, "pos_to_expert", pos_to_expert, e, x.device)
    clamp = _check_clamp(op, swiglu_clamp_value)
    if clamped_count is not None:
        if clamp is None:
            checks.fail(op, "clamped_count", "None without swiglu_clamp_value", "a tensor")
        checks.check_dtype(op, "clamped_count", clamped_count, torch.int64)
        checks.check_ndim(op, "clamped_count", clamped_count, 1)
        checks.check_one_of(op, "clamped_count.shape[0]", clamped_count.shape[0], (3, 4))
        checks.check_contiguous(op, "clamped_count", clamped_count)
        checks.check_same_device(op, "clamped_count", clamped_count, x.device)
    if sf_clamp_min is None:
        clamp_min = get_amax_clamp("e4m3")
    else:
        clamp_min = checks.check_float(op, "sf_clamp_min", sf_clamp_min, E4M3_MAX * 2.0**-126, kind="a float or None",
                                       expected=f"a finite float >= {E4M3_MAX * 2.0**-126:.3g} (448 * 2**-126)")
    if x.device.type != "cuda":
        from . import reference

        return reference.swiglu_forward_and_per_token_cast(
            x,
            fmt,
            num_per_channels,
            pos_to_token_topk,
            topk_weights,
            pos_to_expert,
            use_tma_aligned_col_major_sf,
            round_sf,
            use_packed_ue8m0,
            clamp,
            clamped_count,
            clamp_min,
        )
    out = torch.empty((e, h), dtype=torch.float8_e4m3fn, device=x.device)
    flat, sf = alloc_sf_storage(e, ceil_div(h, num_per_channels), layout, x.device)
    if e:
        swiglu_forward_and_per_token_cast_(
            x,
            pos_to_expert,
            pos_to_token_topk,
            topk_weights,
            out,
            flat,
            clamped_count,
            num_per_channels,
            layout,
            bool(round_sf),
            clamp,
            clamp_min,
        )
    return out, sf


def swiglu_backward_and_per_token_cast(
    x: tuple[torch.Tensor, torch.Tensor],
    grad_out: torch.Tensor,
    weight: torch.Tensor,
    pos_to_token_topk: torch.Tensor,
    token_topk_to_pos: torch.Tensor,
    num_per_channels: int,
    round_sf: bool = False,
    swiglu_clamp_value: float | None = None,
    use_tma_aligned_col_major_sf: bool = False,
    use_packed_ue8m0: bool = False,
):
    """Backward of the weighted SwiGLU for the MoE fused layout, with a per-token e4m3 cast of ``x_grad``.

    - ``x = (x_fp8, x_sf)``: float8_e4m3fn ``(E, 2H)`` (or ``(..., 2H)``, flattened to rows), contiguous, and its
      row-major float32 scales ``(E, 2H / bk)``, ``bk = num_per_channels`` in {32, 64, 128}, ``H % bk == 0``.
    - ``grad_out``: bf16 ``(E, H)`` (any shape with ``E * H`` elements, contiguous).
    - ``weight``: float32 ``(N, K)`` contiguous; ``pos_to_token_topk``: int32 ``(E,)`` (flat ``t*K+k`` or -1);
      ``token_topk_to_pos``: int32 ``(N, K)`` (validated; the kernel does not need it).
    - ``round_sf``, ``use_tma_aligned_col_major_sf``, ``use_packed_ue8m0``: scale rounding and layout of the
      output SF; ``swiglu_clamp_value`` (float > 0) as in the forward.

    Returns ``(out bf16 (E, H), (x_grad_fp8 (E, 2H), sf), x_grad bf16 (E, 2H), weight_grad float32 (N, K))``.
    ``weight_grad`` is exact and deterministic (see the module docstring) and 0 for every (token, k) no row
    refers to. Bit-exact with ``tk_quant.reference.swiglu_backward_and_per_token_cast``.
    """
    op = "swiglu_backward_and_per_token_cast"
    if not (isinstance(x, (tuple, list)) and len(x) == 2):
        checks.fail(op, "x", "a QuantTensor (x_fp8, x_sf)", type(x).__name__, TypeError)
    xq, xs = x
    checks.check_dtype(op, "x[0] (x_fp8)", xq, torch.float8_e4m3fn)
    if xq.dim() < 2:
        checks.fail(op, "x[0] (x_fp8)", "at least 2-D", f"shape {tuple(xq.shape)}")
    checks.check_contiguous(op, "x[0] (x_fp8)", xq)
    xq = xq.view(-1, xq.shape[-1])
    e, h2 = xq.shape
    if h2 % 2:
        checks.fail(op, "x[0].shape[-1]", "even ([gate | up] halves)", h2)
    h = h2 // 2
    checks.check_one_of(op, "num_per_channels", num_per_channels, GROUPS)
    checks.check_divisible(op, "hidden (x[0].shape[-1] / 2)", h, num_per_channels)
    nk = h2 // num_per_channels
    checks.check_dtype(op, "x[1] (x_sf)", xs, torch.float32)
    checks.check_shape(op, "x[1] (x_sf)", xs, (e, nk))
    checks.check_contiguous(op, "x[1] (x_sf)", xs)
    checks.check_same_device(op, "x[1] (x_sf)", xs, xq.device)
    checks.check_dtype(op, "grad_out", grad_out, torch.bfloat16)
    checks.check_contiguous(op, "grad_out", grad_out)
    if grad_out.numel() != e * h or (grad_out.dim() and grad_out.shape[-1] != h):
        checks.fail(op, "grad_out", f"of {e} x {h} elements with last dimension {h}", f"shape {tuple(grad_out.shape)}")
    checks.check_same_device(op, "grad_out", grad_out, xq.device)
    grad_out = grad_out.view(e, h)
    checks.check_dtype(op, "weight", weight, torch.float32)
    checks.check_ndim(op, "weight", weight, 2)
    checks.check_contiguous(op, "weight", weight)
    checks.check_same_device(op, "weight", weight, xq.device)
    _check_index(op, "pos_to_token_topk", pos_to_token_topk, e, xq.device)
    checks.check_dtype(op, "token_topk_to_pos", token_topk_to_pos, torch.int32)
    checks.check_shape(op, "token_topk_to_pos", token_topk_to_pos, tuple(weight.shape))
    checks.check_same_device(op, "token_topk_to_pos", token_topk_to_pos, xq.device)
    clamp = _check_clamp(op, swiglu_clamp_value)
    layout = sf_out_layout(op, use_tma_aligned_col_major_sf, use_packed_ue8m0, round_sf)
    clamp_min = get_amax_clamp("e4m3")
    if xq.device.type != "cuda":
        from . import reference

        return reference.swiglu_backward_and_per_token_cast(
            (xq, xs),
            grad_out,
            weight,
            pos_to_token_topk,
            token_topk_to_pos,
            num_per_channels,
            round_sf,
            clamp,
            use_tma_aligned_col_major_sf,
            use_packed_ue8m0,
        )
    dev = xq.device
    out = torch.empty((e, h), dtype=torch.bfloat16, device=dev)
    x_grad_fp8 = torch.empty((e, h2), dtype=torch.float8_e4m3fn, device=dev)
    flat, sf = alloc_sf_storage(e, nk, layout, dev)
    x_grad = torch.empty((e, h2), dtype=torch.bfloat16, device=dev)
    weight_grad = torch.empty_like(weight)
    swiglu_backward_and_per_token_cast_(
        xq,
        xs,
        grad_out,
        weight,
        pos_to_token_topk,
        out,
        x_grad_fp8,
        flat,
        x_grad,
        weight_grad,
        num_per_channels,
        layout,
        bool(round_sf),
        clamp,
        clamp_min,
    )
    return out, (x_grad_fp8, sf), x_grad, weight_grad


def swiglu_forward_and_per_channel_cast_and_transpose(
    x: torch.Tensor,
    fmt: str,
    num_per_tokens: int,
    round_sf: bool = False,
    without_transpose: bool = False,
    swiglu_clamp_value: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``a = bf16(SwiGLU(x))`` for bf16 ``x = [g | u]`` ``(T, 2H)`` (contiguous, ``H % 64 == 0``,
    ``T % num_per_tokens == 0``), then an e4m3 cast with one scale per ``num_per_tokens`` (32 or 128) tokens
    of each column.

    Returns ``(out, sf)``: ``out`` float8_e4m3fn ``(H, T)`` (``(T, H)`` with ``without_transpose``) and ``sf``
    row-major float32 ``(T / num_per_tokens, H)``. ``swiglu_clamp_value`` (float > 0) is a runtime value (no
    recompile per value), applied in float32. Bit-exact with
    ``tk_quant.reference.swiglu_forward_and_per_channel_cast_and_transpose``.
    """
    op = "swiglu_forward_and_per_channel_cast_and_transpose"
    h = _check_x(op, x, (torch.bfloat16,))
    t = x.shape[0]
    checks.check_divisible(op, "hidden (x.shape[1] / 2)", h, 64)
    checks.check_one_of(op, "fmt", fmt, ("e4m3",))
    checks.check_one_of(op, "num_per_tokens", num_per_tokens, (32, 128))
    checks.check_divisible(op, "x.shape[0] (tokens)", t, num_per_tokens)
    checks.check_bool(op, "round_sf", round_sf)
    checks.check_bool(op, "without_transpose", without_transpose)
    clamp = _check_clamp(op, swiglu_clamp_value)
    clamp_min = get_amax_clamp("e4m3")
    if x.device.type != "cuda":
        from . import reference

        return reference.swiglu_forward_and_per_channel_cast_and_transpose(
            x, fmt, num_per_tokens, round_sf, without_transpose, clamp
        )
    shape = (t, h) if without_transpose else (h, t)
    out = torch.empty(shape, dtype=torch.float8_e4m3fn, device=x.device)
    sf = torch.empty((t // num_per_tokens, h), dtype=torch.float32, device=x.device)
    if t:
        swiglu_forward_and_per_channel_cast_and_transpose_(
            x, out, sf, num_per_tokens, bool(round_sf), not without_transpose, clamp, clamp_min
        )
    return out, sf
