"""tk-quant's fused per-channel cast and transpose equals the separate cast followed by tk-transpose."""

import pytest
import torch

import tk_quant
import tk_transpose
from tk_core.testing import assert_equal


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("bm", [128])  # per_channel_cast supports 128-row blocks
def test_per_channel_cast_and_transpose_equals_cast_then_transpose(device, bm):
    x = torch.randn(256, 384, device=device, dtype=torch.bfloat16)
    fused, fused_sf = tk_quant.per_channel_cast_and_transpose(x, "e4m3", bm, round_sf=True)
    data, sf = tk_quant.per_channel_cast(x, "e4m3", bm, round_sf=True)
    assert_equal(fused, tk_transpose.transpose(data))
    assert_equal(fused_sf, sf)
