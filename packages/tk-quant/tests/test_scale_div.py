"""``_tl.SCALE_DIV``: the unrounded scale rule's ``A'/Q`` and ``Q/A'`` without nvcc's division call, bit for bit the
IEEE quotients for every ``A'`` from ``SCALE_DIV_MIN`` up (exact arithmetic on the CPU, every significand on the
GPU)."""

import math
import random
from fractions import Fraction

import pytest
import tilelang.language as T
import torch

from tk_core import jit
from tk_core.testing import round_f32
from tk_core.testing.compile_check import assert_compiles
from tk_quant import _tl

N = T.dynamic("n")


@jit.kernel
def scale_quotients(fmt_max: float):
    """For each ``a``: ``_tl.scale_rule``'s quotients with ``call_free`` and the IEEE ones (floor ``SCALE_DIV_MIN``)."""

    @T.prim_func
    def main(a: T.Tensor((N,), "float32"), got: T.Tensor((N, 2), "float32"), ieee: T.Tensor((N, 2), "float32")):
        with T.Kernel(T.ceildiv(N, 256), threads=256, prelude=_tl.SCALE_DIV) as bx:
            i = bx * 256 + T.get_thread_binding()
            if i < N:
                floor = T.float32(_tl.SCALE_DIV_MIN)
                s, s_inv = _tl.scale_rule(a[i], floor, fmt_max, False, call_free=True)
                got[i, 0] = s
                got[i, 1] = s_inv
                s, s_inv = _tl.scale_rule(a[i], floor, fmt_max, False)
                ieee[i, 0] = s
                ieee[i, 1] = s_inv

    return main


FMT_MAX = sorted(set(_tl.FORMAT_MAX.values()) | {65024.0})  # e4m3, e2m1, e5m6


@pytest.mark.parametrize("arch", jit.ARCHS)
def test_scale_quotients_compile(arch):
    src = assert_compiles(scale_quotients, arch, fmt_max=448.0)
    assert "tk_scale_quot" in src and "tk_scale_recip" in src


def _quotients(m: Fraction, c: Fraction) -> tuple[Fraction, Fraction]:
    """The device sequence in exact arithmetic for a significand ``m`` in [1, 2): each step one IEEE rounding."""
    rc, rm = round_f32(1 / c), round_f32(1 / m)
    q = round_f32(m * rc)
    q = round_f32(round_f32(m - q * c) * rc + q)
    p = round_f32(c * rm)
    p = round_f32(round_f32(c - p * m) * rm + p)
    return q, p


@pytest.mark.parametrize("fmt_max", FMT_MAX)
def test_scale_quotients_exact_arithmetic(fmt_max):
    """Markstein's correction gives the correctly rounded ``m / Q`` and ``Q / m``: the ends of [1, 2), the
    significands next to the quotients' rounding boundaries, and random ones."""
    c = Fraction(fmt_max)
    rng = random.Random(0)
    ulp = Fraction(1, 1 << 23)
    ms = {1 + k * ulp for k in (0, 1, 2, (1 << 23) - 2, (1 << 23) - 1)}
    ms |= {1 + rng.randrange(1 << 23) * ulp for _ in range(3000)}
    for m in sorted(ms):
        q, p = _quotients(m, c)
        assert q == round_f32(m / c) and p == round_f32(c / m), (float(m), fmt_max)
    assert Fraction(_tl.rn_reciprocal(fmt_max)) == round_f32(1 / c)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt_max", FMT_MAX)
def test_gpu_scale_quotients(fmt_max):
    """Every significand at exponent 0, random ones at every exponent from the floor ``SCALE_DIV_MIN`` to the
    largest, and the specials (+inf, NaN (the floor), the largest float): the call-free quotients equal the IEEE
    ones."""
    every = (torch.arange(1 << 23, dtype=torch.int32) | (127 << 23)).view(torch.float32)
    lo = 127 + int(math.log2(_tl.SCALE_DIV_MIN))  # the biased exponent of the floor
    exps = torch.arange(lo, 255, dtype=torch.int32).repeat_interleave(4096)
    sampled = ((exps << 23) | torch.randint(0, 1 << 23, exps.shape, dtype=torch.int32)).view(torch.float32)
    special = torch.tensor([float("inf"), float("nan"), torch.finfo(torch.float32).max, _tl.SCALE_DIV_MIN, 1e-4])
    a = torch.cat([every, sampled, special]).cuda()
    got, ieee = (torch.empty(a.numel(), 2, device="cuda") for _ in range(2))
    scale_quotients.get(a.device, fmt_max=fmt_max)(a, got, ieee)
    bad = (got.view(torch.int32) != ieee.view(torch.int32)).any(1)
    assert not bad.any(), f"{int(bad.sum())} values differ, e.g. {a[bad][:4].tolist()}"
