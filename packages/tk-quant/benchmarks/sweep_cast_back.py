"""Compares tuning variants of ``cast_back_kernel`` in one GPU run (not a pytest file).

    python3 packages/tk-quant/benchmarks/sweep_cast_back.py [--only WORD[,WORD...]] [threads,units[,split[,min_blocks]] ...]

``--only`` keeps the anchor lines whose name contains one of the words, the odd cases whose name contains one
(``odd`` selects them all) and the odd cases of the selected lines' formats; e.g. ``--only e5m6,odd`` runs the
cast_back_e5m6 and per_token_cast_to_e5m6 lines and every odd case. Every printed line's ``ok`` is its own
bit-exact check (packed UE8M0 SF: only the meaningful bytes; the others are undefined, spec §11.4).

Each variant is compiled (in parallel), checked bit-exact against ``tk_quant.reference`` on odd shapes
(hidden 576/592, 1 and 133 tokens, strided rows, per-element scales) and on the anchor shape, then timed
(L2 flushed) on every cast_back_per_token and cast_back_e5m6 anchor line (T=8001, H=7168). The public
functions (default variant) are also checked on 0 tokens. Then the same for ``per_token_cast`` (its e2m1
and e4m3 lines) and ``per_token_cast_to_e5m6`` through the public functions (the default kernel), and the
e5m6 lines once more through the kernel variants of ``PTC_E5M6_VARIANTS`` (e.g. without the shared-memory
staging of the output words). GB/s counts bytes as the anchor figures do."""

import sys

import tilelang
import torch

import tk_quant
from tk_core.formats import reinterpret
from tk_core.jit import arch_of, precompile, target_of
from tk_core.layout import vector_aligned
from tk_core.testing import count_bytes
from tk_core.testing.bench import copy_bandwidth_gbps, device_time_us
from tk_quant import reference
from tk_quant.cast_back import cast_back_kernel
from tk_quant.common import alloc_data, alloc_sf_out, amax_clamp, sf_kernel_args, sf_kind, sf_out_layout
from tk_quant.per_token_cast import per_token_cast_kernel

# cast_back_kernel variants "threads,units[,split[,min_blocks]]": the op's default (256 threads, 2 units, split,
# min_blocks auto = 8) first; "256,2,0,1" is the previous kernel (per-unit checks only: nvcc sinks the loads)
DEFAULT = ["128,2", "256,2", "128,2,1,1", "128,4"]  # the op's default first
T, H = 8001, 7168
OUT = {"fp32": ("float32", torch.float32), "bf16": ("bfloat16", torch.bfloat16)}

# anchor lines: (kernel name, anchor GB/s, data fmt, out fmt, bk, col-major SF, packed SF)
ANCHORS = [
    ("cast_back_per_token bk128 fp32", 2054, "e2m1", "fp32", 128, False, False),
    ("cast_back_per_token bk128 bf16", 1844, "e2m1", "bf16", 128, False, False),
    ("cast_back_per_token bk7168 fp32", 2005, "e2m1", "fp32", H, False, False),
    ("cast_back_per_token bk7168 bf16", 1868, "e2m1", "bf16", H, False, False),
    ("cast_back_e5m6 bf16", 3990, "e5m6", "bf16", H, False, False),
    ("cast_back_e5m6 fp32", 2646, "e5m6", "fp32", H, False, False),
    ("cast_back_e5m6 bf16 packed", 3987, "e5m6", "bf16", H, True, True),
    ("cast_back_e5m6 fp32 packed", 2648, "e5m6", "fp32", H, True, True),
]
# odd cases: (t, h, data fmt, out fmt, block, strided rows)
ODD = [
    (133, 576, "e2m1", "fp32", (1, 128), True),
    (133, 576, "e2m1", "bf16", (32, 32), False),
    (1, 576, "e4m3", "fp32", (128, 1), False),
    (133, 576, "e4m3", "bf16", (1, 16), True),
    (133, 592, "e5m6", "fp32", (1, 592), True),
    (1, 592, "e5m6", "bf16", (1, 592), False),
]


