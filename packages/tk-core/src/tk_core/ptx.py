"""Device helpers for what TileLang's code generation does not give: their CUDA text goes into the kernel's
``T.Kernel(..., prelude=...)`` and a Python function builds the call (use its result as a statement).
"""

import tilelang.language as T

# One 16-byte global store of four 32-bit words held in registers. Stored through a ``uint4*`` cast, a local
# array's 16 bytes are split by nvcc into four 4-byte stores (seen for bf16, fp8 and 32-bit words alike).
# The generic pointer is used as is (a generic address of global memory is its global address) and there is no
# memory clobber: the kernels never read back in the same launch what they store with it.
ST_GLOBAL_V4 = r"""
__device__ __forceinline__ void tk_st_global_v4(void* p, unsigned a, unsigned b, unsigned c, unsigned d) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};"
               :: "l"(p), "r"(a), "r"(b), "r"(c), "r"(d));
}
"""


def st_global_v4(address, a, b, c, d):
    """``*(uint4*)address = {a, b, c, d}`` as one instruction; ``address`` (``T.address_of(buf[i])``) must be
    16-byte aligned global memory, and the kernel's prelude must contain ``ST_GLOBAL_V4``."""
    return T.call_extern("handle", "tk_st_global_v4", address, a, b, c, d)


# cp.async (sm_80+): a 16-byte global -> shared copy that holds no register, so every copy of a tile is in flight
# at once (ptxas sinks a plain load whose value is used late, e.g. after a barrier). ``.cg`` caches in L2 only.
# The copies of a thread land by its ``tk_cp_async_wait_all``; other threads see them after a barrier that
# follows that wait. A copy is not ordered with the thread's earlier shared-memory reads of its destination:
# reusing a buffer needs a barrier (or a second buffer) between the last read and the next copy.
CP_ASYNC = r"""
__device__ __forceinline__ void tk_cp_async16(void* smem, const void* gmem) {
  unsigned int s = static_cast<unsigned int>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void tk_cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
"""


def cp_async16(smem_address, global_address):
    """Starts a 16-byte copy from global to shared memory (both ``T.address_of(...)``, 16-byte aligned); the
    kernel's prelude must contain ``CP_ASYNC``."""
    return T.call_extern("handle", "tk_cp_async16", smem_address, global_address)


def cp_async_wait_all():
    """Waits until this thread's ``cp_async16`` copies have landed in shared memory."""
    return T.call_extern("handle", "tk_cp_async_wait_all")


# The fast path of ``div.rn.f32`` as nvcc emits it (MUFU.RCP, one Newton step, quotient, exact remainder, one
# correction), without its per-division range check (FCHK) and slow-path call (CALL, BSSY/BSYNC, and the constants
# nvcc re-materializes around the call): about 6 of the ~30 instructions of a SiLU. It is exact only where the
# caller proves it: for ``a / t`` with ``t = 1 + exp(-a)`` (SiLU) and ``|a|`` in ``[2**-64, 64]``, ``t`` is in
# ``[1, 2**93)`` and every intermediate (``1/t``, ``a * r``, the remainder, ``|a / t|`` in ``[2**-87, 64]``) is
# far from the subnormal and overflow ends that FCHK screens for: there ``div.rn`` returns this very sequence, so
# the result is its IEEE quotient bit for bit. (Emulated exactly on the CPU with ``r0 = RN(1/t)``: equal to
# ``RN(a / t)`` for every bf16 ``a`` in the range and ``t`` within an ulp of ``1 + exp(-a)``.)
#
# ``tk_div_silu_bf16`` (also in this prelude) is ``a / b`` for SiLU's ``b = 1 + expf(-a)`` where ``a`` is a bf16
# value in the same range: the same quotient and correction (``tk_quotient_from_rcp``) from the unrefined reciprocal,
# without the Newton step (two FMAs fewer). rcp.approx is not the rounded reciprocal, so this has no general proof;
# but its inputs are few (one ``b`` per bf16 ``a``), and ``test_gpu_div_silu_bf16`` compares every one of them with
# the IEEE quotient on the device. Kernels take it only on the architectures in ``DIV_SILU_BF16_ARCHS``, where that
# check has passed (rcp.approx may differ on other chips).
DIV_FAST = r"""
__device__ __forceinline__ float tk_quotient_from_rcp(float a, float b, float r) {
  float q = __fmaf_rn(a, r, 0.0f);
  return __fmaf_rn(r, __fmaf_rn(-b, q, a), q);
}
__device__ __forceinline__ float tk_div_fast(float a, float b) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(b));
  return tk_quotient_from_rcp(a, b, __fmaf_rn(r, __fmaf_rn(-b, r, 1.0f), r));
}
__device__ __forceinline__ float tk_div_silu_bf16(float a, float b) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(b));
  return tk_quotient_from_rcp(a, b, r);
}
"""
DIV_SILU_BF16_ARCHS = ("sm_90a",)  # H200


