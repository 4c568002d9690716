"""Compares tuning variants of ``transpose_kernel`` in one GPU run (not a pytest file).

    python3 packages/tk-transpose/benchmarks/sweep_transpose.py [bits,lanes_m,warps_m,warps_n,min_blocks,load_bytes ...]

Each variant is compiled (in parallel), checked bit-exact against the reference on edge, strided and
anchor shapes, then timed (CUPTI, L2 flushed) on the anchor shapes: 8064x7168 and 8x8064x7168."""

import sys

import tilelang
import torch

from tk_core.jit import arch_of, target_of
from tk_core.testing.bench import copy_bandwidth_gbps, device_time_us, timing_backend
from tk_transpose import reference
from tk_transpose.transpose import _access_mode, transpose_kernel

DEFAULT = [  # bits,lanes_m,warps_m,warps_n,min_blocks,load_bytes; the op's default first
    "8,4,2,2,4,16", "8,4,2,2,3,16", "8,4,2,2,5,16", "8,4,2,1,8,16", "8,4,4,1,5,16",
    "16,4,2,2,6,16", "16,4,2,4,3,16", "16,4,2,2,5,16", "16,4,2,2,7,16", "16,4,4,1,6,16", "16,4,2,1,12,16",
    "32,4,2,4,4,16",
]
ANCHOR = {8: (3640, 3895), 16: (3909, 4098)}  # anchor GB/s: e4m3 / bf16, 2-D and batched
DT = {8: torch.uint8, 16: torch.uint16, 32: torch.int32}  # views of raw bytes


def params(spec):
    bits, lm, wm, wn, mb, lb = map(int, spec.split(","))
    return bits, dict(lanes_m=lm, warps_m=wm, warps_n=wn, min_blocks=mb, load_bytes=lb)


def rand(shape, bits):
    return torch.randint(0, 256, (*shape[:-1], shape[-1] * bits // 8), dtype=torch.uint8, device="cuda").view(DT[bits])


def run(k, x, out):
    k(x.as_strided(x.shape, (x.stride(0), x.stride(1), 1)), out)


def main():
    specs = sys.argv[1:] or DEFAULT
    funcs = [transpose_kernel(elem_bits=params(s)[0], mode="vector", **params(s)[1]) for s in specs]
    kernels = tilelang.par_compile(funcs, target=target_of(arch_of(None)), num_workers=16,
                                   pass_configs=transpose_kernel.pass_configs)
    ks = {(s, "vector"): k for s, k in zip(specs, kernels)}
    print(f"copy {copy_bandwidth_gbps():.0f} GB/s, timer {timing_backend()}")
    for spec in specs:
        bits, kw = params(spec)
        ok = True
        for shape, pad in [((2, 144, 250), 6), ((3, 208, 576), 16), ((1, 4032, 576), 0), ((2, 16, 4099), 13), ((1, 64, 64), 0)]:
            x = rand((shape[0], shape[1], shape[2] + pad), bits)[..., : shape[2]]
            out = rand((shape[0], shape[2], shape[1]), bits)
            run(ks[(spec, _access_mode(x, out))], x, out)
            ok &= torch.equal(out, reference.batched_transpose(x))
        res = []
        for shape in [(1, 8064, 7168), (8, 8064, 7168)]:
            x = rand(shape, bits)
            out = torch.empty(shape[0], shape[2], shape[1], dtype=x.dtype, device="cuda")
            k = ks[(spec, "vector")]
            run(k, x, out)
            ok &= torch.equal(out, reference.batched_transpose(x))
            us = device_time_us(lambda k=k, x=x, out=out: run(k, x, out))
            res.append(2 * x.numel() * x.element_size() / us / 1e3)
            del x, out
        anchor = ANCHOR.get(bits, (float("nan"),) * 2)
        print(f"{spec:>22} ok={ok} 2d={res[0]:.0f} ({res[0] / anchor[0]:.3f}) batched={res[1]:.0f} "
              f"({res[1] / anchor[1]:.3f}) GB/s", flush=True)


if __name__ == "__main__":
    main()
