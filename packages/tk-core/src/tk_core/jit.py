"""One place that turns a TileLang kernel factory into a cached, compiled kernel.

A *kernel factory* is a function of compile-time parameters only (block sizes, dtypes, formats) that
returns a ``T.prim_func``; sizes such as the token count are ``T.dynamic`` runtime arguments, so a new
batch does not recompile. Decorate it with ``@kernel``::

    @kernel
    def copy_kernel(dtype: str, block: int):
        ...
        return main

    copy_kernel.get(x.device, dtype="bfloat16", block=128)(x, y)   # compiled once per key
    copy_kernel.compile("sm_100a", dtype="bfloat16", block=128)     # no GPU needed

The target comes from the tensor's device (sm_90a on Hopper, sm_100a on Blackwell) or from an explicit
arch, so the compile tier runs on machines without a GPU. ``precompile`` builds a list of variants in
parallel with a progress bar, to warm the cache before serving.
"""

import functools
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

ARCHS = ("sm_90a", "sm_100a")
# Shared memory one CTA may use (bytes) on sm_90 and sm_100; a launch asking for more fails.
MAX_SMEM_PER_BLOCK = 227 * 1024


def blocks_per_sm(threads: int, regs: int) -> int:
    """CTAs of ``threads`` threads an SM holds when each thread may use ``regs`` registers (65,536 registers, at
    most 2,048 threads and 32 CTAs per SM on sm_90 and sm_100); at least 1."""
    return max(1, min(65536 // (threads * regs), 2048 // threads, 32))

# Register spills become compile errors in strict mode (the compile tier).
STRICT_FLAGS = ("-Xptxas=--warn-on-spills", "-Xptxas=--warning-as-error")
_PRINT_SOURCE = os.environ.get("TK_PRINT_KERNEL_SOURCE", "0") not in ("", "0")


def arch_for_capability(major: int, minor: int) -> str:
    """The TileLang arch of a compute capability: the arch-specific ``a`` variant on sm_90 and sm_100."""
    if major in (9, 10):
        return f"sm_{major}{minor}a"
    return f"sm_{major}{minor}"


@functools.cache
def _arch_of_device_index(index: int) -> str:
    return arch_for_capability(*torch.cuda.get_device_capability(index))


def arch_of(device: torch.device | str | int | None = None) -> str:
    """The arch of a CUDA device (the current one by default), or an arch string passed through."""
    if isinstance(device, str) and device.startswith("sm_"):
        return device
    if device is None:
        return _arch_of_device_index(torch.cuda.current_device())
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"tk_core.jit: device must be a CUDA device or an arch like 'sm_90a', got {device}")
    return _arch_of_device_index(device.index if device.index is not None else torch.cuda.current_device())


def target_of(arch: str) -> dict:
    return {"kind": "cuda", "arch": arch}


class KernelFactory:
    """A TileLang kernel factory with a per-(arch, parameters) cache of compiled kernels."""

    def __init__(self, factory: Callable, pass_configs: dict | None = None,
                 shared_aliases: Iterable[tuple[str, str]] = ()):
        self.factory = factory
        self.pass_configs = pass_configs or {}
        # Pairs of shared buffers whose bytes TileLang may overlay (see ``kernel``), checked by the compile tier.
        self.shared_aliases = frozenset(frozenset(pair) for pair in shared_aliases)
        self.name = factory.__name__
        self._cache: dict = {}
        self._lock = threading.Lock()  # guards _key_locks
        self._key_locks: dict = {}  # one lock per (arch, parameters): different kernels compile in parallel
        functools.update_wrapper(self, factory)

    def __call__(self, **params):
        """The ``T.prim_func`` for ``params`` (not compiled)."""
        return self.factory(**params)

    def compile(self, arch: str, *, strict: bool = False, **params):
        """Compiles for ``arch`` (nvcc runs; no GPU needed) and returns the ``JITKernel``."""
        import tilelang

        kernel = tilelang.compile(
            self.factory(**params),
            target=target_of(arch),
            pass_configs=self.pass_configs,
            compile_flags=list(STRICT_FLAGS) if strict else None,
        )
        if _PRINT_SOURCE:
            print(f"// {self.name} {arch} {params}\n{kernel.get_kernel_source()}")
        return kernel

    def get(self, device, **params):
        """The compiled kernel for ``device`` and ``params``, cached: for a CUDA device (a tensor's device, an index,
        ``"cuda:0"``) the function that launches it (``launcher``), for an arch (``"sm_90a"``, no GPU needed) the
        ``JITKernel``. Both take the kernel's arguments in order."""
        key = (device, *params.items())
        kernel = self._cache.get(key)
        if kernel is None:
            arch = arch_of(device)
            full_key = (arch, tuple(sorted(params.items())))
            with self._lock:
                key_lock = self._key_locks.setdefault(full_key, threading.Lock())
            with key_lock:  # the same kernel is compiled once, however many threads ask for it
                kernel = self._cache.get(full_key)
                if kernel is None:
                    kernel = self.compile(arch, **params)
                    self._cache[full_key] = kernel
                self._cache[key] = kernel if arch == device else launcher(kernel)
            kernel = self._cache[key]
        return kernel

    def source(self, arch: str, **params) -> str:
        """The CUDA source for ``arch`` without running nvcc (about 0.1 s)."""
        return self.lower(arch, **params).kernel_source

    def lower(self, arch: str, **params):
        """``tilelang.lower`` of the kernel: the source, the host and device modules."""
        import tilelang
        import tvm
        from tvm.target import Target

        target = target_of(arch)
        # Same pass context as tilelang.compile, so the source matches what compile() builds.
        with Target(target), tvm.transform.PassContext(opt_level=3, config=self.pass_configs):
            return tilelang.lower(self.factory(**params), target=target)


def launcher(kernel) -> Callable:
    """The compiled host function of a TileLang ``JITKernel`` (tvm_ffi backend), which checks the arguments and
    launches the kernel on the current stream: calling it directly skips ``JITKernel.__call__`` and the adapter's
    routing of outputs that TileLang would allocate (``out_idx``, never set by these packages), about 4 us of Python
    per launch on the H200's host (``shared/benchmarks/probe_host_time.py``). Kernels with such outputs, or another
    backend, are returned as they are. Loading the module needs the GPU's driver: call it for a CUDA device only."""
    adapter = getattr(kernel, "adapter", None)
    if adapter is None or adapter.result_idx or not hasattr(adapter, "_get_executable"):
        return kernel
    executable = adapter._get_executable()  # a tvm Executable when just compiled, its module when loaded from disk
    module = executable.jit() if hasattr(type(executable), "jit") else executable
    return module.main


def kernel(factory: Callable | None = None, *, pass_configs: dict | None = None,
           shared_aliases: Iterable[tuple[str, str]] = ()):
    """Decorator: makes a kernel factory a cached ``KernelFactory``.

    ``shared_aliases``: pairs of ``T.alloc_shared`` buffer names that TileLang may place on the same bytes, each
    checked by hand to be ordered by a barrier (or read and rewritten by the same thread only). TileLang's shared
    memory merge gives a buffer the bytes of one whose last use comes earlier in the program, and its sync planner
    does not always put a barrier between a slow warp's last read and a fast warp's first write (it counted a
    barrier inside a conditional block that the last loop iteration skips); with ``tl.disable_thread_storage_sync``
    nothing does. The compile tier (``tk_core.testing.compile_check.assert_compiles``) fails on an overlap of
    buffers not named here."""
    if factory is None:
        return functools.partial(kernel, pass_configs=pass_configs, shared_aliases=shared_aliases)
    return KernelFactory(factory, pass_configs, shared_aliases)


def precompile(
    variants: Iterable[tuple[KernelFactory, dict]],
    archs: Sequence[str] | None = None,
    workers: int | None = None,
    progress: bool = True,
) -> int:
    """Compiles every ``(factory, params)`` for every arch (default: the current GPU's) in parallel.

    nvcc runs in subprocesses, so threads overlap the compiles. Returns the number of kernels built.
    """
    if archs is None:
        archs = (arch_of(None),)
    jobs = [(f, a, p) for f, p in variants for a in archs]
    workers = workers or min(len(jobs), os.cpu_count() or 1) or 1
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(jobs), desc="tk precompile", unit="kernel")
    with ThreadPoolExecutor(workers) as pool:
        for _ in pool.map(lambda job: job[0].get(job[1], **job[2]), jobs):
            if bar is not None:
                bar.update()
    if bar is not None:
        bar.close()
    return len(jobs)
