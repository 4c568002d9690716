"""The compile tier: a kernel variant lowers and compiles for an arch with no GPU present, without
register spills, within the SM's shared memory, and with no shared buffers on the same bytes but those its factory
declares (``tk_core.jit.kernel``'s ``shared_aliases``)."""

import contextlib
import os
import re
import tempfile

from ..jit import MAX_SMEM_PER_BLOCK, KernelFactory

# TileLang prints its shared-memory plan (one block per device function) with this pass option.
_PLAN_CONFIG = {"tl.debug_merge_shared_memory_allocations": True}
_PLAN_BUFFER = re.compile(r"Buffer: (\S+) \(Type: \S+\), Start Offset: (\d+), Size: (\d+) bytes")


def dynamic_smem_bytes(factory: KernelFactory, arch: str, compiled=None, **params) -> int:
    """The dynamic shared memory a kernel launches with, read from its lowered device module.

    ``compiled``, the ``JITKernel`` of ``factory.compile(arch, **params)``, saves lowering the kernel again (seconds
    for the large ones): a fresh compile keeps its lowered modules; one loaded from TileLang's disk cache does not.
    """
    artifact = getattr(compiled, "artifact", None)
    return _dyn_smem_bytes(artifact.device_mod if artifact is not None else factory.lower(arch, **params).device_mod)


def _dyn_smem_bytes(device_mod) -> int:
    sizes = [int(f.attrs["dyn_shared_memory_buf"]) for f in device_mod.functions.values()
             if f.attrs is not None and "dyn_shared_memory_buf" in f.attrs]
    return max(sizes, default=0)


@contextlib.contextmanager
def _stderr_text():
    """Collects what native code writes to file descriptor 2 (TileLang's logging) into the yielded list; if the
    block raises, the text goes back to stderr, so that a failed compile keeps its diagnostics."""
    text = []
    with tempfile.TemporaryFile("w+") as log:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        failed = True
        try:
            yield text
            failed = False
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            log.seek(0)
            text.append(log.read())
            if failed:
                os.write(2, text[0].encode())


def shared_plans(log: str) -> list[list[tuple[str, int, int]]]:
    """The shared-memory plans in TileLang's merge log: per device function, (buffer, byte offset, bytes)."""
    plans = []
    for block in log.split("Individual Buffer Allocations:")[1:]:
        block = block.split("End of Memory Allocation Plan")[0]
        plans.append([(name, int(off), int(size)) for name, off, size in _PLAN_BUFFER.findall(block)])
    return plans


def shared_overlaps(plans) -> set[frozenset]:
    """The pairs of buffers of one plan whose byte ranges intersect."""
    return {frozenset((a[0], b[0])) for plan in plans for i, a in enumerate(plan) for b in plan[i + 1:]
            if a[1] < b[1] + b[2] and b[1] < a[1] + a[2]}


def assert_compiles(factory: KernelFactory, arch: str, *, allow_spills: bool = False, **params) -> str:
    """Compiles with spills as errors, checks shared memory and its undeclared overlays, returns the CUDA source.
    ``allow_spills``: for the variants whose known spills were measured and accepted; the shared-memory checks
    still apply."""
    plan_factory = KernelFactory(factory.factory, factory.pass_configs | _PLAN_CONFIG)
    with _stderr_text() as log:
        kernel = plan_factory.compile(arch, strict=not allow_spills, **params)
    artifact = getattr(kernel, "artifact", None)
    if artifact is None:  # loaded from TileLang's disk cache: its passes did not run; one lowering gives both
        with _stderr_text() as log:
            artifact = plan_factory.lower(arch, **params)
    smem = _dyn_smem_bytes(artifact.device_mod)
    assert smem <= MAX_SMEM_PER_BLOCK, f"{factory.name} {params}: {smem} B shared memory > {MAX_SMEM_PER_BLOCK}"
    undeclared = shared_overlaps(shared_plans(log[0])) - factory.shared_aliases
    assert not undeclared, (f"{factory.name} {params}: TileLang placed shared buffers on the same bytes: "
                            f"{sorted(tuple(sorted(p)) for p in undeclared)}; check that a barrier orders each pair "
                            "and declare it in the factory's shared_aliases, or keep them apart")
    return kernel.get_kernel_source()
