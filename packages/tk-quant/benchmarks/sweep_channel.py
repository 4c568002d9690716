"""Compares tuning variants of ``per_channel_cast_kernel`` in one GPU run (not a pytest file).

    python3 packages/tk-quant/benchmarks/sweep_channel.py [variant ...]

Variants (``VARIANTS``): ``default`` is what the ops launch (``launch_config``: tile order, CTAs per SM and waves of
the persistent grid; ``default_vec``); the others override kernel parameters (``waves``: the grid in
co-resident CTAs) on the anchor lines they name (``QIN``: the QuantTensor-input lines). Each variant is compiled (in
parallel) for its anchor lines (per_channel_cast, per_channel_cast_and_transpose bm 32/128, per_channel_cast_fused
plain and QuantTensor input), checked bit-exact against ``reference.py`` on odd token counts and on the anchor
shape, then timed (CUPTI, L2 flushed). The first variant also checks odd hidden sizes (and 0 tokens, fp32 input and
the gather paths). One line per variant x anchor line: ``name ok=<bool> us=<t> GB/s=<g> anchor=<a> ratio=<g/a>``.
The lossless block cast has its own ``sweep_lossless.py``."""

import sys
import traceback

import tilelang
import torch

from tk_core.config import get_amax_clamp
from tk_core.jit import arch_of, target_of
from tk_core.testing.bench import device_time_us
from tk_quant import reference
from tk_quant.per_channel_cast import launch_config, per_channel_cast_kernel

