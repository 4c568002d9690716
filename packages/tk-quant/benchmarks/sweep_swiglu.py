"""Compares tuning variants of the three SwiGLU kernels in one GPU run (not a pytest file).

    python3 packages/tk-quant/benchmarks/sweep_swiglu.py [fwd_token|fwd_channel|bwd_token[:VARIANT,...] ...]
    (default: the two forward kernels, every variant; ``fwd_token:default,longdiv`` runs those two only)

Each variant's kernels are compiled in parallel, then the public op runs with that variant (the factory the
device op calls is swapped for one that hands out the precompiled kernel). Every variant is checked bit-exact
against ``tk_quant.reference`` (on the GPU) on the anchor shapes and on odd shapes (0 and 1 rows, a hidden
size that is not a multiple of the 512-column span / 128-column tile), then timed (L2 flushed) on each
anchor line of shared/spec/anchor-figures.md. The first variant of each kernel is the op's default.
"""

import functools
import sys
import traceback

import tilelang
import torch
from bench_swiglu import moe_inputs  # the benchmarks' MoE routing (this script's folder is on sys.path)

from tk_core.jit import arch_of, target_of
from tk_core.testing import count_bytes
from tk_core.testing.bench import device_time_us
from tk_quant import reference as R
from tk_quant import swiglu as S

# name -> (factory attribute in tk_quant.swiglu, {variant name: extra kernel parameters}); the op's default (the
# launcher's own choice, no override) first. A variant's "_set" entry names module attributes of tk_quant.swiglu
# set while it runs (launcher choices that depend on runtime values, e.g. CLAMP_IMPL). Forward per-token (H = 3584):
# the default is 2 chunks per warp at 10 CTAs per SM (48 registers), one scale rule per two chunks,
# ``tk_div_fast``, the bf16 clamp counting (``#{u < -c}`` counted directly) with one packed warp reduction, the
# clamp as min.NaN/max.NaN on the loaded bf16 pairs ("bf16", for a clamp value that is a bf16 value, as 0.5) and
# bf16 widened from the loaded words, and the lean parameters (integer counts, the scale rule from the amax's bits,
# int32 scale offsets, redux counts, the bf16 division gate; session 42); s3base: session 3's default (four count reductions, compare-and-select
# clamp, widening by the bf16 conversion); nowords: the default with the bf16 conversion; nan: the min.NaN clamp on
# the widened float32 values. Per-channel: the default has the "bf16" clamp, the word widening and the amax over
# the float32 activations; s3base: session 3's clamp and widening (the amax over the float32 activations, which
# measured 1-2 % faster than over the bf16 ones in sweep_swiglu_s5.log, is the only path now); nan: the default with
# the "nan" clamp.
VARIANTS = {
    "fwd_token": (
        "swiglu_fwd_token_kernel",
        {
            "default": {},
            "s3base": dict(pack_counts=False, clamp_impl="select", widen_words=False),
            "nowords": dict(widen_words=False),
            "nan": {"_set": {"CLAMP_IMPL": "nan"}},
            "longdiv": dict(short_div=False),  # the refined reciprocal in the SiLU division, nvcc's expf
            "longexp": dict(short_exp=False),  # nvcc's expf
            "row": dict(load_order="row"),  # with pos_to_expert too, the loads after the row's pos_to_expert test
            "early": dict(load_order="early"),  # with pos_to_expert, every kernel loads before that test
            "early_if_pe": dict(load_order="early_if_pe"),
            # CTAs per SM (the default: 10, the weighted count kernel 9; ``fwd_token_min_blocks``). Session 37
            # (H100, sweep_swiglu_s37.log), the count kernel before the lean parameters (12 bytes of spill at 10):
            # 9 +0.8-1.6 % over 10 with pos_to_expert, 8 slower; without counts all three equal
            "mb9": dict(min_blocks=9),
            "mb8": dict(min_blocks=8),
            # session 41's kernel: without the lean parameters, at 9 CTAs per SM (the count kernel's no-spill cap
            # then). Session 42 (H100, sweep_swiglu_s42.log; A B B A, mean of two runs): the lean parameters took the
            # count lines 55.7 -> 54.8 us at 9 CTAs and 54.6 at 10 (+2.1 %), the others 54.2 -> 54.0 (the no-count
            # diagnostic line runs at 54.0: near the H100's memory floor)
            "s41": dict(
                int_counts=False, int_scale=False, sf_index32=False, redux_counts=False, bf16_keys=False, min_blocks=9
            ),
        },
    ),
    "fwd_channel": (
        "swiglu_fwd_channel_kernel",
        {
            "default": {},  # bm=32: 128 threads, 6 CTAs per SM, tk_div_fast
            "s3base": dict(clamp_impl="select", widen_words=False),
            "nan": {"_set": {"CLAMP_IMPL": "nan"}},
            "longdiv": dict(short_div=False),  # the refined reciprocal in the SiLU division
        },
    ),
    "bwd_token": (
        "swiglu_bwd_token_kernel",
        {
            "default": {},  # no clamp: preload, 4 CTAs per SM; clamp: plain loop (fast divisions), 4
            "mb1": dict(min_blocks=1),  # no register cap (the clamp kernel then takes 92 registers, 3 CTAs per SM)
        },
    ),
}
DEFAULT_RUN = ("fwd_token", "fwd_channel")  # bwd_token only when named (keeps a plain run under 90 s)


