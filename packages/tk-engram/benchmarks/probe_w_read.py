"""How fast the decode step's W bytes can be read in the GEMV's access pattern (not a pytest file).

    python3 packages/tk-engram/benchmarks/probe_w_read.py

W_K and W_V at d=4096, d_mem=2048 side by side: a 32 MB bf16 matrix of 2048 rows x 8192 columns, read with 16-byte
loads by CTAs of 128 threads, 8 loads per thread in flight, in four orders: ``panel`` (128 CTAs, CTA c reads the
64-column panel c over all rows: 128-byte row segments 16 KB apart, the order of ``decode_gemv_kernel``),
``panel_x2`` (256 CTAs, 2 per SM: each panel split into two halves of the rows), ``panel256`` (128 CTAs, a
256-column panel over a quarter of the rows: 512-byte segments) and ``rows`` (128 CTAs, 16 whole rows each: 256 KB
contiguous). Each order runs with 8 loads per thread in flight (16 KB per CTA) and with as many as the GEMV keeps
per SM (64 KB: 32 loads per thread at 1 CTA per SM, 16 at 2). CUPTI, L2 flushed. ``read_kernel(policy=...)``
loads with an L2 cache hint instead (``POLICIES``; ``probe_l2_flush.py evict``).
"""

import tilelang.language as T
import torch

from tk_core.jit import kernel
from tk_core.testing.bench import device_time_us

R, C = 2048, 8192
THREADS = 128
LAYOUTS = {"panel": 128, "panel_x2": 256, "panel256": 128, "rows": 128}  # layout: CTAs
IN_FLIGHT = {"panel": (8, 32), "panel_x2": (8, 16), "panel256": (8, 32), "rows": (8,)}  # layout: loads per thread


# L2 policies of the hinted load (``createpolicy``'s operands), by name
POLICIES = {
    "evict_first": "fractional.L2::evict_first.b64 %0, 1.0",
    "evict_first_half": "fractional.L2::evict_first.L2::evict_unchanged.b64 %0, 0.5",
    "evict_unchanged": "fractional.L2::evict_unchanged.b64 %0, 1.0",
    "evict_normal": "fractional.L2::evict_normal.b64 %0, 1.0",
}


def hinted_load(policy: str) -> str:
    return r"""
__device__ __forceinline__ void tkp_ld_hint(void* dst, const void* src) {
  uint4 v;
  unsigned long long pol;
  asm("createpolicy.POLICY;" : "=l"(pol));
  asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(src), "l"(pol));
  *reinterpret_cast<uint4*>(dst) = v;
}
""".replace("POLICY", POLICIES[policy])


@kernel(pass_configs={"tl.disable_safe_memory_legalize": True})
def read_kernel(layout: str, U: int = 8, policy: str = ""):
    ctas = LAYOUTS[layout]
    hinted = bool(policy)
    steps = R * C // (ctas * THREADS * 8)  # 16-byte vectors per thread

    @T.prim_func
    def main(W: T.Tensor((R, C), "bfloat16"), out: T.Tensor((ctas * THREADS,), "float32")):
        with T.Kernel(ctas, threads=THREADS, prelude=hinted_load(policy) if policy else "") as c:
            tx = T.get_thread_binding()
            buf = T.alloc_local((U, 8), "bfloat16")
            acc = T.alloc_local((1,), "float32")
            acc[0] = T.float32(0)
            for s0 in T.serial(steps // U):
                for u in T.unroll(U):
                    s = s0 * U + u
                    if layout == "panel":  # 8 threads per 128-byte segment, 16 rows per step
                        row = s * 16 + tx // 8
                        col = c * 64 + (tx % 8) * 8
                    elif layout == "panel_x2":
                        row = (c // 128) * (R // 2) + s * 16 + tx // 8
                        col = (c % 128) * 64 + (tx % 8) * 8
                    elif layout == "panel256":  # 32 threads per 512-byte segment, 4 rows per step
                        row = (c // 32) * (R // 4) + s * 4 + tx // 32
                        col = (c % 32) * 256 + (tx % 32) * 8
                    else:
                        flat = (c * steps + s) * THREADS * 8 + tx * 8
                        row = flat // C
                        col = flat % C
                    if hinted:
                        T.call_extern("handle", "tkp_ld_hint", T.address_of(buf[u, 0]), T.address_of(W[row, col]))
                    else:
                        for e in T.vectorized(8):
                            buf[u, e] = W[row, col + e]
                for u in T.unroll(U):  # keeps the loads
                    acc[0] = acc[0] + T.cast(buf[u, 0], "float32") + T.cast(buf[u, 7], "float32")
            out[c * THREADS + tx] = acc[0]

    return main


def main():
    W = torch.randn(R, C, device="cuda").bfloat16()
    for layout in list(LAYOUTS) * 2:
        for u in IN_FLIGHT[layout]:
            k = read_kernel.get(W.device, layout=layout, U=u)
            out = torch.empty(LAYOUTS[layout] * THREADS, dtype=torch.float32, device="cuda")
            us = device_time_us(lambda k=k, out=out: k(W, out))
            kb = LAYOUTS[layout] * THREADS * u * 16 // 132 // 1024
            print(f"{layout} U={u} (~{kb} KB/SM in flight): {us:.2f} us, {R * C * 2 / us / 1e3:.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()