QIN = "quant_in"  # the QuantTensor-input lines
PLAIN = "plain"  # the bf16 / fp32 lines without a gather or transpose
TR = "transpose"  # the per_channel_cast_and_transpose lines
# name: (per-channel lines it applies to: None all, QIN, PLAIN, TR; channel overrides)
VARIANTS = {
    "default": (None, {}),
    "qmb3": (QIN, dict(min_blocks=3)),  # QuantTensor input at 3 CTAs per SM (its widened tile then spills)
    "qv8mb4": (QIN, dict(vec=8, min_blocks=4)),  # 8-channel e4m3 rows
    # bf16 tiles of 128 x 32 channels at 6 CTAs per SM (a finer tail), and of 128 x 128 at 2
    "v4mb6": (PLAIN, dict(vec=4, min_blocks=6)),
    "v16mb2": (PLAIN, dict(vec=16, min_blocks=2)),
    # fewer CTAs than SMs x 4, so that every CTA walks the same number of tiles (no partial last round): 504 = 7056
    # tiles / 14 (per_channel_cast, and_transpose: 8064 tokens), 512 = 3584 / 7 (fused plain: 4096 tokens). Session
    # 10: 0.6-1.3 % slower than 528 CTAs (c504) and equal (c512): the partial last round costs nothing measurable
    "c504": (None, dict(ctas=504)),  # (the QuantTensor lines, 2 CTAs per SM, are no case for it)
    "c512": (PLAIN, dict(ctas=512)),
    # one CTA per tile (no persistent loop, no prefetch). Session 13: 0.3-7 % slower on the bf16 lines, 28 % on the
    # QuantTensor lines
    "tiles": (None, dict(ctas=1 << 20)),
    # 512-thread CTAs: the same 128 x 64 tile at 2 rows per thread (40 registers at 3 CTAs per SM, 56 at 2)
    # Session 20: -5.6 / -10.6 % (t512mb2 per_channel_cast / fused plain), -3.8 / -5.5 % (t512mb3)
    "t512mb2": (PLAIN, dict(threads=512, min_blocks=2)),
    "t512mb3": (PLAIN, dict(threads=512, min_blocks=3)),
    # a persistent grid of 1-3 times the co-resident CTAs (default: ``launch_config``): later CTAs start as earlier
    # ones finish. Session 20 (static tile order throughout): 2 waves +0.6-0.9 % on the transposed lines, -0.3 % plain,
    # -1.8 % fused plain, -4 % QuantTensor input; 3 waves -0.3 to -12 %; 1.5 and 2.5 waves (a partial last wave)
    # -5 to -14 %. (The bf16 lines now take the dynamic order, except bm 128 rsf 0: ``static`` below.)
    "w1": (None, dict(waves=1)),
    "w1.5": (None, dict(waves=1.5)),
    "w2": (None, dict(waves=2)),
    "w2.5": (None, dict(waves=2.5)),
    "w3": (None, dict(waves=3)),
    # the transposed tile's staged bytes stored after the next tile's amax barrier (the default) against their own
    # barrier right after the staging (three barriers per tile instead of two)
    "nodefer": (TR, dict(defer_store=False)),
    # the tile order (``launch_config``): tiles after each CTA's first three from a device counter, on one wave, or
    # the static order. Session 21 (sweep_s21.log): transposed, dynamic 1.008-1.027 of the anchors against 0.98-1.00
    # static (``static``); ``dyntr`` forces it on bm 128 rsf 0 too (the same as static, a 12-byte spill); on two waves
    # (``dynw2``) -3 to -5 %, at 3 CTAs per SM (``dyntr3``) -2 to -7 %. Untransposed at 3 CTAs per SM (the default)
    # per_channel_cast 1.007-1.009 against 0.99, fused plain the same; at 4 (``dyn``, a 12-byte spill) -1 / -6 %.
    "static": (TR, dict(dynamic=False, waves=2)),
    "dyntr": (TR, dict(dynamic=True, waves=1)),
    "dynw2": (TR, dict(dynamic=True, waves=2)),
    "dyntr3": (TR, dict(dynamic=True, min_blocks=3)),
    "static4": (PLAIN, dict(dynamic=False, min_blocks=4)),
    "dyn": (PLAIN, dict(dynamic=True, min_blocks=4)),
    # the unrounded scales' two quotients without nvcc's division and its slow-path call (``_tl.SCALE_DIV``; the
    # rounded-scale lines do not divide). Session 22 (sweep_s22.log run 1, with one more barrier per tile in the
    # dynamic kernels than now): on every line (``cf``) +0.2-0.7 % on the bf16 lines, -0.3 % QuantTensor input; with
    # the dynamic order on bm 128 rsf 0 (``dyncf``, the default now) +1.1 % over static. ``ieee``: the default's
    # launch with the IEEE division
    "cf": (None, dict(call_free_div=True)),
    "dyncf": (TR, dict(dynamic=True, waves=1, call_free_div=True)),
    "ieee": (None, dict(call_free_div=False)),
    # 128 x 32-channel tiles in the dynamic order (half the tail per tile) at 4 / 5 CTAs per SM (54 / 48 registers).
    # Session 22 (run 3): -16 to -17 % on the four plain lines
    "dynv4mb4": (PLAIN, dict(dynamic=True, vec=4, min_blocks=4)),
    "dynv4mb5": (PLAIN, dict(dynamic=True, vec=4, min_blocks=5)),
    # each scale's two values on two threads for the rounded scales too (``split_scale``; then no spill at 4 CTAs per
    # SM untransposed), and with it the dynamic order at 4 CTAs per SM. Session 22 (run 4): ``split`` -0.7 to -2 % on
    # the rounded-scale plain and QuantTensor lines, equal elsewhere; ``dynsplit4`` per_channel_cast +0.2 / +1.4 %
    # (rsf 0 / 1, lines already met), fused plain -0.5 % (the unmet line): neither kept
    "split": (None, dict(split_scale=True)),
    "dynsplit4": (PLAIN, dict(dynamic=True, min_blocks=4, split_scale=True)),
}
H = 7168
CLAMP = get_amax_clamp("e4m3")
# (line name, kernel params, tokens, anchor GB/s)
LINES = [
    ("per_channel_cast rsf=0", dict(bm=128, round_sf=False), 8064, 3787),
    ("per_channel_cast rsf=1", dict(bm=128, round_sf=True), 8064, 3783),
    ("and_transpose bm=32 rsf=1", dict(bm=32, round_sf=True, transpose=True), 8064, 3666),
    ("and_transpose bm=128 rsf=1", dict(bm=128, round_sf=True, transpose=True), 8064, 3686),
    ("and_transpose bm=32 rsf=0", dict(bm=32, round_sf=False, transpose=True), 8064, 3626),
    ("and_transpose bm=128 rsf=0", dict(bm=128, round_sf=False, transpose=True), 8064, 3615),
    ("fused rsf=0", dict(bm=128, round_sf=False), 4096, 3544),
    ("fused rsf=1", dict(bm=128, round_sf=True), 4096, 3542),
    ("fused cast_back rsf=0", dict(bm=128, round_sf=False, quant_in=True), 4096, 3032),
    ("fused cast_back rsf=1", dict(bm=128, round_sf=True, quant_in=True), 4096, 3022),
]
# Extra kernels checked for the first variant only: odd hidden sizes, fp32 input, gather.
EXTRA = [
    dict(hidden=576, bm=128, round_sf=True),
    dict(hidden=576, bm=32, round_sf=False, transpose=True),
    dict(hidden=576, bm=128, round_sf=False, in_dtype="float32"),
    dict(hidden=640, bm=128, round_sf=True, quant_in=True),
    dict(hidden=576, bm=128, round_sf=False, gather=True),
    dict(hidden=2048, bm=128, round_sf=True, quant_in=True, gather=True),
]