class Shim:
    """Stands in for a kernel factory: records the parameters asked for, or serves precompiled kernels."""

    def __init__(self, factory, extra, table):
        self.factory, self.table, self.wanted = factory, table, []
        self.extra = {k: v for k, v in extra.items() if k != "_set"}
        self.module_set = extra.get("_set", {})

    def install(self, attr):
        """Puts the shim in place of the factory and sets the variant's module attributes; returns the undo."""
        saved = {k: getattr(S, k) for k in self.module_set}
        setattr(S, attr, self)
        for k, v in self.module_set.items():
            setattr(S, k, v)

        def undo():
            setattr(S, attr, self.factory)
            for k, v in saved.items():
                setattr(S, k, v)

        return undo

    def key(self, params):
        return (self.factory.name, tuple(sorted({**params, **self.extra}.items())))

    def get(self, device, **params):
        k = self.key(params)
        if k not in self.table:
            self.wanted.append({**params, **self.extra})
            raise LookupError(k)
        return self.table[k]


def fwd_token_cases():
    """[(label, anchor GB/s or None, fn(op) -> outputs, bytes)]; ``fn(R.op)`` gives the reference. A case's
    ``fn.timed`` (if set) is what is timed: the clamp lines count into one counter made beforehand, as
    bench_swiglu.py does (a ``torch.zeros`` per call would add its fill kernel to the CUPTI time). The "no count"
    line (clamp without a counter) is a diagnostic: it splits the clamp's cost from the counting's."""
    cases = []
    idx, pe, ptt, ttp, x = moe_inputs(3584, 16)
    anchors = {(True, None): 1862, (True, 0.5): 1877, (False, None): 2629, (False, 0.5): 1906}
    for (use_pe, clamp), a in [*anchors.items(), ((True, "0.5 no count"), 1877)]:
        counting = clamp == 0.5

        def fn(op, x=x, pe=pe if use_pe else None, clamp=0.5 if clamp else None, counting=counting, cnt=None):
            if counting and cnt is None:
                cnt = torch.zeros(3, dtype=torch.int64, device="cuda")
            return (*op(x, "e4m3", 128, None, None, pe, True, True, True, clamp, cnt), cnt)

        out, sf, _ = fn(R.swiglu_forward_and_per_token_cast)
        if counting:
            fn.timed = functools.partial(fn, cnt=torch.zeros(3, dtype=torch.int64, device="cuda"))
        cases.append((f"pe={use_pe} clamp={clamp}", a, fn, count_bytes(x, out, sf)))
    for rows, h, bk in [(0, 3584, 128), (1, 3584, 128), (333, 1152, 128), (77, 1280, 64), (50, 1024, 1024)]:
        xo = torch.randn(rows, 2 * h, device="cuda").bfloat16()
        peo = torch.where(torch.rand(rows, device="cuda") < 0.2, -1, 0).int()
        w = torch.randn(rows, 2, device="cuda")
        pto = torch.randint(-1, 2 * rows, (rows,), device="cuda", dtype=torch.int32) if rows else peo

        def fn(op, x=xo, pe=peo, w=w, pt=pto, bk=bk, row=bk > 128):
            cnt = torch.full((4,), 3, dtype=torch.int64, device="cuda")
            return (*op(x, "e4m3", bk, pt, w, pe, not row, True, not row, 0.5, cnt), cnt)

        cases.append((f"odd rows={rows} h={h} bk={bk}", None, fn, 0))
    xe = wide_values(96, 2 * 3584)
    for clamp in (None, 0.5, 1e-33, 100.0):  # the anchor's kernels (no extra compile); clamp values at runtime

        def fn(op, x=xe, clamp=clamp):
            cnt = torch.zeros(3, dtype=torch.int64, device="cuda") if clamp is not None else None
            return (*op(x, "e4m3", 128, None, None, None, True, True, True, clamp, cnt), cnt)

        cases.append((f"wide values clamp={clamp}", None, fn, 0))
    return cases, S.swiglu_forward_and_per_token_cast, R.swiglu_forward_and_per_token_cast


