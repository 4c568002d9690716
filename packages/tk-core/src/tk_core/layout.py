"""Alignment helpers and the storage layouts of scale factors (SF).

A scale covers a ``(bm, bk)`` block of a ``(T, H)`` tensor; the SF grid is ``nm x nk`` with
``nm = ceil(T/bm)``, ``nk = ceil(H/bk)``. Every returned SF has logical shape ``(nm, nk)`` (row index =
token block) in one of three layouts:

- ``"row"``: contiguous float32 ``(nm, nk)``;
- ``"col"``: TMA-aligned column-major float32: storage ``(nk, align(nm, 4))``, returned transposed, so
  strides are ``(1, align(nm, 4))`` and each column starts on a 16-byte boundary;
- ``"packed"``: packed UE8M0, column-major: int32 ``(nm, ceil(nk/4))`` with strides
  ``(1, align(nm, 4))``; byte ``j`` of word ``[m, c]`` is the exponent of block ``(m, 4c + j)``.
  Needs power-of-two scales (``round_sf=True``).
"""

import math

import torch

from . import checks
from .formats import decode_ue8m0, encode_ue8m0, pack_ue8m0, unpack_ue8m0

SF_LAYOUTS = ("row", "col", "packed")


def ceil_div(x: int, y: int) -> int:
    return (x + y - 1) // y


def align(x: int, y: int) -> int:
    return ceil_div(x, y) * y


def is_power_of_two(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def tma_aligned_size(n: int, element_size: int) -> int:
    """``n`` rounded up so that ``n * element_size`` is a multiple of 16 bytes."""
    return align(n, 16 // element_size)


def vector_aligned(x: torch.Tensor, nbytes: int = 16) -> torch.Tensor:
    """``x`` itself when kernels may access it in ``nbytes``-byte vectors along its unit-stride last dimension:
    base address and every leading stride (of dimensions longer than 1) multiples of ``nbytes`` bytes.
    Otherwise a fresh contiguous copy. ``contiguous()`` would not do: it keeps a misaligned base address.
    A dimension of length 1 whose stride is not such a multiple gets the contiguous stride in a view of the same
    memory (the stride is never stepped, but ``view(dtype)`` to a wider dtype checks it: e.g. one row of a buffer with
    an odd row length). While ``torch.compile`` traces, tensors have no address; the compiled graph passes fresh
    buffers."""
    checks.check_positive_int("vector_aligned", "nbytes", nbytes)
    if torch.compiler.is_compiling():
        return x
    size = x.element_size()
    odd = [n > 1 for n, s in zip(x.shape[:-1], x.stride()[:-1]) if s * size % nbytes]  # unaligned leading strides
    if x.data_ptr() % nbytes or any(odd):
        return x.clone(memory_format=torch.contiguous_format)
    if odd:  # only length-1 dimensions
        strides = [s if n > 1 else math.prod(x.shape[i + 1:]) for i, (n, s) in enumerate(zip(x.shape, x.stride()))]
        return x.as_strided(x.shape, strides)
    return x


def sf_layout(op: str, use_tma_aligned_col_major_sf: bool, use_packed_ue8m0: bool, round_sf: bool) -> str:
    """Maps the two layout flags to a layout name; rejects packed without col-major or rounding."""
    if use_packed_ue8m0:
        if not use_tma_aligned_col_major_sf:
            raise ValueError(f"{op}: use_packed_ue8m0 must come with use_tma_aligned_col_major_sf=True, got False")
        if not round_sf:
            raise ValueError(f"{op}: use_packed_ue8m0 must come with round_sf=True (power-of-two scales), got False")
        return "packed"
    return "col" if use_tma_aligned_col_major_sf else "row"


def alloc_sf(nm: int, nk: int, layout: str, device) -> torch.Tensor:
    """An uninitialised SF of logical shape ``(nm, nk)`` in ``layout`` (padding included)."""
    if nm < 0 or nk < 0:
        checks.fail("alloc_sf", "(nm, nk)", "non-negative", (nm, nk))
    if layout == "row":
        return torch.empty((nm, nk), dtype=torch.float32, device=device)
    if layout == "col":
        return torch.empty((nk, align(nm, 4)), dtype=torch.float32, device=device)[:, :nm].t()
    if layout == "packed":
        return torch.empty((ceil_div(nk, 4), align(nm, 4)), dtype=torch.int32, device=device)[:, :nm].t()
    raise ValueError(f"alloc_sf: layout must be one of {SF_LAYOUTS}, got {layout!r}")


def sf_to_layout(sf: torch.Tensor, layout: str) -> torch.Tensor:
    """Row-major float32 ``(nm, nk)`` -> the same scales in ``layout``; padding is zero."""
    checks.check_one_of("sf_to_layout", "layout", layout, SF_LAYOUTS)
    checks.check_ndim("sf_to_layout", "sf", sf, 2)
    nm, nk = sf.shape
    if layout == "row":
        return sf.to(torch.float32, copy=True)
    values = pack_ue8m0(encode_ue8m0(sf)) if layout == "packed" else sf.float()
    # column-major storage built whole (zeros, then the scales): no write through an as_strided view, which
    # torch.compile cannot functionalise
    storage = values.new_zeros((values.shape[1], align(nm, 4)))
    storage[:, :nm] = values.t()
    return storage[:, :nm].t()


def sf_layout_of(sf: torch.Tensor) -> str:
    """Recognises the layout of an SF tensor (``"row"``, ``"col"`` or ``"packed"``) from dtype and strides.

    Column-major means ``stride(0) == 1 and stride(1) != 1``, so a row-major ``(N, 1)`` stays row-major.
    """
    if sf.dtype == torch.int32:
        return "packed"
    return "col" if sf.dim() == 2 and sf.stride(0) == 1 and sf.stride(1) != 1 else "row"


def sf_to_row_major(sf: torch.Tensor, nk: int) -> torch.Tensor:
    """Any-layout SF -> contiguous float32 ``(nm, nk)``; packed bytes are decoded as ``2**(e-127)``."""
    if sf.dtype == torch.int32:
        return decode_ue8m0(unpack_ue8m0(sf.contiguous(), nk))
    return sf.float().contiguous()
