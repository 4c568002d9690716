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
