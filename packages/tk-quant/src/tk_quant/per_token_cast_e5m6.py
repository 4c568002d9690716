"""E5M6 per-token cast: ``per_token_cast(x, 'e5m6', num_per_channels=H)``.

Math: one scale per row (``num_per_channels == H``, as in the original) or per ``(1, bk)`` group with
``bk`` in {16, 32, 64, 128} dividing ``H`` (an extension), the scale rule with ``Q = 65024`` and the
floor ``tk_core.config.get_amax_clamp('e5m6')`` (1e-4): ``y = fl(x * sf_inv)``; each ``y`` becomes a 12-bit
code (``tk_core.formats.encode_e5m6``: round toward zero to fp16, keep the top 12 bits, round half-even on
the 17 fp32 bits below; exact RNE in the fp16 normal range) and 8 codes pack into 3 little-endian uint32
words (``tk_core.formats.pack_e5m6``). Input bf16/fp32 ``(T, H)`` with ``H % 16 == 0`` and any row stride.
Outputs: uint8 ``(T, 3H/2)`` and an SF ``(T, H/bk)`` (row-major fp32, column-major fp32, or packed UE8M0 int32
``(T, 1)`` with only byte 0 meaningful; packed needs col-major and ``round_sf``).

The kernel is ``tk_quant.per_token_cast.per_token_cast_kernel`` with ``fmt='e5m6'`` (one row over 32*W lanes,
a cross-warp amax in shared memory, 16 elements -> 6 words per thread with packed ``cvt.rz.f16x2.f32``
conversions; with ``H % 32 == 0`` each warp stages its words in shared memory and stores 16-byte chunks).
CPU tensors run ``tk_quant.reference.cast_to_e5m6``.
"""

import torch

from tk_core.checks import check_dtype, check_ndim, check_positive_int, fail

from . import reference
from .common import alloc_sf_out, amax_clamp, data_from_reference, data_out, sf_out_layout
from .per_token_cast import _per_token_cast_op


def per_token_cast_to_e5m6(
    x: torch.Tensor,
    num_per_channels: int,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
    out: torch.Tensor | None = None,
):
    """Quantizes bf16/fp32 ``x (T, H)`` to packed E5M6 (one scale per row or per ``(1, bk)`` group); returns ``(data, sf)``."""
    op = "per_token_cast_to_e5m6"
    if not isinstance(x, torch.Tensor):
        fail(op, "x", "a torch.Tensor", type(x).__name__, TypeError)
    check_dtype(op, "x", x, (torch.float32, torch.bfloat16))
    check_ndim(op, "x", x, 2)
    if x.shape[1] > 1 and x.stride(1) != 1:
        fail(op, "x", "unit-stride in its last dimension", f"strides {tuple(x.stride())}")
    t, h = x.shape
    if h % 16:
        fail(op, "hidden", "a multiple of 16", h)
    check_positive_int(op, "num_per_channels", num_per_channels)
    if num_per_channels != h and (num_per_channels not in (16, 32, 64, 128) or h % num_per_channels):
        fail(op, "num_per_channels", f"the hidden size {h} or one of (16, 32, 64, 128) dividing it", num_per_channels)
    layout = sf_out_layout(op, use_tma_aligned_col_major_sf, use_packed_ue8m0, round_sf)
    if x.device.type != "cuda":
        data, sf = reference.cast_to_e5m6(x, num_per_channels, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
        return data_from_reference(op, out, data, "e5m6", t, h, x.device), sf
    data = data_out(op, out, "e5m6", t, h, x.device)
    sf = alloc_sf_out(t, h // num_per_channels, layout, x.device)
    if t:
        _per_token_cast_op(x, None, data, sf, "e5m6", num_per_channels, 1, 16, bool(round_sf), "cast", amax_clamp("e5m6"), False, 0)
    return data, sf
