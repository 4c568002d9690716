"""Compares tuning variants of ``per_block_cast_lossless_kernel`` in one GPU run (not a pytest file).

    python3 packages/tk-quant/benchmarks/sweep_lossless.py [variant ...]

Variants (``VARIANTS``, the op's default first): overrides of ``passes`` (consecutive rows per thread),
``min_blocks`` (CTAs per SM; the persistent grid is SMs x min_blocks CTAs), ``seg`` (values per thread and row),
``bufs`` (tile buffers: ``bufs - 1`` tiles in flight), ``int_lut`` and ``threads`` (CTA size) on every anchor line,
or ``grid`` ("tiles": one CTA per tile instead of the persistent grid; an int: that many times the co-resident
CTAs). Each variant is compiled (in parallel) for the four anchor lines (T=8001, H=7168, input blocks 1 x 32 fp32:
out blocks 1x128, 32x32, 128x128 and 1x128 with packed UE8M0 SF), checked bit-exact against ``tk_quant.reference``
(data, SF and the error count) on 1, 127 and 4001 tokens, on the anchor shape and on inputs with inadmissible
scales, then timed (CUPTI, L2 flushed). The first variant also checks hidden 576 (a partial column tile) with fp32,
TMA-aligned column-major and packed UE8M0 input scales, and the public function: 0 tokens, and the ``ValueError`` of
an inadmissible block. One line per variant x anchor line: ``name ok=<bool> us=<t> GB/s=<g> anchor=<a> ratio=<g/a>``
(the anchors are ~1,000 GB/s; the target is 3,500). Before the variants: the fill and copy bandwidth at the cast's
size, and the public call on each anchor line with ``check=True`` and ``check=False``."""

import sys
import traceback

import tilelang
import torch

from tk_core.jit import arch_of, target_of
from tk_core.layout import ceil_div
from tk_core.testing.bench import copy_bandwidth_gbps, device_time_us
from tk_quant import reference
from tk_quant.per_block_cast import alloc_sf_storage
from tk_quant.per_block_cast_lossless import (
    PASSES,
    SEG,
    THREADS,
    _sf_flat,
    _tile,
    default_min_blocks,
    per_block_cast_lossless,
    per_block_cast_lossless_kernel,
)

# name: kernel overrides (passes = rows per thread, min_blocks = CTAs per SM, seg = values per thread and row);
# {} is what the op launches
VARIANTS = {
    "default": {},  # 16 values x 2 rows per thread (4 for 128 x 128), 6 CTAs per SM for 1-row blocks, else 5 (3)
    # session 18's default: 4 rows at 3 CTAs per SM (``bufs``: tile buffers, ``bufs - 1`` tiles in flight)
    "p4": dict(passes=4, min_blocks=3),
    "p4b2": dict(passes=4, min_blocks=3, bufs=2),
    "p4b3": dict(passes=4, min_blocks=3, bufs=3),
    "p4mb4": dict(passes=4, min_blocks=4),
    "p4b4mb2": dict(passes=4, min_blocks=2, bufs=4),
    "tiles": dict(grid="tiles"),  # the default kernel launched with one CTA (and error slot) per tile
    # the e4m3 byte LUT from seven multiplications and four conversions per row and tile (session 19: built by
    # integer arithmetic when every value stays normal)
    "flut": dict(int_lut=False),
    # rows per thread x CTAs per SM (registers on sm_90a: p2mb5 42-48, p2mb6 39-40, p1mb8 31-32; no spill)
    "p2mb5": dict(passes=2, min_blocks=5),
    "p2mb6": dict(passes=2, min_blocks=6),
    "p2mb6b2": dict(passes=2, min_blocks=6, bufs=2),
    "p2mb5b2": dict(passes=2, min_blocks=5, bufs=2),
    "p1mb8": dict(passes=1, min_blocks=8),
    "p1mb8b2": dict(passes=1, min_blocks=8, bufs=2),
    # 512-thread CTAs: a 128-row tile at 2 rows per thread, so 128 x 128 blocks take the 2-row tile too (40 registers
    # at 3 CTAs per SM, 48-53 at 2). Session 20 (1 x 128, 32 x 32, 128 x 128, packed): t512mb2 -2.5 / -3.9 / -2.2 /
    # -0.2 %, t512mb3 -0.8 / -6.3 / -4.9 / +0.3 %
    "t512mb2": dict(threads=512, min_blocks=2),
    "t512mb3": dict(threads=512, min_blocks=3),
    # a persistent grid of 2 / 3 times the co-resident CTAs (later CTAs start as earlier ones finish). Session 20:
    # w2 -1.7 / -5.5 / -3.7 / +0.5 %, w3 -1.6 / -5.5 / -2.8 / +1.1 %
    "w2": dict(grid=2),
    "w3": dict(grid=3),
}
T, H = 8001, 7168
# (out block, packed SF output, anchor GB/s)
LINES = [((1, 128), False, 1058), ((32, 32), False, 1042), ((128, 128), False, 1009), ((1, 128), True, 1043)]
# first variant only: (hidden, out block, packed SF output, input SF (col-major, packed))
ODD = [(576, ob, pk, (False, False)) for ob, pk, _ in LINES] + [
    (576, (32, 32), True, (True, True)),
    (576, (128, 128), False, (True, False)),
    (576, (1, 128), True, (True, True)),
    (576, (2, 64), False, (False, False)),  # several block maxima per thread
    (576, (64, 512), True, (False, False)),  # 8 threads per row, shared memory
    (576, (4, 256), False, (True, True)),
]


