"""What the L2 flush's dirty lines cost a kernel that reads less than the L2 holds (not a pytest file).

    python3 packages/tk-engram/benchmarks/probe_l2_flush.py

The benchmarks flush the L2 as the anchor figures were taken: ``zero_()`` of a 256 MB buffer, which leaves the L2
full of dirty lines, so a kernel's first reads evict lines that must be written back. A decode step in a served
model follows kernels that read weights and write a few activation rows, so its L2 holds clean lines. Each
workload is timed (kernel time from the profiler's CUPTI records, median of ``ITERS``) after either flush:
``dirty`` (``zero_()`` of 256 MB, the benchmarks' flush) and ``clean`` (a sum over 256 MB: reads only), and once
through ``device_time_us`` (the benchmarks' figure). Workloads: copies of 32 MiB and 1 GiB, the decode W read of
``probe_w_read.py`` (``panel_x2``, 16 loads per thread in flight), and ``engram_decode_step`` at the anchors.
With the argument ``gemv``: ``decode_gemv_kernel`` at B = 1 in other warp counts, load depths, CTAs per SM and
W ring sizes (``GEMV_CONFIGS``) instead. With ``timeline``: where the GEMV's time goes (``timeline``). With
``evict``: L2 eviction policies (``evict``).
"""

import statistics
import sys

import probe_w_read
import torch
from bench_gate_conv import DECODE, decode_inputs
from sweep_decode import COPY_GBPS
from torch.profiler import ProfilerActivity, profile

from tk_core.layout import ceil_div
from tk_core.testing.bench import device_time_us
from tk_engram import decode, engram_decode_step

ITERS = 30
FLUSH = torch.empty(64 << 20, dtype=torch.int32, device="cuda")
FLUSHES = {"dirty": FLUSH.zero_, "clean": lambda: FLUSH.sum()}
# (warps, k16 steps in flight per warp, CTAs per SM, W ring slots per warp: 0 for the register-direct loads); the
# first is decode_plan's. The grid is one CTA per panel (128 at d=4096, 224 at d=7168), so the warps per SM are set
# by the CTA size.
GEMV_CONFIGS = [(4, 8, 2, 2), (4, 8, 2, 0)]


def _kernel_names(fn) -> set[str]:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type.name == "CUDA"}


def kernel_us(fn, flush) -> float:
    """Median over ITERS of the summed durations of fn's kernels, each run after ``flush``."""
    flush_names = _kernel_names(flush)
    for _ in range(3):
        flush()
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(ITERS):
            flush()
            fn()
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    runs, cur = [], 0.0
    for e in ev:
        if e.name in flush_names:
            if cur:
                runs.append(cur)
            cur = 0.0
        else:
            cur += e.time_range.end - e.time_range.start
    runs.append(cur)
    return statistics.median(runs)


def report(name: str, fn, nbytes: int):
    cupti = device_time_us(fn)
    t = {k: kernel_us(fn, f) for k, f in FLUSHES.items()}
    print(f"{name}: device_time_us {cupti:.2f} | dirty {t['dirty']:.2f} us | clean {t['clean']:.2f} us"
          f" ({nbytes / t['clean'] / 1e3:.0f} GB/s clean, {nbytes / t['dirty'] / 1e3:.0f} dirty)", flush=True)


def w_bytes(d_mem: int, d: int) -> int:
    """Bytes of W_K and W_V (bf16), the decode line's measure."""
    return 2 * d_mem * d * 2


def report_w_read(layout: str, policy: str = ""):
    """``report`` of ``probe_w_read.py``'s plain read in ``layout`` with its most loads in flight."""
    W = torch.randn(probe_w_read.R, probe_w_read.C, device="cuda").bfloat16()
    u = max(probe_w_read.IN_FLIGHT[layout])
    k = probe_w_read.read_kernel.get(W.device, layout=layout, U=u, policy=policy)
    out = torch.empty(probe_w_read.LAYOUTS[layout] * probe_w_read.THREADS, dtype=torch.float32, device="cuda")
    report(f"W read {layout} U={u} policy={policy or '-'}", lambda: k(W, out), W.numel() * 2)


def gemv_configs():
    d_mem = 2048
    for d in (4096, 7168):
        e, h, state, pos, WK, WV, wh, wv, cw = decode_inputs(1, d_mem, d)
        y = torch.empty_like(h)
        sums = decode.decode_scratch(1, d_mem, d, h.device, "gemv")[1]
        ctr = decode._counters(h.device)
        for nw, depth, mb, ring in GEMV_CONFIGS:
            name = f"gemv d={d} nw={nw} depth={depth} min_blocks={mb} ring={ring}"
            try:
                k = decode.decode_gemv_kernel.get(h.device, dtype="bfloat16", d_mem=d_mem, d=d, taps=4, dilation=1,
                                                  mt=1, nw=nw, depth=depth, min_blocks=mb, ring=ring)
            except Exception as exc:  # a configuration that does not build
                print(f"{name}: {type(exc).__name__}: {exc}", flush=True)
                continue
            fn = lambda k=k: k(e, WK, WV, h, wh, wv, cw, state, pos, y, sums, ctr, 1e-6)  # noqa: E731
            report(name, fn, w_bytes(d_mem, d))


