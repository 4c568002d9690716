"""Compares tuning variants of the GateConv forward kernel in one GPU run (not a pytest file), then checks and
times the backward as the public op runs it (one variant: ``bwd[default]``).

    python3 packages/tk-engram/benchmarks/sweep_gate_conv.py [VARIANT ...]

A variant is ``default`` (the op's ``gate_conv.FWD_PARAMS``) or comma-separated ``gate_conv_fwd_kernel``
parameters that override those, e.g. ``budget=100`` (in KB), ``vecs=3``, ``min_blocks=1``. Every variant is
compiled in parallel and run on odd shapes (d=200 fp16 with 3 taps and dilation 2, an unaligned d=1000, the same
with conv taps so large that most |u| exceed 64, T below the history, 1 token) and on the
anchors: its seven outputs must match ``reference.gate_conv_fwd_ref`` with the GPU-test tolerances, be
deterministic and equal the first variant's as integers (no parameter may change a bit). Then each is timed
(CUPTI, L2 flushed) on the benchmark shapes of bench_gate_conv.py. ``anchor`` is the measured copy bandwidth, so
``ratio`` is the fraction of copy (target 0.85). Bytes: ``gate_conv.fwd_roofline_bytes`` (each tensor once)."""

import sys
import traceback
from concurrent.futures import ThreadPoolExecutor

import tilelang
import torch

from tk_core.jit import arch_of, target_of
from tk_core.testing import calc_diff
from tk_core.testing.bench import copy_bandwidth_gbps, device_time_us
from tk_engram import engram_gate_conv_bwd, reference
from tk_engram._gate_conv_kernels import gate_conv_bwd_kernel, gate_conv_dconv_kernel, gate_conv_fwd_kernel
from tk_engram.gate_conv import DCONV_PARAMS, FWD_PARAMS, bwd_config, bwd_roofline_bytes, fwd_roofline_bytes

DEFAULT = ["default", "budget=90", "planes=0"]  # first = the op default
ANCHORS = [(4, 2048, 4096, 4, 1), (4, 2048, 7168, 4, 1), (2, 4096, 7168, 4, 3)]  # (M, T, d, taps, dilation)
ODD = [  # (M, T, d, taps, dilation, dtype, conv_w scale)
    (2, 67, 200, 3, 2, torch.float16, 0.5),
    (3, 70, 1000, 4, 1, torch.bfloat16, 0.5),
    (3, 70, 1000, 4, 1, torch.bfloat16, 40.0),  # |u| > 64 in most vectors
    (2, 5, 4096, 4, 3, torch.bfloat16, 0.5),
    (1, 1, 7168, 4, 1, torch.bfloat16, 0.5),
    (1, 70, 8192, 4, 2, torch.bfloat16, 0.5),
]
TL = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def params(spec):
    p = dict(FWD_PARAMS)
    if spec != "default":
        for kv in spec.split(","):
            k, v = kv.split("=")
            p[k] = int(v) * 1024 if k == "budget" else int(v)
    return p


def bits(x):
    """x as integers of its width (NaN payloads and signed zeros compare exactly)."""
    return x.view({2: torch.int16, 4: torch.int32}[x.element_size()])


def inputs(M, T, d, taps, dtype, conv_scale=0.5):
    torch.manual_seed(M * 1000003 + T * 1009 + d + taps)
    g = lambda *s: torch.randn(*s, device="cuda")  # noqa: E731
    return (g(M, T, d).to(dtype), g(M, T, d).to(dtype), g(M, T, d).to(dtype), (1 + 0.3 * g(d)).to(dtype),
            (1 + 0.3 * g(d)).to(dtype), (conv_scale * g(taps, d)).to(dtype))


def outputs(x, dilation):
    """Y, vhat, the 4 statistics and the state, NaN-filled so that unwritten elements fail the check."""
    M, T, d = x[0].shape
    hist = dilation * (x[5].shape[0] - 1)
    nan = lambda *s, dt=x[0].dtype: torch.full(s, float("nan"), dtype=dt, device="cuda")  # noqa: E731
    return [nan(M, T, d), nan(M, T, d), *(nan(M, T, dt=torch.float32) for _ in range(4)), nan(M, max(hist, 1), d)]


def run(k, x, out, dilation):
    k(*x, *out, 1e-6)
    return (*out[:6], out[6][:, : dilation * (x[5].shape[0] - 1)])


def close(out, ref, dtype):
    ok = True
    for o, r in zip(out, ref):
        tol = dict(rtol=1e-4, atol=1e-5) if o.dtype == torch.float32 else (
            dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=4e-3, atol=4e-3))
        ok &= o.shape == r.shape and bool(torch.isclose(o.float(), r.float(), **tol).all()) and calc_diff(o, r) < 1e-5
    return ok


def bwd_jobs():
    """The backward kernels the public op runs on the anchors, as (factory, params) lists, one list per
    factory: the factory cache compiles one kernel at a time, so each list goes to its own thread."""
    bwd, dconv = [], []
    for _, _, d, taps, dil in ANCHORS:
        p = dict(dtype="bfloat16", d=d, taps=taps, dilation=dil)
        cfg = bwd_config(d, arch_of(None))
        bwd.append((gate_conv_bwd_kernel, dict(p, **cfg)))
        if not cfg["with_dconv"]:
            dconv.append((gate_conv_dconv_kernel, dict(p, **DCONV_PARAMS)))
    return [bwd, dconv]


