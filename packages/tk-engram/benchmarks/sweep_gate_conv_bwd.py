"""Compares GateConv backward configurations in one GPU run (not a pytest file).

    PYTHONPATH=$(ls -d packages/*/src | tr '\\n' :) python3 packages/tk-engram/benchmarks/sweep_gate_conv_bwd.py [name ...]

A variant is a replacement for ``gate_conv.bwd_config`` (the main kernel's parameters by row width: chunk, the
2-CTA cluster ``split``, whether dconv_w is fused, vectors per thread, the shared-memory layout); the public op
runs with it. All kernels compile first, in parallel.

Checks, per variant, on the anchors and odd shapes (d=200 fp16 with 3 taps and dilation 2, an unaligned d=1000,
the same with conv taps so large that most vectors take the IEEE reciprocal, T below the history, 1 token, 0
tokens, a d=8192 row, the cluster's halves wider than 4096 columns at d = 9216 / 12320 / 16384, and d=9224 without
16-byte halves): the public op against ``reference.gate_conv_bwd_ref`` with the GPU test's criteria (``ref``) and
two runs bit-identical (``det``). Then times the public op (main kernel, the dconv kernel where it runs, the
fixed-order sums; CUPTI, L2 flushed) on the anchors, or with ``wide`` among the arguments on 8192 tokens at d = 9216 /
12288 / 16384 (``WIDE``). ``anchor`` is the measured copy bandwidth, so
``ratio-of-copy`` is the fraction of copy (target 0.85). Bytes: ``gate_conv.bwd_roofline_bytes``.
"""

import sys
import traceback
from concurrent.futures import ThreadPoolExecutor

import torch

from tk_core.jit import KernelFactory, arch_of
from tk_core.testing import calc_diff
from tk_core.testing.bench import copy_bandwidth_gbps, device_time_us
from tk_engram import _gate_conv_kernels as K
from tk_engram import gate_conv, reference


