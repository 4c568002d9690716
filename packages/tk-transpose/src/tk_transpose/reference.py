"""Plain-PyTorch references of tk-transpose (CPU or GPU)."""

import torch


def batched_transpose(x: torch.Tensor) -> torch.Tensor:
    """``(B, M, N) -> (B, N, M)``, contiguous; moves raw bits (8-bit floats are copied as bytes, since
    not every torch backend copies them natively)."""
    if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return x.view(torch.uint8).transpose(-2, -1).contiguous().view(x.dtype)
    return x.transpose(-2, -1).contiguous()


def transpose(x: torch.Tensor) -> torch.Tensor:
    """``(M, N) -> (N, M)``, contiguous."""
    return batched_transpose(x.unsqueeze(0)).squeeze(0)