def full(p, over, sms, arch):
    """Kernel parameters as the device ops pass them, with ``over`` on top."""
    q = dict(in_dtype="bfloat16", hidden=H, gather=False, quant_in=False, transpose=False) | p
    if q["quant_in"]:
        q["in_dtype"] = "float8_e4m3fn"
    over = dict(over)
    dynamic, call_free, min_blocks, waves = launch_config(q["in_dtype"], arch, q["bm"], q["round_sf"], q["gather"],
                                                          q["transpose"], CLAMP)
    waves = over.pop("waves", waves)
    q = q | dict(min_blocks=min_blocks, dynamic=dynamic, call_free_div=call_free) | over
    return dict(ctas=int(waves * sms * q["min_blocks"])) | q  # a variant's ``ctas`` caps the persistent grid itself


def applies(sel, p):
    quant_in, gather, transpose = (p.get(k, False) for k in ("quant_in", "gather", "transpose"))
    return (sel is None or (sel == QIN and quant_in) or (sel == PLAIN and not (quant_in or gather or transpose))
            or (sel == TR and transpose))


def make_input(p, t, t_in=None):
    t_in = t if t_in is None else t_in
    x = torch.randn(t_in, p["hidden"], device="cuda", dtype=getattr(torch, p["in_dtype"]) if not p["quant_in"] else torch.bfloat16)
    if p["quant_in"]:
        x = reference.cast(x, "e4m3", (1, 128))
    pos = torch.randint(-1, t_in + 2, (t,), device="cuda", dtype=torch.int32) if p["gather"] else None
    return x, pos


