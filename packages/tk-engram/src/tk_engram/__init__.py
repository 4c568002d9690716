"""tk-engram: Engram hashing, RMSNorm-fused gating (forward and backward), GateConv and decode."""

from .__about__ import __version__

# GateConv (TileOPs-style post-projection) forward, backward, autograd, decode
from .decode import EngramDecodeFwdOp, engram_decode_step, init_decode_state

# Engram hashing and gating
from .fused_weight import fused_weight
from .gate import engram_gate_bwd, engram_gate_fwd, grad_w_reduce
from .gate_conv import (
    EngramGateConvBwdOp,
    EngramGateConvFn,
    EngramGateConvFwdOp,
    engram_gate_conv,
    engram_gate_conv_bwd,
    engram_gate_conv_fwd,
)
from .gate_fn import EngramGateFn, engram_gate
from .hash import engram_hash
from .reference import make_offsets

__all__ = [
    "__version__",
    # Engram hashing and gating
    "EngramGateFn",
    "engram_gate",
    "engram_gate_bwd",
    "engram_gate_fwd",
    "engram_hash",
    "fused_weight",
    "grad_w_reduce",
    "make_offsets",
    # GateConv and decode
    "EngramDecodeFwdOp",
    "EngramGateConvBwdOp",
    "EngramGateConvFn",
    "EngramGateConvFwdOp",
    "engram_decode_step",
    "engram_gate_conv",
    "engram_gate_conv_bwd",
    "engram_gate_conv_fwd",
    "init_decode_state",
]
