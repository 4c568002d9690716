"""Counts that a kernel writes straight into pinned host memory: a check the host reads after a sync, no copy.

Under unified virtual addressing (every 64-bit CUDA platform) the pinned memory of ``cudaHostAlloc`` (what
``torch.zeros(..., pin_memory=True)`` takes) is mapped into each device's address space at its host address, so a
CUDA tensor aliasing it lets a kernel store to host memory over the bus. An op whose check is nearly always clean
(error counts of zero) then lets its kernel write only nonzero counts into zeroed host words, and the host reads
them after synchronising the stream. The usual way, a device buffer copied to the host, costs a device-to-host
copy per call (about 1.5 us of device time on an H200, even for a few hundred bytes).
"""

import ctypes
import threading

import torch

from . import checks

_INT32 = "<i4"


class _Alias:
    """The ``__cuda_array_interface__`` of a pinned int32 host tensor; keeps that tensor alive while the CUDA
    tensor made from it lives (torch holds this object until the alias is freed)."""

    def __init__(self, host: torch.Tensor):
        self.host = host
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": _INT32,
            "data": (host.data_ptr(), False),
            "version": 3,
        }


_streams: dict = {}  # (stream id, device index, device type) -> torch.cuda.Stream


def current_stream(index: int) -> torch.cuda.Stream:
    """The current stream of CUDA device ``index``. ``torch.cuda.current_stream`` builds a new ``Stream`` object
    per call (~10 us of host time on the H200's host, ``shared/benchmarks/probe_host_time.py``); here the objects
    are cached by what identifies them, the triple torch itself builds them from (``torch.cuda.current_stream``
    reads it from the same private call)."""
    key = torch._C._cuda_getCurrentStream(index)
    stream = _streams.get(key)
    if stream is None:
        stream = _streams[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
    return stream


class HostCounts:
    """``capacity`` int32 words of pinned host memory (``host``) and a CUDA tensor over them (``alias``) on device
    ``index``."""

    def __init__(self, host: torch.Tensor, alias: torch.Tensor, index: int):
        self.host = host
        self.alias = alias
        self.index = index
        self._words = host.numpy()  # the same memory: a numpy sum costs less host time than a torch one

    @property
    def capacity(self) -> int:
        return self.host.numel()

    def zeroed(self, n: int) -> torch.Tensor:
        """The first ``n`` words, zeroed on the host, as the CUDA tensor a kernel writes. No kernel of an earlier
        call may still be writing them: callers ``collect`` before they return."""
        if not 0 <= n <= self.capacity:  # memset past the pinned buffer would corrupt the host heap
            checks.fail("HostCounts.zeroed", "n", f"in [0, {self.capacity}]", n)
        ctypes.memset(self.host.data_ptr(), 0, 4 * n)
        return self.alias[:n]

    def collect(self, n: int) -> int:
        """Waits for the device's current stream (the kernel's) and returns the sum of the first ``n`` words."""
        current_stream(self.index).synchronize()
        return int(self._words[:n].sum())


_cache = threading.local()  # per host thread: {device index: HostCounts or None}


def host_counts(n: int, device) -> HostCounts | None:
    """This thread's host counts for ``device`` with room for ``n`` words (grown as needed), or None where a
    pinned alias cannot be made or does not work (checked once: a fill on the device must reach the host).

    One buffer per host thread and device: a thread's calls run one after the other, and each collects (waits
    for its kernel) before it returns, so no kernel still writes a buffer that the next call zeroes. Device
    stores reach ``host`` over the bus: for a few words written rarely, not for data."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    per_device = _cache.__dict__.setdefault("per_device", {})
    capacity = 0
    if index in per_device:
        counts = per_device[index]
        if counts is None or counts.capacity >= n:
            return counts
        capacity = counts.capacity
    with torch.cuda.device(index):
        host = torch.zeros(max(n, 2 * capacity, 1024), dtype=torch.int32, pin_memory=True)
        try:
            alias = torch.as_tensor(_Alias(host))
        except RuntimeError:  # not registered with CUDA (a host allocator without cudaHostAlloc)
            alias = None
        ok = alias is not None and alias.device == torch.device("cuda", index)
        if ok:
            alias.fill_(1)
            torch.cuda.current_stream().synchronize()
            ok = bool(host.eq(1).all())
    per_device[index] = HostCounts(host, alias, index) if ok else None
    return per_device[index]
