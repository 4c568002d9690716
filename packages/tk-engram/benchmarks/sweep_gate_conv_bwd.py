"""Compares the GateConv backward kernels with their pre-cut copy and tuning variants in one GPU run (not a pytest
file).

    PYTHONPATH=$(ls -d packages/*/src | tr '\\n' :) python3 packages/tk-engram/benchmarks/sweep_gate_conv_bwd.py [name ...]

``old`` (optional): a frozen copy of the kernels as they were before session 4's instruction cut, in
``.proto/gcb_old.py`` at the repository root (ignored by git; carry ``.proto`` to the GPU machine). Without it only
the package kernels run, checked against the reference. Each variant sets ``gate_conv.BWD_PARAMS`` (main kernel, by
``fuse_dconv(d)``: 16-byte vectors per thread, whether the weights load once per iteration) and runs the package
kernels. All kernels compile first, in parallel.

Checks, per variant, on the anchors and odd shapes (d=200 fp16 with 3 taps and dilation 2, an unaligned d=1000,
the same with conv taps so large that most vectors take the IEEE reciprocal, T below the history, 1 token, 0
tokens): every kernel output (dH, dk, dv, the per-CTA partial sums of both kernels, NaN-prefilled so that unwritten
elements count) equal as integers to the old kernels' with the same parameters (``ok``, with ``old``), and the public op against
``reference.gate_conv_bwd_ref`` with the GPU test's criteria (``ref``). Then times the public op (main kernel,
dconv kernel and the fixed-order sums; CUPTI, L2 flushed) on the anchors. ``anchor`` is the measured copy
bandwidth, so ``ratio-of-copy`` is the fraction of copy (target 0.85). Bytes: ``gate_conv.bwd_roofline_bytes``.
"""

import os
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor

import torch

from tk_core.jit import arch_of
from tk_core.testing import calc_diff
from tk_core.testing.bench import copy_bandwidth_gbps, device_time_us
from tk_engram import _gate_conv_kernels as K
from tk_engram import gate_conv, reference

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", ".proto"))
try:
    import gcb_old
except ImportError:  # the frozen copy lives outside the repository
    gcb_old = None


def bp(vecs4096=1, hoist4096=False, vecs7168=1, hoist7168=False, ahead=True, planes4096=True, planes7168=False):
    """``BWD_PARAMS`` from the choices for fused-dconv rows (d <= 4096) and wider rows."""
    return {
        True: dict(vecs=vecs4096, hoist_w=hoist4096, ahead=ahead, planes=planes4096),
        False: dict(vecs=vecs7168, hoist_w=hoist7168, ahead=ahead, planes=planes7168),
    }


VARIANTS = {  # name: BWD_PARAMS; ``new`` = the op default (also timed with the old kernels: ``old``)
    "new": gate_conv.BWD_PARAMS,
    "v1": bp(1, False, 1, False),  # 1 vector per thread at every width (session 3's layout)
    "v2": bp(2, True, 2, False),  # 2 vectors per thread at every width, weights hoisted at d=4096
    "planes": bp(1, False, 2, False, planes7168=True),  # the two-plane float32 rows also at d=7168
}
ANCHORS = [(4, 2048, 4096, 4, 1), (4, 2048, 7168, 4, 1), (2, 4096, 7168, 4, 3)]  # (M, T, d, taps, dilation)
ODD = [  # (M, T, d, taps, dilation, dtype, conv_w scale)
    (2, 67, 200, 3, 2, torch.float16, 0.5),
    (3, 70, 1000, 4, 1, torch.bfloat16, 0.5),
    (3, 70, 1000, 4, 1, torch.bfloat16, 40.0),  # u < -87 in most vectors: the IEEE reciprocal
    (2, 2, 4096, 4, 1, torch.bfloat16, 0.5),  # T below the history
    (1, 201, 7168, 4, 3, torch.bfloat16, 0.5),
    (1, 1, 7168, 4, 1, torch.bfloat16, 0.5),
    (2, 0, 200, 3, 2, torch.float16, 0.5),
]
TL = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
SHAPES = [(*a, torch.bfloat16, 0.5) for a in ANCHORS] + ODD


def factories(impl):
    if impl == "old":
        return gcb_old.gate_conv_bwd_kernel_old, gcb_old.gate_conv_dconv_kernel_old
    return K.gate_conv_bwd_kernel, K.gate_conv_dconv_kernel


def kernel_params(impl, bwd, d, taps, dil, dtype):
    """(main kernel params, dconv kernel params or None) of one shape."""
    p = dict(dtype=TL[dtype], d=d, taps=taps, dilation=dil)
    fused = K.fuse_dconv(d)
    mp = dict(p, chunk=gate_conv.CHUNK, with_dconv=fused, **bwd[fused])
    if impl == "old":
        mp.pop("planes", None)  # a layout of shared memory only: the old kernels have the contiguous rows
    return mp, None if fused else dict(p, **gate_conv.DCONV_PARAMS)


def jobs(impl, variant):
    fb, fd = factories(impl)
    out = []
    for _, _, d, taps, dil, dt, _ in SHAPES:
        mp, dp = kernel_params(impl, VARIANTS[variant], d, taps, dil, dt)
        out.append((fb, mp))
        if dp is not None:
            out.append((fd, dp))
    return out


