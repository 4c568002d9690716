"""``fused_weight``: the float32 product of the two bf16 Engram gate weights.

Math: ``out = float(weight_hidden) * float(weight_embed)``, elementwise over (n, H). The product of two
bf16 values is exact in float32, so the result is bit-exact against any implementation.

Inputs: weight_hidden, weight_embed bf16 (n, H) on CUDA (any float dtype on CPU, where the reference runs);
H a multiple of 64 (any size on CPU is fine too, but the contract is the kernel's). Output float32 (n, H),
contiguous, on the weights' device. Errors: ``TypeError`` for dtypes, ``ValueError`` for shapes/devices.

Kernel: 8 columns (one 16-byte load per weight, two 16-byte stores) per thread over the flat n*H.
"""

import torch

from tk_core import checks
from tk_core.library import device_op

from . import reference
from ._gate_kernels import fused_weight_kernel

OP = "fused_weight"


@device_op("tk_engram::fused_weight", mutates_args=("out",))
def _fused_weight_op(weight_hidden: torch.Tensor, weight_embed: torch.Tensor, out: torch.Tensor) -> None:
    n, hidden = weight_hidden.shape
    fused_weight_kernel.get(out.device, n=n, hidden=hidden)(weight_hidden, weight_embed, out)


def fused_weight(weight_hidden: torch.Tensor, weight_embed: torch.Tensor) -> torch.Tensor:
    """float(weight_hidden) * float(weight_embed): float32 (n, H) (see the module docstring)."""
    for name, t in (("weight_hidden", weight_hidden), ("weight_embed", weight_embed)):
        checks.check_tensor(OP, name, t)  # before its device is read
        if t.device.type == "cuda":
            checks.check_dtype(OP, name, t, torch.bfloat16)
        else:
            checks.check_dtype(OP, name, t, (torch.bfloat16, torch.float16, torch.float32, torch.float64))
        checks.check_ndim(OP, name, t, 2)
    n, hidden = weight_hidden.shape
    checks.check_shape(OP, "weight_embed", weight_embed, (n, hidden))
    checks.check_same_device(OP, "weight_embed", weight_embed, weight_hidden.device)
    checks.check_divisible(OP, "hidden size H", hidden, 64)
    if weight_hidden.device.type != "cuda":
        return reference.fused_weight_ref(weight_hidden, weight_embed)
    out = torch.empty((n, hidden), dtype=torch.float32, device=weight_hidden.device)
    if out.numel():
        _fused_weight_op(weight_hidden.contiguous(), weight_embed.contiguous(), out)
    return out
