"""Per-block casts: one scale per ``bm x bk`` block of a 2-D activation.

Math (``x`` bf16/fp32 ``(T, H)``, ``block_size = (bm, bk)``, scale grid ``nm x nk`` with
``nm = ceil(T/bm)``, ``nk = ceil(H/bk)``; partial blocks at the bottom/right edge use only the elements
that exist):

- ``A[m, k] = max |x[t, j]|`` over the block (exact, fp32);
- the scale rule of ``tk_core.formats.compute_scales``: ``A' = max(A, c_min)`` (``c_min`` from
  ``tk_core.config.get_amax_clamp(fmt)``); ``sf = A'/Q``, ``sf_inv = Q/A'`` (two IEEE divisions), or with
  ``round_sf`` the power-of-two pair ``sf = 2**k``, ``sf_inv = 2**-k``, ``k = ceil(log2(A'/Q))``;
- ``out[t, j] = convert(x[t, j] * sf_inv)``: e4m3 RNE saturating at +-448, or e2m1 RNE on the code grid
  (two codes per int8 byte, element ``2j`` in the low nibble).

Variants: ``per_block_cast`` returns ``(out, sf)``; ``per_block_cast_with_sf_only`` returns the SF only
(no data buffer is allocated or written); ``per_block_cast_with_precomputed_sf`` takes a row-major fp32
``sf`` and returns ``convert(x * fl(1/sf))``.

Shapes and layouts: ``out`` is float8_e4m3fn ``(T, H)`` or int8 ``(T, H/2)``; ``sf`` has logical shape
``(nm, nk)`` in the layout of the flags (``tk_core.layout``): row-major fp32, TMA-aligned column-major
fp32, or packed UE8M0 int32 ``(nm, ceil(nk/4))`` (needs ``round_sf`` and col-major; unused bytes of the
last word are written as zero).

Constraints: ``x`` 2-D, contiguous, bf16 or fp32; ``H % 64 == 0``; ``bm, bk`` in {32, 128};
``fmt`` in {'e4m3', 'e2m1'}; any ``T`` (0 allocates and returns without a launch).
Errors: ``TypeError`` for wrong types/dtypes, ``ValueError`` otherwise, naming op and argument.

Kernel: 256 threads per CTA over a ``bm x BK`` tile (``BK = max(bk, 8192/bm)``); each thread owns
8 consecutive columns (one 16-byte load for bf16) in ``bm/RPP`` rows and keeps them in registers; the
block amax is reduced with warp shuffles and one shared-memory exchange; the token count is dynamic.
"""

import tilelang.language as T
import torch

from tk_core import checks
from tk_core.config import get_amax_clamp
from tk_core.jit import kernel
from tk_core.layout import align, ceil_div
from tk_core.library import device_op

from . import _tl
from .common import check_block_pair, data_from_reference, data_out, sf_out_layout

OP = "per_block_cast"
_IN_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
VEC = 8  # columns per thread
THREADS = 256