def params(h, ob, packed, in_packed, over):
    """Kernel parameters as ``per_block_cast_lossless_`` passes them, with ``over`` on top."""
    over = {key: val for key, val in over.items() if key != "grid"}
    passes = over.get("passes") or PASSES
    seg = over.get("seg") or SEG
    in_kind = "packed" if in_packed else "fp32"
    threads = over.get("threads") or THREADS
    mb = over.get("min_blocks") or default_min_blocks(_tile(*ob, passes, seg, threads)[2], ob[0], ob[1], in_kind, seg)
    return dict(hidden=h, bm_in=1, bk_in=32, in_kind=in_kind, bm_out=ob[0], bk_out=ob[1],
                layout="packed" if packed else "row", passes=passes, min_blocks=mb, seg=seg, bufs=over.get("bufs", 0),
                int_lut=over.get("int_lut", True), threads=threads)


def fp4_input(t, h, in_sf=(False, False), bad=False):
    xq = reference.cast(torch.randn(t, h, device="cuda"), "e2m1", (1, 32), round_sf=True,
                        use_tma_aligned_col_major_sf=in_sf[0], use_packed_ue8m0=in_sf[1])
    if bad and t > 5 and xq[1].dtype == torch.float32:  # a non-power-of-two scale, and a spread of 2**20 inside one row (d < -8 for 32x32 too)
        sf = xq[1].clone()
        sf[3, 2] *= 1.5
        sf[5, 1] *= 2.0**-20
        xq = (xq[0], sf)
    return xq


