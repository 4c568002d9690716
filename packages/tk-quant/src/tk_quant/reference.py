"""Plain-PyTorch references of every tk-quant op (CPU or GPU); the golden models the kernels match bit
for bit. Built on ``tk_core.formats`` (conversions, the scale rule) and ``tk_core.layout`` (SF layouts)."""


# --- per-token / general block casts, cast back, E5M6 (§9.1-9.4) ---------------------------------

import torch  # noqa: E402
from tk_core.formats import (  # noqa: E402
    compute_scales,
    decode_e5m6,
    encode_e2m1,
    encode_e4m3,
    encode_e5m6,
    pack_e2m1,
    pack_e5m6,
    unpack_e5m6,
)
from tk_core.layout import ceil_div, sf_to_layout  # noqa: E402

from .common import (  # noqa: E402
    FMT_MAX,
    OUT_DTYPES,
    QuantInput,
    alloc_sf_out,
    amax_clamp,
    check_quant_input,
    decode_data,
    decode_sf,
    expand_sf,
    sf_out_layout,
)


def _block_amax(v: torch.Tensor, bm: int, bk: int) -> torch.Tensor:
    """max |v| over each (bm, bk) block (partial edge blocks use their valid elements) -> (nm, nk).

    NaN is ignored like the kernels' ``fmaxf`` does (a NaN-only block gives 0)."""
    t, h = v.shape
    nm, nk = ceil_div(t, bm), ceil_div(h, bk)
    a = torch.nan_to_num(v.abs(), nan=0.0, posinf=float("inf"))
    a = torch.nn.functional.pad(a, (0, nk * bk - h, 0, nm * bm - t))
    return a.view(nm, bm, nk, bk).amax(dim=(1, 3))


def _sf_to_out(sf_rows: torch.Tensor, layout: str, e4m3_sf: bool) -> torch.Tensor:
    if not e4m3_sf:
        return sf_to_layout(sf_rows, layout)
    out = alloc_sf_out(*sf_rows.shape, layout, sf_rows.device, e4m3_sf=True)
    out.copy_(sf_rows)
    return out


def cast(
    x,
    fmt: str,
    block_size=(32, 32),
    sf: torch.Tensor | None = None,
    x_block_size=None,
    round_sf: bool = False,
    use_tma_aligned_col_major_sf: bool = False,
    use_packed_ue8m0: bool = False,
    use_e4m3_sf: bool = False,
):
    """General 2-D block quantizer to e4m3 or packed e2m1 with scale block ``block_size = (bm, bk)``.

    ``x`` is a bf16/fp32 ``(T, H)`` tensor (any row stride) or a QuantTensor ``(data, sf_in)`` with block
    ``x_block_size``; a QuantTensor is requantized in kernel order: ``amax = max |decode(data)*s_in|``,
    ``q = convert(decode(data) * (s_in * sf_inv))``. Scales follow ``tk_core.formats.compute_scales``
    (floor ``tk_core.config.get_amax_clamp``); with ``use_e4m3_sf`` the scale is ``sf = e4m3(A'/Q)`` and
    ``sf_inv = 1/float(sf)``. With ``sf`` given (any layout), ``sf_inv = 1/sf`` and only the data is returned.
    Returns ``(data, sf)`` with ``sf`` in the layout of the flags (``tk_core.layout``).
    """
    op = "tk_quant.reference.cast"
    if fmt not in ("e4m3", "e2m1"):
        raise ValueError(f"{op}: fmt must be one of ('e4m3', 'e2m1'), got {fmt!r}")
    bm, bk = block_size
    if isinstance(x, (tuple, list)):
        q = check_quant_input(op, x, x_block_size)
        s_in = expand_sf(decode_sf(q.sf, q.nm, q.nk), q.t, q.h, *q.block)
        base = decode_data(q.data)
        v = base * s_in
    else:
        if x.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"{op}: x must be of dtype float32 or bfloat16, got {x.dtype}")
        base, s_in = x.float(), None
        v = base
    t, h = v.shape
    if fmt == "e2m1" and h % 2:
        raise ValueError(f"{op}: hidden must be even for e2m1, got {h}")
    nm, nk = ceil_div(t, bm), ceil_div(h, bk)
    layout = sf_out_layout(op, use_tma_aligned_col_major_sf, use_packed_ue8m0, round_sf, use_e4m3_sf)
    if sf is not None:
        sf_rows = decode_sf(sf, nm, nk)
        if tuple(sf_rows.shape) != (nm, nk):
            raise ValueError(f"{op}: sf must be of shape {(nm, nk)}, got shape {tuple(sf.shape)}")
        sf_inv = sf_rows.reciprocal()
    else:
        amax = _block_amax(v, bm, bk)
        if use_e4m3_sf:
            a = torch.clamp_min(amax, amax_clamp(fmt, True))
            sf_rows = encode_e4m3(a / FMT_MAX[fmt]).float()
            sf_inv = 1.0 / sf_rows
        else:
            sf_rows, sf_inv = compute_scales(amax, FMT_MAX[fmt], amax_clamp(fmt), round_sf)
    mult = expand_sf(sf_inv, t, h, bm, bk)
    y = base * (s_in * mult) if s_in is not None else base * mult
    data = encode_e4m3(y) if fmt == "e4m3" else pack_e2m1(encode_e2m1(y))
    if sf is not None:
        return data
    return data, _sf_to_out(sf_rows, layout, use_e4m3_sf)


