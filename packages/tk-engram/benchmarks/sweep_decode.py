"""The decode step's dispatch against the previous one, in one GPU run (not a pytest file).

    python3 packages/tk-engram/benchmarks/sweep_decode.py [variant ...]

``new`` launches what the op launches (``decode.decode_plan``: ``decode_gemv_kernel`` up to
``GEMV_MAX_BATCH`` rows, or up to ``GEMV_RING_MAX_BATCH`` with the W ring, else ``decode_fused_kernel`` or the two
launches); ``old`` the dispatch before the ring took more than two m-tiles (session 29: the GEMV up to 32 rows, else
the fused kernel or the two launches); ``two`` the two launches for every batch above ``GEMV_MAX_BATCH``; ``mw2`` two
warps per ring slot from 17 rows (one m-tile per warp at 17-32 rows); ``early``, ``kfirst`` and ``normal`` the ring
kernels without ``late_cache`` / ``v_first`` / ``w_evict_first`` (the kernel's reference points). Both paths are built
explicitly, every kernel in one ``tilelang.par_compile`` pool per factory, then each is checked against
``reference.decode_step_ref`` (the GPU test's tolerances, run-to-run bit equality, the GEMV counters back at
zero) on the anchors (``new`` also on odd shapes: d = 200 / 1088, d_mem = 24 / 64 / 520, batch 0, 1, 3, 13, 17,
33, 50, fp16, dilation 2-3) and timed (CUPTI, L2 flushed) on batch 1, 8, 64 x d 4096, 7168 and 17, 32, 48 x d 4096,
d_mem 2048. Line format:

    name[B=,d=] ok=<bool> us=<t> budget_us=<b> ratio=<b/t> GB/s=<W bytes/t> path=<kernel path> cfg=<tuning>

with budget = W_K + W_V bytes / (0.8 x 4230 GB/s) (ratio >= 1 meets the target), then one ``speedup`` line per
anchor (old us / new us). A variant that fails to build or to check is reported and the run goes on; a kernel
that traps (a stuck counter) ends the CUDA context, so ``new`` runs first."""

import math
import sys
import time
import traceback

import tilelang
import torch

from tk_core.jit import arch_of, target_of
from tk_core.testing import calc_diff
from tk_core.testing.bench import device_time_us
from tk_engram import decode, engram_decode_step, reference

TAPS = 4
COPY_GBPS = 4230  # H200 copy bandwidth (the anchor figures' measurement)
ANCHORS = [(b, 2048, d) for d in (4096, 7168) for b in (1, 8, 64)] + [(b, 2048, 4096) for b in (17, 32, 48)]
# (batch, d_mem, d, dilation, dtype), checked for ``new`` only (compile time): ragged d and d_mem, fp16, a partial
# 64-row tile of the fused kernel, odd batches on the anchors' kernels (nothing more to compile)
ODD = [
    (1, 64, 200, 2, torch.float16),
    (3, 24, 200, 1, torch.bfloat16),
    (13, 520, 1088, 3, torch.bfloat16),
    (17, 512, 4096, 3, torch.bfloat16),
    (3, 2048, 4096, 1, torch.bfloat16),
    (13, 2048, 7168, 1, torch.bfloat16),
    (32, 256, 640, 2, torch.float16),
    (24, 520, 4096, 1, torch.bfloat16),
    (33, 512, 640, 2, torch.float16),
    (50, 512, 4096, 3, torch.bfloat16),
]


def old_plan(B, d_mem, d):
    """The dispatch of session 29: the GEMV kernel up to 32 rows (two m-tiles, one warp per ring slot)."""
    if B <= 32:
        return decode.decode_plan(B, d_mem, d)
    if B >= decode.TWO_LAUNCH_MIN_BATCH and d <= decode.TWO_LAUNCH_MAX_D:
        return "two_launch", decode.proj_config(B, d_mem, d)
    cfg = decode.fused_config(B, d_mem, d)
    if decode._waiters(B, d, cfg["block_m"]) < decode._SMS:
        return "fused", cfg
    return "two_launch", decode.proj_config(B, d_mem, d)


def two_launch_plan(B, d_mem, d):
    """The two launches for every batch the GEMV kernel does not take."""
    if B <= decode.GEMV_MAX_BATCH:
        return decode.decode_plan(B, d_mem, d)
    return "two_launch", decode.proj_config(B, d_mem, d)


def mw2_plan(B, d_mem, d):
    """Two warps per ring slot wherever the GEMV takes more than one m-tile."""
    path, cfg = decode.decode_plan(B, d_mem, d)
    if path == "gemv" and cfg["mt"] > 1:
        cfg = dict(cfg, mw=2)
    return path, cfg


