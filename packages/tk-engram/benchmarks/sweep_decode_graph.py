"""Per-step time of the decode paths inside a CUDA graph, launch gaps included (not a pytest file).

    python3 packages/tk-engram/benchmarks/sweep_decode_graph.py

CUPTI kernel time (``sweep_decode.py``, the benchmarks) leaves out the gap between the two launches of the
two-launch path; a CUDA graph replay of 20 x (256 MB L2 flush, step), minus that of the 20 flushes alone, timed
by CUDA events (median of 20 replays), does not. Compares ``sweep_decode.VARIANTS`` ``new`` (the op's plan) and
``two`` (the two launches above ``GEMV_MAX_BATCH`` rows) at d_mem 2048.
"""

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sweep_decode as S  # noqa: E402

SHAPES = [(64, 4096), (64, 7168), (32, 4096), (17, 4096), (8, 4096)]  # (batch, d)
_flush = torch.empty(64 << 20, dtype=torch.int32, device="cuda")


def graph_us(fn, steps=20, reps=20):
    """Median time per ``(flush, fn)`` pair of a captured graph of ``steps`` pairs."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # warm-up (and compilation) outside the capture
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(steps):
            _flush.zero_()
            fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / steps)
    return statistics.median(times)


def main():
    base = graph_us(lambda: None)
    print(f"flush alone {base:.2f} us", flush=True)
    for B, d in SHAPES:
        for name in ("new", "two"):
            path, cfg = S.VARIANTS[name](B, 2048, d)
            kernels = [f.get(torch.device("cuda"), **p) for f, p in S.keys_of(path, cfg, 2048, d, 1, torch.bfloat16)]
            run = S.launcher(path, kernels, B, 2048, d)
            args = S.inputs(B, 2048, d, torch.bfloat16, 4)
            y = torch.empty_like(args[1])
            print(f"{name}[B={B},d={d}] path={path} graph_us={graph_us(lambda: run(*args, y)) - base:.2f}", flush=True)


if __name__ == "__main__":
    main()