def div_silu_bf16(a, b):
    """``a / b`` by ``tk_div_silu_bf16`` (the kernel's prelude must contain ``DIV_FAST``): the IEEE quotient for a
    bf16 ``a`` in ``div_fast``'s range (``fast_div_ok``) and ``b = 1 + exp(-a)``, as checked on the device."""
    return T.call_extern("float32", "tk_div_silu_bf16", a, b)


# ``1 + expf(-a)`` for a bf16 value ``a`` with |a| in [2**-16, 64] (``EXP_SILU_BF16_LO``), in seven instructions
# instead of nvcc's eight. nvcc's expf(x) takes n = floor(252 * RN(x * RN(log2e / 252) + 0.5)) - 126 (one FMA with
# saturation, one rounding down to the integer grid of 1.5 * 2**23, one FADD), then r = x * log2e - n in two FMAs
# (log2e as float32 plus its remainder), ex2.approx(r), and 2**n from the grid value's bits shifted by 23, folded
# into the ``+ 1``. Here the grid value is one FMA rounding down, ``x * log2e + 1.5 * 2**23 + 127``, so n is
# floor(x * log2e); the rest is nvcc's sequence. Both n agree for every bf16 ``a`` in the range (the saturation
# cannot act there, |x * log2e| < 93; they differ only for a in (0, 2.6e-6], where nvcc's rounding gives n = 0), so
# the result is nvcc's bit for bit: tests/test_ptx.py checks the n of every such ``a`` in exact arithmetic on the
# CPU, and the whole SiLU quotient against the IEEE one on the device.
EXP_SILU_BF16_LO = (127 - 16) << 23
EXP_SILU_BF16 = r"""
__device__ __forceinline__ float tk_one_plus_exp_neg_bf16(float a) {
  const float j = __fmaf_rd(-a, 1.4426950216293334961f, 12583039.0f);
  const float n = j - 12583039.0f;
  float r = __fmaf_rn(-a, 1.4426950216293334961f, -n);
  r = __fmaf_rn(-a, 1.925963033500011079e-08f, r);
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(r));
  return __fmaf_rn(__uint_as_float(__float_as_uint(j) << 23), e, 1.0f);
}
"""


def one_plus_exp_neg_bf16(a):
    """``1 + exp(-a)`` by ``EXP_SILU_BF16`` (the kernel's prelude must contain it): nvcc's ``1.0f + expf(-a)`` bit
    for bit for a bf16 ``a`` with |a| in [2**-16, 64] (``fast_div_ok(key, EXP_SILU_BF16_LO)``)."""
    return T.call_extern("float32", "tk_one_plus_exp_neg_bf16", a)


# |a| in [2**-64, 64] (zeros, larger |a|, inf and NaN take the IEEE division), tested on the float bits as
# ``2 * bits - 2 * LO <= 2 * (HI - LO)`` in uint32 (doubling drops the sign bit): two instructions per element.
FAST_DIV_LO = (127 - 64) << 23
FAST_DIV_HI = (127 + 6) << 23


def div_fast(a, b):
    """``a / b`` by ``DIV_FAST`` (the kernel's prelude must contain it): the IEEE quotient only for SiLU's
    ``b = 1 + exp(-a)`` with ``a`` in range (``fast_div_ok``)."""
    return T.call_extern("float32", "tk_div_fast", a, b)