def quantize(t, h, fmt, out_fmt, block, col=False, packed=False, strided=False):
    x = torch.randn(t, h, device="cuda", dtype=OUT[out_fmt][1])
    if fmt == "e5m6":
        q = tk_quant.per_token_cast(x, "e5m6", h, None, col, True, packed)
    elif block[0] == 1 and block[1] in (16, 32, 64, 128, h):
        q = tk_quant.per_token_cast(x, fmt, block[1], None, col, True, packed)
    else:
        q = reference.cast(x, fmt, block, round_sf=True)
    if strided:  # same values, rows 16 bytes wider than the data
        d = q[0]
        big = torch.zeros(t, d.shape[1] + 16 // d.element_size(), dtype=d.dtype, device="cuda")
        big[:, : d.shape[1]] = d
        q = (big[:, : d.shape[1]], q[1])
    return x, q


def params(fmt, out_fmt, h, block, sf):
    return dict(fmt=fmt, out_dtype=OUT[out_fmt][0], hidden=h, bm=block[0], bk=block[1], sf=sf_kind(sf))


def launcher(k, q, fmt, out):
    """What ``_cast_back_op`` does, for a kernel of one variant."""
    data = vector_aligned(q[0], 8).view(torch.int32) if fmt == "e5m6" else vector_aligned(q[0], 8 if fmt == "e2m1" else 16)
    flat, s0, s1 = sf_kernel_args(q[1])
    return lambda: k(data, flat, out.view(-1), s0, s1)


def reference_out(q, fmt, out_fmt, block):
    if fmt == "e5m6":
        return reference.cast_back_from_e5m6(q, out_fmt, block)
    return reference.cast_back(q, out_fmt, block)


def same_bits(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                                              b.view(torch.int16 if b.element_size() == 2 else torch.int32))


def parse_args(argv):
    """``(words or None, specs)`` from ``[--only W1,W2] [threads,units ...]``."""
    words, specs, i = None, [], 0
    while i < len(argv):
        if argv[i] == "--only" and i + 1 < len(argv):
            words = [w for w in argv[i + 1].split(",") if w]
            i += 2
        elif argv[i].startswith("--only="):
            words = [w for w in argv[i].split("=", 1)[1].split(",") if w]
            i += 1
        else:
            specs.append(argv[i])
            i += 1
    return words, specs or DEFAULT


def selected(name, words):
    return words is None or any(w in name for w in words)


def select(anchors, odd, odd_name, odd_fmt, words):
    """The anchor lines named by ``words`` and the odd cases named by them or of a selected line's format."""
    lines = [a for a in anchors if selected(a[0], words)]
    fmts = {a[2] for a in lines}
    return lines, [c for c in odd if selected(odd_name(c), words) or (words is not None and odd_fmt(c) in fmts)]


def odd_name(c):
    return f"cast_back odd {c[2]}->{c[3]} t={c[0]} h={c[1]} block={c[4][0]}x{c[4][1]}" + (" strided" if c[5] else "")


def main():
    words, specs = parse_args(sys.argv[1:])
    torch.manual_seed(0)
    lines, odd_cases = select(ANCHORS, ODD, odd_name, lambda c: c[2], words)
    odd = [(c, *quantize(c[0], c[1], c[2], c[3], c[4], strided=c[5])) for c in odd_cases]
    anchors = [(a, *quantize(T, H, a[2], a[3], (1, a[4]), a[5], a[6])) for a in lines]
    jobs = []  # (spec, key, params)
    for s in specs:
        v = [int(n) for n in s.split(",")]
        knobs = dict(threads=v[0], units=v[1]) | (dict(split=bool(v[2])) if len(v) > 2 else {})
        knobs |= dict(min_blocks=v[3]) if len(v) > 3 else {}
        for c, _, q in odd:
            jobs.append((s, ("odd", c), params(c[2], c[3], c[1], c[4], q[1]) | knobs))
        for a, _, q in anchors:
            jobs.append((s, ("anchor", a), params(a[2], a[3], H, (1, a[4]), q[1]) | knobs))
    funcs, keys = [], []
    for s, key, p in jobs:
        try:
            funcs.append(cast_back_kernel(**p))
            keys.append((s, key))
        except Exception as e:  # noqa: BLE001
            print(f"{s} {key[1][0]}: lowering failed: {type(e).__name__}: {e}")
    ks = {}
    if funcs:
        compile_all(funcs, keys, ks)
    print(f"copy {copy_bandwidth_gbps():.0f} GB/s")
    if lines or odd:
        cast_back_lines(specs, odd, anchors, ks)
    per_token_cast_lines(words)


def compile_all(funcs, keys, ks):
    try:
        built = tilelang.par_compile(funcs, target=target_of(arch_of(None)), num_workers=16,
                                     pass_configs=cast_back_kernel.pass_configs)
        ks.update(zip(keys, built))
    except Exception as e:  # noqa: BLE001
        print(f"par_compile failed ({type(e).__name__}: {e}); compiling one by one")
        for (s, key), f in zip(keys, funcs):
            try:
                ks[(s, key)] = tilelang.compile(f, target=target_of(arch_of(None)), pass_configs=cast_back_kernel.pass_configs)
            except Exception as e2:  # noqa: BLE001
                print(f"{s} {key[1][0]}: compile failed: {type(e2).__name__}: {e2}")


def cast_back_lines(specs, odd, anchors, ks):
    # public path (default variant) on 0 tokens
    for fmt, x_special in (("e2m1", None), ("e5m6", "e5m6")):
        x, q = quantize(0, 576, fmt, "fp32", (1, 576))
        y = tk_quant.cast_back(q, "fp32", (1, 576), x_special)
        print(f"public {fmt} T=0 ok={tuple(y.shape) == (0, 576)}")
    for s in specs:
        for c, _, q in odd:
            k = ks.get((s, ("odd", c)))
            good = False
            if k is not None:
                try:
                    out = torch.full((c[0], c[1]), float("nan"), device="cuda", dtype=OUT[c[3]][1])
                    launcher(k, q, c[2], out)()
                    good = same_bits(out, reference_out(q, c[2], c[3], c[4]))
                except Exception as e:  # noqa: BLE001
                    print(f"{odd_name(c)} [{s}]: {type(e).__name__}: {e}")
            print(f"{odd_name(c)} [{s}] ok={good}", flush=True)
        for a, x, q in anchors:
            name, anchor = a[0], a[1]
            k = ks.get((s, ("anchor", a)))
            if k is None:
                print(f"{name} [{s}] ok=False us=nan GB/s=nan anchor={anchor} ratio=nan")
                continue
            try:
                out = torch.full((T, H), float("nan"), device="cuda", dtype=OUT[a[3]][1])
                fn = launcher(k, q, a[2], out)
                fn()
                good = same_bits(out, reference_out(q, a[2], a[3], (1, a[4])))
                us = device_time_us(fn)
                nbytes = count_bytes(x, q)  # output (same size as x) + data + SF, as the anchor counts
                gbps = nbytes / us / 1e3
                print(f"{name} [{s}] ok={good} us={us:.1f} GB/s={gbps:.0f} anchor={anchor} ratio={gbps / anchor:.3f}",
                      flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"{name} [{s}] ok=False error {type(e).__name__}: {e}")


# (name, anchor GB/s, fmt, in dtype, bk, col-major SF, packed SF)
PTC_ANCHORS = [
    ("per_token_cast e4m3 bk32", 3926, "e4m3", "fp32", 32, True, True),
    ("per_token_cast e2m1 bk32", 1495, "e2m1", "fp32", 32, True, True),
    ("per_token_cast e4m3 bk64", 3922, "e4m3", "fp32", 64, True, True),
    ("per_token_cast e2m1 bk64", 1481, "e2m1", "fp32", 64, True, True),
    ("per_token_cast_to_e5m6 bf16", 3674, "e5m6", "bf16", H, False, False),
    ("per_token_cast_to_e5m6 fp32", 4094, "e5m6", "fp32", H, False, False),
    ("per_token_cast_to_e5m6 bf16 packed", 3703, "e5m6", "bf16", H, True, True),
    ("per_token_cast_to_e5m6 fp32 packed", 4098, "e5m6", "fp32", H, True, True),
]
# kernel variants timed on the per_token_cast_to_e5m6 lines after the default (the public path)
PTC_E5M6_VARIANTS = [dict(min_blocks=4), dict(stage=False)]
# odd cases: (t, h, fmt, in dtype, bk, col, packed, strided rows)
PTC_ODD = [
    (133, 576, "e2m1", "fp32", 32, True, True, True),
    (1, 576, "e2m1", "bf16", 64, False, False, False),
    (133, 592, "e4m3", "fp32", 16, False, False, True),
    (0, 576, "e2m1", "fp32", 32, True, True, False),
    (133, 592, "e5m6", "bf16", 592, False, False, True),
    (1, 592, "e5m6", "fp32", 592, True, True, False),
    (133, 576, "e5m6", "fp32", 576, True, True, True),  # staged stores, 8 rows per CTA, a partial last CTA
    (0, 592, "e5m6", "fp32", 592, False, False, False),
]


def ptc(x, fmt, bk, col, packed, ref):
    if fmt == "e5m6":
        f = reference.cast_to_e5m6 if ref else tk_quant.per_token_cast_to_e5m6
        return f(x, bk, col, True, packed)
    if ref:
        return reference.cast(x, fmt, (1, bk), None, None, True, col, packed)
    return tk_quant.per_token_cast(x, fmt, bk, None, col, True, packed)


def e5m6_variant(x, bk, col, packed, extra):
    """``(launch, data, sf)``: ``per_token_cast_to_e5m6(x, bk, col, True, packed)`` through a kernel variant
    (what ``_per_token_cast_op`` does)."""
    t, h = x.shape
    data = alloc_data("e5m6", t, h, x.device)
    sf = alloc_sf_out(t, h // bk, sf_out_layout("sweep", col, packed, True), x.device)
    k = per_token_cast_kernel.get(x.device, in_dtype=OUT["bf16" if x.dtype == torch.bfloat16 else "fp32"][0], fmt="e5m6",
                                  hidden=h, bk=bk, round_sf=True, mode="cast", sf_out=sf_kind(sf), **extra)
    flat, s0, s1 = sf_kernel_args(sf)
    dummy = torch.empty(16, dtype=torch.uint8, device=x.device)
    y = data.view(-1).view(torch.int32)
    return (lambda: k(x, dummy, y, flat, 0, 0, s0, s1, amax_clamp("e5m6"))), data, sf


def bits(v):
    return v.view(torch.uint8) if v.element_size() == 1 else v.view(torch.int32)


def sf_bits(sf, nk):
    """A packed UE8M0 SF -> its meaningful bytes ``(rows, nk)`` (the padding bytes of the last word are
    undefined); other SF -> their bits."""
    return reinterpret(sf, torch.uint8)[:, :nk] if sf.dtype == torch.int32 else bits(sf)


def ptc_ok(x, fmt, bk, col, packed):
    (d, s), (rd, rs) = ptc(x, fmt, bk, col, packed, False), ptc(x, fmt, bk, col, packed, True)
    nk = -(-x.shape[1] // bk)
    return (d.shape == rd.shape and s.shape == rs.shape and torch.equal(bits(d), bits(rd))
            and torch.equal(sf_bits(s, nk), sf_bits(rs, nk)))


def ptc_odd_name(c):
    t, h, fmt, dt, bk, col, packed, strided = c
    flags = "".join(f" {n}" for n, on in (("col", col), ("packed", packed), ("strided", strided)) if on)
    return f"per_token_cast odd {fmt} {dt} t={t} h={h} bk={bk}{flags}"


def per_token_cast_lines(words):
    anchors, odd = select(PTC_ANCHORS, PTC_ODD, ptc_odd_name, lambda c: c[2], words)
    if not anchors and not odd:
        return
    # compile the public path's kernels in parallel first (else ~5 s each, one after another)
    cases = [(h, fmt, dt, bk, packed) for _, h, fmt, dt, bk, _, packed, _ in odd]
    cases += [(H, fmt, dt, bk, packed) for _, _, fmt, dt, bk, _, packed in anchors]
    variants = {
        (h, fmt, dt, bk, packed): dict(in_dtype=OUT[dt][0], fmt=fmt, hidden=h, bk=bk, round_sf=True, mode="cast",
                                       sf_out="packed" if packed else "fp32")
        for h, fmt, dt, bk, packed in cases
    }
    jobs = [(per_token_cast_kernel, p) for p in variants.values()]
    jobs += [(per_token_cast_kernel, variants[(H, fmt, dt, bk, packed)] | extra)
             for _, _, fmt, dt, bk, _, packed in anchors if fmt == "e5m6" for extra in PTC_E5M6_VARIANTS]
    try:
        precompile(jobs, workers=16, progress=False)
    except Exception as e:  # noqa: BLE001
        print(f"per_token_cast precompile failed: {type(e).__name__}: {e}")
    for c in odd:
        t, h, fmt, dt, bk, col, packed, strided = c
        try:
            x = torch.randn(t, h + (8 if strided else 0), device="cuda", dtype=OUT[dt][1])[:, :h]
            if t:  # a zero row (the amax floor) and edge values
                x[0] = 0
                x[-1, :4] = torch.tensor([-0.0, 1e-30, 3e38, -6.5], device="cuda", dtype=x.dtype)
            good = ptc_ok(x, fmt, bk, col, packed)
        except Exception as e:  # noqa: BLE001
            print(f"{ptc_odd_name(c)}: {type(e).__name__}: {e}")
            good = False
        print(f"{ptc_odd_name(c)} [default] ok={good}", flush=True)
    for name, anchor, fmt, dt, bk, col, packed in anchors:
        try:
            x = torch.randn(T, H, device="cuda", dtype=OUT[dt][1])
            good = ptc_ok(x, fmt, bk, col, packed)
            fn = lambda x=x, fmt=fmt, bk=bk, col=col, packed=packed: ptc(x, fmt, bk, col, packed, False)  # noqa: E731
            nbytes = count_bytes(x, *fn())
            us = device_time_us(fn)
            gbps = nbytes / us / 1e3
            print(f"{name} [default] ok={good} us={us:.1f} GB/s={gbps:.0f} anchor={anchor} ratio={gbps / anchor:.3f}",
                  flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{name} [default] ok=False error {type(e).__name__}: {e}")
        if fmt != "e5m6":
            continue
        for extra in PTC_E5M6_VARIANTS:
            tag = ",".join(f"{k}={v}" for k, v in extra.items())
            try:
                fn, d, sf = e5m6_variant(x, bk, col, packed, extra)
                fn()
                rd, rs = ptc(x, fmt, bk, col, packed, True)
                good = torch.equal(bits(d), bits(rd)) and torch.equal(sf_bits(sf, 1), sf_bits(rs, 1))
                us = device_time_us(fn)
                gbps = count_bytes(x, d, sf) / us / 1e3
                print(f"{name} [{tag}] ok={good} us={us:.1f} GB/s={gbps:.0f} anchor={anchor} ratio={gbps / anchor:.3f}",
                      flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"{name} [{tag}] ok=False error {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
