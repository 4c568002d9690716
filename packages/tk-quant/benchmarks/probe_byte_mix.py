"""How fast the H200 moves the byte mixes of the lossless FP4 -> FP8 cast and the per-channel casts (not a pytest
file).

    python3 packages/tk-quant/benchmarks/probe_byte_mix.py

``per_block_cast_lossless`` at 8001 x 7168 reads 28.7 MB of packed fp4 (+ 7.2 MB of fp32 1 x 32 scales) and writes
57.3 MB of e4m3 (+ 1.8 MB of scales): one byte read per 1.65 written. This times plain kernels that move bytes in
fixed mixes at that size, with no arithmetic: ``widen`` reads 16-byte chunks and writes each twice (1 : 2; every
warp store covers 512 contiguous bytes), torch's ``copy_`` of the same total bytes (1 : 1) and ``zero_`` of the
output (0 : 1). ``narrow`` (2 : 1, the bf16 -> e4m3 per-channel casts at 8064 and 4096 x 7168): each thread reads
two 16-byte chunks and writes their xor, next to torch's own bf16 -> e4m3 conversion. GB/s count bytes read plus
written (CUPTI, L2 flushed), as the benchmarks do.
"""

import tilelang.language as T
import torch

from tk_core.jit import kernel
from tk_core.testing.bench import copy_bandwidth_gbps, device_time_us

THREADS = 256


@kernel(pass_configs={"tl.disable_safe_memory_legalize": True})
def widen_kernel(unroll: int = 2):
    """``out[2 g + h, lane-block]``: each 256-chunk group of the input written twice, as two 256-chunk groups."""
    n = T.dynamic("n")  # input 16-byte chunks, a multiple of THREADS * unroll

    @T.prim_func
    def main(x: T.Tensor((n, 4), "uint32"), out: T.Tensor((2 * n, 4), "uint32")):
        with T.Kernel(T.ceildiv(n, THREADS * unroll), threads=THREADS) as bx:
            tx = T.get_thread_binding()
            buf = T.alloc_local((unroll, 4), "uint32")
            for u in T.unroll(unroll):
                for e in T.vectorized(4):
                    buf[u, e] = x[(bx * unroll + u) * THREADS + tx, e]
            for u in T.unroll(unroll):
                base = 2 * (bx * unroll + u) * THREADS
                for e in T.vectorized(4):
                    out[base + tx, e] = buf[u, e]
                for e in T.vectorized(4):
                    out[base + THREADS + tx, e] = buf[u, e] ^ T.uint32(0x01010101)

    return main


@kernel(pass_configs={"tl.disable_safe_memory_legalize": True})
def narrow_kernel(unroll: int = 2):
    """``out[c] = x[2 c'] ^ x[2 c' + 1]`` per 256-chunk group: two 16-byte chunks read per chunk written."""
    n = T.dynamic("n")  # output 16-byte chunks, a multiple of THREADS * unroll

    @T.prim_func
    def main(x: T.Tensor((2 * n, 4), "uint32"), out: T.Tensor((n, 4), "uint32")):
        with T.Kernel(T.ceildiv(n, THREADS * unroll), threads=THREADS) as bx:
            tx = T.get_thread_binding()
            a = T.alloc_local((unroll, 4), "uint32")
            b = T.alloc_local((unroll, 4), "uint32")
            for u in T.unroll(unroll):
                base = 2 * (bx * unroll + u) * THREADS
                for e in T.vectorized(4):
                    a[u, e] = x[base + tx, e]
                for e in T.vectorized(4):
                    b[u, e] = x[base + THREADS + tx, e]
            for u in T.unroll(unroll):
                for e in T.vectorized(4):
                    out[(bx * unroll + u) * THREADS + tx, e] = a[u, e] ^ b[u, e]

    return main


def main():
    print(f"copy bandwidth {copy_bandwidth_gbps():.0f} GB/s (1 GiB)")
    in_bytes = 8001 * 3584  # the packed fp4 of 8001 x 7168
    n = in_bytes // 16 // (THREADS * 4) * (THREADS * 4)
    x = torch.randint(0, 2**31, (n, 4), dtype=torch.int32, device="cuda").view(torch.uint32)
    out = torch.empty(2 * n, 4, dtype=torch.uint32, device="cuda")
    moved = 3 * n * 16
    for unroll in (1, 2, 4):
        k = widen_kernel.get(x.device, unroll=unroll)
        k(x, out)
        assert torch.equal(out.view(-1, 2, THREADS, 4)[:, 0], x.view(-1, THREADS, 4))
        us = device_time_us(lambda k=k: k(x, out))
        print(f"widen 1:2, {unroll} chunks per thread: {us:.2f} us, {moved / us / 1e3:.0f} GB/s")
    src = torch.empty(3 * n * 8, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = device_time_us(lambda: dst.copy_(src))
    print(f"copy_ 1:1 of the same total bytes: {us:.2f} us, {2 * src.numel() / us / 1e3:.0f} GB/s")
    us = device_time_us(lambda: out.zero_())
    print(f"zero_ 0:1 of the output: {us:.2f} us, {out.numel() * 4 / us / 1e3:.0f} GB/s")
    for t in (8064, 4096):
        xb = torch.randn(t, 7168, device="cuda", dtype=torch.bfloat16)
        moved = xb.numel() * 3
        us = device_time_us(lambda xb=xb: xb.to(torch.float8_e4m3fn))
        print(f"T={t} torch bf16 -> e4m3 (2:1): {us:.2f} us, {moved / us / 1e3:.0f} GB/s")
        xi = xb.view(torch.uint32).view(-1, 4)
        nout = torch.empty(xi.shape[0] // 2, 4, dtype=torch.uint32, device="cuda")
        for unroll in (1, 2, 4):
            k = narrow_kernel.get(xb.device, unroll=unroll)
            us = device_time_us(lambda k=k, xi=xi, nout=nout: k(xi, nout))
            print(f"T={t} narrow 2:1, {unroll} chunks per thread: {us:.2f} us, {moved / us / 1e3:.0f} GB/s")


if __name__ == "__main__":
    main()
