"""Per-channel casts: e4m3 with one scale per ``(bm, 1)`` block (``bm`` tokens of one channel).

Math (``v`` the fp32 input rows, ``(T_out, H)``):

- ``A[b, j] = max |v[t, j]|`` over the tokens ``t`` of block ``b`` (``b = t // bm``; a partial last block
  uses its valid rows); the scale rule of ``tk_core.formats.compute_scales`` with ``Q = 448`` and the
  e4m3 amax floor gives ``sf[b, j]`` (dequantization scale) and ``sf_inv``;
- ``out[t, j] = e4m3(v[t, j] * sf_inv[t // bm, j])`` (RNE, saturating).

``sf`` is always row-major fp32 ``(ceil(T_out/bm), H)``.

Ops:

- ``per_channel_cast(x, fmt, num_per_tokens=128, round_sf)``: ``x`` bf16/fp32 ``(T, H)``.
- ``per_channel_cast_fused(x, fmt, num_per_tokens=128, round_sf, num_per_channels=None, pos_to_token=None)``:
  ``x`` is bf16/fp32 ``(T, H)`` or a QuantTensor ``(e4m3 (T, H), fp32 sf (T, H/128))`` with per-token
  ``1 x 128`` scales (``num_per_channels == 128``), then ``v = (decode(x) * s_in)``, and
  ``out = (decode(x) * s_in) * sf_inv`` left to right. ``pos_to_token`` (int32 ``(T_out,)``) gathers rows:
  output row ``r`` is input row ``pos_to_token[r]``, or zeros when it is negative. Indices ``>= T`` are
  counted on the device and raise ``ValueError`` with ``check=True`` (one host sync; the rows are
  written as zeros); ``check=False`` skips the sync (CUDA graphs), ``error_count`` receives the count.
- ``per_channel_cast_and_transpose(x, fmt, num_per_tokens in {32, 128}, round_sf)``: ``x`` bf16; the data
  is returned transposed, e4m3 ``(H, T)``, the SF is not transposed. Needs ``T % 16 == 0``.

Constraints: ``fmt == 'e4m3'``; ``H % 64 == 0`` (``H % 128 == 0`` for QuantTensor input); contiguous
inputs; outputs on ``x``'s device. Reference: ``tk_quant.reference.cast(x, 'e4m3', (bm, 1), round_sf)`` and
``tk_quant.reference.per_channel_cast_fused``.

Kernel: 256 threads over a 128-token x 64-channel tile (128 x 128 for e4m3 input); each thread loads 8
channels (one 16-byte bf16 vector; 16 e4m3 channels) of 4 rows and keeps them in registers; the column
amax goes through warp shuffles and one shared-memory exchange; the transposed variant stages the e4m3
tile in XOR-swizzled shared memory and stores 16-byte runs of tokens while the next tile is reduced. A
persistent grid (SMs x 3-4 CTAs for bf16 on sm_90a) walks the tiles and prefetches the next tile into registers
(issued after the amax of the current one) while the current one is reduced and stored. A bf16 launch without a
gather takes its tiles after the first three from a per-stream device counter (the ``dynamic`` tile order;
``launch_config`` says which launches take it). The token counts are dynamic.
"""

from types import SimpleNamespace

import tilelang.language as T
import torch

from tk_core import checks, config, hostmem
from tk_core.jit import arch_of, kernel
from tk_core.layout import ceil_div
from tk_core.library import device_op
from tk_core.ptx import E4M3X4_TO_F32, e4m3x4_to_f32

from . import _tl
from .common import scratch

THREADS = 256
BM = 128  # tokens per tile
TPR = 8  # threads per row
DEFAULT_SMS = 132  # H200; the device ops pass tk_core.config.get_num_sms of the tensor's device


def blocks_per_sm(in_dtype: str, arch: str = "") -> int:
    """CTAs per SM the register budget must allow (both tile buffers in registers, no spills).

    bf16: 4 (64 registers) on sm_90a; sm_100a code spills there and gets 3. fp32 tiles are twice the
    registers (and the bytes in flight): 2. e4m3 (16-channel rows, ``default_vec``, a 64-float32 widened tile): 2.
    """
    if in_dtype in ("float32", "float8_e4m3fn"):
        return 2
    return 4 if arch == "sm_90a" else 3


def default_vec(quant_in: bool) -> int:
    """Channels per thread: 8 (a 16-byte bf16 load; 128 x 64 tiles), 16 for e4m3 input (a 16-byte load too;
    128 x 128 tiles). The loop is close to issue-bound, and an 8-channel e4m3 tile carries two thirds of the
    bytes of a bf16 one for about the same per-thread overhead (index math, barriers, scale phase)."""
    return 16 if quant_in else 8


_IN_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


# The gathering cast's error count goes on the amax partials' bytes, after the barrier that starts
# ``_tl.store_cta_count``.
@kernel(pass_configs={"tl.disable_safe_memory_legalize": True, "tl.disable_thread_storage_sync": True},
        shared_aliases=[("red", "warp_bad")])
