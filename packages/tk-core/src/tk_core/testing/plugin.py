"""pytest plugin of the tk packages (entry point ``tk_core``; load it with
``pytest_plugins = ["tk_core.testing.plugin"]`` where entry points are not installed).

- Markers: ``gpu`` (needs a CUDA device), ``compile`` (needs nvcc, no GPU), ``benchmark`` (needs a
  CUDA device and ``--run-benchmark``). Tests that cannot run here are skipped with the reason.
- A per-test seed derived from the test id (plus ``--seed``) seeds torch, Python's ``random`` and
  NumPy, so a failure reproduces whatever the order or xdist sharding.
- ``gpu_benchmark``: times an op for pytest-benchmark (see ``GpuBenchmark``).
"""

import hashlib
import os
import random
import shutil
import subprocess

import pytest
import torch

from .bench import copy_bandwidth_gbps, device_time_us, eager_time_us, timing_backend


def pytest_addoption(parser):
    group = parser.getgroup("tk")
    group.addoption("--seed", type=int, default=0, help="base of the per-test random seed")
    group.addoption("--run-benchmark", action="store_true", help="run tests marked benchmark")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; kernel against reference")
    config.addinivalue_line("markers", "compile: compiles kernels for sm_90a/sm_100a; needs nvcc, no GPU")
    config.addinivalue_line("markers", "benchmark: GPU timing with pytest-benchmark; needs --run-benchmark")
    if not os.environ.get("CUDA_HOME") and os.path.isdir("/usr/local/cuda"):
        os.environ["CUDA_HOME"] = "/usr/local/cuda"


def _nvcc_available() -> bool:
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    return shutil.which("nvcc") is not None or os.path.exists(os.path.join(home, "bin", "nvcc"))


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    has_nvcc = _nvcc_available()
    run_bench = config.getoption("--run-benchmark")
    for item in items:
        if "benchmark" in item.keywords:
            if not has_cuda:
                item.add_marker(pytest.mark.skip(reason="benchmark needs a CUDA device, none found"))
            elif not run_bench:
                item.add_marker(pytest.mark.skip(reason="benchmarks run with --run-benchmark (nox -s bench)"))
        elif "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="gpu tier needs a CUDA device, none found"))
        elif "compile" in item.keywords and not has_nvcc:
            item.add_marker(pytest.mark.skip(reason="compile tier needs nvcc (set CUDA_HOME), none found"))


def seed_for(nodeid: str, base: int = 0) -> int:
    return base + int(hashlib.sha256(nodeid.encode()).hexdigest(), 16) % 2**31


@pytest.fixture(autouse=True)
def seed(request) -> int:
    """Seeds torch, random and NumPy from the test id; returns the seed."""
    s = seed_for(request.node.nodeid, request.config.getoption("--seed"))
    torch.manual_seed(s)
    random.seed(s)
    try:
        import numpy

        numpy.random.seed(s % 2**32)
    except ImportError:
        pass
    return s


def pytest_runtest_teardown(item):
    """Hands a gpu test's cached CUDA blocks back to the device: with 16 pytest-xdist workers on one GPU, the
    caching allocators of the workers that ran the large cases held ~140 GB between them, and tests in other
    workers failed with out-of-memory errors."""
    if "gpu" in item.keywords and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def copy_gbps() -> float:
    """The device's copy bandwidth (1 GiB device-to-device, read plus written), once per session."""
    return copy_bandwidth_gbps()


class GpuBenchmark:
    """Times one op for pytest-benchmark and fills ``extra_info``.

    ``gpu_benchmark(fn, kernel=..., impl=..., bytes=..., **params)`` measures two medians: the device
    time of ``fn`` (CUPTI, L2 flushed; gives ``gbps`` and ``pct_of_copy``) and the eager call time
    (CUDA events around one Python call; ``eager_us``). pytest-benchmark's own statistics time a host
    round trip (call plus synchronize). ``kernel`` is the op's name as in the anchor figures; ``impl`` is
    ``tk``, ``torch`` or ``torch.compile``; cases of one op and shape share a group.
    """

    def __init__(self, benchmark, copy_gbps: float):
        self.benchmark = benchmark
        self.copy_gbps = copy_gbps

    def __call__(self, fn, *, kernel: str, impl: str, bytes: int, **params) -> dict:
        device_us = device_time_us(fn)
        eager_us = eager_time_us(fn)
        gbps = bytes / device_us / 1e3
        shape = ",".join(f"{k}={v}" for k, v in sorted(params.items()))
        self.benchmark.group = f"{kernel}[{shape}]"
        info = dict(
            kernel=kernel,
            impl=impl,
            bytes=bytes,
            device_us=round(device_us, 2),
            eager_us=round(eager_us, 2),
            gbps=round(gbps, 1),
            copy_gbps=round(self.copy_gbps, 1),
            pct_of_copy=round(100 * gbps / self.copy_gbps, 1),
            timer=timing_backend(),
            **params,
        )
        self.benchmark.extra_info.update(info)

        def synced():
            fn()
            torch.cuda.synchronize()

        self.benchmark.pedantic(synced, rounds=20, warmup_rounds=3)
        print(f"\n  BENCH {kernel} {impl} [{shape}]: {device_us:.1f} us, {gbps:.0f} GB/s "
              f"({info['pct_of_copy']}% of copy), eager {eager_us:.1f} us")
        return info


@pytest.fixture
def gpu_benchmark(benchmark, copy_gbps) -> GpuBenchmark:
    return GpuBenchmark(benchmark, copy_gbps)



@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_update_machine_info(config, machine_info):
    """Adds the GPU, the library versions and the commit to the benchmark JSON."""
    import importlib.metadata as md

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        machine_info["gpu"] = props.name
        machine_info["gpu_sms"] = props.multi_processor_count
    machine_info["torch"] = torch.__version__
    machine_info["cuda"] = torch.version.cuda
    for dist in ("tilelang", "tk-core", "tk-transpose", "tk-quant", "tk-engram"):
        try:
            machine_info[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    commit = os.environ.get("TK_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        except OSError:
            commit = ""
    machine_info["tk_commit"] = commit or "unknown"
