"""Compares tuning variants of the Engram gate kernels (``gate_fwd_kernel`` save/nosave, ``gate_bwd_kernel``)
in one GPU run (not a pytest file).

    python3 packages/tk-engram/benchmarks/sweep_gate.py [fwd:threads,blocks | bwd:threads,blocks[,flag] ...]

bwd flag (``gate_bwd_kernel``'s ``xk_late``; none: the op's choice for the layout, ``bwd_xk_late``): ``xklate``
(x and k loaded into registers after the barrier, the grad_w accumulators in shared memory) or ``cpasync`` (x and k
as cp.async copies into two shared-memory stages, the grad_w accumulators in registers).

Every variant is compiled in parallel (n=4; H=7168 and H=576, whose last vector tile is partial), checked
against ``reference.py`` with the tolerances of tests/test_engram_gate.py (calc_diff; nosave out equal to
save out; a second run bit-identical) on T = 8001, 77 and 1 tokens, then timed (CUPTI, L2 flushed) on the
anchor lines (T=8001, n=4, H=7168), bytes counted as the anchor counts them. ``blocks`` is the CTAs per SM
the registers are capped for (and the grid is sized to). The first variant of each kind is the op's default.
Every bwd variant must also give exactly the bits of the default kernel (no flag, 2 CTAs per SM) of its thread count
(which fixes the order of dg's sum) run with the variant's token chunks (chunk and partial count are runtime
arguments), partial rows included."""

import sys

import tilelang
import torch

from tk_core.jit import arch_of, target_of
from tk_core.testing import calc_diff
from tk_core.testing.bench import device_time_us
from tk_engram import reference
from tk_engram._gate_kernels import PASS_CONFIGS, gate_bwd_kernel, gate_fwd_kernel
from tk_engram.gate import _vec_view, token_chunks

# fwd: the op's layout only (a regression check); bwd: the op's layout (x/k late) first, then the cp.async load
# order (the op's default before it: 3,808 against 3,955 GB/s on the H200).
DEFAULT = ["fwd:224,3", "bwd:224,2", "bwd:224,2,cpasync"]
FLAGS = {"xklate": ("xk_late", True), "cpasync": ("xk_late", False)}
N, H, T_ = 4, 7168, 8001
EPS, CLAMP = 1e-6, 1e-6
ANCHOR = {("fwd", True): 3809, ("fwd", False): 3811, ("bwd", None): 3916}
SMS = torch.cuda.get_device_properties(0).multi_processor_count


def parse(spec):
    """(kind, threads, blocks, flags): flags a sorted tuple of FLAGS keys (at most one)."""
    kind, rest = spec.split(":")
    threads, blocks, *flags = rest.split(",")
    return kind, int(threads), int(blocks), tuple(sorted(flags))


def bwd_params(threads, blocks, flags):
    return dict(threads=threads, blocks=blocks, **dict(FLAGS[f] for f in flags))


def inputs(t, n, h):
    x = torch.randn(t, n, h, device="cuda").bfloat16()
    k = torch.randn(t, n, h, device="cuda").bfloat16()
    v = torch.randn(t, h, device="cuda").bfloat16()
    wh = (1 + 0.1 * torch.randn(n, h, device="cuda")).bfloat16()
    we = (1 + 0.1 * torch.randn(n, h, device="cuda")).bfloat16()
    return x, k, v, reference.fused_weight_ref(wh, we)


