"""tk_core.ptx helpers whose exactness rests on a check over every input they are used for: in exact arithmetic on
the CPU where the sequence is deterministic IEEE arithmetic, on the GPU where it involves hardware approximations."""

import math
import struct
from fractions import Fraction

import pytest
import tilelang.language as T
import torch

from tk_core import jit
from tk_core.ptx import (
    DIV_FAST,
    EXP_SILU_BF16,
    EXP_SILU_BF16_LO,
    FAST_DIV_HI,
    FAST_DIV_LO,
    div_silu_bf16,
    one_plus_exp_neg_bf16,
)
from tk_core.testing import round_f32
from tk_core.testing.compile_check import assert_compiles

N_BF16 = 1 << 16


@jit.kernel
def silu_quotients():
    """For every bf16 bit pattern ``a``: ``tk_div_silu_bf16(a, 1 + exp(-a))``, the same with ``1 + exp(-a)`` by
    ``tk_one_plus_exp_neg_bf16``, and the IEEE ``a / (1 + exp(-a))``."""

    @T.prim_func
    def main(
        fast: T.Tensor((N_BF16,), "float32"),
        fast_exp: T.Tensor((N_BF16,), "float32"),
        ieee: T.Tensor((N_BF16,), "float32"),
    ):
        with T.Kernel(N_BF16 // 256, threads=256, prelude=DIV_FAST + EXP_SILU_BF16) as bx:
            i = bx * 256 + T.get_thread_binding()
            a = T.reinterpret(T.shift_left(T.cast(i, "uint32"), 16), "float32")
            b = T.float32(1) + T.exp(-a)
            fast[i] = div_silu_bf16(a, b)
            fast_exp[i] = div_silu_bf16(a, one_plus_exp_neg_bf16(a))
            ieee[i] = a / b

    return main


@pytest.mark.parametrize("arch", jit.ARCHS)
def test_silu_quotients_compile(arch):
    src = assert_compiles(silu_quotients, arch)
    assert "rcp.approx.ftz.f32" in src and "ex2.approx.ftz.f32" in src


def _bf16_in_range(lo: int) -> list[int]:
    """The bf16 bit patterns whose float32 magnitude bits lie in ``[lo, FAST_DIV_HI]``."""
    return [h for h in range(N_BF16) if lo <= (h << 16) & 0x7FFFFFFF <= FAST_DIV_HI]


def _f32(bits: int) -> Fraction:
    return Fraction(struct.unpack("<f", struct.pack("<I", bits))[0])


def test_exp_silu_bf16_reduction():
    """``tk_one_plus_exp_neg_bf16`` is nvcc's ``1.0f + expf(-a)`` but for the integer part n of ``-a * log2e``;
    the two n are equal, in exact arithmetic, for every bf16 ``a`` of its range, and differ just below it (so the
    range's lower end is needed). nvcc's n (sm_90a SASS of expf(x)): ``s = sat(RN(x * c + 0.5))`` with ``c`` the
    float32 0x3BBB989D (log2e / 252), ``j = RD(s * 252 + 12582913)``, ``n = j - 12583039``; the helper's
    ``n = RD(x * log2e + 12583039) - 12583039`` with log2e the float32 0x3FB8AA3B."""
    c, log2e = _f32(0x3BBB989D), _f32(0x3FB8AA3B)

    def n_pair(h):
        x = -_f32(h << 16)
        s = min(max(round_f32(x * c + Fraction(1, 2)), Fraction(0)), Fraction(1))
        return math.floor(s * 252 + 12582913) - 12583039, math.floor(x * log2e + 12583039) - 12583039

    checked = _bf16_in_range(EXP_SILU_BF16_LO)
    assert len(checked) == 2 * ((FAST_DIV_HI - EXP_SILU_BF16_LO) >> 16) + 2
    assert all(a == b for a, b in map(n_pair, checked))
    in_range = set(checked)
    below = [h for h in _bf16_in_range(FAST_DIV_LO) if h not in in_range]
    assert any(a != b for a, b in map(n_pair, below))


@pytest.mark.gpu
def test_gpu_div_silu_bf16():
    """The two-FMA-shorter SiLU division equals the IEEE one for each bf16 ``a`` in ``div_fast``'s range, and so does
    the division of ``tk_one_plus_exp_neg_bf16``'s denominator in that helper's range."""
    fast, fast_exp, ieee = (torch.empty(N_BF16, device="cuda") for _ in range(3))
    silu_quotients.get(fast.device)(fast, fast_exp, ieee)
    bits = torch.arange(N_BF16, dtype=torch.int32, device="cuda") << 16
    mag = bits & 0x7FFFFFFF
    for got, lo in ((fast, FAST_DIV_LO), (fast_exp, EXP_SILU_BF16_LO)):
        in_range = (mag >= lo) & (mag <= FAST_DIV_HI)
        assert int(in_range.sum()) == 2 * ((FAST_DIV_HI - lo) >> 16) + 2
        bad = in_range & (got.view(torch.int32) != ieee.view(torch.int32))
        assert not bad.any(), f"{int(bad.sum())} bf16 values differ, e.g. {bits[bad][:4].view(torch.float32).tolist()}"
