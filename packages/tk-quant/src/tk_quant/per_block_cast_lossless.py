"""Lossless FP4 -> FP8 block re-quantization: ``cast_back(result) == cast_back(input)`` bit for bit.

Input: ``x = (data, sf)``, ``data`` packed e2m1 int8 ``(T, H/2)`` (contiguous), ``sf`` power-of-two
scales for blocks ``x_block_size = (bm_in, bk_in)`` in any SF layout (row-major fp32, TMA-aligned
column-major fp32, packed UE8M0 int32). Output: float8_e4m3fn ``(T, H)`` and power-of-two scales for
``out_block_size = (bm_out, bk_out)`` in the layout of the output flags.

Math, for each output block ``B`` (the input blocks it covers that hold elements):

- ``e_i`` = biased exponent of input scale ``i`` (0..255; an fp32 scale must be ``+2**(e-127)`` or
  ``+0.0``; a UE8M0 byte is the exponent itself);
- ``E = max e_i``; ``e_out = max(E - 6, 1)``: the output scale is ``2**(e_out - 127)``, never the
  UE8M0 byte 0 (which decodes to 0.0; §15.7 of the spec);
- ``out = e4m3(fp4 * 2**(e_i - e_out))`` (``+-0`` for a zero scale). This is exact when
  ``d_i = e_i - e_out`` is in ``[-8, 6]``: ``6 * 2**6 = 384 <= 448`` and the smallest fp4 step
  ``0.5 * 2**-8 = 2**-9`` is the e4m3 subnormal step, so the admissible spread of the input scales of
  one output block is ``2**14`` (1.0.0 allowed only ``2**11``).

Inadmissible input (a scale that is not a non-negative power of two or zero, an inf/NaN scale or the
UE8M0 byte 255, or ``d_i < -8``) is counted per 32-column row segment into a small int32 device
counter; the wrapper raises ``ValueError`` when it is non-zero (``check=True``, the default: one host
sync). ``check=False`` never synchronises (use it under CUDA graphs / ``torch.compile``); pass your own
zeroed ``error_count`` (int32 ``(1,)``) to read the count later. Offending segments are written
deterministically but not losslessly.

``round_sf`` must be True (the output scales are powers of two by construction; False is rejected).
Constraints: ``fmt == 'e4m3'``; logical ``H % 32 == 0``; ``bk_in`` and ``bk_out`` powers of two with
``32 <= bk_in <= bk_out <= 1024``; ``bm_in, bm_out`` powers of two, ``bm_out % bm_in == 0``,
``bm_out <= 128``.

Kernel: 256 threads; each thread turns one 16-byte fp4 vector (32 values of one row) into 32 e4m3
bytes per pass, with integer/bit arithmetic plus the exact hardware fp32->e4m3 conversion; the block
maximum of exponents is reduced with warp shuffles, alone for ``bm_out == 1`` (one warp per 1024-column
row segment: no shared memory, no barrier), else followed by shared-memory atomics. A persistent grid
(SMs x 4 CTAs) walks the tiles and prefetches the next tile (data and raw input scales) into registers
while the current one is converted and stored. The token count and the input SF strides are runtime
arguments.
"""

import tilelang.language as T
import torch

from tk_core import checks
from tk_core.jit import kernel
from tk_core.layout import align, ceil_div, is_power_of_two, sf_layout
from tk_core.library import device_op

from . import _tl
from .per_block_cast import alloc_sf_storage

OP = "per_block_cast_lossless"
THREADS = 256
SEG = 32  # logical fp4 values per thread per pass (16 bytes)


PASSES = 2  # row passes per thread at least; with the prefetch buffer, 64 B of fp4 loads per thread in flight
DEFAULT_SMS = 132  # H200; the device op passes the SM count of the tensor's device
MIN_BLOCKS = 4  # CTAs per SM: both tile buffers fit 64 registers (58-64 on sm_90a and sm_100a, no spills)