def timeline():
    """The plain W reads of ``probe_w_read.py`` (``panel``, the GEMV's order, and ``panel_x2``), then
    ``decode_gemv_kernel(timeline=True)``'s per-CTA global-timer stamps under each flush: medians over ``ITERS``
    launches of the time (from the earliest CTA's start) at which the last (or first) K or V CTA started, finished its
    loop, stored its row sums, arrived, finished its wait, issued its stores and ended."""
    for layout in ("panel", "panel_x2"):
        report_w_read(layout)
    d_mem = 2048
    for B, d in ((1, 4096), (8, 4096), (1, 7168), (32, 4096), (64, 4096)):
        e, h, state, pos, WK, WV, wh, wv, cw = decode_inputs(B, d_mem, d)
        y = torch.empty_like(h)
        sums = decode.decode_scratch(B, d_mem, d, h.device, "gemv")[1]
        ctr = torch.zeros(decode._CTR_LEN, dtype=torch.int32, device="cuda")  # stamps in words the GEMV leaves
        k = decode.decode_gemv_kernel.get(h.device, dtype="bfloat16", d_mem=d_mem, d=d, taps=4, dilation=1,
                                          timeline=True, **decode.decode_plan(B, d_mem, d)[1])
        fn = lambda k=k, ctr=ctr: k(e, WK, WV, h, wh, wv, cw, state, pos, y, sums, ctr, 1e-6)  # noqa: E731
        report(f"gemv(timeline) B={B} d={d}", fn, w_bytes(d_mem, d))
        np_ = ceil_div(d, decode.GEMV_PANEL)
        n = 2 * np_ * decode.TIMELINE_STAMPS
        for name, flush in FLUSHES.items():
            runs = []
            for _ in range(ITERS):
                flush()
                fn()
                st = ctr[:n].view(2 * np_, decode.TIMELINE_STAMPS).to(torch.int64).cpu()
                st = (st - st[:, 0].min()) % (1 << 32)  # the low 32 bits of ns wrap every 4.3 s
                kc, vc = st[:np_], st[np_:]
                runs.append([kc[:, 0].max(), kc[:, 1].max(), kc[:, 2].max(), kc[:, 3].max(), vc[:, 1].max(),
                             vc[:, 3].max(), vc[:, 4].min(), vc[:, 4].max(), vc[:, 5].max(), vc[:, 6].max(),
                             (vc[:, 5] - vc[:, 4]).median(), (vc[:, 6] - vc[:, 5]).median()])
            m = [x / 1e3 for x in torch.tensor(runs, dtype=torch.float64).median(0).values.tolist()]
            print(f"  {name}: last start {m[0]:.2f} | K last: loop done {m[1]:.2f}, sums {m[2]:.2f}, arrived "
                  f"{m[3]:.2f} | V last: loop done {m[4]:.2f}, arrived {m[5]:.2f} | V wait done first {m[6]:.2f} "
                  f"last {m[7]:.2f} | V last: stores issued {m[8]:.2f}, end {m[9]:.2f} us | per V CTA: wait done"
                  f" -> stores {m[10]:.2f}, stores -> end {m[11]:.2f} us", flush=True)


def evict():
    """The plain W read under each L2 policy of ``probe_w_read.POLICIES`` (hinted loads), then the op's GEMV
    kernels with and without ``w_evict_first``, under both flushes."""
    for _ in range(2):
        for policy in ["", *probe_w_read.POLICIES]:
            report_w_read("panel_x2", policy)
    d_mem = 2048
    for B, d in ((1, 4096), (8, 4096), (32, 4096), (64, 4096), (1, 7168)):
        e, h, state, pos, WK, WV, wh, wv, cw = decode_inputs(B, d_mem, d)
        y = torch.empty_like(h)
        sums = decode.decode_scratch(B, d_mem, d, h.device, "gemv")[1]
        ctr = decode._counters(h.device)
        for w_evict_first in (False, True, False, True):
            k = decode.decode_gemv_kernel.get(h.device, dtype="bfloat16", d_mem=d_mem, d=d, taps=4, dilation=1,
                                              w_evict_first=w_evict_first, **decode.decode_plan(B, d_mem, d)[1])
            fn = lambda k=k: k(e, WK, WV, h, wh, wv, cw, state, pos, y, sums, ctr, 1e-6)  # noqa: E731
            report(f"gemv B={B} d={d} w_evict_first={w_evict_first}", fn, w_bytes(d_mem, d))


def main():
    for mib in (32, 1024):
        src = torch.empty(mib << 20, dtype=torch.uint8, device="cuda").random_()
        dst = torch.empty_like(src)
        report(f"copy {mib} MiB", lambda dst=dst, src=src: dst.copy_(src), 2 * src.numel())
        del src, dst

    report_w_read("panel_x2")

    for B, d_mem, d in DECODE:
        args = decode_inputs(B, d_mem, d)
        budget = w_bytes(d_mem, d) / (0.8 * COPY_GBPS * 1e3)
        report(f"decode B={B} d={d} (W budget {budget:.2f} us)", lambda args=args: engram_decode_step(*args),
               w_bytes(d_mem, d))


if __name__ == "__main__":
    {"gemv": gemv_configs, "timeline": timeline, "evict": evict}.get(sys.argv[1] if sys.argv[1:] else "", main)()
