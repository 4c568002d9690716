"""tk_quant.common helpers that no op test covers on its own."""

import torch

from tk_quant import common


def test_scratch_is_cached_grown_and_kept():
    a = common.scratch("cpu", torch.int32)
    assert a.dtype == torch.int32 and a.numel() >= 16 and common.scratch("cpu", torch.int32, 16) is a
    assert common.scratch("cpu", torch.uint8) is not a  # one per dtype
    big = common.scratch("cpu", torch.int32, a.numel() + 1)
    assert big.numel() > a.numel() and common.scratch("cpu", torch.int32, 8) is big
    # the replaced one is never freed: a kernel on another stream may still be writing it
    assert any(r is a for r in common._retired)