def _tile(bm_out: int, bk_out: int, passes: int = PASSES) -> tuple[int, int, int, int]:
    """(BK, TPR, RPP, P). ``bm_out == 1``: one warp per row (BK = 1024), so the output scales a CTA writes
    for one row are a contiguous run (a full sector for row-major fp32 1 x 128 scales, not one scattered
    word per row), and no 128-row floor (the block max stays inside a warp)."""
    if bm_out == 1:
        BK = 32 * SEG
        return BK, 32, THREADS // 32, passes
    BK = max(bk_out, 128)
    TPR = BK // SEG
    RPP = THREADS // TPR
    P = max(passes, 128 // RPP, bm_out // RPP)
    return BK, TPR, RPP, P


_FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of the e2m1 codes 0..7


# The bounds of every access are already guarded by the row/column tests: the legalizer's extra checks would
# load the input scale twice.
@kernel(pass_configs={"tl.disable_safe_memory_legalize": True})
def per_block_cast_lossless_kernel(
    hidden: int,
    bm_in: int,
    bk_in: int,
    in_kind: str,
    bm_out: int,
    bk_out: int,
    layout: str,
    passes: int = PASSES,
    min_blocks: int = 0,
    ctas: int = 0,
):
    """``in_kind``: ``"fp32"`` (any strides) or ``"packed"`` (UE8M0 bytes); ``layout``: output SF layout;
    ``passes``: row passes per thread (a power of two; raised to cover 128 rows and one block row for
    ``bm_out > 1``).

    Persistent: at most ``ctas`` CTAs (0: ``DEFAULT_SMS`` x ``min_blocks``; ``min_blocks`` 0:
    ``MIN_BLOCKS``) loop over the tiles, and each loads its next tile (data and raw input scales) into a
    second register buffer before it converts and stores the current one, so loads stay in flight across
    the conversion, the barriers and the stores."""
    min_blocks = min_blocks or MIN_BLOCKS
    ctas = ctas or DEFAULT_SMS * min_blocks
    num_tokens = T.dynamic("num_tokens")
    sf_in_len = T.dynamic("sf_in_len")
    sf_len = T.dynamic("sf_len")
    BK, TPR, RPP, P = _tile(bm_out, bk_out, passes)
    BM = RPP * P
    NBR = BM // bm_out  # output block rows per tile
    NBC = BK // bk_out  # output block columns per tile
    NXT = ceil_div(hidden, BK)  # column tiles
    nk = ceil_div(hidden, bk_out)
    in_dtype = "uint8" if in_kind == "packed" else "int32"
    sf_dtype = "uint8" if layout == "packed" else "float32"
    rows_per_warp = 32 // TPR
    offsets = [1 << i for i in range(5) if (1 << i) < bk_out // SEG and (1 << i) < TPR]
    offsets += [TPR << i for i in range(5) if (TPR << i) < 32 and (1 << i) < bm_out]

    @T.macro
    def load(x, sf_in, s0, s1, xb, sw, tile, tx):
        """Data and raw input scale words of ``tile`` (zeros outside the tensor: exponent 0, admissible)."""
        col = T.truncmod(tile, NXT) * BK + (tx % TPR) * SEG
        for p in T.unroll(P):
            row = T.truncdiv(tile, NXT) * BM + p * RPP + tx // TPR
            if row < num_tokens and col < hidden:
                for v in T.vectorized(SEG // 8):
                    xb[p, v] = x[row, col // 8 + v]
                if in_kind == "packed":
                    m_in = row // bm_in
                    k_in = col // bk_in
                    sw[p] = T.cast(sf_in[4 * (m_in * s0 + (k_in // 4) * s1) + k_in % 4], "int32")
                else:
                    sw[p] = sf_in[(row // bm_in) * s0 + (col // bk_in) * s1]
            else:
                sw[p] = 0

    @T.prim_func
    def main(
        x: T.Tensor((num_tokens, hidden // 8), "int32"),
        sf_in: T.Tensor((sf_in_len,), in_dtype),
        out: T.Tensor((num_tokens, hidden // 4), "uint32"),
        sf: T.Tensor((sf_len,), sf_dtype),
        err: T.Tensor((1,), "int32"),
        s0: T.int32,
        s1: T.int32,
    ):
        ntiles = NXT * T.ceildiv(num_tokens, BM)
        nctas = T.min(ntiles, ctas)
        with T.Kernel(nctas, threads=THREADS) as bid:
            if min_blocks > 1:
                T.annotate_min_blocks_per_sm(min_blocks)
            tx = T.get_thread_binding()
            xin = T.alloc_local((P, SEG // 8), "int32")
            xn = T.alloc_local((P, SEG // 8), "int32")
            sw = T.alloc_local((P,), "int32")
            swn = T.alloc_local((P,), "int32")
            ow = T.alloc_local((SEG // 4,), "uint32")
            ex = T.alloc_local((P,), "int32")
            bad = T.alloc_local((P,), "int32")
            mx = T.alloc_local((1,), "int32")
            em = T.alloc_local((P,), "int32")
            red = T.alloc_shared((NBR * NBC,), "int32")
            nm = T.ceildiv(num_tokens, bm_out)
            cb = (tx % TPR) * SEG // bk_out  # output block column inside the tile
            niter = T.truncdiv(ntiles - bid + nctas - 1, nctas)

            load(x, sf_in, s0, s1, xin, sw, bid, tx)
            for it in T.serial(niter):
                tile = bid + it * nctas
                bx = T.truncmod(tile, NXT)
                by = T.truncdiv(tile, NXT)
                col = bx * BK + (tx % TPR) * SEG
                if it + 1 < niter:
                    load(x, sf_in, s0, s1, xn, swn, tile + nctas, tx)
                if bm_out > 1:
                    for i in T.unroll(ceil_div(NBR * NBC, THREADS)):
                        if i * THREADS + tx < NBR * NBC:
                            red[i * THREADS + tx] = 0
                for p in T.unroll(P):
                    if in_kind == "packed":
                        ex[p] = sw[p]
                        bad[p] = T.if_then_else(ex[p] == 255, 1, 0)
                    else:
                        ex[p] = T.bitwise_and(T.shift_right(sw[p], 23), 0xFF)
                        bad[p] = T.if_then_else(T.bitwise_and(sw[p], T.int32(-0x7F800001)) != 0 or ex[p] == 255, 1, 0)
                if bm_out == 1:
                    # A 1 x bk_out block lies in consecutive lanes of one warp: the butterfly gives every lane the
                    # block maximum, with no shared memory and no barrier.
                    for p in T.unroll(P):
                        em[p] = ex[p]
                        for off in offsets:
                            em[p] = T.max(em[p], T.shfl_xor(em[p], off))
                else:
                    T.sync_threads()
                    for p in T.unroll(P):
                        mx[0] = ex[p]
                        for off in offsets:
                            mx[0] = T.max(mx[0], T.shfl_xor(mx[0], off))
                        if (tx % 32) % TPR % (bk_out // SEG) == 0 and (tx % 32) // TPR % T.min(bm_out, rows_per_warp) == 0:
                            T.atomic_max(red[((p * RPP + tx // TPR) // bm_out) * NBC + cb], mx[0])
                    T.sync_threads()
                for p in T.unroll(P):
                    row = by * BM + p * RPP + tx // TPR
                    blk = em[p] if bm_out == 1 else red[((p * RPP + tx // TPR) // bm_out) * NBC + cb]
                    e_out = T.max(blk - 6, 1)
                    if row < num_tokens and col < hidden:
                        d = ex[p] - e_out
                        if ex[p] != 0 and d < -8:
                            bad[p] = 1
                        if bad[p] != 0:
                            T.atomic_add(err[0], 1)
                        scale = T.if_then_else(ex[p] == 0, T.float32(0), _tl.pow2(T.max(d, -126)))
                        # 8-entry LUT (magnitude code -> e4m3 byte at this scale) in two words for __byte_perm
                        lut = T.alloc_local((2,), "uint32")
                        lut[0] = T.uint32(0)
                        lut[1] = T.uint32(0)
                        for c in list(range(1, 8)):
                            lut[c // 4] = T.bitwise_or(
                                lut[c // 4],
                                T.shift_left(
                                    T.cast(T.reinterpret(T.cast(T.float32(_FP4[c]) * scale, "float8_e4m3fn"), "uint8"), "uint32"),
                                    (c % 4) * 8,
                                ),
                            )
                        for i in T.unroll(SEG // 8):
                            for h in T.unroll(2):
                                w = T.bitwise_and(T.shift_right(xin[p, i], 16 * h), 0xFFFF)
                                sg = T.bitwise_and(w, 0x8888)
                                y = T.bitwise_or(T.bitwise_and(sg, 0x88), T.shift_left(T.bitwise_and(sg, 0x8800), 8))
                                ow[2 * i + h] = T.bitwise_or(
                                    T.call_extern("uint32", "__byte_perm", lut[0], lut[1], T.cast(T.bitwise_and(w, 0x7777), "uint32")),
                                    T.cast(
                                        T.bitwise_or(
                                            T.shift_left(T.bitwise_and(y, 0x080008), 4), T.shift_left(T.bitwise_and(y, 0x800080), 8)
                                        ),
                                        "uint32",
                                    ),
                                )
                        for j in T.vectorized(SEG // 4):
                            out[row, col // 4 + j] = ow[j]
                        if row % bm_out == 0 and col % bk_out == 0:
                            m = row // bm_out
                            k = col // bk_out
                            if layout == "packed":
                                sf[_tl.sf_offset(layout, m, k, nm, nk)] = T.cast(e_out, "uint8")
                                if k == nk - 1:
                                    for z in T.serial(align(nk, 4) - nk):
                                        sf[_tl.sf_offset(layout, m, nk + z, nm, nk)] = T.uint8(0)
                            else:
                                sf[_tl.sf_offset(layout, m, k, nm, nk)] = T.reinterpret(T.shift_left(e_out, 23), "float32")
                if bm_out > 1:
                    T.sync_threads()  # every block maximum of this tile is read before the next tile clears them
                for p in T.unroll(P):
                    sw[p] = swn[p]
                    for v in T.vectorized(SEG // 8):
                        xin[p, v] = xn[p, v]

    return main


# --- device op ------------------------------------------------------------------------------------


@device_op("tk_quant::per_block_cast_lossless_", mutates_args=("out", "sf_flat", "error_count"))
def per_block_cast_lossless_(
    data: torch.Tensor,
    sf_in_flat: torch.Tensor,
    s0: int,
    s1: int,
    out: torch.Tensor,
    sf_flat: torch.Tensor,
    error_count: torch.Tensor,
    bm_in: int,
    bk_in: int,
    bm_out: int,
    bk_out: int,
    layout: str,
) -> None:
    in_kind = "packed" if sf_in_flat.dtype == torch.uint8 else "fp32"
    k = per_block_cast_lossless_kernel.get(
        data.device, hidden=out.shape[1], bm_in=bm_in, bk_in=bk_in, in_kind=in_kind, bm_out=bm_out, bk_out=bk_out, layout=layout,
        min_blocks=MIN_BLOCKS, ctas=torch.cuda.get_device_properties(data.device).multi_processor_count * MIN_BLOCKS,
    )
    k(data.view(torch.int32), sf_in_flat, out.view(torch.uint32), sf_flat, error_count, s0, s1)


# --- public function ------------------------------------------------------------------------------


def _check_block(op: str, arg: str, block) -> tuple[int, int]:
    if not isinstance(block, (tuple, list)) or len(block) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) for b in block):
        checks.fail(op, arg, "a pair of ints (bm, bk)", repr(block), TypeError)
    bm, bk = block
    if not (is_power_of_two(bm) and is_power_of_two(bk)):
        checks.fail(op, arg, "powers of two", repr(tuple(block)))
    return bm, bk


def _sf_flat(sf: torch.Tensor):
    """(flat storage, s0, s1) of an input SF; packed int32 -> bytes with word strides."""
    s0, s1 = sf.stride()
    extent = 1 + sum((n - 1) * s for n, s in zip(sf.shape, sf.stride()) if n > 0)
    flat = sf.as_strided((extent,), (1,))
    if sf.dtype == torch.int32:
        return flat.view(torch.uint8), s0, s1
    return flat.view(torch.int32), s0, s1


def per_block_cast_lossless(
    x: tuple[torch.Tensor, torch.Tensor],
    fmt: str,
    x_block_size: tuple[int, int],
    out_block_size: tuple[int, int],
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = True,
    use_packed_ue8m0: bool = False,
    check: bool = True,
    error_count: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-quantizes FP4 data with power-of-two block scales to e4m3 with coarser power-of-two scales,
    losslessly (see the module docstring for the math and the admissible range).

    ``x = (data int8 (T, H/2), sf)`` with input blocks ``x_block_size``; returns ``(out e4m3 (T, H),
    sf_out)`` with blocks ``out_block_size`` in the layout of the flags. ``check=True`` synchronises
    once and raises ``ValueError`` if any input scale is inadmissible; ``check=False`` does not
    synchronise (CUDA graphs); ``error_count`` (int32 ``(1,)``, zeroed by the caller) receives the count
    of offending 32-column row segments.
    """
    from .common import check_quant_input

    if fmt != "e4m3":
        checks.fail(OP, "fmt", "'e4m3'", repr(fmt))
    if not round_sf:
        checks.fail(OP, "round_sf", "True (lossless output scales are always powers of two)", round_sf)
    q = check_quant_input(OP, x, x_block_size, data_fmts=("e2m1",))
    data, sf_in = x
    checks.check_contiguous(OP, "x[0] (data)", data)
    bm_in, bk_in = _check_block(OP, "x_block_size", x_block_size)
    bm_out, bk_out = _check_block(OP, "out_block_size", out_block_size)
    t, h = q.t, q.h
    checks.check_divisible(OP, "hidden (logical)", h, SEG)
    if not 32 <= bk_in <= bk_out <= 1024:
        checks.fail(OP, "x_block_size[1] and out_block_size[1]", "powers of two with 32 <= bk_in <= bk_out <= 1024", (bk_in, bk_out))
    if bm_out % bm_in or bm_out > 128:
        checks.fail(OP, "out_block_size[0]", f"a multiple of x_block_size[0]={bm_in} and at most 128", bm_out)
    if sf_in.dtype not in (torch.float32, torch.int32):
        checks.fail(OP, "x[1] (sf)", "float32 or packed UE8M0 int32 power-of-two scales", sf_in.dtype, TypeError)
    checks.check_same_device(OP, "x[1] (sf)", sf_in, data.device)
    layout = sf_layout(OP, use_tma_aligned_col_major_sf, use_packed_ue8m0, True)
    if error_count is not None:
        checks.check_dtype(OP, "error_count", error_count, torch.int32)
        checks.check_shape(OP, "error_count", error_count, (1,))
        checks.check_same_device(OP, "error_count", error_count, data.device)
    if data.device.type != "cuda":
        from . import reference

        out, sf, n_err = reference.per_block_cast_lossless(
            x, fmt, (bm_in, bk_in), (bm_out, bk_out), use_tma_aligned_col_major_sf, True, use_packed_ue8m0
        )
        if error_count is not None:
            error_count += n_err
        if check and n_err:
            checks.fail(OP, "x", "FP4 data with power-of-two scales whose spread per output block is at most 2**14",
                        f"{n_err} inadmissible 32-column row segments")
        return out, sf
    out = torch.empty((t, h), dtype=torch.float8_e4m3fn, device=data.device)
    flat, sf = alloc_sf_storage(ceil_div(t, bm_out), ceil_div(h, bk_out), layout, data.device)
    if t:
        err = error_count if error_count is not None else torch.zeros(1, dtype=torch.int32, device=data.device)
        sf_in_flat, s0, s1 = _sf_flat(sf_in)
        per_block_cast_lossless_(data, sf_in_flat, s0, s1, out, flat, err, bm_in, bk_in, bm_out, bk_out, layout)
        if check:
            n_err = int(err.item()) if error_count is None else None
            if error_count is not None:
                n_err = int(err.item())
            if n_err:
                checks.fail(OP, "x", "FP4 data with power-of-two scales whose spread per output block is at most 2**14",
                            f"{n_err} inadmissible 32-column row segments")
    return out, sf
