"""Compares tuning variants of the transpose kernels in one GPU run (not a pytest file).

    python3 packages/tk-transpose/benchmarks/sweep_transpose.py [spec ...]

A spec is ``shared,bits,block_m,block_n,threads,ctas_per_sm`` (``transpose_shared_kernel``, 8/16-bit),
``shifted,...`` (the same with ``shifted_stores``: output rows not 16-byte aligned) or
``register,bits,lanes_m,warps_m,warps_n,min_blocks,load_bytes`` (``transpose_kernel``). Each variant is
compiled (in parallel), checked bit-exact against the reference on edge, strided and anchor shapes, then timed
(CUPTI, L2 flushed) on the anchor shapes 8064x7168 and 8x8064x7168 (``shifted``: 8001 rows)."""

import sys

import tilelang
import torch

from tk_core.jit import arch_of, target_of
from tk_core.testing.bench import copy_bandwidth_gbps, device_time_us, timing_backend
from tk_transpose import reference
from tk_transpose.transpose import _access_mode, transpose_kernel, transpose_shared_kernel

DEFAULT = [  # the op's defaults first
    "shared,16,128,128,256,3", "shared,16,64,128,128,6", "shared,16,128,128,256,4", "shared,16,128,256,256,2",
    "shared,8,128,256,128,5", "shared,8,128,256,128,3", "shared,8,128,128,64,9", "shared,8,256,256,256,2",
    "register,16,4,2,2,6,16", "register,8,4,2,2,4,16", "register,32,4,2,4,4,16",
]
ANCHOR = {8: (3640, 3895), 16: (3909, 4098)}  # anchor GB/s: e4m3 / bf16, 2-D and batched
DT = {8: torch.uint8, 16: torch.uint16, 32: torch.int32}  # views of raw bytes
EDGE_CASES = [((2, 144, 250), 6), ((3, 208, 576), 16), ((1, 4032, 576), 0), ((2, 16, 4099), 13), ((1, 64, 64), 0),
              ((2, 272, 300), 20), ((2, 145, 250), 6), ((3, 201, 576), 16), ((1, 4031, 576), 0), ((2, 9, 4099), 13),
              ((1, 63, 64), 0), ((2, 263, 300), 20), ((1, 8001, 1000), 0)]


def parse(spec):
    kind, *nums = spec.split(",")
    bits, *p = map(int, nums)
    if kind in ("shared", "shifted"):
        return bits, transpose_shared_kernel, dict(block_m=p[0], block_n=p[1], threads=p[2], ctas_per_sm=p[3],
                                                    shifted_stores=kind == "shifted")
    return bits, transpose_kernel, dict(mode="vector", lanes_m=p[0], warps_m=p[1], warps_n=p[2], min_blocks=p[3],
                                         load_bytes=p[4])


def rand(shape, bits):
    return torch.randint(0, 256, (*shape[:-1], shape[-1] * bits // 8), dtype=torch.uint8, device="cuda").view(DT[bits])


def run(k, x, out):
    k(x.as_strided(x.shape, (x.stride(0), x.stride(1), 1)), out)


def main():
    specs = sys.argv[1:] or DEFAULT
    parsed = [parse(s) for s in specs]
    funcs = [f(elem_bits=bits, **kw) for bits, f, kw in parsed]
    kernels = tilelang.par_compile(funcs, target=target_of(arch_of(None)), num_workers=16,
                                   pass_configs=transpose_shared_kernel.pass_configs)
    print(f"copy {copy_bandwidth_gbps():.0f} GB/s, timer {timing_backend()}")
    for spec, (bits, _, kw), k in zip(specs, parsed, kernels):
        mode = "vector_load" if kw.get("shifted_stores") else "vector"
        rows = 8001 if mode == "vector_load" else 8064
        ok = True
        for shape, pad in EDGE_CASES:
            x = rand((shape[0], shape[1], shape[2] + pad), bits)[..., : shape[2]]
            out = rand((shape[0], shape[2], shape[1]), bits)
            if _access_mode(x, out) != mode:
                continue
            run(k, x, out)
            ok &= torch.equal(out, reference.batched_transpose(x))
        res = []
        for shape in [(1, rows, 7168), (8, rows, 7168)]:
            x = rand(shape, bits)
            out = torch.empty(shape[0], shape[2], shape[1], dtype=x.dtype, device="cuda")
            run(k, x, out)
            ok &= torch.equal(out, reference.batched_transpose(x))
            us = device_time_us(lambda k=k, x=x, out=out: run(k, x, out))
            res.append(2 * x.numel() * x.element_size() / us / 1e3)
            del x, out
        anchor = ANCHOR.get(bits, (float("nan"),) * 2)
        print(f"{spec:>26} ok={ok} 2d={res[0]:.0f} ({res[0] / anchor[0]:.3f}) batched={res[1]:.0f} "
              f"({res[1] / anchor[1]:.3f}) GB/s", flush=True)


if __name__ == "__main__":
    main()
