"""Compares tuning variants of the GateConv backward in one GPU run (not a pytest file).

    python3 packages/tk-engram/benchmarks/sweep_gate_conv_bwd.py [name ...]

A variant sets ``gate_conv.BWD_PARAMS`` (main kernel, by ``fuse_dconv(d)``: 16-byte vectors per thread and
whether the weights load once per iteration) and ``gate_conv.DCONV_PARAMS`` (the d > 4096 dconv kernel: chain
tokens per CTA, threads, CTAs per SM), then runs the public ``engram_gate_conv_bwd`` (main kernel, dconv kernel
and the fixed-order sums, all in the time). All kernels compile first in parallel. Each variant is checked
against ``reference.gate_conv_bwd_ref`` with the GPU test's criteria (no NaN, calc_diff < 1e-4) on odd shapes
(d=200 fp16 with 3 taps and dilation 2, T below the history, 1 token, 0 tokens) and on the anchors, checked
deterministic and bitwise equal to the first variant (all variants sum in the same order), then timed (CUPTI,
L2 flushed) on the anchors. ``anchor`` is the measured copy bandwidth, so ``ratio`` is the fraction of copy
(target 0.85). Bytes: ``gate_conv.bwd_roofline_bytes`` (each tensor once)."""

import sys
import traceback
from concurrent.futures import ThreadPoolExecutor

import torch

from tk_core.jit import arch_of
from tk_core.testing import calc_diff
from tk_core.testing.bench import copy_bandwidth_gbps, device_time_us
from tk_engram import gate_conv, reference
from tk_engram._gate_conv_kernels import fuse_dconv, gate_conv_bwd_kernel, gate_conv_dconv_kernel

DC = dict(chunk=128, threads=128, min_blocks=4)


def bp(vecs4096, hoist4096, vecs7168, hoist7168, ahead=True):
    """``BWD_PARAMS`` from the choices for fused-dconv rows (d <= 4096) and wider rows."""
    return {
        True: dict(vecs=vecs4096, hoist_w=hoist4096, ahead=ahead),
        False: dict(vecs=vecs7168, hoist_w=hoist7168, ahead=ahead),
    }


VARIANTS = {  # name: (BWD_PARAMS, DCONV_PARAMS); first = the op default
    "v1": (bp(1, False, 1, False), DC),
    "v2": (bp(2, True, 2, False), DC),
    "v1_noahead": (bp(1, False, 1, False, ahead=False), DC),
    "v2_noahead": (bp(2, True, 2, False, ahead=False), DC),
    "v1_dc64": (bp(1, False, 1, False), dict(chunk=64, threads=128, min_blocks=4)),
}
ANCHORS = [(4, 2048, 4096, 4, 1), (4, 2048, 7168, 4, 1), (2, 4096, 7168, 4, 3)]  # (M, T, d, taps, dilation)
ODD = [  # (M, T, d, taps, dilation, dtype)
    (2, 67, 200, 3, 2, torch.float16),
    (2, 2, 4096, 4, 1, torch.bfloat16),  # T below the history
    (1, 201, 7168, 4, 3, torch.bfloat16),
    (1, 1, 7168, 4, 1, torch.bfloat16),
    (2, 0, 200, 3, 2, torch.float16),
]
TL = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def jobs(variant):
    """(factory, params) of every kernel the variant runs on the anchors and odd shapes."""
    bwd, dc = VARIANTS[variant]
    out = []
    for _, _, d, taps, dil, dt in [(*a, torch.bfloat16) for a in ANCHORS] + ODD:
        p = dict(dtype=TL[dt], d=d, taps=taps, dilation=dil)
        fused = fuse_dconv(d)
        out.append((gate_conv_bwd_kernel, dict(p, chunk=gate_conv.CHUNK, with_dconv=fused, **bwd[fused])))
        if not fused:
            out.append((gate_conv_dconv_kernel, dict(p, **dc)))
    return out


def case(M, T, d, taps, dil, dtype):
    """Backward arguments with the reference forward's statistics."""
    g = lambda *s: torch.randn(*s, device="cuda")  # noqa: E731
    x = (
        g(M, T, d).to(dtype),
        g(M, T, d).to(dtype),
        g(M, T, d).to(dtype),
        (1 + 0.3 * g(d)).to(dtype),
        (1 + 0.3 * g(d)).to(dtype),
        (0.5 * g(taps, d)).to(dtype),
    )
    stats = reference.gate_conv_fwd_ref(*x, dil, 1e-6)[2:6]
    return (g(M, T, d).to(dtype), *x, *stats)


def use(variant):
    bwd, dc = VARIANTS[variant]
    gate_conv.BWD_PARAMS = bwd
    gate_conv.DCONV_PARAMS = dc


def check(args, dil, first):
    out = gate_conv.engram_gate_conv_bwd(*args, dilation=dil)
    ref = reference.gate_conv_bwd_ref(*args, dil)
    ok = all(o.shape == r.shape and not o.float().isnan().any() and calc_diff(o, r) < 1e-4 for o, r in zip(out, ref))
    ok &= all(torch.equal(a, b) for a, b in zip(out, gate_conv.engram_gate_conv_bwd(*args, dilation=dil)))
    if first is not None:
        ok &= all(torch.equal(a, b) for a, b in zip(out, first))
    return ok, out


def main():
    names = sys.argv[1:] or list(VARIANTS)
    uniq = {}
    for n in names:
        for f, p in jobs(n):
            uniq[(f.name, tuple(sorted(p.items())))] = (f, p)

    def build(job):  # failures print and leave the variant to fail below
        try:
            job[0].get(arch_of(None), **job[1])
        except Exception as e:
            print(f"compile FAILED {job[0].name} {job[1]}: {str(e)[-300:]}", flush=True)

    with ThreadPoolExecutor(16) as pool:  # nvcc runs in subprocesses: the compiles overlap
        list(pool.map(build, uniq.values()))
    copy = copy_bandwidth_gbps()
    print(f"copy {copy:.0f} GB/s", flush=True)
    cases = {c: case(*c) for c in ODD}
    anchors = {a: case(*a, torch.bfloat16) for a in ANCHORS}
    firsts = {}
    for n in names:
        try:
            use(n)
            ok = True
            for c, args in cases.items():
                good, out = check(args, c[4], firsts.get(c))
                if good:
                    firsts.setdefault(c, out)
                ok &= good
            for a, args in anchors.items():
                M, T, d, taps, dil = a
                good, out = check(args, dil, firsts.get(a))
                if good:
                    firsts.setdefault(a, out)
                us = device_time_us(lambda args=args, dil=dil: gate_conv.engram_gate_conv_bwd(*args, dilation=dil))
                gbs = gate_conv.bwd_roofline_bytes(M, T, d, taps) / us / 1e3
                print(
                    f"bwd[{n}] M={M} T={T} d={d} dil={dil} ok={ok and good} us={us:.1f} GB/s={gbs:.0f} "
                    f"anchor={copy:.0f} ratio={gbs / copy:.3f}",
                    flush=True,
                )
        except Exception:  # one broken variant must not hide the others
            print(f"bwd[{n}] FAILED", flush=True)
            traceback.print_exc()


if __name__ == "__main__":
    main()
