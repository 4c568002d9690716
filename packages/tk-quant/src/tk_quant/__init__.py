"""tk-quant: FP8 (e4m3), FP4 (e2m1) and E5M6 quantization kernels."""

from .__about__ import __version__

__all__ = ["__version__"]
