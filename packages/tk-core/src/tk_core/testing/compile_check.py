"""The compile tier: a kernel variant lowers and compiles for an arch with no GPU present, without
register spills, and within the SM's shared memory."""

import re

from ..jit import KernelFactory

# Usable shared memory per block (bytes) on sm_90 and sm_100.
MAX_SMEM_PER_BLOCK = 227 * 1024


def dynamic_smem_bytes(factory: KernelFactory, arch: str, **params) -> int:
    """The dynamic shared memory a kernel launches with, read from its lowered host module."""
    script = factory.lower(arch, **params).host_mod.script()
    sizes = [int(m) for m in re.findall(r'T\.call_packed\("[^"]+",[^\n]*?,\s*(\d+)\)', script)]
    return max(sizes, default=0)


def assert_compiles(factory: KernelFactory, arch: str, **params) -> str:
    """Compiles with spills as errors, checks shared memory, returns the CUDA source."""
    kernel = factory.compile(arch, strict=True, **params)
    smem = dynamic_smem_bytes(factory, arch, **params)
    assert smem <= MAX_SMEM_PER_BLOCK, f"{factory.name} {params}: {smem} B shared memory > {MAX_SMEM_PER_BLOCK}"
    return kernel.get_kernel_source()