def config(split_max=2, cluster_chunk=2 * gate_conv.CHUNK):
    """A ``bwd_config``: ``split_max`` 1 is the one-CTA-per-chunk kernel of session 6 at every width;
    ``cluster_chunk`` the tokens a 2-CTA cluster walks (single CTAs keep ``CHUNK``)."""
    def cfg(d, arch):
        split = min(K.bwd_split(d), split_max)
        fused = K.fuse_dconv(d // split)
        chunk = cluster_chunk if split > 1 else gate_conv.CHUNK
        return dict(chunk=chunk, split=split, with_dconv=fused, **gate_conv.bwd_params(fused, arch))
    return cfg


def half_vecs(vecs):
    """The op default with ``vecs`` vectors per thread in the cluster CTAs that hold more than 4096 columns."""
    def cfg(d, arch, default=gate_conv.bwd_config):  # bound now: ``main`` replaces ``gate_conv.bwd_config``
        c = default(d, arch)
        return dict(c, vecs=vecs) if c["split"] > 1 and not c["with_dconv"] else c
    return cfg


def default_with(**over):
    """The op default with ``over`` set (bound now: ``main`` replaces ``gate_conv.bwd_config`` by the variant)."""
    return lambda d, arch, cfg=gate_conv.bwd_config: dict(cfg(d, arch), **over)


VARIANTS = {
    "new": gate_conv.bwd_config,  # the op default (128 tokens per cluster)
    "nosplit": config(split_max=1),  # session 6: one CTA per chunk, 2 vectors per thread and the dconv kernel
    # the cluster's halves wider than 4096 columns (d > 8192) at 2 / 3 vectors per thread (default:
    # ``bwd_half_vecs``); ``nosplit`` is the op before session 38 there (one CTA up to d = 10,240, the reference
    # above)
    "hv2": half_vecs(2),
    "hv3": half_vecs(3),
    "split_c64": config(cluster_chunk=64),  # twice the clusters: two rounds at 8192 tokens
    "split_c32": config(cluster_chunk=32),
    # the approximate sigmoid at every width (the op takes it in the cluster kernels only)
    "approx": default_with(approx_sigmoid=True),
    # session 35: the weights loaded where each stage uses them (the default before it, and on sm_100a)
    "stage_w": default_with(resident_w=False),
    # the op default with TileLang's shared-memory sync planner on (as before session 23; ``PLANNER_KERNEL``): at
    # d > 4096 it added two barriers per token around the row sums' exchange
    "planner": gate_conv.bwd_config,
    # the int64 addresses of TileLang's indices (the op's choice from 2**31 elements on; before session 43 always)
    "int64": default_with(idx32=False),
}
PLANNER_KERNEL = KernelFactory(K.gate_conv_bwd_kernel.factory,
                               {**K.gate_conv_bwd_kernel.pass_configs, "tl.disable_thread_storage_sync": False})
ANCHORS = [(4, 2048, 4096, 4, 1), (4, 2048, 7168, 4, 1), (2, 4096, 7168, 4, 3)]  # (M, T, d, taps, dilation)
ODD = [  # (M, T, d, taps, dilation, dtype, conv_w scale)
    (2, 67, 200, 3, 2, torch.float16, 0.5),
    (3, 70, 1000, 4, 1, torch.bfloat16, 0.5),
    (3, 70, 1000, 4, 1, torch.bfloat16, 40.0),  # u < -87 in most vectors: the IEEE reciprocal
    (2, 2, 4096, 4, 1, torch.bfloat16, 0.5),  # T below the history
    (1, 201, 7168, 4, 3, torch.bfloat16, 0.5),
    (1, 1, 7168, 4, 1, torch.bfloat16, 0.5),
    (3, 150, 7168, 3, 2, torch.bfloat16, 40.0),
    (1, 70, 8192, 4, 2, torch.bfloat16, 0.5),
    (2, 0, 200, 3, 2, torch.float16, 0.5),
    (1, 70, 9216, 4, 2, torch.bfloat16, 0.5),  # cluster halves wider than 4096 columns
    (2, 33, 12320, 3, 1, torch.float16, 0.5),  # (halves of 6160 columns: a partial last vector group)
    (1, 40, 16384, 4, 3, torch.bfloat16, 0.5),
    (1, 20, 9224, 4, 1, torch.bfloat16, 0.5),  # no 16-byte halves: one CTA
]
# checked and timed with ``wide`` among the arguments (instead of timing the anchors): the rows the cluster takes
# from session 38 on
WIDE = [(1, 8192, 9216, 4, 1), (1, 8192, 12288, 4, 1), (1, 8192, 16384, 4, 1)]
TL = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
SHAPES = [(*a, torch.bfloat16, 0.5) for a in ANCHORS] + ODD


def jobs(variant, shapes):
    out = []
    for _, _, d, taps, dil, dt, _ in shapes:
        cfg = VARIANTS[variant](d, arch_of(None))
        p = dict(dtype=TL[dt], d=d, taps=taps, dilation=dil)
        out.append((main_kernel(variant), dict(p, **cfg)))
        if not cfg["with_dconv"]:
            out.append((K.gate_conv_dconv_kernel, dict(p, **gate_conv.DCONV_PARAMS)))
    return out


def main_kernel(variant):
    return PLANNER_KERNEL if variant == "planner" else K.gate_conv_bwd_kernel


def case(M, T, d, taps, dil, dtype, scale):
    """Backward arguments with the reference forward's statistics."""
    g = lambda *s: torch.randn(*s, device="cuda")  # noqa: E731
    x = (g(M, T, d).to(dtype), g(M, T, d).to(dtype), g(M, T, d).to(dtype), (1 + 0.3 * g(d)).to(dtype),
         (1 + 0.3 * g(d)).to(dtype), (scale * g(taps, d)).to(dtype))
    stats = reference.gate_conv_fwd_ref(*x, dil, 1e-6)[2:6]
    return (g(M, T, d).to(dtype), *x, *stats)


def same_bits(xs, ys):
    iv = {2: torch.int16, 4: torch.int32}
    return len(xs) == len(ys) and all(
        x.shape == y.shape and torch.equal(x.view(iv[x.element_size()]), y.view(iv[y.element_size()]))
        for x, y in zip(xs, ys))


def checks(args, dil):
    """(ref, det): the op against the reference (the GPU test's criteria) and two runs with the same bits."""
    out = gate_conv.engram_gate_conv_bwd(*args, dilation=dil)
    again = gate_conv.engram_gate_conv_bwd(*args, dilation=dil)
    ref = reference.gate_conv_bwd_ref(*args, dil)
    good = all(o.shape == r.shape and not o.float().isnan().any() and (o.numel() == 0 or calc_diff(o, r) < 1e-4)
               for o, r in zip(out, ref))
    return good, same_bits(out, again)


def main():
    names = [n for n in sys.argv[1:] if n in VARIANTS] or list(VARIANTS)
    timed = WIDE if "wide" in sys.argv[1:] else ANCHORS
    shapes = SHAPES + [(*a, torch.bfloat16, 0.5) for a in timed if a not in ANCHORS]
    uniq = {}
    for n in names:
        for f, p in jobs(n, shapes):
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
    cases = {s: case(*s) for s in shapes}
    default = gate_conv.bwd_config
    for n in names:
        try:
            gate_conv.bwd_config = VARIANTS[n]
            gate_conv.gate_conv_bwd_kernel = main_kernel(n)
            for s, args in cases.items():
                M, T, d, taps, dil = s[:5]
                good, det = checks(args, dil)
                shape = f"M={M} T={T} d={d} taps={taps} dil={dil} {TL[s[5]]} w={s[6]}"
                if s[:5] not in timed or s[5] != torch.bfloat16 or s[6] != 0.5:
                    print(f"bwd[{n}] {shape} ref={good} det={det}", flush=True)
                    continue
                us = device_time_us(lambda args=args, dil=dil: gate_conv.engram_gate_conv_bwd(*args, dilation=dil))
                gbs = gate_conv.bwd_roofline_bytes(M, T, d, taps) / us / 1e3
                print(f"bwd[{n}] {shape} ref={good} det={det} us={us:.1f} GB/s={gbs:.0f} anchor={copy:.0f} "
                      f"ratio-of-copy={gbs / copy:.3f}", flush=True)
        except Exception:  # one broken variant must not hide the others
            print(f"bwd[{n}] FAILED", flush=True)
            traceback.print_exc()
        finally:
            gate_conv.bwd_config = default
            gate_conv.gate_conv_bwd_kernel = K.gate_conv_bwd_kernel


if __name__ == "__main__":
    main()