def case(M, T, d, taps, dil, dtype, scale):
    """Backward arguments with the reference forward's statistics."""
    g = lambda *s: torch.randn(*s, device="cuda")  # noqa: E731
    x = (g(M, T, d).to(dtype), g(M, T, d).to(dtype), g(M, T, d).to(dtype), (1 + 0.3 * g(d)).to(dtype),
         (1 + 0.3 * g(d)).to(dtype), (scale * g(taps, d)).to(dtype))
    stats = reference.gate_conv_fwd_ref(*x, dil, 1e-6)[2:6]
    return (g(M, T, d).to(dtype), *x, *stats)


def raw(impl, variant, args, dil):
    """Every output of the two kernels (NaN-prefilled), as the public op would launch them."""
    dY, H, k, v, wh, wv, cw, a, rh, rk, rv = args
    M, T, d = H.shape
    taps = cw.shape[0]
    if M * T == 0:
        return []
    fb, fd = factories(impl)
    mp, dp = kernel_params(impl, VARIANTS[variant], d, taps, dil, H.dtype)
    nan = lambda *s, dt: torch.full(s, float("nan"), dtype=dt, device="cuda")  # noqa: E731
    dH, dk, dv = (nan(M, T, d, dt=H.dtype) for _ in range(3))
    part = nan(gate_conv._num_parts(M, T, dil), 2 + taps if dp is None else 2, d, dt=torch.float32)
    fb.get(H.device, **mp)(dY, H, k, v, wh, wv, cw, a, rh, rk, rv, dH, dk, dv, part)
    out = [dH, dk, dv, part]
    if dp is not None:
        dpart = nan(gate_conv._num_parts(M, T, dil, gate_conv.DCONV_PARAMS["chunk"]), taps, d, dt=torch.float32)
        fd.get(H.device, **dp)(dY, v, wv, cw, a, rv, dpart)
        out.append(dpart)
    return out


def same_bits(xs, ys):
    iv = {2: torch.int16, 4: torch.int32}
    return len(xs) == len(ys) and all(
        x.shape == y.shape and torch.equal(x.view(iv[x.element_size()]), y.view(iv[y.element_size()]))
        for x, y in zip(xs, ys))


def use(impl, variant):
    """Point the public op at the old or new kernels with the variant's parameters."""
    gate_conv.BWD_PARAMS = VARIANTS[variant]
    gate_conv.gate_conv_bwd_kernel, gate_conv.gate_conv_dconv_kernel = factories(impl)


def ref_ok(args, dil):
    out = gate_conv.engram_gate_conv_bwd(*args, dilation=dil)
    ref = reference.gate_conv_bwd_ref(*args, dil)
    return all(o.shape == r.shape and not o.float().isnan().any() and (o.numel() == 0 or calc_diff(o, r) < 1e-4)
               for o, r in zip(out, ref))


def main():
    names = [n for n in sys.argv[1:] if n in VARIANTS] or list(VARIANTS)
    impls = ["new"] + (["old"] if gcb_old is not None else [])
    if gcb_old is None:
        print("no .proto/gcb_old.py: new kernels only, checked against the reference", flush=True)
    uniq = {}
    for n in names:
        for impl in impls:
            for f, p in jobs(impl, n):
                uniq[(f.name, tuple(sorted(p.items())))] = (f, p)

    def build(job):  # failures print and leave the variant to fail below
        try:
            job[0].get(arch_of(None), **job[1])
        except Exception as e:
            print(f"compile FAILED {job[0].name} {job[1]}: {str(e)[-300:]}", flush=True)

    with ThreadPoolExecutor(16) as pool:  # nvcc runs in subprocesses: the compiles overlap
        list(pool.map(build, uniq.values()))
    copy = copy_bandwidth_gbps()
    print(f"copy {copy:.0f} GB/s ({len(uniq)} kernels)", flush=True)
    torch.manual_seed(0)
    cases = {s: case(*s) for s in SHAPES}
    for n in names:
        for impl in impls if n == "new" else ["new"]:
            name = n if impl == "new" else "old"
            try:
                use(impl, n)
                for s, args in cases.items():
                    M, T, d, taps, dil = s[:5]
                    ok = good = "base"
                    if impl == "new":
                        ok = same_bits(raw("new", n, args, dil), raw("old", n, args, dil)) if gcb_old else None
                        good = ref_ok(args, dil)
                    shape = f"M={M} T={T} d={d} taps={taps} dil={dil} {TL[s[5]]} w={s[6]}"
                    if s[:5] not in ANCHORS or s[5] != torch.bfloat16 or s[6] != 0.5:
                        if impl == "new":
                            print(f"bwd[{name}] {shape} ok={ok} ref={good}", flush=True)
                        continue
                    us = device_time_us(lambda args=args, dil=dil: gate_conv.engram_gate_conv_bwd(*args, dilation=dil))
                    gbs = gate_conv.bwd_roofline_bytes(M, T, d, taps) / us / 1e3
                    print(f"bwd[{name}] {shape} ok={ok} ref={good} us={us:.1f} GB/s={gbs:.0f} anchor={copy:.0f} "
                          f"ratio-of-copy={gbs / copy:.3f}", flush=True)
            except Exception:  # one broken variant must not hide the others
                print(f"bwd[{name}] FAILED", flush=True)
                traceback.print_exc()
    use("new", "new")


if __name__ == "__main__":
    main()