def launch(k, p, x, pos):
    """Allocates the outputs, returns (fn, out, sf, err) with fn() running the kernel."""
    data = x[0] if p["quant_in"] else x
    t = pos.shape[0] if p["gather"] else data.shape[0]
    h = p["hidden"]
    out = torch.full((h, t) if p["transpose"] else (t, h), 0x7F, dtype=torch.uint8, device="cuda")
    sf = torch.full((-(-t // p["bm"]), h), float("nan"), device="cuda")
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    # (no uint32 view of an empty transposed output: it is not launched)
    o = out.view(torch.uint32).view(h, -1, 4) if p["transpose"] and t else out.view(torch.float8_e4m3fn)
    args = [data] + ([x[1]] if p["quant_in"] else []) + ([pos] if p["gather"] else []) + [o, sf] + ([err] if p["gather"] else [])
    if p.get("dynamic"):
        args.append(torch.zeros(2, dtype=torch.int32, device="cuda"))  # the tile counter, reset by each launch
    return (lambda: k(*args, CLAMP)), out, sf, err


def check(k, p, t, t_in=None):
    x, pos = make_input(p, t, t_in)
    fn, out, sf, err = launch(k, p, x, pos)
    if t:
        fn()
        if p.get("dynamic"):  # a second launch on the same counter: the first one must have reset it
            out.fill_(0x7F)
            sf.fill_(float("nan"))
            fn()
    return same(p, x, pos, out, sf, err)


def same(p, x, pos, out, sf, err):
    """Whether ``out``, ``sf`` (and the error count) equal the reference's for this input."""
    if p["gather"] or p["quant_in"]:
        ro, rs = reference.per_channel_cast_fused(x, 128, 128 if p["quant_in"] else None, p["round_sf"], pos)
    else:
        ro, rs = reference.cast(x, "e4m3", (p["bm"], 1), round_sf=p["round_sf"])
    if p["transpose"]:
        ro = ro.t().contiguous()
    ok = torch.equal(out, ro.view(torch.uint8)) and torch.equal(sf.view(torch.int32), rs.view(torch.int32))
    if p["gather"] and err is not None:
        ok &= int(err.item()) == int((pos >= x[0].shape[0] if p["quant_in"] else pos >= x.shape[0]).sum())
    return ok


def main():
    names = sys.argv[1:] or list(VARIANTS)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    arch = arch_of(None)
    first = names[0]
    jobs = []
    for s in names:
        sel, cover = VARIANTS[s]
        jobs += [(s, i, full(p, cover, sms, arch)) for i, (_, p, _, _) in enumerate(LINES) if applies(sel, p)]
    sel, cover = VARIANTS[first]
    jobs += [(first, f"x{i}", full(p, cover, sms, arch)) for i, p in enumerate(EXTRA) if applies(sel, p)]
    funcs, live = [], []
    for s, i, p in jobs:
        try:
            funcs.append(per_channel_cast_kernel(**p))
            live.append((s, i, p))
        except Exception:
            print(f"{s} {i} trace failed:\n{traceback.format_exc(limit=2)}", flush=True)
    kernels = tilelang.par_compile(funcs, target=target_of(arch), num_workers=16,
                                   pass_configs=per_channel_cast_kernel.pass_configs)
    ks = {(s, i): (k, p) for (s, i, p), k in zip(live, kernels)}
    for s in names:
        for i, (name, _, t, anchor) in enumerate(LINES):
            if (s, i) not in ks:
                continue
            try:
                k, p = ks[(s, i)]
                ok = True
                odd = [16, 208] if p["transpose"] else [1, 200, 4001]
                for tt in odd + [t]:
                    ok &= check(k, p, tt)
                if s == first and i == 0:
                    for j in range(len(EXTRA)):
                        if (s, f"x{j}") not in ks:  # an extra kernel the variant does not apply to
                            continue
                        kx, px = ks[(s, f"x{j}")]
                        for tt in ([0, 16, 208] if px["transpose"] else [0, 1, 200]):
                            ok &= check(kx, px, tt, t_in=tt + 37 if px["gather"] else None)
                x, pos = make_input(p, t)
                fn, out, sf, _ = launch(k, p, x, pos)
                us = device_time_us(fn)
                ok &= same(p, x, pos, out, sf, None)  # the last timed launch's output
                nbytes = sum(v.numel() * v.element_size() for v in ((*x,) if p["quant_in"] else (x,))) + out.numel() + sf.numel() * 4
                g = nbytes / us / 1e3
                print(f"{s:>9} {name:<28} ok={ok} us={us:.1f} GB/s={g:.0f} anchor={anchor} ratio={g / anchor:.3f}", flush=True)
                del x, out, sf
            except Exception:
                print(f"{s:>9} {name:<28} ok=False failed:\n{traceback.format_exc(limit=3)}", flush=True)


if __name__ == "__main__":
    main()