def wide_values(rows, cols):
    """bf16 of magnitudes 2**-135 .. 2**12 (bf16 subnormals to beyond the fast-division range |g| <= 64), both
    signs, with +-0 sprinkled: exercises both sides of ``tk_div_fast``'s range test, also within one chunk."""
    g = torch.Generator(device="cuda").manual_seed(7)
    mag = torch.exp2(torch.rand(rows, cols, device="cuda", generator=g) * 147 - 135)
    x = torch.where(torch.rand(rows, cols, device="cuda", generator=g) < 0.5, -mag, mag)
    x[torch.rand(rows, cols, device="cuda", generator=g) < 0.01] = 0.0
    x[torch.rand(rows, cols, device="cuda", generator=g) < 0.01] = -0.0
    x[: rows // 2] = torch.randn(rows // 2, cols, device="cuda", generator=g) * 4  # whole chunks in range
    return x.bfloat16()


def fwd_channel_cases():
    cases = []
    t, h = 8064, 7168
    x = torch.randn(t, 2 * h, device="cuda").bfloat16()
    anchors = {(True, None): 3670, (True, 0.5): 3596, (False, None): 3661, (False, 0.5): 3590}
    for (rnd, clamp), a in anchors.items():
        cases.append(
            (
                f"round_sf={rnd} clamp={clamp}",
                a,
                lambda op, rnd=rnd, clamp=clamp: op(x, "e4m3", 32, rnd, True, clamp),
                x.numel() * 2 + t * h + (t // 32) * h * 4,
            )
        )
    xe = wide_values(128, 2 * h)
    for rnd, clamp in ((True, None), (False, 0.5), (True, 100.0)):  # the anchor's kernels
        cases.append(
            (
                f"wide values round_sf={rnd} clamp={clamp}",
                None,
                lambda op, rnd=rnd, clamp=clamp: op(xe, "e4m3", 32, rnd, True, clamp),
                0,
            )
        )
    for tt, hh, bm, tr in [(0, 7168, 32, True), (32, 576, 32, True), (96, 576, 32, False), (128, 1024, 128, True)]:
        xo = torch.randn(tt, 2 * hh, device="cuda").bfloat16() * 3
        cases.append(
            (
                f"odd t={tt} h={hh} bm={bm} transpose={tr}",
                None,
                lambda op, xo=xo, bm=bm, tr=tr: op(xo, "e4m3", bm, True, not tr, 0.5),
                0,
            )
        )
    return (
        cases,
        S.swiglu_forward_and_per_channel_cast_and_transpose,
        R.swiglu_forward_and_per_channel_cast_and_transpose,
    )


def bwd_token_cases():
    cases = []
    h = 7168
    anchors = {(32, None): 2934, (32, 0.5): 2847, (128, None): 2884, (128, 0.5): 2788}
    for (bk, clamp), a in anchors.items():
        idx, pe, ptt, ttp, x = moe_inputs(h, bk)
        q = R.cast(x, "e4m3", (1, bk))
        weight = torch.rand(idx.shape[0], 2, device="cuda")
        grad = torch.randn(x.shape[0], h, device="cuda").bfloat16()
        args = (q, grad, weight, ptt, ttp, bk, True, clamp)
        nbytes = count_bytes(q, grad, weight, ptt, ttp, R.swiglu_backward_and_per_token_cast(*args))
        cases.append((f"bk={bk} clamp={clamp}", a, lambda op, args=args: op(*args), nbytes))
    for rows, hh, bk, flags in [
        (0, 1024, 128, (False, False)),
        (1, 7168, 32, (False, False)),
        (333, 1152, 128, (True, True)),
        (65, 1280, 64, (True, False)),
    ]:
        xo = torch.randn(rows, 2 * hh, device="cuda").bfloat16() * 2
        q = R.cast(xo, "e4m3", (1, bk))
        n = max(rows, 3)
        weight = torch.rand(n, 2, device="cuda")
        ptt = torch.full((rows,), -1, dtype=torch.int32, device="cuda")
        perm = torch.randperm(2 * n, device="cuda")[: max(rows - 1, 0)].int()
        ptt[: perm.numel()] = perm
        ttp = torch.full((n, 2), -1, dtype=torch.int32, device="cuda")
        ttp.view(-1)[perm.long()] = torch.arange(perm.numel(), dtype=torch.int32, device="cuda")
        grad = torch.randn(rows, hh, device="cuda").bfloat16()
        args = (q, grad, weight, ptt, ttp, bk, True, 0.5, *flags)
        cases.append((f"odd rows={rows} h={hh} bk={bk}", None, lambda op, args=args: op(*args), 0))
    return cases, S.swiglu_backward_and_per_token_cast, R.swiglu_backward_and_per_token_cast


def flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if out is None:
        return []
    return [t for o in out for t in flat(o)]


def bits(t):
    return t.contiguous().view(-1).view(torch.uint8)


def same(a, b):
    """Bit equality of every output tensor (shape, dtype, and strides of non-empty tensors: an empty tensor's
    strides carry no layout, e.g. the reference's ``(0, H).t().contiguous()`` keeps strides ``(1, H)``)."""
    fa, fb = flat(a), flat(b)
    return len(fa) == len(fb) and all(
        x.shape == y.shape
        and x.dtype == y.dtype
        and (x.numel() == 0 or x.stride() == y.stride())
        and torch.equal(bits(x), bits(y))
        for x, y in zip(fa, fb, strict=True)
    )


def main():
    names = sys.argv[1:] or list(DEFAULT_RUN)
    builders = {"fwd_token": fwd_token_cases, "fwd_channel": fwd_channel_cases, "bwd_token": bwd_token_cases}
    table = {}
    plan = []
    for name in names:
        name, _, only = name.partition(":")
        attr, variants = VARIANTS[name]
        if only:
            variants = {v: variants[v] for v in only.split(",")}
        factory = getattr(S, attr)
        try:
            cases, op, ref = builders[name]()
        except Exception:  # noqa: BLE001
            print(f"{name} inputs FAILED\n{traceback.format_exc(limit=3)}", flush=True)
            continue
        for vname, extra in variants.items():
            shim = Shim(factory, extra, table)
            undo = shim.install(attr)
            for _, _, fn, _ in cases:
                try:
                    fn(op)
                except Exception:  # noqa: BLE001  (the shim's LookupError, possibly wrapped by the op)
                    pass
            undo()
            plan.append((name, attr, factory, vname, extra, cases, op, ref, shim))
    # compile every (variant, shape) kernel at once; a variant that fails to compile is reported and skipped
    jobs = {}
    for *_, shim in plan:
        for p in shim.wanted:
            jobs.setdefault(shim.key(p), (shim.factory, p))
    arch = arch_of(None)
    keys = list(jobs)
    funcs, ok_keys = [], []
    for k in keys:
        try:
            funcs.append(jobs[k][0](**jobs[k][1]))
            ok_keys.append(k)
        except Exception as exc:  # noqa: BLE001
            print(f"build {k} failed: {exc!r}", flush=True)
    for factory in {f for f, _ in jobs.values()}:
        ks = [k for k in ok_keys if k[0] == factory.name]
        fs = [funcs[ok_keys.index(k)] for k in ks]
        try:
            table.update(
                zip(
                    ks,
                    tilelang.par_compile(fs, target=target_of(arch), num_workers=16, pass_configs=factory.pass_configs),
                )
            )
        except Exception:  # noqa: BLE001
            for k, f in zip(ks, fs):  # one by one, to isolate the failing variant
                try:
                    table[k] = tilelang.compile(f, target=target_of(arch), pass_configs=factory.pass_configs)
                except Exception as exc:  # noqa: BLE001
                    print(f"compile {k} failed: {exc!r}", flush=True)
    for name, attr, _factory, vname, extra, cases, op, ref, shim in plan:
        undo = shim.install(attr)
        try:
            ok = True
            if "spans" in extra:  # the weight-grad summation order follows the split
                R.wgrad_dot = functools.partial(wgrad_dot, spans=extra["spans"])
            for label, _, fn, _ in cases:
                good = same(fn(op), fn(ref))
                if not good:
                    print(f"  {name}/{vname} MISMATCH on {label}", flush=True)
                ok &= good
            for label, anchor, fn, nbytes in cases:
                if anchor is None:
                    continue
                timed = getattr(fn, "timed", fn)
                us = device_time_us(lambda timed=timed: timed(op), rep_ms=60, warmup_ms=15)
                g = nbytes / us / 1e3
                print(
                    f"{name}/{vname} [{label}] ok={ok} us={us:.1f} GB/s={g:.0f} anchor={anchor} ratio={g / anchor:.2f}",
                    flush=True,
                )
        except Exception:  # noqa: BLE001
            print(f"{name}/{vname} FAILED\n{traceback.format_exc(limit=3)}", flush=True)
        finally:
            undo()
            R.wgrad_dot = wgrad_dot


wgrad_dot = R.wgrad_dot

if __name__ == "__main__":
    main()
