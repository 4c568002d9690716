"""Compares tuning variants of the decode step in one GPU run (not a pytest file).

    python3 packages/tk-engram/benchmarks/sweep_decode.py [variant ...]

Fused variants run ``decode_fused_kernel`` (one launch: projection, split-K sum, gate, conv, cache update)
with ``fused_config``'s tiling changed as named in VARIANTS (the first is the op's default);
``two_launch`` is the previous path (``decode_proj_kernel`` + ``decode_step_kernel``, still used when the
fused kernel has too many panel finishers), timed per kernel too (proj_us, step_us). Each variant is compiled
(in parallel), checked against ``reference.decode_step_ref`` (the GPU test's tolerances, plus run-to-run bit
equality, which also checks that the counters reset) on the anchor shapes and on odd ones (d = 200,
d_mem = 64 and 24, batch 1, 3, 17), then timed (CUPTI, L2 flushed) on the benchmark's decode cases:
batch 1, 8, 64 x d 4096, 7168, d_mem 2048. GB/s counts W_K + W_V only; the anchor is the target, 80 % of the
measured copy bandwidth."""

import math
import sys

import tilelang
import torch

from tk_core.jit import arch_of, target_of
from tk_core.testing import calc_diff
from tk_core.testing.bench import copy_bandwidth_gbps, device_time_us
from tk_engram import decode, reference

TAPS = 4
ANCHORS = [(b, 2048, d) for d in (4096, 7168) for b in (1, 8, 64)]  # (batch, d_mem, d)
ODD = [(1, 64, 200, 2, torch.float16), (3, 24, 200, 1, torch.bfloat16), (17, 512, 7168, 3, torch.bfloat16)]