def cast_back(x, fmt: str, block_size=(32, 32)) -> torch.Tensor:
    """``round_out(decode(data) * s)`` with ``s`` the block's scale (any SF layout); ``fmt`` 'bf16'/'fp32'."""
    op = "tk_quant.reference.cast_back"
    if fmt not in OUT_DTYPES:
        raise ValueError(f"{op}: fmt must be one of ('bf16', 'fp32'), got {fmt!r}")
    q = check_quant_input(op, x, block_size)
    s = expand_sf(decode_sf(q.sf, q.nm, q.nk), q.t, q.h, *q.block)
    return (decode_data(q.data) * s).to(OUT_DTYPES[fmt])


def cast_to_e5m6(
    x: torch.Tensor,
    num_per_channels: int,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
):
    """bf16/fp32 ``(T, H)`` -> (uint8 ``(T, 3H/2)`` packed E5M6 words, SF ``(T, H/bk)``).

    ``sf, sf_inv`` from the scale rule with ``Q = 65024`` and floor ``get_amax_clamp('e5m6')``;
    ``y = x * sf_inv``; each ``y`` is encoded by ``tk_core.formats.encode_e5m6`` (RZ to fp16, top 12 bits,
    round half-even on the fp32 bits below) and packed 8 codes -> 3 little-endian words.
    """
    op = "tk_quant.reference.cast_to_e5m6"
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"{op}: x must be of dtype float32 or bfloat16, got {x.dtype}")
    t, h = x.shape
    if h % 8 or h % num_per_channels:
        raise ValueError(f"{op}: hidden must be a multiple of 8 and of num_per_channels, got {h}")
    layout = sf_out_layout(op, use_tma_aligned_col_major_sf, use_packed_ue8m0, round_sf)
    v = x.float()
    amax = _block_amax(v, 1, num_per_channels)
    sf_rows, sf_inv = compute_scales(amax, FMT_MAX["e5m6"], amax_clamp("e5m6"), round_sf)
    y = v * expand_sf(sf_inv, t, h, 1, num_per_channels)
    data = pack_e5m6(encode_e5m6(y)) if t else torch.empty((0, h * 3 // 2), dtype=torch.uint8, device=x.device)
    return data, sf_to_layout(sf_rows, layout)


def cast_back_from_e5m6(x, fmt: str, x_block_size) -> torch.Tensor:
    """Packed E5M6 ``(data uint8 (T, 3H/2), sf)`` -> ``round_out(decode_e5m6(code) * s)`` in bf16/fp32."""
    op = "tk_quant.reference.cast_back_from_e5m6"
    if fmt not in OUT_DTYPES:
        raise ValueError(f"{op}: fmt must be one of ('bf16', 'fp32'), got {fmt!r}")
    q: QuantInput = check_quant_input(op, x, x_block_size, data_fmts=("e5m6",))
    codes = unpack_e5m6(q.data) if q.t else torch.empty((0, q.h), dtype=torch.int32, device=q.data.device)
    s = expand_sf(decode_sf(q.sf, q.nm, q.nk), q.t, q.h, *q.block)
    return (decode_e5m6(codes) * s).to(OUT_DTYPES[fmt])
