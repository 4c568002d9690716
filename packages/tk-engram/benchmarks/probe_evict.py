"""Does the L2 evict-first policy take the benchmarks' dirty-flush penalty away (not a pytest file)?

    python3 packages/tk-engram/benchmarks/probe_evict.py

A 32 MiB copy (16-byte vectors, 4 in flight per thread, 4 CTAs of 256 threads per SM) with its loads and / or its
stores under ``createpolicy.fractional.L2::evict_first``, timed after the dirty and the clean flush of
``probe_l2_flush.py``.
"""

import tilelang.language as T
import torch
from probe_l2_flush import report
from probe_w_read import POLICIES

from tk_core.jit import kernel

N = 32 << 20  # bytes
THREADS, CTAS, U = 256, 512, 4  # 4 steps per thread cover N exactly
PRELUDE = r"""
__device__ __forceinline__ unsigned long long tkp_ef() {
  unsigned long long pol;
  asm("createpolicy.POLICY;" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ void tkp_ld(void* dst, const void* src, int ef) {
  uint4 v;
  if (ef) asm volatile("ld.global.nc.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                       : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(src), "l"(tkp_ef()));
  else asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(src));
  *reinterpret_cast<uint4*>(dst) = v;
}
__device__ __forceinline__ void tkp_st(void* dst, const void* src, int ef) {
  uint4 v = *reinterpret_cast<const uint4*>(src);
  if (ef) asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1,%2,%3,%4}, %5;"
                       :: "l"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "l"(tkp_ef()) : "memory");
  else asm volatile("st.global.v4.u32 [%0], {%1,%2,%3,%4};" :: "l"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                    : "memory");
}
""".replace("POLICY", POLICIES["evict_first"])


@kernel(pass_configs={"tl.disable_safe_memory_legalize": True})
def copy_kernel(ld_ef: bool, st_ef: bool):
    vecs = N // 16
    steps = vecs // (CTAS * THREADS * U)

    @T.prim_func
    def main(src: T.Tensor((vecs, 4), "int32"), dst: T.Tensor((vecs, 4), "int32")):
        with T.Kernel(CTAS, threads=THREADS, prelude=PRELUDE) as c:
            tx = T.get_thread_binding()
            buf = T.alloc_local((U, 4), "int32")
            for s in T.serial(steps):
                for u in T.unroll(U):
                    i = ((s * CTAS + c) * U + u) * THREADS + tx
                    T.call_extern("handle", "tkp_ld", T.address_of(buf[u, 0]), T.address_of(src[i, 0]), int(ld_ef))
                for u in T.unroll(U):
                    i = ((s * CTAS + c) * U + u) * THREADS + tx
                    T.call_extern("handle", "tkp_st", T.address_of(dst[i, 0]), T.address_of(buf[u, 0]), int(st_ef))

    return main


def main():
    src = torch.randint(0, 1 << 30, (N // 16, 4), dtype=torch.int32, device="cuda")
    dst = torch.empty_like(src)
    report("torch copy_ 32 MiB", lambda: dst.copy_(src), 2 * N)
    for _ in range(2):
        for ld_ef, st_ef in ((False, False), (True, False), (False, True), (True, True)):
            k = copy_kernel.get(src.device, ld_ef=ld_ef, st_ef=st_ef)
            dst.zero_()
            k(src, dst)
            assert torch.equal(dst, src)
            report(f"copy 32 MiB ld_ef={ld_ef} st_ef={st_ef}", lambda k=k: k(src, dst), 2 * N)


if __name__ == "__main__":
    main()