def run_fwd(kern, blocks, x, k, v, w, save):
    t, n, h = x.shape
    chunk, parts = token_chunks(t, SMS * blocks // n)
    X, (sx0, sx1) = _vec_view(x)
    K, (sk0, sk1) = _vec_view(k)
    V, (sv0,) = _vec_view(v)
    out = torch.empty(t, n, h, dtype=torch.bfloat16, device="cuda")
    saved = [torch.empty(t, n, device="cuda") for _ in range(4)] if save else []
    call = lambda: kern(X, K, V, w, out, *saved, sx0, sx1, sk0, sk1, sv0, EPS, CLAMP, chunk, parts)  # noqa: E731
    call()
    return (out, *saved), call


def run_bwd(kern, blocks, G, x, k, v, w, dot, gate, rx, rk):
    """``blocks`` sizes the token chunks (the grid); the kernel may be capped for another count."""
    t, n, h = x.shape
    chunk, parts = token_chunks(t, SMS * blocks // n)
    Gf, (sg0, sg1) = _vec_view(G)
    X, (sx0, sx1) = _vec_view(x)
    K, (sk0, sk1) = _vec_view(k)
    V, (sv0,) = _vec_view(v)
    outs = [torch.empty(t, n, h, dtype=torch.bfloat16, device="cuda"), torch.empty(t, n, h, dtype=torch.bfloat16, device="cuda"),
            torch.empty(t, h, dtype=torch.bfloat16, device="cuda"), torch.empty(parts, n, h, device="cuda")]
    call = lambda: kern(Gf, X, K, V, w, dot, gate, rx, rk, *outs, sg0, sg1, sx0, sx1, sk0, sk1, sv0, CLAMP, chunk)  # noqa: E731
    call()
    return outs, parts, call


def check_fwd(kerns, blocks, t, h):
    x, k, v, w = inputs(t, N, h)
    ref = reference.engram_gate_fwd_ref(x, k, v, w, EPS, CLAMP)
    got, _ = run_fwd(kerns[True], blocks, x, k, v, w, True)
    ok = calc_diff(got[0], ref[0]) < 1e-9 and all(calc_diff(a, b) < 1e-10 for a, b in zip(got[1:], ref[1:]))
    again, _ = run_fwd(kerns[True], blocks, x, k, v, w, True)
    nosave, _ = run_fwd(kerns[False], blocks, x, k, v, w, False)
    return ok and all(torch.equal(a, b) for a, b in zip(again, got)) and torch.equal(nosave[0], got[0])


def check_bwd(kern, base, blocks, t, h):
    """The failed checks, e.g. ``base:partial@77x7168`` (ref: against reference.py, again: a second run, base: the
    default kernel's bits)."""
    x, k, v, w = inputs(t, N, h)
    G = torch.randn(t, N, h, device="cuda").bfloat16()
    _, dot, gate, rx, rk = reference.engram_gate_fwd_ref(x, k, v, w, EPS, CLAMP)
    got, parts, _ = run_bwd(kern, blocks, G, x, k, v, w, dot, gate, rx, rk)
    ref = reference.engram_gate_bwd_ref(G, x, k, v, w, dot, gate, rx, rk, CLAMP, num_parts=parts)
    again, _, _ = run_bwd(kern, blocks, G, x, k, v, w, dot, gate, rx, rk)
    want, _, _ = run_bwd(base, blocks, G, x, k, v, w, dot, gate, rx, rk)
    fails = []
    for name, a, r, b, c in zip(("gx", "gk", "gv", "partial"), got, ref, again, want):
        fails += [f"{what}:{name}@{t}x{h}" for what, bad in (("ref", not calc_diff(a, r) < 1e-8),
                  ("again", not torch.equal(a, b)), ("base", not torch.equal(a, c))) if bad]
    return fails


def main():
    specs = sys.argv[1:] or DEFAULT
    uniq = {}  # (kind, threads, blocks, flags), hidden, save -> prim_func
    bases = [f"bwd:{parse(s_)[1]},2" for s_ in specs if s_.startswith("bwd")]
    for spec in [*specs, *bases]:
        kind, threads, blocks, flags = parse(spec)
        for hidden in (H, 576):
            for save in (True, False) if kind == "fwd" else (None,):
                key = ((kind, threads, blocks, flags), hidden, save)
                if key not in uniq:
                    uniq[key] = (
                        gate_fwd_kernel(n=N, hidden=hidden, save=save, threads=threads, blocks=blocks)
                        if kind == "fwd"
                        else gate_bwd_kernel(n=N, hidden=hidden, **bwd_params(threads, blocks, flags))
                    )
    names = list(uniq)
    try:
        built = tilelang.par_compile([uniq[u] for u in names], target=target_of(arch_of(None)), num_workers=16,
                                     pass_configs=PASS_CONFIGS)
    except Exception as e:  # noqa: BLE001 - fall back to one by one, so one bad variant does not stop the rest
        print(f"par_compile failed ({type(e).__name__}: {e}); compiling one by one", flush=True)
        built = []
        for u in names:
            try:
                built.append(tilelang.compile(uniq[u], target=target_of(arch_of(None)), pass_configs=PASS_CONFIGS))
            except Exception as e2:  # noqa: BLE001
                print(f"compile {u} failed: {type(e2).__name__}: {e2}", flush=True)
                built.append(None)
    kern = dict(zip(names, built))

    x, k, v, w = inputs(T_, N, H)
    G = torch.randn(T_, N, H, device="cuda").bfloat16()
    _, dot, gate, rx, rk = reference.engram_gate_fwd_ref(x, k, v, w, EPS, CLAMP)
    nb = lambda *ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    for spec in specs:
        kind, threads, blocks, flags = parse(spec)
        base = {h: kern.get((("bwd", threads, 2, ()), h, None)) for h in (H, 576)}
        name = f"{kind} threads={threads} blocks={blocks}" + "".join(f" {f}" for f in flags)
        try:
            kk = {(h, s): kern[((kind, threads, blocks, flags), h, s)]
                  for h in (H, 576) for s in ((True, False) if kind == "fwd" else (None,))}
            if any(v_ is None for v_ in (*kk.values(), *(base.values() if kind == "bwd" else ()))):
                print(f"{name} ok=False (compile failed)", flush=True)
                continue
            if kind == "fwd":
                ok = all(check_fwd({s: kk[(h, s)] for s in (True, False)}, blocks, t, h)
                         for t, h in ((T_, H), (77, H), (1, H), (257, 576), (1, 576)))
                for save in (True, False):
                    res, call = run_fwd(kk[(H, save)], blocks, x, k, v, w, save)
                    us = device_time_us(call)
                    gbps = (nb(x, k, v, w, *res)) / us / 1e3
                    a = ANCHOR[("fwd", save)]
                    print(f"{name} save={save} ok={ok} us={us:.1f} GB/s={gbps:.0f} anchor={a} ratio={gbps / a:.3f}",
                          flush=True)
                    del res
            else:
                fails = [f for t, h in ((T_, H), (77, H), (1, H), (257, 576), (1, 576))
                         for f in check_bwd(kk[(h, None)], base[h], blocks, t, h)]
                ok = not fails
                outs, _, call = run_bwd(kk[(H, None)], blocks, G, x, k, v, w, dot, gate, rx, rk)
                us = device_time_us(call)
                gw = torch.empty(N, H, device="cuda")
                gbps = nb(G, x, k, v, w, dot, gate, rx, rk, *outs[:3], gw, gw) / us / 1e3
                a = ANCHOR[("bwd", None)]
                print(f"{name} ok={ok} us={us:.1f} GB/s={gbps:.0f} anchor={a} ratio={gbps / a:.3f}"
                      + (f" failed={','.join(fails)}" if fails else ""), flush=True)
                del outs
        except Exception as e:  # noqa: BLE001 - report and go on with the next variant
            print(f"{name} ok=False error={type(e).__name__}: {e}", flush=True)


if __name__ == "__main__":
    main()