def case(k, p, xq, grid=None):
    """(fn, ok_fn, nbytes): the kernel on ``xq`` and its bit-exact check (data, SF, error count). ``grid="tiles"``:
    one CTA per tile instead of the persistent grid; an int: that many times the co-resident CTAs."""
    data, sf_in = xq
    t, h, ob, packed = data.shape[0], p["hidden"], (p["bm_out"], p["bk_out"]), p["layout"] == "packed"
    out = torch.full((t, h), 0x7F, dtype=torch.uint8, device="cuda")
    flat, sf = alloc_sf_storage(ceil_div(t, ob[0]), ceil_div(h, ob[1]), p["layout"], "cuda")
    flat.fill_(0x7F if packed else float("nan"))
    # one error slot per CTA, as the op launches: SMs x min_blocks, or one per tile when there are fewer
    bk, tpr, rows = _tile(*ob, p["passes"], p["seg"], p["threads"])
    ntiles = ceil_div(h, bk) * ceil_div(t, p["threads"] // tpr * rows)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ctas = ntiles if grid == "tiles" else min(ntiles, (grid or 1) * sms * p["min_blocks"])
    err = torch.full((ctas,), -1, dtype=torch.int32, device="cuda")
    sf_flat, s0, s1 = _sf_flat(sf_in)
    fn = lambda: k(data.view(torch.int32), sf_flat, out.view(torch.uint32), flat, err, s0, s1)  # noqa: E731

    def ok_fn():
        ro, rs, n_err = reference.per_block_cast_lossless(xq, "e4m3", (1, 32), ob, packed, True, packed)
        return (torch.equal(out, ro.view(torch.uint8)) and torch.equal(sf.view(torch.int32), rs.view(torch.int32))
                and bool(err.ge(0).all()) and int(err.sum()) == int(n_err))

    nbytes = data.numel() + sf_in.numel() * sf_in.element_size() + out.numel() + sf.numel() * sf.element_size()
    return fn, ok_fn, nbytes


def checked(k, p, xq, grid=None):
    fn, ok_fn, _ = case(k, p, xq, grid)
    fn()
    return ok_fn()


def public_checks():
    """The op's own path: 0 tokens, the error of an inadmissible block, check=False with a count."""
    out, sf = per_block_cast_lossless((torch.empty(0, 64, dtype=torch.int8, device="cuda"), torch.empty(0, 4, device="cuda")),
                                      "e4m3", (1, 32), (32, 32))
    ok = out.shape == (0, 128) and sf.shape == (0, 4)
    xq = fp4_input(127, 576, bad=True)
    try:
        per_block_cast_lossless(xq, "e4m3", (1, 32), (1, 128))
        ok = False
    except ValueError as e:
        ok &= "inadmissible" in str(e)
    cnt = torch.zeros(1, dtype=torch.int32, device="cuda")
    o, s = per_block_cast_lossless(xq, "e4m3", (1, 32), (1, 128), check=False, error_count=cnt)
    ro, rs, n_err = reference.per_block_cast_lossless(xq, "e4m3", (1, 32), (1, 128))
    ok &= torch.equal(o.view(torch.uint8), ro.view(torch.uint8)) and torch.equal(s, rs) and int(cnt.item()) == int(n_err) > 0
    print(f"public T=0 / ValueError / error_count ok={ok}", flush=True)


def public_timing(xq):
    """The public call on the anchor lines, as the benchmark times it: with ``check=True`` (the copy of the error
    slots to the host counts) and with ``check=False`` (the cast kernel alone)."""
    for ob, pk, anchor in LINES:
        for check in (True, False):
            fn = lambda: per_block_cast_lossless(xq, "e4m3", (1, 32), ob, pk, True, pk, check=check)  # noqa: E731
            out, sf = fn()
            nbytes = xq[0].numel() + xq[1].numel() * 4 + out.numel() + sf.numel() * sf.element_size()
            us = device_time_us(fn)
            print(f"  public lossless {ob[0]}x{ob[1]}{' packed' if pk else '':<7} check={check!s:<5} us={us:.1f} "
                  f"GB/s={nbytes / us / 1e3:.0f} anchor={anchor} target=3500", flush=True)


def main():
    names = sys.argv[1:] or list(VARIANTS)
    arch = arch_of(None)
    first = names[0]
    jobs = [(s, i, params(H, ob, pk, False, VARIANTS[s])) for s in names for i, (ob, pk, _) in enumerate(LINES)]
    jobs += [(first, f"x{i}", params(h, ob, pk, in_sf[1], VARIANTS[first])) for i, (h, ob, pk, in_sf) in enumerate(ODD)]
    funcs, live = [], []
    for s, i, p in jobs:
        try:
            funcs.append(per_block_cast_lossless_kernel(**p))
            live.append((s, i, p))
        except Exception:
            print(f"{s} {i} trace failed:\n{traceback.format_exc(limit=2)}", flush=True)
    ks = {}
    try:
        kernels = tilelang.par_compile(funcs, target=target_of(arch), num_workers=16,
                                       pass_configs=per_block_cast_lossless_kernel.pass_configs)
        ks = {(s, i): (k, p) for (s, i, p), k in zip(live, kernels)}
    except Exception as e:  # noqa: BLE001
        print(f"par_compile failed ({type(e).__name__}: {e}); compiling one by one", flush=True)
        for (s, i, p), f in zip(live, funcs):
            try:
                ks[(s, i)] = (tilelang.compile(f, target=target_of(arch), pass_configs=per_block_cast_lossless_kernel.pass_configs), p)
            except Exception as e2:  # noqa: BLE001
                print(f"{s} {i}: compile failed: {type(e2).__name__}: {e2}", flush=True)
    print(f"copy {copy_bandwidth_gbps():.0f} GB/s", flush=True)
    # ceilings at the cast's size (36 MB read, 57 MB written): a fill of 57 MB (writes alone) and a copy moving
    # the same 93 MB (half read, half written)
    out = torch.empty(57 << 20, dtype=torch.uint8, device="cuda")
    src = torch.empty(93 << 19, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = device_time_us(lambda: out.fill_(1))
    print(f"fill 57 MB {out.numel() / us / 1e3:.0f} GB/s", flush=True)
    us = device_time_us(lambda: dst.copy_(src))
    print(f"copy 46.5 MB (93 MB moved) {2 * src.numel() / us / 1e3:.0f} GB/s", flush=True)
    try:
        public_checks()
    except Exception:
        print(f"public ok=False failed:\n{traceback.format_exc(limit=3)}", flush=True)
    torch.manual_seed(0)
    anchor_in = fp4_input(T, H)
    small = {t: fp4_input(t, H) for t in (1, 127, 4001)}
    bad_in = fp4_input(127, H, bad=True)
    public_timing(anchor_in)
    for s in names:
        for i, (ob, pk, anchor) in enumerate(LINES):
            name = f"lossless {ob[0]}x{ob[1]}{' packed' if pk else ''}"
            try:
                k, p = ks[(s, i)]
                grid = VARIANTS[s].get("grid")
                ok = all(checked(k, p, xq, grid) for xq in (*small.values(), bad_in))
                if s == first and i == 0:
                    for j, (h, ob2, pk2, in_sf) in enumerate(ODD):
                        kx, px = ks[(s, f"x{j}")]
                        for t in (1, 133):
                            good = checked(kx, px, fp4_input(t, h, in_sf, bad=True))
                            if not good:
                                print(f"{s:>8} odd h={h} {ob2} packed={pk2} in_sf={in_sf} t={t} ok=False", flush=True)
                            ok &= good
                fn, ok_fn, nbytes = case(k, p, anchor_in, grid)
                fn()
                ok &= ok_fn()
                us = device_time_us(fn)
                g = nbytes / us / 1e3
                print(f"{s:>8} {name:<22} ok={ok} us={us:.1f} GB/s={g:.0f} anchor={anchor} ratio={g / anchor:.3f} "
                      f"target=3500 passes={p['passes']} min_blocks={p['min_blocks']}", flush=True)
            except Exception:
                print(f"{s:>8} {name:<22} ok=False us=nan GB/s=nan anchor={anchor} ratio=nan failed:\n"
                      f"{traceback.format_exc(limit=3)}", flush=True)


if __name__ == "__main__":
    main()
