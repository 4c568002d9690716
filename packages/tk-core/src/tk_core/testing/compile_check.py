"""The compile tier: a kernel variant lowers and compiles for an arch with no GPU present, without
register spills, and within the SM's shared memory."""

from ..jit import MAX_SMEM_PER_BLOCK, KernelFactory


def dynamic_smem_bytes(factory: KernelFactory, arch: str, compiled=None, **params) -> int:
    """The dynamic shared memory a kernel launches with, read from its lowered device module.

    ``compiled``, the ``JITKernel`` of ``factory.compile(arch, **params)``, saves lowering the kernel again (seconds
    for the large ones): a fresh compile keeps its lowered modules; one loaded from TileLang's disk cache does not.
    """
    artifact = getattr(compiled, "artifact", None)
    device_mod = artifact.device_mod if artifact is not None else factory.lower(arch, **params).device_mod
    sizes = [int(f.attrs["dyn_shared_memory_buf"]) for f in device_mod.functions.values()
             if f.attrs is not None and "dyn_shared_memory_buf" in f.attrs]
    return max(sizes, default=0)


def assert_compiles(factory: KernelFactory, arch: str, **params) -> str:
    """Compiles with spills as errors, checks shared memory, returns the CUDA source."""
    kernel = factory.compile(arch, strict=True, **params)
    smem = dynamic_smem_bytes(factory, arch, kernel, **params)
    assert smem <= MAX_SMEM_PER_BLOCK, f"{factory.name} {params}: {smem} B shared memory > {MAX_SMEM_PER_BLOCK}"
    return kernel.get_kernel_source()