def kfirst_plan(B, d_mem, d):
    """The ring kernels with the K CTAs on the first block indices (before ``v_first``)."""
    path, cfg = decode.decode_plan(B, d_mem, d)
    if path == "gemv" and cfg["ring"]:
        cfg = dict(cfg, v_first=False)
    return path, cfg


def early_plan(B, d_mem, d):
    """The ring kernels with the epilogue operands' copies (and the positions' loads) before the second chunk's."""
    path, cfg = decode.decode_plan(B, d_mem, d)
    if path == "gemv" and cfg["ring"]:
        cfg = dict(cfg, late_cache=False)
    return path, cfg


def evict_normal_plan(B, d_mem, d):
    """The ring kernels with W's TMA copies under the L2's normal eviction policy."""
    path, cfg = decode.decode_plan(B, d_mem, d)
    if path == "gemv" and cfg["ring"]:
        cfg = dict(cfg, w_evict_first=False)
    return path, cfg


# name -> plan(B, d_mem, d) -> (path, tuning)
VARIANTS = {"new": decode.decode_plan, "old": old_plan, "two": two_launch_plan, "mw2": mw2_plan, "early": early_plan,
            "kfirst": kfirst_plan, "normal": evict_normal_plan}


def keys_of(path, cfg, d_mem, d, dil, dt):
    """The kernels of one step as (factory, compile parameters) pairs (batch is a runtime size)."""
    dts = "bfloat16" if dt == torch.bfloat16 else "float16"
    p = dict(dtype=dts, d_mem=d_mem, d=d, taps=TAPS, dilation=dil)
    if path == "gemv":
        return [(decode.decode_gemv_kernel, dict(p, **cfg))]
    if path == "fused":
        return [(decode.decode_fused_kernel, dict(p, **cfg))]
    return [(decode.decode_proj_kernel, dict(dtype=dts, d_mem=d_mem, d=d, **cfg)),
            (decode.decode_step_kernel, dict(dtype=dts, d=d, taps=TAPS, dilation=dil, splits=cfg["splits"],
                                             cluster=decode.STEP_CLUSTER))]


def _key(f, p):
    return f.name, tuple(sorted(p.items()))


def launcher(path, kernels, B, d_mem, d):
    """A closure (e, h, state, pos, WK, WV, wh, wv, cw, y) -> None over fresh scratch, as ``_decode_dev`` runs it."""
    part, sums = decode.decode_scratch(B, d_mem, d, "cuda", path)
    ctr = decode._counters(torch.device("cuda", torch.cuda.current_device()))
    if path == "gemv":
        return lambda e, h, st, pos, WK, WV, wh, wv, cw, y: kernels[0](e, WK, WV, h, wh, wv, cw, st, pos, y, sums,
                                                                       ctr, 1e-6)
    if path == "fused":
        return lambda e, h, st, pos, WK, WV, wh, wv, cw, y: kernels[0](e, WK, WV, h, wh, wv, cw, st, pos, y, part,
                                                                       sums, ctr, 1e-6)

    def run(e, h, st, pos, WK, WV, wh, wv, cw, y):
        kernels[0](e, WK, WV, part)
        kernels[1](h, part, wh, wv, cw, st, pos, y, sums, 1e-6)

    return run


def inputs(B, d_mem, d, dtype, L, seed=0):
    torch.manual_seed(seed)
    g = lambda *s: torch.randn(*s, device="cuda")  # noqa: E731
    e, h = g(B, d_mem).to(dtype), g(B, d).to(dtype)
    WK, WV = ((g(d_mem, d) / math.sqrt(d_mem)).to(dtype) for _ in range(2))
    wh, wv = ((1 + 0.3 * g(d)).to(dtype) for _ in range(2))
    cw = (0.5 * g(TAPS, d)).to(dtype)
    state = (0.5 * g(B, L, d)).to(dtype)
    pos = torch.randint(0, 50, (B,), device="cuda", dtype=torch.int32)
    return e, h, state, pos, WK, WV, wh, wv, cw


