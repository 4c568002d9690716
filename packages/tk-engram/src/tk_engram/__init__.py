"""tk-engram: Engram hashing, RMSNorm-fused gating (forward and backward), GateConv and decode."""

from .__about__ import __version__

__all__ = ["__version__"]
