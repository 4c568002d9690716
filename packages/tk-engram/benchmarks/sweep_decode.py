"""Compares tuning variants of the decode step (``decode_proj_kernel`` + ``decode_step_kernel``) in one GPU
run (not a pytest file).

    python3 packages/tk-engram/benchmarks/sweep_decode.py [variant ...]

A variant changes ``proj_config``'s tiling and/or the step's CTAs per row (names in VARIANTS; the first is
the op's default). Each is compiled (in parallel), checked against ``reference.decode_step_ref`` (the GPU
test's tolerances, plus run-to-run bit equality) on the anchor shapes and on odd ones (d = 200, d_mem = 64
and 24, batch 1, 3, 17), then timed (CUPTI, L2 flushed) on the benchmark's decode cases: batch 1, 8, 64 x
d 4096, 7168, d_mem 2048. GB/s counts W_K + W_V only; the anchor is the target, 80 % of the measured copy
bandwidth. Every variant also times the two kernels alone (proj_us, step_us)."""

import math
import sys

import tilelang
import torch

from tk_core.jit import arch_of, target_of
from tk_core.testing import calc_diff
from tk_core.testing.bench import copy_bandwidth_gbps, device_time_us
from tk_engram import reference
from tk_engram.decode import STEP_CLUSTER, decode_proj_kernel, decode_step_kernel, proj_config

TAPS = 4
ANCHORS = [(b, 2048, d) for d in (4096, 7168) for b in (1, 8, 64)]  # (batch, d_mem, d)
ODD = [(1, 64, 200, 2, torch.float16), (3, 24, 200, 1, torch.bfloat16), (17, 512, 7168, 3, torch.bfloat16)]


