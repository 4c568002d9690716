"""tk_core.hostmem: counts that device code writes straight into pinned host memory."""

import threading

import pytest
import torch

from tk_core import hostmem


@pytest.mark.gpu
def test_device_stores_reach_the_host_without_a_copy():
    counts = hostmem.host_counts(5, "cuda")
    assert counts is not None  # an H100 / H200 under UVA maps pinned memory
    assert counts.host.is_pinned() and counts.alias.data_ptr() == counts.host.data_ptr()
    for value in (7, 0, 3):
        slots = counts.zeroed(5)  # a previous round's values are gone
        assert slots.device == torch.device("cuda", torch.cuda.current_device()) and slots.shape == (5,)
        slots[1:3].fill_(value)  # a device kernel
        assert counts.collect(5) == 2 * value
        assert counts.host[:5].tolist() == [0, value, value, 0, 0]
    assert hostmem.host_counts(5, "cuda") is counts  # reused by this thread
    bigger = hostmem.host_counts(counts.capacity + 1, "cuda")  # grown
    assert bigger.capacity > counts.capacity and hostmem.host_counts(5, "cuda") is bigger
    other = []
    thread = threading.Thread(target=lambda: other.append(hostmem.host_counts(5, "cuda")))
    thread.start()
    thread.join()
    assert other[0] is not None and other[0] is not bigger  # one buffer per host thread


@pytest.mark.gpu
def test_collect_waits_for_the_current_stream():
    index = torch.cuda.current_device()
    side = torch.cuda.Stream()
    assert hostmem.current_stream(index) == torch.cuda.current_stream()
    counts = hostmem.host_counts(4, "cuda")
    with torch.cuda.stream(side):
        assert hostmem.current_stream(index) == side and hostmem.current_stream(index) is hostmem.current_stream(index)
        slots = counts.zeroed(4)
        torch.cuda._sleep(50_000_000)  # ~25 ms of device time before the store lands
        slots[3:].fill_(5)
        assert counts.collect(4) == 5


def test_zeroed_refuses_counts_past_the_buffer():
    host = torch.arange(4, dtype=torch.int32)
    counts = hostmem.HostCounts(host, host, 0)  # (a CPU stand-in for the pinned buffer and its CUDA alias)
    for n in (-1, 5):  # memset past the buffer would corrupt the host heap
        with pytest.raises(ValueError, match=rf"HostCounts.zeroed: n must be in \[0, 4\], got {n}"):
            counts.zeroed(n)
    assert host.tolist() == [0, 1, 2, 3]
    assert counts.zeroed(2).tolist() == [0, 0] and host.tolist() == [0, 0, 2, 3]