def _with(**over):
    """fused_config with some entries replaced (a callable entry maps the default value)."""

    def cfg(B, d_mem, d):
        c = decode.fused_config(B, d_mem, d)
        for k, v in over.items():
            c[k] = v(c[k]) if callable(v) else v
        nk = -(-d_mem // c["block_k"])
        while nk % c["splits"]:
            c["splits"] //= 2
        return c

    return cfg


def _small(**over):
    """Changes for block_m 16 only (batch <= 16)."""
    f = _with(**over)
    return lambda B, d_mem, d: f(B, d_mem, d) if B <= 16 else decode.fused_config(B, d_mem, d)


VARIANTS = {  # name -> fused config f(B, d_mem, d), or None for the two-launch path
    "fused": decode.fused_config,
    "fused_splits_x2": _with(splits=lambda s: 2 * s),
    "fused_bk128_st3": _small(block_k=128, stages=3, min_blocks=2),
    "fused_st6": _small(stages=6, min_blocks=2),
    "fused_bk32_s8": _small(block_k=32, splits=8, min_blocks=4),  # d=7168: 896 small CTAs, 97 % even per SM
    "two_launch": None,
}


def inputs(B, d_mem, d, dtype, L):
    g = lambda *s: torch.randn(*s, device="cuda")  # noqa: E731
    e, h = g(B, d_mem).to(dtype), g(B, d).to(dtype)
    WK, WV = ((g(d_mem, d) / math.sqrt(d_mem)).to(dtype) for _ in range(2))
    wh, wv = ((1 + 0.3 * g(d)).to(dtype) for _ in range(2))
    cw = (0.5 * g(TAPS, d)).to(dtype)
    state = (0.5 * g(B, L, d)).to(dtype)
    pos = torch.randint(0, 50, (B,), device="cuda", dtype=torch.int32)
    return e, h, state, pos, WK, WV, wh, wv, cw


def keys_of(name, B, d_mem, d, dil, dt):
    """The kernels' compile keys (batch is dynamic): (factory, params) pairs."""
    dts = "bfloat16" if dt == torch.bfloat16 else "float16"
    f = VARIANTS[name]
    if f is None:
        pc = decode.proj_config(B, d_mem, d)
        return ((decode.decode_proj_kernel, dict(dtype=dts, d_mem=d_mem, d=d, **pc)),
                (decode.decode_step_kernel, dict(dtype=dts, d=d, taps=TAPS, dilation=dil, splits=pc["splits"],
                                                 cluster=decode.STEP_CLUSTER)))
    return ((decode.decode_fused_kernel, dict(dtype=dts, d_mem=d_mem, d=d, taps=TAPS, dilation=dil, **f(B, d_mem, d))),)


def launchers(kernels, params, B, d):
    """(whole op, per-kernel list) of closures over fresh scratch for the given compiled kernels."""
    if len(kernels) == 1:
        part = torch.empty((params[0]["splits"], 2, B, d), device="cuda")
        sums = torch.empty((B, -(-d // decode.FUSED_PANEL), 4), device="cuda")
        ctr = decode._counters(torch.device("cuda", torch.cuda.current_device()))

        def run(e, h, state, pos, WK, WV, wh, wv, cw, y):
            kernels[0](e, WK, WV, h, wh, wv, cw, state, pos, y, part, sums, ctr, 1e-6)

        return run, None
    part = torch.empty((params[0]["splits"], 2, B, d), device="cuda")
    sums = torch.empty((B, 8, 4), device="cuda")

    def run(e, h, state, pos, WK, WV, wh, wv, cw, y):
        kernels[0](e, WK, WV, part)
        kernels[1](h, part, wh, wv, cw, state, pos, y, sums, 1e-6)

    def parts(e, h, state, pos, WK, WV, wh, wv, cw, y):
        return (lambda: kernels[0](e, WK, WV, part),
                lambda: kernels[1](h, part, wh, wv, cw, state, pos, y, sums, 1e-6))

    return run, parts


def main():
    names = sys.argv[1:] or list(VARIANTS)
    shapes = [(b, m, d, 1, torch.bfloat16) for b, m, d in ANCHORS] + ODD
    jobs = {}  # (factory name, params) -> (factory, params)
    for n in names:
        for s in shapes:
            for f, p in keys_of(n, *s):
                jobs.setdefault((f.__name__ if hasattr(f, "__name__") else id(f), tuple(sorted(p.items()))), (f, p))
    tgt = target_of(arch_of(None))
    compiled = {}
    for fac in {id(f): f for f, _ in jobs.values()}.values():
        ks = [k for k, (f, _) in jobs.items() if f is fac]
        # ignore_error: a variant that fails to build comes back as None and is reported, not fatal.
        outs = tilelang.par_compile([fac(**jobs[k][1]) for k in ks], target=tgt, num_workers=16,
                                    pass_configs=fac.pass_configs, ignore_error=True)
        compiled.update(zip(ks, outs))

    def get(n, s):
        ks = keys_of(n, *s)
        kern = [compiled[(f.__name__ if hasattr(f, "__name__") else id(f), tuple(sorted(p.items())))] for f, p in ks]
        return kern, [p for _, p in ks]

    copy = copy_bandwidth_gbps()
    anchor = 0.8 * copy
    print(f"copy {copy:.0f} GB/s; anchor = 80 % of copy = {anchor:.0f} GB/s of W_K + W_V", flush=True)

    for n in names:
        try:
            ok = True
            for B, d_mem, d, dil, dt in ODD + [(b, m, d, 1, torch.bfloat16) for b, m, d in ANCHORS]:
                kern, params = get(n, (B, d_mem, d, dil, dt))
                if any(k is None for k in kern):
                    ok = False
                    continue
                run, _ = launchers(kern, params, B, d)
                e, h, state, pos, WK, WV, wh, wv, cw = inputs(B, d_mem, d, dt, dil * (TAPS - 1) + 1)
                st_ref = state.clone()
                y_ref = reference.decode_step_ref(e, h, st_ref, pos, WK, WV, wh, wv, cw, dil, 1e-6)
                outs = []
                for _ in range(2):
                    st = state.clone()
                    y = torch.full_like(h, float("nan"))
                    run(e, h, st, pos, WK, WV, wh, wv, cw, y)
                    outs.append((y, st))
                tol = dict(rtol=2e-2, atol=2e-2) if dt == torch.bfloat16 else dict(rtol=4e-3, atol=4e-3)
                y, st = outs[0]
                good = (
                    torch.allclose(y.float(), y_ref.float(), **tol)
                    and calc_diff(y, y_ref) < 1e-5
                    and torch.allclose(st.float(), st_ref.float(), **tol)
                    and torch.equal(y, outs[1][0])
                    and torch.equal(st, outs[1][1])
                )
                if not good:
                    print(f"{n} MISMATCH B={B} d_mem={d_mem} d={d} dil={dil} {dt}: "
                          f"max|dy|={(y.float() - y_ref.float()).abs().max().item():.3g}", flush=True)
                ok &= good
            for B, d_mem, d in ANCHORS:
                kern, params = get(n, (B, d_mem, d, 1, torch.bfloat16))
                if any(k is None for k in kern):
                    print(f"{n}[B={B},d={d}] ok=False (compile failed)", flush=True)
                    continue
                run, parts = launchers(kern, params, B, d)
                args = inputs(B, d_mem, d, torch.bfloat16, TAPS - 1)
                y = torch.empty_like(args[1])
                us = device_time_us(lambda: run(*args, y), rep_ms=40, warmup_ms=10)  # noqa: B023
                extra = ""
                if parts is not None:
                    pu, su = (device_time_us(f, rep_ms=20, warmup_ms=5) for f in parts(*args, y))
                    extra = f" proj_us={pu:.2f} step_us={su:.2f}"
                g = 2 * d_mem * d * 2 / us / 1e3
                cs = ",".join(f"{k}={v}" for k, v in sorted(params[0].items()) if k not in ("dtype", "d", "d_mem"))
                print(f"{n}[B={B},d={d}] ok={ok} us={us:.2f} GB/s={g:.0f} anchor={anchor:.0f} "
                      f"ratio={g / anchor:.3f}{extra} cfg={cs}", flush=True)
        except Exception as exc:
            print(f"{n} ok=False error={exc!r}", flush=True)


if __name__ == "__main__":
    main()
