"""tk-quant: FP8 (e4m3), FP4 (e2m1) and E5M6 quantization kernels."""

from .__about__ import __version__
from .cast_back import cast_back, cast_back_e5m6, per_token_cast_back
from .common import QuantTensor, unpack_from_e2m1fn_x2
from .elementwise_cast import cast
from .per_block_cast import per_block_cast, per_block_cast_with_precomputed_sf, per_block_cast_with_sf_only
from .per_block_cast_lossless import per_block_cast_lossless
from .per_channel_cast import per_channel_cast, per_channel_cast_and_transpose, per_channel_cast_fused
from .per_token_cast import (
    per_token_cast,
    per_token_cast_and_cast_back,
    per_token_cast_with_precomputed_sf,
    per_token_cast_with_sf_only,
)
from .per_token_cast_e5m6 import per_token_cast_to_e5m6
from .swiglu import (
    swiglu_backward_and_per_token_cast,
    swiglu_forward_and_per_channel_cast_and_transpose,
    swiglu_forward_and_per_token_cast,
)

__all__ = [
    "__version__",
    "QuantTensor",
    "cast",
    "cast_back",
    "cast_back_e5m6",
    "per_block_cast",
    "per_block_cast_lossless",
    "per_block_cast_with_precomputed_sf",
    "per_block_cast_with_sf_only",
    "per_channel_cast",
    "per_channel_cast_and_transpose",
    "per_channel_cast_fused",
    "per_token_cast",
    "per_token_cast_and_cast_back",
    "per_token_cast_back",
    "per_token_cast_to_e5m6",
    "per_token_cast_with_precomputed_sf",
    "per_token_cast_with_sf_only",
    "swiglu_backward_and_per_token_cast",
    "swiglu_forward_and_per_channel_cast_and_transpose",
    "swiglu_forward_and_per_token_cast",
    "unpack_from_e2m1fn_x2",
]