def _prev(B, d_mem, d):
    """The projection tiling before the H200 sweep of 2026-11-29 (block_k 64 everywhere, one-wave splits)."""
    block_m = 16 if B <= 16 else 64
    panels = -(-d // 64) * 2 * -(-B // block_m)
    nk = -(-d_mem // 64)
    slots = (4 if block_m == 16 else 3) * 132
    splits = 1
    for s in (2, 4, 8):
        if nk % s == 0 and panels * s <= slots:
            splits = s
    return dict(block_m=block_m, block_n=64, block_k=64, stages=4, splits=splits, min_blocks=4)


VARIANTS = {  # name -> (proj config f(B, d_mem, d), step CTAs per row)
    "default": (proj_config, STEP_CLUSTER),
    "cluster1": (proj_config, 1),
    "cluster4": (proj_config, 4),
    "prev_proj": (_prev, STEP_CLUSTER),
}


def config(name, B, d_mem, d):
    return VARIANTS[name][0](B, d_mem, d)


def inputs(B, d_mem, d, dtype, L):
    g = lambda *s: torch.randn(*s, device="cuda")  # noqa: E731
    e, h = g(B, d_mem).to(dtype), g(B, d).to(dtype)
    WK, WV = ((g(d_mem, d) / math.sqrt(d_mem)).to(dtype) for _ in range(2))
    wh, wv = ((1 + 0.3 * g(d)).to(dtype) for _ in range(2))
    cw = (0.5 * g(TAPS, d)).to(dtype)
    state = (0.5 * g(B, L, d)).to(dtype)
    pos = torch.randint(0, 50, (B,), device="cuda", dtype=torch.int32)
    return e, h, state, pos, WK, WV, wh, wv, cw


def time_case(p, s, cfg, B, d_mem, d):
    """Device time of the two launches, and of each alone, on fresh bf16 inputs."""
    e, h, state, pos, WK, WV, wh, wv, cw = inputs(B, d_mem, d, torch.bfloat16, TAPS - 1)
    part = torch.empty((cfg["splits"], 2, B, d), device="cuda")
    sums = torch.empty((B, 8, 4), device="cuda")
    y = torch.empty_like(h)
    proj = lambda: p(e, WK, WV, part)  # noqa: E731
    step = lambda: s(h, part, wh, wv, cw, state, pos, y, sums, 1e-6)  # noqa: E731
    us = device_time_us(lambda: (proj(), step()), rep_ms=40, warmup_ms=10)
    return us, device_time_us(proj, rep_ms=20, warmup_ms=5), device_time_us(step, rep_ms=20, warmup_ms=5)


def main():
    names = sys.argv[1:] or list(VARIANTS)
    arch = arch_of(None)
    shapes = [(b, m, d, 1, torch.bfloat16) for b, m, d in ANCHORS] + ODD
    # One compiled (proj, step) pair per distinct parameter set: batch is dynamic.
    keys = {}
    for n in names:
        for B, d_mem, d, dil, dt in shapes:
            cfg = config(n, B, d_mem, d)
            dts = "bfloat16" if dt == torch.bfloat16 else "float16"
            keys[(n, B, d_mem, d, dil, dt)] = (
                (dts, d_mem, d, tuple(sorted(cfg.items()))),
                (dts, d, dil, cfg["splits"], VARIANTS[n][1]),
            )
    pkeys = sorted({p for p, _ in keys.values()})
    skeys = sorted({s for _, s in keys.values()})
    tgt = target_of(arch)

    def compile_all(factory, funcs):
        # ignore_error: a variant that fails to build comes back as None and is reported, not fatal.
        return tilelang.par_compile(
            funcs, target=tgt, num_workers=16, pass_configs=factory.pass_configs, ignore_error=True
        )

    pfuncs = [decode_proj_kernel(dtype=t, d_mem=m, d=d, **dict(c)) for t, m, d, c in pkeys]
    sfuncs = [decode_step_kernel(dtype=t, d=d, taps=TAPS, dilation=dil, splits=s, cluster=c)
              for t, d, dil, s, c in skeys]
    pk = dict(zip(pkeys, compile_all(decode_proj_kernel, pfuncs)))
    sk = dict(zip(skeys, compile_all(decode_step_kernel, sfuncs)))
    copy = copy_bandwidth_gbps()
    anchor = 0.8 * copy
    print(f"copy {copy:.0f} GB/s; anchor = 80 % of copy = {anchor:.0f} GB/s of W_K + W_V", flush=True)

    for n in names:
        try:
            ok = True
            for B, d_mem, d, dil, dt in ODD + [(b, m, d, 1, torch.bfloat16) for b, m, d in ANCHORS]:
                (pkey, skey), cfg = keys[(n, B, d_mem, d, dil, dt)], config(n, B, d_mem, d)
                p, s = pk[pkey], sk[skey]
                if p is None or s is None:
                    ok = False
                    continue
                e, h, state, pos, WK, WV, wh, wv, cw = inputs(B, d_mem, d, dt, dil * (TAPS - 1) + 1)
                st_ref = state.clone()
                y_ref = reference.decode_step_ref(e, h, st_ref, pos, WK, WV, wh, wv, cw, dil, 1e-6)
                outs = []
                for _ in range(2):
                    st = state.clone()
                    part = torch.full((cfg["splits"], 2, B, d), float("nan"), device="cuda")
                    sums = torch.full((B, 8, 4), float("nan"), device="cuda")
                    y = torch.full_like(h, float("nan"))
                    p(e, WK, WV, part)
                    s(h, part, wh, wv, cw, st, pos, y, sums, 1e-6)
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
                    print(
                        f"{n} MISMATCH B={B} d_mem={d_mem} d={d} dil={dil} {dt}: "
                        f"max|dy|={(y.float() - y_ref.float()).abs().max().item():.3g}",
                        flush=True,
                    )
                ok &= good
            for B, d_mem, d in ANCHORS:
                (pkey, skey), cfg = keys[(n, B, d_mem, d, 1, torch.bfloat16)], config(n, B, d_mem, d)
                p, s = pk[pkey], sk[skey]
                if p is None or s is None:
                    print(f"{n} B={B} d={d} ok=False (compile failed)", flush=True)
                    continue
                us, pu, su = time_case(p, s, cfg, B, d_mem, d)
                g = 2 * d_mem * d * 2 / us / 1e3
                extra = f" proj_us={pu:.2f} step_us={su:.2f}"
                cs = ",".join(f"{k}={v}" for k, v in sorted(cfg.items())) + f",cluster={VARIANTS[n][1]}"
                print(
                    f"{n}[B={B},d={d}] ok={ok} us={us:.2f} GB/s={g:.0f} anchor={anchor:.0f} "
                    f"ratio={g / anchor:.3f}{extra} cfg={cs}",
                    flush=True,
                )
        except Exception as exc:
            print(f"{n} ok=False error={exc!r}", flush=True)


if __name__ == "__main__":
    main()
