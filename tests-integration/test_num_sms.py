"""``tk_core.config.set_num_sms`` limits the persistent grids of tk-quant and the decode plan of tk-engram (to
leave SMs to kernels that run beside them, e.g. communication), and the results stay those of the full grid."""

import pytest
import torch

import tk_engram
import tk_quant
from tk_core import config
from tk_core.testing import assert_equal, calc_diff
from tk_quant import reference
from tk_quant.per_block_cast_lossless import num_ctas as lossless_ctas
from tk_quant.per_channel_cast import num_ctas as channel_ctas


def _run(x, xq, pos, decode_args):
    """per_channel_cast, the gathering per_channel_cast_fused (check=True: host counts), the lossless cast and one
    decode step (on a copy of the state)."""
    e, h, state, cache_pos, *rest = decode_args
    return (
        *tk_quant.per_channel_cast(x, "e4m3", 128),
        *tk_quant.per_channel_cast_fused(x, "e4m3", 128, pos_to_token=pos),
        *tk_quant.per_block_cast_lossless(xq, "e4m3", (1, 32), (32, 32)),
        tk_engram.engram_decode_step(e, h, state.clone(), cache_pos, *rest),
    )


@pytest.mark.gpu
def test_set_num_sms_limits_the_grids_not_the_results():
    t, h, d, d_mem = 1000, 2048, 4096, 1024
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    xq = reference.cast(torch.randn(t, h, device="cuda"), "e2m1", (1, 32), round_sf=True)
    pos = torch.randint(-1, t, (1024,), device="cuda", dtype=torch.int32)
    g = lambda *s: torch.randn(*s, device="cuda").bfloat16()  # noqa: E731
    state, cache_pos = tk_engram.init_decode_state(2, d, device="cuda")
    decode_args = (g(2, d_mem), g(2, d), g(*state.shape), cache_pos + 3, g(d_mem, d) / 32, g(d_mem, d) / 32,
                   1 + g(d) / 4, 1 + g(d) / 4, g(4, d) / 2)
    full = _run(x, xq, pos, decode_args)
    sms = config.get_num_sms()
    assert channel_ctas(x, 1024, False) == min(h // 64 * 8, sms * 4)
    try:
        config.set_num_sms(3)
        assert channel_ctas(x, 1024, False) == 12  # 3 SMs x 4 CTAs walk the 256 tiles
        assert lossless_ctas(t, h, 32, 32, "fp32", config.get_num_sms()) == 15  # 3 SMs x 5 CTAs
        few = _run(x, xq, pos, decode_args)  # the decode waits on no CTA it might not get: two launches
    finally:
        config.reset()
    for a, b in zip(full[:-1], few[:-1]):
        assert_equal(b, a)
    assert calc_diff(few[-1], full[-1]) < 1e-5