def check(name, run, B, d_mem, d, dil, dt):
    """y and the cache against the reference, two runs bit-equal, the GEMV counters at zero."""
    e, h, state, pos, WK, WV, wh, wv, cw = inputs(B, d_mem, d, dt, dil * (TAPS - 1) + 1, seed=B + d)
    st_ref = state.clone()
    y_ref = reference.decode_step_ref(e, h, st_ref, pos, WK, WV, wh, wv, cw, dil, 1e-6)
    outs = []
    for _ in range(2):
        st = state.clone()
        y = torch.full_like(h, float("nan"))
        run(e, h, st, pos, WK, WV, wh, wv, cw, y)
        outs.append((y, st))
    torch.cuda.synchronize()
    tol = dict(rtol=2e-2, atol=2e-2) if dt == torch.bfloat16 else dict(rtol=4e-3, atol=4e-3)
    y, st = outs[0]
    close = (torch.allclose(y.float(), y_ref.float(), **tol) and calc_diff(y, y_ref) < 1e-5
             and torch.allclose(st.float(), st_ref.float(), **tol))
    same = torch.equal(y, outs[1][0]) and torch.equal(st, outs[1][1])
    zero = not decode._counters(h.device)[decode._GEMV_CTR:].any()
    if not (close and same and zero):
        print(f"{name} MISMATCH B={B} d_mem={d_mem} d={d} dil={dil} {dt} close={close} repeat_equal={same} "
              f"counters_zero={zero} max|dy|={(y.float() - y_ref.float()).abs().nan_to_num(1e9).max().item():.3g}",
              flush=True)
    return close and same and zero


def main():
    t0 = time.time()
    names = sys.argv[1:] or list(VARIANTS)
    anchors = [(b, m, d, 1, torch.bfloat16) for b, m, d in ANCHORS]

    def checked(n):
        return (ODD if n == "new" else []) + anchors

    jobs = {}
    for n in names:
        for B, d_mem, d, dil, dt in checked(n):
            for f, p in keys_of(*VARIANTS[n](B, d_mem, d), d_mem, d, dil, dt):
                jobs.setdefault(_key(f, p), (f, p))
    tgt = target_of(arch_of(None))
    compiled = {}
    for fac in {f.name: f for f, _ in jobs.values()}.values():
        ks = [k for k, (f, _) in jobs.items() if f is fac]
        # ignore_error: a kernel that fails to build comes back as None; its variant is reported, not fatal.
        outs = tilelang.par_compile([fac(**jobs[k][1]) for k in ks], target=tgt, num_workers=16,
                                    pass_configs=fac.pass_configs, ignore_error=True)
        compiled.update(zip(ks, outs, strict=True))
    print(f"compiled {len(jobs)} kernels in {time.time() - t0:.0f} s; budget = W_K + W_V bytes / (0.8 x {COPY_GBPS} "
          f"GB/s)", flush=True)

    def get(n, B, d_mem, d, dil, dt):
        path, cfg = VARIANTS[n](B, d_mem, d)
        kern = [compiled[_key(f, p)] for f, p in keys_of(path, cfg, d_mem, d, dil, dt)]
        return path, cfg, kern

    times = {}
    for n in names:
        try:
            ok = True
            for B, d_mem, d, dil, dt in checked(n):
                path, _, kern = get(n, B, d_mem, d, dil, dt)
                if any(k is None for k in kern):
                    print(f"{n} BUILD FAILED B={B} d_mem={d_mem} d={d} path={path}", flush=True)
                    ok = False
                    continue
                ok &= check(n, launcher(path, kern, B, d_mem, d), B, d_mem, d, dil, dt)
            if n == "new":  # no rows: the public function launches nothing
                args = inputs(0, 2048, 4096, torch.bfloat16, TAPS - 1)
                ok &= engram_decode_step(*args).shape == (0, 4096)
            for B, d_mem, d in ANCHORS:
                path, cfg, kern = get(n, B, d_mem, d, 1, torch.bfloat16)
                if any(k is None for k in kern):
                    print(f"{n}[B={B},d={d}] ok=False (build failed)", flush=True)
                    continue
                run = launcher(path, kern, B, d_mem, d)
                args = inputs(B, d_mem, d, torch.bfloat16, TAPS - 1)
                y = torch.empty_like(args[1])
                us = device_time_us(lambda: run(*args, y), rep_ms=40, warmup_ms=10)  # noqa: B023
                times[(n, B, d)] = us
                budget = 2 * d_mem * d * 2 / (0.8 * COPY_GBPS * 1e3)
                cs = ",".join(f"{k}={v}" for k, v in sorted(cfg.items()))
                print(f"{n}[B={B},d={d}] ok={ok} us={us:.2f} budget_us={budget:.2f} ratio={budget / us:.3f} "
                      f"GB/s={2 * d_mem * d * 2 / us / 1e3:.0f} path={path} cfg={cs}", flush=True)
        except Exception:  # the last lines only: a failed nvcc run prints pages
            print(f"{n} ok=False FAILED: {traceback.format_exc()[-1500:]}", flush=True)
    for B, _, d in ANCHORS:
        if ("new", B, d) in times and ("old", B, d) in times:
            print(f"speedup[B={B},d={d}] old/new={times[('old', B, d)] / times[('new', B, d)]:.3f}", flush=True)
    print(f"done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