def per_channel_cast_kernel(
    in_dtype: str,
    hidden: int,
    bm: int,
    round_sf: bool,
    gather: bool,
    quant_in: bool,
    transpose: bool,
    min_blocks: int = 0,
    ctas: int = 0,
    vec: int = 0,
    count_slots: bool = False,
    threads: int = THREADS,
    defer_store: bool = True,
    dynamic: bool = False,
    call_free_div: bool = False,
    split_scale: bool = False,
):
    """``in_dtype``: bfloat16/float32, or float8_e4m3fn with ``quant_in`` (per-token 1x128 fp32 scales).

    Persistent: at most ``ctas`` CTAs (SMs x ``min_blocks``) loop over the 128 x 64 tiles, and each loads
    its next tile into a second register buffer while it reduces, scales and stores the current one, so
    loads stay in flight across the barriers. The next tile waits in registers in its input dtype (a bf16 row
    of 8 channels is 4 registers, an e4m3 row of 16 channels too); the current one is widened once into a float32
    tile that both the amax and the quantization read. ``min_blocks`` / ``ctas`` 0: ``blocks_per_sm`` for
    an unnamed arch, and ``DEFAULT_SMS`` SMs (the ops: ``launch_config``).
    ``vec``: channels per thread (0: ``default_vec``); the tile is 128 x ``8 * vec``. ``threads``: 256 (4 rows per
    thread) or 512 (2 rows; not transposed; a sweep variant, 4-11 % slower). ``defer_store`` (transposed): the
    staged tile goes out after the next tile's amax barrier, so a tile costs two barriers instead of three (False:
    its own barrier after the staging; the sweep's reference point, 0-0.7 % slower). e4m3 input is widened four
    values at a time (``tk_core.ptx.E4M3X4_TO_F32``; TileLang's cast converts byte by byte): 17 % fewer
    instructions in the QuantTensor kernel, whose anchor line went from 22.2 to 19.7 us. (bf16 widened a word at a
    time measured the same as TileLang's cast: those lines are bound by memory, not by issue.)

    ``dynamic`` (no gather, no QuantTensor input): a CTA's first three tiles are those
    of the static grid, the later ones come from the device counter ``sched[0]`` (offset by 3 x CTAs), so that a CTA
    whose loads are served sooner takes more tiles; the last CTA to finish zeroes ``sched`` (``[tiles handed out,
    CTAs finished]``) for the next launch, which therefore must not overlap this one on the same counter
    (``launch_config`` says where the ops take it).

    ``call_free_div`` (unrounded scales; the amax floor ``clamp_min`` must be at least ``_tl.SCALE_DIV_MIN``): the
    scale's two quotients by ``_tl.SCALE_DIV`` instead of the IEEE division, whose slow-path call pins registers; for
    128-token blocks two threads per channel compute them, one quotient each (``split_scale``: the same for the
    rounded scales; a sweep variant, 0 to -2 %).

    The barriers are explicit (TileLang's sync planner would add one per tile to the dynamic order: it cannot tell
    that thread 0 writes a ring slot other threads no longer read); it added none to the static kernels.

    Gather indices ``>= num_tokens`` are counted once per output row: atomically into ``err[0]``, or with
    ``count_slots`` per CTA into ``err[bid]``, written only when nonzero (the slots are zeroed host memory that
    the check reads, ``tk_core.hostmem``: no fill kernel before and no copy after the cast).
    """
    VEC = vec or default_vec(quant_in)
    BK = TPR * VEC  # channels per tile
    P = BM * TPR // threads  # rows per thread (adjacent, one scale block)
    WARPS = threads // 32
    ROWS_PER_WARP = 32 // TPR * P
    # the swizzled transpose staging is laid out for 64-channel tiles and packs a thread's 4 rows into one word
    assert not (transpose and (VEC != 8 or P != 4))
    assert not (dynamic and (gather or quant_in))
    call_free_div = call_free_div and not round_sf  # (rounded scales do not divide)
    # the two quotients on two threads each where the tile has the threads for it (128-token blocks): a lower
    # register peak in the scale phase (``split_scale`` for the rounded scales as well)
    split_scale = (split_scale or call_free_div) and 2 * (BM // bm) * BK <= threads
    prelude = ((E4M3X4_TO_F32 if quant_in else "") + (_tl.SCALE_DIV if call_free_div else "")) or None
    min_blocks = min_blocks or blocks_per_sm(in_dtype)
    ctas = ctas or DEFAULT_SMS * min_blocks
    num_tokens = T.dynamic("num_tokens")
    num_out = T.dynamic("num_out")
    NBT = BM // bm  # scale blocks per tile
    NX = hidden // BK  # channel tiles
    assert BM % bm == 0 and bm % ROWS_PER_WARP == 0 and NBT * BK <= threads
    nt16 = T.dynamic("nt16")
    out_shape = (hidden, nt16, 4) if transpose else (num_out, hidden)
    out_dtype = "uint32" if transpose else "float8_e4m3fn"

    WPB = bm // ROWS_PER_WARP  # warps per scale block

    @T.macro
    def load(x, x_sf, pos, err, nbad, xr, s_in, ok, src, tile, tx, c8, r0):
        bx = T.truncmod(tile, NX)
        by = T.truncdiv(tile, NX)
        for p in T.unroll(P):
            r = by * BM + r0 + p
            src[0] = r
            ok[0] = T.if_then_else(r < num_out, 1, 0)
            if gather:
                src[0] = T.if_then_else(r < num_out, pos[T.min(r, num_out - 1)], -1)
                if src[0] >= num_tokens:
                    ok[0] = 0
                    if bx == 0 and tx % TPR == 0:
                        if count_slots:
                            nbad[0] += 1
                        else:
                            T.atomic_add(err[0], 1)
                if src[0] < 0:
                    ok[0] = 0
            if ok[0] != 0:
                if quant_in:
                    s_in[p] = x_sf[src[0], (bx * BK + c8) // 128]
                for v in T.vectorized(VEC):
                    xr[p, v] = x[src[0], bx * BK + c8 + v]
            else:
                if quant_in:
                    s_in[p] = T.float32(0)
                for v in T.vectorized(VEC):  # e4m3 zeros as bytes: a converted 0.0 costs a cvt and byte packing
                    xr[p, v] = T.reinterpret(T.uint8(0), in_dtype) if quant_in else T.cast(0, in_dtype)

    @T.macro
    def store_staged(out, qs, tile, tx):
        """The transposed e4m3 tile staged in ``qs`` to ``out``: 16-byte runs of tokens (LDS.128 -> STG.128)."""
        bx = T.truncmod(tile, NX)
        by = T.truncdiv(tile, NX)
        for q in T.unroll(BK * BM // 16 // threads):
            chunk = q * threads + tx
            c = chunk // (BM // 16)
            k = chunk % (BM // 16)
            if by * (BM // 16) + k < nt16:
                for v in T.vectorized(4):
                    out[bx * BK + c, by * (BM // 16) + k, v] = qs[c, T.bitwise_xor(k, (c // VEC) % TPR) * 4 + v]

    @T.macro
    def tile_step(k, tile, next_tile, has_next, prev_tile, has_prev):
        """One tile of the persistent loop: widen, amax, the next tile's loads, scales, quantized stores (``k``: the
        CTA's tensors, buffers and indices)."""
        x, x_sf, pos, out, sf, err, clamp_min = k.x, k.x_sf, k.pos, k.out, k.sf, k.err, k.clamp_min
        xr, xn, s_in, s_n, am, xf, si = k.xr, k.xn, k.s_in, k.s_n, k.am, k.xf, k.si
        ok, src, nbad, red, sis, qs, tx, c8, r0 = k.ok, k.src, k.nbad, k.red, k.sis, k.qs, k.tx, k.c8, k.r0
        # Widened (and, for QuantTensor input, scaled) once for both the amax and the quantization: ptxas
        # otherwise recomputes it to save registers (QuantTensor input: 2,553 -> 2,763 GB/s at 2 CTAs/SM).
        for p in T.unroll(P):
            if quant_in:  # four values per conversion call (``tk_core.ptx.E4M3X4_TO_F32``), then the scale
                for q in T.unroll(VEC // 4):
                    T.evaluate(e4m3x4_to_f32(T.address_of(xf[p, 4 * q]), T.address_of(xr[p, 4 * q])))
                for v in T.unroll(VEC):
                    xf[p, v] = xf[p, v] * s_in[p]
            else:
                for v in T.unroll(VEC):
                    xf[p, v] = T.cast(xr[p, v], "float32")
        for v in T.unroll(VEC):
            am[v] = T.float32(0)
        for p in T.unroll(P):
            for v in T.unroll(VEC):
                am[v] = T.max(am[v], T.abs(xf[p, v]))
        # The next tile's loads: issued after this tile's amax (measured 2-5% faster than before it, where
        # they compete with the amax for issue slots and registers), they still land across the barriers.
        if has_next:
            load(x, x_sf, pos, err, nbad, xn, s_n, ok, src, next_tile, tx, c8, r0)
        for v in T.unroll(VEC):
            am[v] = T.max(am[v], T.shfl_xor(am[v], 8))
            am[v] = T.max(am[v], T.shfl_xor(am[v], 16))
            if tx % 32 < TPR:
                red[tx // 32, c8 + v] = am[v]
        if dynamic and tx == 0:  # publish the tile after next (see ``ring``), fetch the one after it
            k.ring[T.bitwise_and(k.itr[0] + 2, 3)] = k.fetched[0]
            if k.fetched[0] < k.ntiles:
                k.fetched[0] = 3 * k.nctas + T.atomic_add(k.sched[0], 1, return_prev=True)
        T.sync_threads()
        if tx < NBT * BK * (2 if split_scale else 1):
            b = tx % (NBT * BK) // BK
            c = tx % BK
            m = T.alloc_local((1,), "float32")
            m[0] = red[b * WPB, c]
            for w in T.unroll(1, WPB):
                m[0] = T.max(m[0], red[b * WPB + w, c])
            s, s_inv = _tl.scale_rule(m[0], clamp_min, 448.0, round_sf, call_free_div)
            by = T.truncdiv(tile, NX)
            if split_scale:
                if tx < NBT * BK:
                    sis[b, c] = s_inv
                elif (by * NBT + b) * bm < num_out:
                    sf[by * NBT + b, T.truncmod(tile, NX) * BK + c] = s
            else:
                sis[b, c] = s_inv
                if (by * NBT + b) * bm < num_out:
                    sf[by * NBT + b, T.truncmod(tile, NX) * BK + c] = s
        if transpose and defer_store:
            # the previous tile's staged bytes, complete since the barrier above, go out here (no barrier
            # of their own); this tile is staged only after the next barrier, when every thread has read them
            if has_prev:
                store_staged(out, qs, prev_tile, tx)
        T.sync_threads()
        for v in T.unroll(VEC):
            si[v] = sis[r0 // bm, c8 + v]
        if transpose:
            ql = T.alloc_local((P,), "float8_e4m3fn")
            w = r0 // 4
            for v in T.unroll(VEC):
                for p in T.unroll(P):
                    ql[p] = T.cast(xf[p, v] * si[v], "float8_e4m3fn")
                qs[c8 + v, T.bitwise_xor(w // 4, tx % TPR) * 4 + w % 4] = T.bitwise_or(
                    T.bitwise_or(
                        T.cast(T.reinterpret(ql[0], "uint8"), "uint32"),
                        T.shift_left(T.cast(T.reinterpret(ql[1], "uint8"), "uint32"), 8),
                    ),
                    T.bitwise_or(
                        T.shift_left(T.cast(T.reinterpret(ql[2], "uint8"), "uint32"), 16),
                        T.shift_left(T.cast(T.reinterpret(ql[3], "uint8"), "uint32"), 24),
                    ),
                )
            if not defer_store:
                T.sync_threads()
                store_staged(out, qs, tile, tx)
        else:
            by = T.truncdiv(tile, NX)
            for p in T.unroll(P):
                r = by * BM + r0 + p
                if r < num_out:
                    for v in T.vectorized(VEC):
                        out[r, T.truncmod(tile, NX) * BK + c8 + v] = T.cast(xf[p, v] * si[v], "float8_e4m3fn")
        for p in T.unroll(P):
            if quant_in:
                s_in[p] = s_n[p]
            for v in T.vectorized(VEC):
                xr[p, v] = xn[p, v]

    @T.macro
    def body(x, x_sf, pos, out, sf, err, clamp_min, sched=None):
        ntiles = NX * T.ceildiv(num_out, BM)
        nctas = T.min(ntiles, ctas)
        with T.Kernel(nctas, threads=threads, prelude=prelude) as bid:
            if min_blocks > 1:
                T.annotate_min_blocks_per_sm(min_blocks)
            tx = T.get_thread_binding()
            xr = T.alloc_local((P, VEC), in_dtype)
            xn = T.alloc_local((P, VEC), in_dtype)
            s_in = T.alloc_local((P,), "float32")
            s_n = T.alloc_local((P,), "float32")
            am = T.alloc_local((VEC,), "float32")
            xf = T.alloc_local((P, VEC), "float32")
            si = T.alloc_local((VEC,), "float32")
            ok = T.alloc_local((1,), "int32")
            src = T.alloc_local((1,), "int32")
            nbad = T.alloc_local((1,), "int32") if count_slots else None  # this thread's bad gather indices
            red = T.alloc_shared((WARPS, BK), "float32")
            sis = T.alloc_shared((NBT, BK), "float32")
            # transposed: the e4m3 tile, channel-major, 4 tokens per word. The 16-byte groups of a channel row are
            # XOR-swizzled by (channel // 8) % 8: the word stores of a warp (8 channels 8 apart) hit 32 banks, and
            # the read side copies whole 16-byte groups.
            qs = T.alloc_shared((BK, BM // 4), "uint32") if transpose else None
            c8 = (tx % TPR) * VEC
            r0 = (tx // TPR) * P  # this thread's first row in the tile (P adjacent rows, one scale block)
            if count_slots:
                nbad[0] = 0

            # dynamic: the tiles after the first come from a device counter (``sched[0]``), so that a CTA whose loads
            # are served sooner takes more tiles. ``ring[i % 4]`` holds iteration i's tile: thread 0 publishes
            # iteration i + 2's tile during iteration i (before its first barrier), fetched one iteration earlier,
            # so the atomic's latency is hidden; a slot is rewritten only after every thread's last read of it.
            ring = T.alloc_shared((4,), "int32") if dynamic else None
            fetched = T.alloc_local((1,), "int32") if dynamic else None
            itr = T.alloc_local((1,), "int32") if dynamic else None
            k = SimpleNamespace(x=x, x_sf=x_sf, pos=pos, out=out, sf=sf, err=err, clamp_min=clamp_min, tx=tx, xr=xr,
                                xn=xn, s_in=s_in, s_n=s_n, am=am, xf=xf, si=si, ok=ok, src=src, nbad=nbad, red=red,
                                sis=sis, qs=qs, c8=c8, r0=r0, ntiles=ntiles, nctas=nctas, sched=sched, ring=ring,
                                fetched=fetched, itr=itr)
            if dynamic:
                load(x, x_sf, pos, err, nbad, xr, s_in, ok, src, bid, tx, c8, r0)
                if tx == 0:  # the first three tiles as in the static grid (no atomics at the launch's start)
                    ring[0] = bid
                    ring[1] = bid + nctas
                    fetched[0] = bid + 2 * nctas
                T.sync_threads()
                itr[0] = 0
                while ring[T.bitwise_and(itr[0], 3)] < ntiles:
                    nxt = ring[T.bitwise_and(itr[0] + 1, 3)]
                    tile_step(k, ring[T.bitwise_and(itr[0], 3)], nxt, nxt < ntiles, ring[T.bitwise_and(itr[0] + 3, 3)],
                              itr[0] > 0)
                    itr[0] = itr[0] + 1
                if transpose and defer_store:
                    T.sync_threads()
                    store_staged(out, qs, ring[T.bitwise_and(itr[0] + 3, 3)], tx)
                if tx == 0:
                    # the last CTA to finish resets the counters for the next launch: the release orders each CTA's
                    # fetches before its arrival here, so no fetch follows the reset
                    fetched[0] = T.atomic_add(sched[1], 1, memory_order="acq_rel", return_prev=True)
                    if fetched[0] == nctas - 1:
                        sched[0] = 0
                        sched[1] = 0
            else:
                niter = T.truncdiv(ntiles - bid + nctas - 1, nctas)
                load(x, x_sf, pos, err, nbad, xr, s_in, ok, src, bid, tx, c8, r0)
                for it in T.serial(niter):
                    tile = bid + it * nctas
                    tile_step(k, tile, tile + nctas, it + 1 < niter, tile - nctas, it > 0)
                if transpose and defer_store:
                    T.sync_threads()
                    store_staged(out, qs, bid + (niter - 1) * nctas, tx)
            if count_slots:
                warp_bad = T.alloc_shared((WARPS,), "int32")
                _tl.store_cta_count(err, bid, nbad, warp_bad, tx, WARPS, False)

    num_slots = T.dynamic("num_slots") if count_slots else 1

    if gather and quant_in:

        @T.prim_func
        def main(
            x: T.Tensor((num_tokens, hidden), in_dtype),
            x_sf: T.Tensor((num_tokens, hidden // 128), "float32"),
            pos: T.Tensor((num_out,), "int32"),
            out: T.Tensor(out_shape, out_dtype),
            sf: T.Tensor((T.ceildiv(num_out, bm), hidden), "float32"),
            err: T.Tensor((num_slots,), "int32"),
            clamp_min: T.float32,
        ):
            body(x, x_sf, pos, out, sf, err, clamp_min)

    elif gather:

        @T.prim_func
        def main(
            x: T.Tensor((num_tokens, hidden), in_dtype),
            pos: T.Tensor((num_out,), "int32"),
            out: T.Tensor(out_shape, out_dtype),
            sf: T.Tensor((T.ceildiv(num_out, bm), hidden), "float32"),
            err: T.Tensor((num_slots,), "int32"),
            clamp_min: T.float32,
        ):
            body(x, None, pos, out, sf, err, clamp_min)

    elif quant_in:

        @T.prim_func
        def main(
            x: T.Tensor((num_out, hidden), in_dtype),
            x_sf: T.Tensor((num_out, hidden // 128), "float32"),
            out: T.Tensor(out_shape, out_dtype),
            sf: T.Tensor((T.ceildiv(num_out, bm), hidden), "float32"),
            clamp_min: T.float32,
        ):
            body(x, x_sf, None, out, sf, None, clamp_min)

    elif dynamic:

        @T.prim_func
        def main(
            x: T.Tensor((num_out, hidden), in_dtype),
            out: T.Tensor(out_shape, out_dtype),
            sf: T.Tensor((T.ceildiv(num_out, bm), hidden), "float32"),
            sched: T.Tensor((2,), "int32"),
            clamp_min: T.float32,
        ):
            body(x, None, None, out, sf, None, clamp_min, sched)

    else:

        @T.prim_func
        def main(
            x: T.Tensor((num_out, hidden), in_dtype),
            out: T.Tensor(out_shape, out_dtype),
            sf: T.Tensor((T.ceildiv(num_out, bm), hidden), "float32"),
            clamp_min: T.float32,
        ):
            body(x, None, None, out, sf, None, clamp_min)

    return main


# --- device ops -----------------------------------------------------------------------------------


def launch_config(in_dtype: str, arch: str, bm: int, round_sf: bool, gather: bool, transpose: bool,
                  clamp_min: float) -> tuple[bool, bool, int, int]:
    """(``dynamic`` tile order, ``call_free_div``, CTAs per SM, waves of the persistent grid) of the ops' launch, as
    measured on an H200 (``sweep_channel.py``; sweep_s20.log, sweep_s21.log, sweep_s22.log):

    - bf16 without a gather: the dynamic tile order on one wave, transposed at ``blocks_per_sm`` (4) CTAs per SM
      (1.008-1.027 of the anchors against 0.98-1.00 for the static order), untransposed at 3 (per_channel_cast 1.007
      -1.009 against 0.99, the 4,096-token fused plain line the same as static; at 4 CTAs it spilled and lost 1-6 %);
      on sm_90a with an amax floor of at least ``_tl.SCALE_DIV_MIN``, unrounded scales by ``_tl.SCALE_DIV`` (0 to +0.3
      % on those lines; on sm_100a, not measured there, it would spill 4 bytes);
    - except the transposed cast with 128-token blocks and unrounded scales by the IEEE division: its dynamic kernel
      spills 12 bytes at 64 registers (the division's slow-path call) and measured the same as the static one (3,620
      against 3,623 GB/s), so the static order there; with ``SCALE_DIV`` it does not spill and the dynamic order
      takes that line from 3,626 to 3,742 GB/s (session 22);
    - the rest (fp32 input, gathers, QuantTensor input) the static order at ``blocks_per_sm``; static grids on one
      wave, or two for the transposed cast (a second wave, starting as the first one's CTAs finish: +0.6-0.9 %; plain
      -0.3 %, fused plain -1.8 %, QuantTensor input -4 %; 1.5 or 2.5 waves -5 to -14 %; the dynamic order on two
      waves -3 to -5 %).
    """
    family = in_dtype == "bfloat16" and not gather
    call_free = family and not round_sf and arch == "sm_90a" and clamp_min >= _tl.SCALE_DIV_MIN
    dynamic = family and not (transpose and bm == 128 and not round_sf and not call_free)
    min_blocks = blocks_per_sm(in_dtype, arch)
    if dynamic and not transpose:
        min_blocks = min(min_blocks, 3)
    return dynamic, call_free, min_blocks, 2 if transpose and not dynamic else 1


def _launch(x: torch.Tensor, bm: int, round_sf: bool, gather: bool, quant_in: bool, transpose: bool,
            clamp_min: float) -> tuple[str, bool, bool, int, int]:
    """(input dtype name, dynamic, call_free_div, CTAs per SM, CTAs of the persistent grid at most) of a launch on
    ``x``'s device: ``launch_config`` with the SMs of ``tk_core.config.get_num_sms`` (a ``set_num_sms`` limit
    recompiles)."""
    in_dtype = "float8_e4m3fn" if quant_in else _IN_DTYPES[x.dtype]
    dynamic, call_free, min_blocks, waves = launch_config(in_dtype, arch_of(x.device), bm, round_sf, gather, transpose,
                                                          clamp_min)
    return in_dtype, dynamic, call_free, min_blocks, config.get_num_sms(x.device.index) * min_blocks * waves


_TILE_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}


def _tile_counter(device: torch.device) -> torch.Tensor:
    """Counters for the dynamic tile order (int32 ``[2]``, zero at each launch's start: every launch resets them):
    one per stream of ``device``, as launches on one counter must not overlap. While the stream is captured into a
    CUDA graph, a new zeroed one per call: its zero fill is part of the graph, so every replay starts from zero
    (a stream's counter, baked into the graph, would be shared by replays on other streams)."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(2, dtype=torch.int32, device=device)
    key = (device.index, torch.cuda.current_stream(device).cuda_stream)
    counter = _TILE_COUNTERS.get(key)
    if counter is None:
        counter = _TILE_COUNTERS[key] = torch.zeros(2, dtype=torch.int32, device=device)
    return counter


def num_ctas(x: torch.Tensor, num_out: int, quant_in: bool) -> int:
    """CTAs the gathering kernel launches for ``num_out`` output rows (one error slot each with ``count_slots``)."""
    ntiles = x.shape[1] // (TPR * default_vec(quant_in)) * ceil_div(num_out, BM)
    # (the gather's grid does not depend on the amax floor)
    return min(ntiles, _launch(x, 128, False, True, quant_in, False, config.get_amax_clamp("e4m3"))[4])


def _launch_kernel(x: torch.Tensor, bm: int, round_sf: bool, gather: bool, quant_in: bool, transpose: bool, args,
                   clamp_min: float, count_slots: bool = False) -> None:
    """Runs the kernel for these flags on ``x``'s device with ``args`` (the tensors before ``sched``)."""
    in_dtype, dynamic, call_free, min_blocks, ctas = _launch(x, bm, round_sf, gather, quant_in, transpose, clamp_min)
    k = per_channel_cast_kernel.get(
        x.device,
        in_dtype=in_dtype,
        hidden=x.shape[1],
        bm=bm,
        round_sf=round_sf,
        gather=gather,
        quant_in=quant_in,
        transpose=transpose,
        min_blocks=min_blocks,
        ctas=ctas,
        count_slots=count_slots,
        dynamic=dynamic,
        call_free_div=call_free,
    )
    k(*args, *([_tile_counter(x.device)] if dynamic else []), clamp_min)


@device_op("tk_quant::per_channel_cast_", mutates_args=("out", "sf"))
def per_channel_cast_(x: torch.Tensor, out: torch.Tensor, sf: torch.Tensor, bm: int, round_sf: bool, transpose: bool, clamp_min: float) -> None:
    if transpose:
        out = out.view(torch.uint32).view(out.shape[0], -1, 4)
    _launch_kernel(x, bm, round_sf, False, False, transpose, [x, out, sf], clamp_min)


@device_op("tk_quant::per_channel_cast_fused_", mutates_args=("out", "sf", "error_count"))
def per_channel_cast_fused_(
    x: torch.Tensor,
    x_sf: torch.Tensor | None,
    pos_to_token: torch.Tensor | None,
    out: torch.Tensor,
    sf: torch.Tensor,
    error_count: torch.Tensor | None,
    round_sf: bool,
    clamp_min: float,
    count_slots: bool = False,
) -> None:
    """With ``pos_to_token``, bad indices are added atomically to ``error_count[0]``, or with ``count_slots`` each
    CTA's count goes to ``error_count[cta]`` when it is nonzero (``num_ctas`` zeroed slots); ``error_count`` None
    with ``count_slots``: the counts go to scratch (nobody reads them)."""
    quant_in = x_sf is not None
    args = [x] + ([x_sf] if quant_in else []) + ([pos_to_token] if pos_to_token is not None else []) + [out, sf]
    if pos_to_token is not None:
        if error_count is None:
            error_count = scratch(x.device, torch.int32, num_ctas(x, out.shape[0], quant_in))
        args.append(error_count)
    _launch_kernel(x, 128, round_sf, pos_to_token is not None, quant_in, False, args, clamp_min, count_slots)


# --- public functions -----------------------------------------------------------------------------


def _check_common(op: str, fmt: str, num_per_tokens: int, round_sf: bool, allowed=(128,)) -> None:
    checks.check_one_of(op, "fmt", fmt, ("e4m3",))
    checks.check_one_of(op, "num_per_tokens", num_per_tokens, allowed)
    checks.check_bool(op, "round_sf", round_sf)


def _check_plain(op: str, x, dtypes=tuple(_IN_DTYPES)) -> None:
    checks.check_dtype(op, "x", x, dtypes)
    checks.check_ndim(op, "x", x, 2)
    checks.check_contiguous(op, "x", x)
    checks.check_divisible(op, "x.shape[1] (hidden)", x.shape[1], 64)


def per_channel_cast(x: torch.Tensor, fmt: str, num_per_tokens: int = 128, round_sf: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel e4m3 cast: one scale per 128 tokens of each channel (see the module docstring).

    ``x``: bf16/fp32 ``(T, H)``, contiguous, ``H % 64 == 0``, any ``T`` (a partial last block uses its
    valid rows). Returns ``(out e4m3 (T, H), sf fp32 (ceil(T/128), H))``, bit-exact with
    ``reference.cast(x, 'e4m3', (128, 1), round_sf=round_sf)``.
    """
    op = "per_channel_cast"
    _check_common(op, fmt, num_per_tokens, round_sf)
    _check_plain(op, x)
    if x.device.type != "cuda":
        from . import reference

        return reference.cast(x, "e4m3", (num_per_tokens, 1), round_sf=round_sf)
    t, h = x.shape
    out = torch.empty((t, h), dtype=torch.float8_e4m3fn, device=x.device)
    sf = torch.empty((ceil_div(t, num_per_tokens), h), dtype=torch.float32, device=x.device)
    if t:
        per_channel_cast_(x, out, sf, num_per_tokens, bool(round_sf), False, config.get_amax_clamp("e4m3"))
    return out, sf


def per_channel_cast_and_transpose(
    x: torch.Tensor, fmt: str, num_per_tokens: int, round_sf: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel e4m3 cast with the data transposed: ``out[j, t] = e4m3(x[t, j] * sf_inv[t // bm, j])``.

    ``x``: bf16 ``(T, H)``, contiguous, ``T % 16 == 0``, ``H % 64 == 0``; ``num_per_tokens`` (``bm``) in
    {32, 128}. Returns ``(out e4m3 (H, T), sf fp32 (ceil(T/bm), H))`` (the SF is not transposed),
    bit-exact with ``reference.cast(x, 'e4m3', (bm, 1), round_sf)`` with the data transposed.
    """
    op = "per_channel_cast_and_transpose"
    _check_common(op, fmt, num_per_tokens, round_sf, (32, 128))
    _check_plain(op, x, (torch.bfloat16,))
    t, h = x.shape
    checks.check_divisible(op, "x.shape[0] (num_tokens)", t, 16)
    if x.device.type != "cuda":
        from . import reference

        out, sf = reference.cast(x, "e4m3", (num_per_tokens, 1), round_sf=round_sf)
        return out.t().contiguous(), sf
    out = torch.empty((h, t), dtype=torch.float8_e4m3fn, device=x.device)
    sf = torch.empty((ceil_div(t, num_per_tokens), h), dtype=torch.float32, device=x.device)
    if t:
        per_channel_cast_(x, out, sf, num_per_tokens, bool(round_sf), True, config.get_amax_clamp("e4m3"))
    return out, sf


def per_channel_cast_fused(
    x,
    fmt: str,
    num_per_tokens: int = 128,
    round_sf: bool = False,
    num_per_channels: int | None = None,
    pos_to_token: torch.Tensor | None = None,
    check: bool = True,
    error_count: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel e4m3 cast with an optional row gather and optional per-token-quantized input.

    ``x``: bf16/fp32 ``(T, H)`` (``num_per_channels`` None), or ``(data e4m3 (T, H), sf fp32 (T, H/128))``
    with ``num_per_channels == 128`` (both contiguous, ``H % 128 == 0``). ``pos_to_token``: optional
    contiguous int32 ``(T_out,)``; row ``r`` of the output is input row ``pos_to_token[r]``, zeros for a
    negative index. Returns ``(out e4m3 (T_out, H), sf fp32 (ceil(T_out/128), H))`` on ``x``'s device,
    bit-exact with ``reference.per_channel_cast_fused``. Indices ``>= T`` raise ``ValueError`` with
    ``check=True`` (one host sync); with ``check=False`` they are only counted into ``error_count``
    (int32 ``(1,)``, zeroed by the caller) and their rows are zeros.
    """
    op = "per_channel_cast_fused"
    _check_common(op, fmt, num_per_tokens, round_sf)
    checks.check_bool(op, "check", check)
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            checks.fail(op, "x", "a tensor or a QuantTensor (data, sf)", f"a sequence of length {len(x)}", TypeError)
        if num_per_channels is None:
            checks.fail(op, "num_per_channels", "128 for a QuantTensor input", None)
        checks.check_one_of(op, "num_per_channels", num_per_channels, (128,))
        data, x_sf = x
        checks.check_dtype(op, "x[0] (data)", data, torch.float8_e4m3fn)
        checks.check_ndim(op, "x[0] (data)", data, 2)
        checks.check_contiguous(op, "x[0] (data)", data)
        checks.check_divisible(op, "x[0].shape[1] (hidden)", data.shape[1], 128)
        checks.check_dtype(op, "x[1] (sf)", x_sf, torch.float32)
        checks.check_shape(op, "x[1] (sf)", x_sf, (data.shape[0], data.shape[1] // 128))
        checks.check_contiguous(op, "x[1] (sf)", x_sf)
        checks.check_same_device(op, "x[1] (sf)", x_sf, data.device)
    else:
        if num_per_channels is not None:
            checks.fail(op, "num_per_channels", "None for a plain tensor input", num_per_channels)
        data, x_sf = x, None
        _check_plain(op, data)
    t, h = data.shape
    t_out = t
    if pos_to_token is not None:
        checks.check_dtype(op, "pos_to_token", pos_to_token, torch.int32)
        checks.check_ndim(op, "pos_to_token", pos_to_token, 1)
        checks.check_contiguous(op, "pos_to_token", pos_to_token)
        checks.check_same_device(op, "pos_to_token", pos_to_token, data.device)
        t_out = pos_to_token.shape[0]
    if error_count is not None:
        checks.check_dtype(op, "error_count", error_count, torch.int32)
        checks.check_shape(op, "error_count", error_count, (1,))
        checks.check_same_device(op, "error_count", error_count, data.device)
    if data.device.type != "cuda":
        from . import reference

        if pos_to_token is not None:
            n_bad = int((pos_to_token >= t).sum())
            if error_count is not None:
                error_count += n_bad
            if check and n_bad:
                checks.fail(op, "pos_to_token", f"indices < num_tokens={t}", f"{n_bad} indices out of range")
        return reference.per_channel_cast_fused(x, num_per_tokens, num_per_channels, round_sf, pos_to_token)
    out = torch.empty((t_out, h), dtype=torch.float8_e4m3fn, device=data.device)
    sf = torch.empty((ceil_div(t_out, num_per_tokens), h), dtype=torch.float32, device=data.device)
    if t_out:
        # A gather's bad indices: with check=True per-CTA counts in zeroed pinned host memory, written only when
        # nonzero and read after a stream sync (no fill kernel before, no copy after); with error_count atomics into
        # the caller's device counter; with neither per-CTA counts into scratch that nobody reads (the op's).
        gather = pos_to_token is not None
        counts, err, slots = None, None, False
        if gather and not check:
            err, slots = error_count, error_count is None
        elif gather:
            n_slots = num_ctas(data, t_out, x_sf is not None)
            counts = hostmem.host_counts(n_slots, data.device)
            if counts is not None:
                err, slots = counts.zeroed(n_slots), True
            else:  # no host counts on this system: one device counter, copied to the host
                err = torch.zeros(1, dtype=torch.int32, device=data.device)
        per_channel_cast_fused_(data, x_sf, pos_to_token, out, sf, err, bool(round_sf), config.get_amax_clamp("e4m3"),
                                slots)
        if gather and check:
            if counts is not None:
                n_bad = counts.collect(n_slots)
            else:
                n_bad = int(err.item())
            if error_count is not None:
                error_count += n_bad
            if n_bad:
                checks.fail(op, "pos_to_token", f"indices < num_tokens={t}", f"{n_bad} indices out of range")
    return out, sf
