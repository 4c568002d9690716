"""GPU timing: device time of an op, eager call time, and the device's copy bandwidth.

- ``device_time_us``: median device time after warm-up, the L2 flushed before every run, through
  ``tilelang.profiler.do_bench`` with CUPTI (kernel time only, as the anchor figures were taken); CUDA
  events where CUPTI is unavailable.
- ``eager_time_us``: CUDA events around one Python call, L2 flushed before each, median: host dispatch
  counts here, which dominates for tiny ops.
- ``copy_bandwidth_gbps``: a device-to-device copy of 1 GiB, bytes read plus written.
"""

import functools
import statistics

import torch

_FLUSH_BYTES = 256 << 20


@functools.cache
def _flush_buffer(device_index: int) -> torch.Tensor:
    return torch.empty(_FLUSH_BYTES // 4, dtype=torch.int32, device=f"cuda:{device_index}")


def flush_l2() -> None:
    _flush_buffer(torch.cuda.current_device()).zero_()


@functools.cache
def timing_backend() -> str:
    """``cupti`` when tilelang's CUPTI profiler works on this machine, else ``event``."""
    from tilelang.profiler import do_bench

    x = torch.empty(1 << 20, device="cuda")
    try:
        do_bench(lambda: x.add_(1), backend="cupti", _n_warmup=1, _n_repeat=2)
        return "cupti"
    except Exception:
        return "event"


def device_time_us(fn, rep_ms: float = 100.0, warmup_ms: float = 25.0) -> float:
    """Median device time of ``fn()`` in microseconds (L2 flushed before each run)."""
    from tilelang.profiler import do_bench

    ms = do_bench(fn, warmup=warmup_ms, rep=rep_ms, backend=timing_backend(), return_mode="median")
    return float(ms) * 1e3


def eager_time_us(fn, iters: int = 50, warmup: int = 5) -> float:
    """Median time of one eager Python call of ``fn`` (CUDA events around it, L2 flushed before)."""
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        flush_l2()
        torch.cuda.synchronize()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def copy_bandwidth_gbps(nbytes: int = 1 << 30) -> float:
    """Bandwidth of a device-to-device copy of ``nbytes``, counting bytes read plus written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    us = device_time_us(lambda: dst.copy_(src))
    return 2 * nbytes / us / 1e3
