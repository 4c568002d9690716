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