def tile_cols(bm: int, bk: int) -> int:
    return max(bk, 8192 // bm)


@kernel
def per_block_cast_kernel(
    in_dtype: str, fmt: str, hidden: int, bm: int, bk: int, layout: str, round_sf: bool, mode: str, linear_grid: bool = False
):
    """``mode``: ``"cast"`` (data + SF), ``"sf_only"`` (SF only) or ``"cast_only"`` (data from a row-major SF).
    ``linear_grid``: see ``_tl.tile_grid`` (launches of more than 65,535 row blocks)."""
    num_tokens = T.dynamic("num_tokens")
    sf_len = T.dynamic("sf_len")
    BK = tile_cols(bm, bk)
    TPR = BK // VEC  # threads per row
    RPP = THREADS // TPR  # rows per pass
    P = bm // RPP  # passes
    NB = BK // bk  # scale blocks per tile
    WARPS = THREADS // 32
    nk = ceil_div(hidden, bk)
    col_tiles = ceil_div(hidden, BK)
    e2m1 = fmt == "e2m1"
    out_cols = hidden // 2 if e2m1 else hidden
    out_dtype = "uint8" if e2m1 else "float8_e4m3fn"
    sf_dtype = "uint8" if layout == "packed" else "float32"
    fmt_max = _tl.FORMAT_MAX[fmt]
    # lanes that hold the same scale block: column bits inside the block, row bits inside the warp
    offsets = [1 << i for i in range(5) if (1 << i) < bk // VEC] + [1 << i for i in range(5) if TPR <= (1 << i) < 32]
    write_data = mode != "sf_only"
    compute_sf = mode != "cast_only"

    @T.macro
    def body(x, out, sf, clamp_min):
        with _tl.tile_grid(col_tiles, T.ceildiv(num_tokens, bm), linear_grid, threads=THREADS) as ids:
            bx, by = _tl.tile_ids(ids, col_tiles, linear_grid)
            tx = T.get_thread_binding()
            xr = T.alloc_local((P, VEC), in_dtype)
            am = T.alloc_local((1,), "float32")
            red = T.alloc_shared((WARPS, NB), "float32")
            col = bx * BK + (tx % TPR) * VEC
            kb = col // bk
            nm = T.ceildiv(num_tokens, bm)
            am[0] = T.float32(0)
            for p in T.unroll(P):
                row = by * bm + p * RPP + tx // TPR
                if row < num_tokens and col < hidden:
                    for v in T.vectorized(VEC):
                        xr[p, v] = x[row, col + v]
                else:
                    for v in T.vectorized(VEC):
                        xr[p, v] = T.cast(0, in_dtype)
                if compute_sf:
                    for v in T.unroll(VEC):
                        am[0] = T.max(am[0], T.abs(T.cast(xr[p, v], "float32")))
            if compute_sf:
                for off in offsets:
                    am[0] = T.max(am[0], T.shfl_xor(am[0], off))
                if tx % 32 < TPR and (tx % TPR) * VEC % bk == 0:
                    red[tx // 32, (tx % TPR) * VEC // bk] = am[0]
                T.sync_threads()
                for w in T.unroll(WARPS):
                    am[0] = T.max(am[0], red[w, (tx % TPR) * VEC // bk])
            if compute_sf:
                s, si = _tl.scale_rule(am[0], clamp_min, fmt_max, round_sf)
                if tx < TPR and (tx % TPR) * VEC % bk == 0 and kb < nk:
                    if layout == "packed":
                        sf[_tl.sf_offset(layout, by, kb, nm, nk)] = _tl.ue8m0_byte(s)
                        if kb == nk - 1:
                            for z in T.serial(align(nk, 4) - nk):
                                sf[_tl.sf_offset(layout, by, nk + z, nm, nk)] = T.uint8(0)
                    else:
                        sf[_tl.sf_offset(layout, by, kb, nm, nk)] = s
            else:
                si = T.float32(1) / sf[by * nk + T.min(kb, nk - 1)]
            if write_data:
                for p in T.unroll(P):
                    row = by * bm + p * RPP + tx // TPR
                    if row < num_tokens and col < hidden:
                        if e2m1:
                            for v in T.vectorized(VEC // 2):
                                out[row, col // 2 + v] = T.cast(
                                    T.bitwise_or(
                                        _tl.encode_e2m1(T.cast(xr[p, 2 * v], "float32") * si),
                                        T.shift_left(_tl.encode_e2m1(T.cast(xr[p, 2 * v + 1], "float32") * si), 4),
                                    ),
                                    "uint8",
                                )
                        else:
                            for v in T.vectorized(VEC):
                                out[row, col + v] = T.cast(T.cast(xr[p, v], "float32") * si, "float8_e4m3fn")

    if write_data:

        @T.prim_func
        def main(
            x: T.Tensor((num_tokens, hidden), in_dtype),
            out: T.Tensor((num_tokens, out_cols), out_dtype),
            sf: T.Tensor((sf_len,), sf_dtype),
            clamp_min: T.float32,
        ):
            body(x, out, sf, clamp_min)

    else:

        @T.prim_func
        def main(x: T.Tensor((num_tokens, hidden), in_dtype), sf: T.Tensor((sf_len,), sf_dtype), clamp_min: T.float32):
            body(x, None, sf, clamp_min)

    return main


# --- SF allocation ------------------------------------------------------------------------------


def alloc_sf_storage(nm: int, nk: int, layout: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(flat, sf)``: the flat storage the kernel writes (fp32, or uint8 bytes for packed) and the
    user-facing logical ``(nm, nk)`` (packed: ``(nm, ceil(nk/4))`` int32) view of it."""
    if layout == "row":
        flat = torch.empty(nm * nk, dtype=torch.float32, device=device)
        return flat, flat.view(nm, nk)
    nm4 = align(nm, 4)
    if layout == "col":
        flat = torch.empty(nk * nm4, dtype=torch.float32, device=device)
        return flat, flat.view(nk, nm4)[:, :nm].t()
    words = torch.empty(ceil_div(nk, 4) * nm4, dtype=torch.int32, device=device)
    return words.view(torch.uint8), words.view(ceil_div(nk, 4), nm4)[:, :nm].t()


# --- device ops -----------------------------------------------------------------------------------


def _params(x: torch.Tensor, fmt: str, bm: int, bk: int, layout: str, round_sf: bool, mode: str) -> dict:
    return dict(
        in_dtype=_IN_DTYPES[x.dtype], fmt=fmt, hidden=x.shape[1], bm=bm, bk=bk, layout=layout, round_sf=round_sf, mode=mode,
        **_tl.grid_params(ceil_div(x.shape[0], bm)),
    )


@device_op("tk_quant::per_block_cast_", mutates_args=("out", "sf_flat"))
def per_block_cast_(
    x: torch.Tensor, out: torch.Tensor, sf_flat: torch.Tensor, fmt: str, bm: int, bk: int, layout: str, round_sf: bool, clamp_min: float
) -> None:
    k = per_block_cast_kernel.get(x.device, **_params(x, fmt, bm, bk, layout, round_sf, "cast"))
    k(x, out.view(torch.uint8) if fmt == "e2m1" else out, sf_flat, clamp_min)


@device_op("tk_quant::per_block_cast_sf_only_", mutates_args=("sf_flat",))
def per_block_cast_sf_only_(
    x: torch.Tensor, sf_flat: torch.Tensor, fmt: str, bm: int, bk: int, layout: str, round_sf: bool, clamp_min: float
) -> None:
    per_block_cast_kernel.get(x.device, **_params(x, fmt, bm, bk, layout, round_sf, "sf_only"))(x, sf_flat, clamp_min)


@device_op("tk_quant::per_block_cast_precomputed_", mutates_args=("out",))
def per_block_cast_precomputed_(x: torch.Tensor, out: torch.Tensor, sf: torch.Tensor, fmt: str, bm: int, bk: int) -> None:
    k = per_block_cast_kernel.get(x.device, **_params(x, fmt, bm, bk, "row", False, "cast_only"))
    k(x, out.view(torch.uint8) if fmt == "e2m1" else out, sf.view(-1), 0.0)


# --- public functions -----------------------------------------------------------------------------


def _check(op: str, x, fmt, block_size) -> tuple[int, int]:
    checks.check_dtype(op, "x", x, tuple(_IN_DTYPES))
    checks.check_ndim(op, "x", x, 2)
    checks.check_contiguous(op, "x", x)
    checks.check_divisible(op, "x.shape[1] (hidden)", x.shape[1], 64)
    checks.check_one_of(op, "fmt", fmt, ("e4m3", "e2m1"))
    bm, bk = check_block_pair(op, "block_size", block_size)
    checks.check_one_of(op, "block_size[0]", bm, (32, 128))
    checks.check_one_of(op, "block_size[1]", bk, (32, 128))
    return bm, bk


def per_block_cast(
    x: torch.Tensor,
    fmt: str,
    block_size: tuple[int, int],
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes ``x`` (bf16/fp32 ``(T, H)``, contiguous, ``H % 64 == 0``) to ``fmt`` ('e4m3' or 'e2m1')
    with one scale per ``block_size = (bm, bk)`` block, ``bm, bk`` in {32, 128}. ``out`` (optional): a
    preallocated contiguous, 16-byte aligned data output of the returned dtype and shape.

    Returns ``(out, sf)``: ``out`` float8_e4m3fn ``(T, H)`` or packed-e2m1 int8 ``(T, H/2)``; ``sf`` the
    dequantization scales ``(ceil(T/bm), ceil(H/bk))`` in the layout chosen by the flags (row-major fp32;
    TMA-aligned column-major fp32; packed UE8M0 int32 ``(nm, ceil(nk/4))``, which needs col-major and
    ``round_sf``). ``round_sf`` rounds scales up to powers of two. Bit-exact with
    ``tk_quant.reference.cast(x, fmt, block_size, ...)``.
    Raises ``TypeError``/``ValueError`` on invalid inputs.
    """
    bm, bk = _check(OP, x, fmt, block_size)
    layout = sf_out_layout(OP, use_tma_aligned_col_major_sf, use_packed_ue8m0, round_sf)
    t, h = x.shape
    if x.device.type != "cuda":
        from . import reference

        data, sf = reference.cast(
            x, fmt, (bm, bk), round_sf=round_sf,
            use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf, use_packed_ue8m0=use_packed_ue8m0,
        )
        return data_from_reference(OP, out, data, fmt, t, h, x.device), sf
    out = data_out(OP, out, fmt, t, h, x.device)
    flat, sf = alloc_sf_storage(ceil_div(t, bm), ceil_div(h, bk), layout, x.device)
    if t:
        per_block_cast_(x, out, flat, fmt, bm, bk, layout, bool(round_sf), get_amax_clamp(fmt))
    return out, sf


def per_block_cast_with_sf_only(
    x: torch.Tensor,
    fmt: str,
    block_size: tuple[int, int],
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> torch.Tensor:
    """The SF that ``per_block_cast`` would return, computed without writing (or allocating) the data.
    Same arguments, checks and layouts as ``per_block_cast``."""
    op = "per_block_cast_with_sf_only"
    bm, bk = _check(op, x, fmt, block_size)
    layout = sf_out_layout(op, use_tma_aligned_col_major_sf, use_packed_ue8m0, round_sf)
    if x.device.type != "cuda":
        from . import reference

        return reference.cast(
            x, fmt, (bm, bk), round_sf=round_sf,
            use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf, use_packed_ue8m0=use_packed_ue8m0,
        )[1]
    t, h = x.shape
    flat, sf = alloc_sf_storage(ceil_div(t, bm), ceil_div(h, bk), layout, x.device)
    if t:
        per_block_cast_sf_only_(x, flat, fmt, bm, bk, layout, bool(round_sf), get_amax_clamp(fmt))
    return sf


def per_block_cast_with_precomputed_sf(
    x: torch.Tensor,
    fmt: str,
    block_size: tuple[int, int],
    sf: torch.Tensor,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Casts ``x`` with given dequantization scales: ``out = convert(x * fl(1/sf[block]))`` (``out`` optional and
    preallocated, as in ``per_block_cast``).

    ``sf`` must be a contiguous row-major float32 ``(ceil(T/bm), ceil(H/bk))`` on ``x``'s device; the
    layout flags must be False (col-major or packed scales are rejected rather than misread) and
    ``round_sf`` is accepted for signature compatibility (the given scales are used as they are).
    Returns the data only (float8_e4m3fn ``(T, H)`` or int8 ``(T, H/2)``).
    """
    op = "per_block_cast_with_precomputed_sf"
    bm, bk = _check(op, x, fmt, block_size)
    checks.check_bool(op, "use_tma_aligned_col_major_sf", use_tma_aligned_col_major_sf)
    checks.check_bool(op, "round_sf", round_sf)
    checks.check_bool(op, "use_packed_ue8m0", use_packed_ue8m0)
    if use_tma_aligned_col_major_sf or use_packed_ue8m0:
        checks.fail(op, "use_tma_aligned_col_major_sf/use_packed_ue8m0", "False (sf is row-major fp32)", "True")
    t, h = x.shape
    checks.check_dtype(op, "sf", sf, torch.float32)
    checks.check_shape(op, "sf", sf, (ceil_div(t, bm), ceil_div(h, bk)))
    checks.check_contiguous(op, "sf", sf)
    checks.check_same_device(op, "sf", sf, x.device)
    if x.device.type != "cuda":
        from . import reference

        data = reference.cast(x, fmt, (bm, bk), sf=sf)
        return data_from_reference(op, out, data, fmt, t, h, x.device)
    out = data_out(op, out, fmt, t, h, x.device)
    if t:
        per_block_cast_precomputed_(x, out, sf, fmt, bm, bk)
    return out