def fast_div_key(a, lo: int = FAST_DIV_LO):
    """The uint32 whose maximum over a group of values is at most ``fast_div_ok``'s bound exactly when every one
    of them lies in the range of ``div_fast`` (|a| in [2**-64, 64]; with ``lo``, the float bits of the lower end:
    ``EXP_SILU_BF16_LO`` for ``one_plus_exp_neg_bf16``)."""
    bits = T.reinterpret(a, "uint32")
    return bits + bits - T.uint32(2 * lo)


def fast_div_ok(key_max, lo: int = FAST_DIV_LO):
    """Whether the group whose ``fast_div_key`` maximum (with the same ``lo``) is ``key_max`` lies in range."""
    return key_max <= T.uint32(2 * (FAST_DIV_HI - lo))


# 1 / b for b in [1, 2**126) (SiLU's b = 1 + exp(-u)): nvcc compiles the IEEE ``1.0f / b`` (rcp.rn.f32) to
# rcp.approx + two FMAs behind an exponent test that sends b >= 2**126 (and inf, NaN) to a slow-path call;
# ``tk_rcp_fast`` is that fast path without the test (fma(-b, r, 1) is nvcc's -(b*r - 1): rounding is symmetric
# and a zero's sign cannot change r*t + r), so in range it gives nvcc's bits. Its value is also the refined
# reciprocal inside ``tk_div_fast(a, b)``. Callers gate a group of values on its range, e.g. by the unsigned
# maximum of their bits against ``RCP_FAST_BITS``, and keep the division for other groups.
RCP_FAST = r"""
__device__ __forceinline__ float tk_rcp_fast(float b) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(b));
  return __fmaf_rn(r, __fmaf_rn(-b, r, 1.0f), r);
}
"""
RCP_FAST_BITS = (127 + 126) << 23  # the bits of 2**126


def rcp_fast(b):
    """``1 / b`` by ``RCP_FAST`` (the kernel's prelude must contain it): the IEEE reciprocal for b in [1, 2**126)."""
    return T.call_extern("float32", "tk_rcp_fast", b)


# e4m3 -> float32, four values of one 32-bit word at a time: one ``cvt.rn.f16x2.e4m3x2`` per pair of bytes, then
# each f16 to float32 (both exact: every e4m3 value, NaN included, is an f16 value, the same f16 as the one-byte
# conversion gives). TileLang's cast of an fp8 element converts each byte alone (a byte extraction, a cvt and the
# widening per element): 3 instructions per element against about 1.75 here.
E4M3X4_TO_F32 = r"""
__device__ __forceinline__ void tk_e4m3x4_to_f32(float* dst, const void* src) {
  const unsigned w = *reinterpret_cast<const unsigned*>(src);
  unsigned lo, hi;  // f16 pairs of bytes 0-1 and 2-3 (the lower byte into the lower half)
  asm("{\n\t.reg .b16 a, b;\n\tmov.b32 {a, b}, %2;\n\tcvt.rn.f16x2.e4m3x2 %0, a;\n\tcvt.rn.f16x2.e4m3x2 %1, b;\n\t}"
      : "=r"(lo), "=r"(hi) : "r"(w));
  asm("{\n\t.reg .b16 a, b;\n\tmov.b32 {a, b}, %2;\n\tcvt.f32.f16 %0, a;\n\tcvt.f32.f16 %1, b;\n\t}"
      : "=f"(dst[0]), "=f"(dst[1]) : "r"(lo));
  asm("{\n\t.reg .b16 a, b;\n\tmov.b32 {a, b}, %2;\n\tcvt.f32.f16 %0, a;\n\tcvt.f32.f16 %1, b;\n\t}"
      : "=f"(dst[2]), "=f"(dst[3]) : "r"(hi));
}
"""


def e4m3x4_to_f32(dst_address, src_address):
    """Widens the four e4m3 values at ``src_address`` (4-byte aligned, e.g. ``T.address_of(buf[4 * i])`` of a
    local fp8 buffer) into the four float32 at ``dst_address``; the kernel's prelude must contain
    ``E4M3X4_TO_F32``. Bit for bit ``T.cast(x, "float32")`` of each value."""
    return T.call_extern("handle", "tk_e4m3x4_to_f32", dst_address, src_address)