def sweep_bwd(copy, fwd_kernels):
    """The backward through the public function on the anchors (odd shapes: the GPU tests), with the stats
    of the first forward variant: the GPU test's check (no NaN, calc_diff < 1e-4 for all six outputs) and
    bitwise determinism, then the time."""
    for M, T, d, taps, dil in ANCHORS:
        try:
            x = inputs(M, T, d, taps, torch.bfloat16)
            stats = run(fwd_kernels[("bfloat16", d, taps, dil)], x, outputs(x, dil), dil)[2:6]
            args = (torch.randn(M, T, d, device="cuda").bfloat16(), *x, *stats)
            out = engram_gate_conv_bwd(*args, dilation=dil)
            ref = reference.gate_conv_bwd_ref(*args, dil)
            ok = all(not o.float().isnan().any() and calc_diff(o, r) < 1e-4 for o, r in zip(out, ref))
            ok &= all(torch.equal(a, b) for a, b in zip(out, engram_gate_conv_bwd(*args, dilation=dil)))
            us = device_time_us(lambda args=args, dil=dil: engram_gate_conv_bwd(*args, dilation=dil))
            gbs = bwd_roofline_bytes(M, T, d, taps) / us / 1e3
            print(f"bwd[default] M={M} T={T} d={d} dil={dil} ok={ok} us={us:.1f} GB/s={gbs:.0f} "
                  f"anchor={copy:.0f} ratio={gbs / copy:.3f}", flush=True)
        except Exception:
            print(f"bwd[default] M={M} T={T} d={d} dil={dil} FAILED", flush=True)
            traceback.print_exc()


def compile_serial(jobs):
    """Compiles into the factory caches (what the public functions use); failures are printed."""
    for factory, p in jobs:
        try:
            factory.get(arch_of(None), **p)
        except Exception as e:
            print(f"compile FAILED {factory.name} {p}: {str(e)[-300:]}", flush=True)


def check(ks, variants):
    """Per variant and odd or anchor case: the outputs match the reference (GPU-test tolerances), two runs give
    the same bits and so does the first variant. Failing cases are printed."""
    ok = dict.fromkeys(variants, True)
    cases = ODD + [(M, T, d, taps, dil, torch.bfloat16, 0.5) for M, T, d, taps, dil in ANCHORS]
    for M, T, d, taps, dil, dt, cs in cases:
        key = (TL[dt], d, taps, dil)
        x = inputs(M, T, d, taps, dt, cs)
        ref = reference.gate_conv_fwd_ref(*x, dil, 1e-6)
        first = None
        for v in variants:
            try:
                k = ks[(v, key)]
                out = [o.clone() for o in run(k, x, outputs(x, dil), dil)]
                first = out if first is None else first
                near = close(out, ref, dt)
                det = all(torch.equal(bits(a), bits(b)) for a, b in zip(out, run(k, x, outputs(x, dil), dil)))
                same = all(torch.equal(bits(a), bits(b)) for a, b in zip(out, first))
                if not (near and det and same):
                    print(f"fwd[{v}] M={M} T={T} d={d} taps={taps} dil={dil}: reference {near}, deterministic "
                          f"{det}, bits of fwd[{variants[0]}] {same}", flush=True)
                ok[v] &= near and det and same
                del out
            except Exception:  # one broken variant must not hide the others
                print(f"fwd[{v}] M={M} T={T} d={d} taps={taps} dil={dil} FAILED", flush=True)
                traceback.print_exc()
                ok[v] = False
        del x, ref, first
    return ok


def main():
    variants = sys.argv[1:] or DEFAULT
    cases = [(M, T, d, taps, dil, torch.bfloat16) for M, T, d, taps, dil in ANCHORS] + [c[:6] for c in ODD]
    keys = sorted({(TL[dt], d, taps, dil) for _, _, d, taps, dil, dt in cases})
    jobs = [(v, key) for v in variants for key in keys]
    with ThreadPoolExecutor(2) as pool:  # the backward kernels compile while par_compile runs
        for group in bwd_jobs():
            pool.submit(compile_serial, group)
        funcs = [gate_conv_fwd_kernel(dtype=key[0], d=key[1], taps=key[2], dilation=key[3], **params(v))
                 for v, key in jobs]
        kernels = tilelang.par_compile(funcs, target=target_of(arch_of(None)), num_workers=16,
                                       pass_configs=gate_conv_fwd_kernel.pass_configs, ignore_error=True)
    ks = {job: k for job, k in zip(jobs, kernels) if k is not None}
    copy = copy_bandwidth_gbps()
    print(f"copy {copy:.0f} GB/s", flush=True)
    for v in variants:
        if any((v, key) not in ks for key in keys):
            print(f"fwd[{v}] FAILED to compile", flush=True)
    good = [v for v in variants if all((v, key) in ks for key in keys)]
    ok = check(ks, good)
    for v in good:
        try:
            for M, T, d, taps, dil in ANCHORS:
                x = inputs(M, T, d, taps, torch.bfloat16)
                k = ks[(v, ("bfloat16", d, taps, dil))]
                buf = outputs(x, dil)
                us = device_time_us(lambda k=k, x=x, buf=buf: k(*x, *buf, 1e-6))
                gbs = fwd_roofline_bytes(M, T, d, taps) / us / 1e3
                print(f"fwd[{v}] M={M} T={T} d={d} dil={dil} ok={ok[v]} us={us:.1f} GB/s={gbs:.0f} "
                      f"anchor={copy:.0f} ratio={gbs / copy:.3f}", flush=True)
                del x, buf
        except Exception:  # one broken variant must not hide the others
            print(f"fwd[{v}] FAILED", flush=True)
            traceback.print_exc()
    sweep_bwd(copy, {key: k for (v, key), k in ks.items() if v == variants[0]})


if __name__ == "__main__":
    main()
