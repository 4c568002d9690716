"""tk_core.ptx helpers whose exactness rests on a device check: every input they are used for, on the GPU."""

import pytest
import tilelang.language as T
import torch

from tk_core import jit
from tk_core.ptx import DIV_SILU_BF16, FAST_DIV_HI, FAST_DIV_LO, div_silu_bf16
from tk_core.testing.compile_check import assert_compiles

N_BF16 = 1 << 16


@jit.kernel
def silu_quotients():
    """For every bf16 bit pattern ``a``: ``tk_div_silu_bf16(a, 1 + exp(-a))`` and the IEEE ``a / (1 + exp(-a))``."""

    @T.prim_func
    def main(fast: T.Tensor((N_BF16,), "float32"), ieee: T.Tensor((N_BF16,), "float32")):
        with T.Kernel(N_BF16 // 256, threads=256, prelude=DIV_SILU_BF16) as bx:
            i = bx * 256 + T.get_thread_binding()
            a = T.reinterpret(T.shift_left(T.cast(i, "uint32"), 16), "float32")
            b = T.float32(1) + T.exp(-a)
            fast[i] = div_silu_bf16(a, b)
            ieee[i] = a / b

    return main


@pytest.mark.parametrize("arch", jit.ARCHS)
def test_silu_quotients_compile(arch):
    src = assert_compiles(silu_quotients, arch)
    assert "rcp.approx.ftz.f32" in src


@pytest.mark.gpu
def test_gpu_div_silu_bf16():
    """The two-FMA-shorter SiLU division equals the IEEE one for each bf16 ``a`` in ``div_fast``'s range."""
    fast = torch.empty(N_BF16, device="cuda")
    ieee = torch.empty(N_BF16, device="cuda")
    silu_quotients.get(fast.device)(fast, ieee)
    bits = torch.arange(N_BF16, dtype=torch.int32, device="cuda") << 16
    mag = bits & 0x7FFFFFFF
    in_range = (mag >= FAST_DIV_LO) & (mag <= FAST_DIV_HI)
    assert int(in_range.sum()) == 2 * ((FAST_DIV_HI - FAST_DIV_LO) >> 16) + 2
    bad = in_range & (fast.view(torch.int32) != ieee.view(torch.int32))
    assert not bad.any(), f"{int(bad.sum())} bf16 values differ, e.g. {bits[bad][:4].view(torch.float32).tolist()}"
