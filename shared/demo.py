"""Runs every op of the installed tk packages on realistic shapes, checks each result against its
plain-PyTorch reference, and prints a table: op, shape, device, time, GB/s (and % of the device's copy
bandwidth on a GPU).

On a GPU the public functions run the TileLang kernels and are timed by device time (CUPTI, L2 flushed);
on a CPU they run the references, on smaller token counts, timed by wall clock.

    python shared/demo.py            # or: nox -s demo
"""

import importlib.util
import statistics
import sys
import time

import torch

from tk_core.testing import calc_diff, count_bytes

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
TOKENS = 8001 if GPU else 1024  # CPU references are slow on full-size inputs
CASES = []


def case(op: str, shape: str, exact: bool = True, package: str = "tk_core", tol: float = 1e-5):
    """Registers a demo case: ``build()`` returns ``(run, reference, inputs)``: two callables returning tensors,
    compared bit for bit (``exact``) or by ``calc_diff < tol``, and the input tensors the GB/s count."""

    def register(build):
        CASES.append((op, shape, exact, tol, package, build))
        return build

    return register


def flatten(result) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    return [t for item in result if item is not None for t in flatten(item)]


def same(a: torch.Tensor, b: torch.Tensor, exact: bool, tol: float) -> bool:
    if exact:
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.contiguous().flatten().view(torch.uint8), b.contiguous().flatten().view(torch.uint8))
    return a.shape == b.shape and calc_diff(a.float(), b.float()) < tol


def timed_us(fn) -> float:
    if GPU:
        from tk_core.testing.bench import device_time_us

        return device_time_us(fn)
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - start) * 1e6)
    return statistics.median(runs)


# --- tk-transpose ---------------------------------------------------------------------------------


@case("transpose", f"bf16 {TOKENS}x7168", package="tk_transpose")
def _transpose():
    import tk_transpose

    x = torch.randn(TOKENS, 7168, device=DEVICE, dtype=torch.bfloat16)
    return (lambda: tk_transpose.transpose(x)), (lambda: tk_transpose.reference.transpose(x)), (x,)


@case("batched_transpose", f"e4m3 8x{TOKENS // 8 * 8}x7168", package="tk_transpose")
def _batched_transpose():
    import tk_transpose

    x = torch.randn(8, TOKENS // 8 * 8, 7168, device=DEVICE).to(torch.float8_e4m3fn)
    return (lambda: tk_transpose.batched_transpose(x)), (lambda: tk_transpose.reference.batched_transpose(x)), (x,)


# --- tk-quant -------------------------------------------------------------------------------------


@case("per_token_cast", f"bf16 {TOKENS}x7168 -> e4m3, 1x128, packed ue8m0", package="tk_quant")
def _per_token_e4m3():
    import tk_quant

    x = torch.randn(TOKENS, 7168, device=DEVICE, dtype=torch.bfloat16)
    kw = dict(use_tma_aligned_col_major_sf=True, round_sf=True, use_packed_ue8m0=True)
    return ((lambda: tk_quant.per_token_cast(x, "e4m3", 128, **kw)),
            (lambda: tk_quant.reference.cast(x, "e4m3", (1, 128), **kw)), (x,))


@case("per_token_cast", f"fp32 {TOKENS}x7168 -> e2m1, 1x32", package="tk_quant")
def _per_token_e2m1():
    import tk_quant

    x = torch.randn(TOKENS, 7168, device=DEVICE)
    return ((lambda: tk_quant.per_token_cast(x, "e2m1", 32, round_sf=True)),
            (lambda: tk_quant.reference.cast(x, "e2m1", (1, 32), round_sf=True)), (x,))


@case("per_token_cast", f"fp32 {TOKENS}x7168 -> e4m3, 1x32, stochastic rounding", package="tk_quant")
def _per_token_stochastic():
    import tk_quant

    x = torch.randn(TOKENS, 7168, device=DEVICE)
    return ((lambda: tk_quant.per_token_cast(x, "e4m3", 32, round_sf=True, stochastic_rounding=True, seed=1)),
            (lambda: tk_quant.reference.cast(x, "e4m3", (1, 32), round_sf=True, stochastic_seed=1)), (x,))


@case("cast", f"fp32 {TOKENS}x7168 -> bf16, stochastic rounding", package="tk_quant")
def _elementwise_cast():
    import tk_quant

    x = torch.randn(TOKENS, 7168, device=DEVICE)
    return ((lambda: tk_quant.cast(x, torch.bfloat16, stochastic_rounding=True, seed=1)),
            (lambda: tk_quant.reference.elementwise_cast(x, torch.bfloat16, stochastic_seed=1)), (x,))


@case("per_block_cast", f"bf16 {TOKENS}x7168 -> e4m3, 128x128", package="tk_quant")
def _per_block():
    import tk_quant

    x = torch.randn(TOKENS, 7168, device=DEVICE, dtype=torch.bfloat16)
    return ((lambda: tk_quant.per_block_cast(x, "e4m3", (128, 128), round_sf=True)),
            (lambda: tk_quant.reference.cast(x, "e4m3", (128, 128), round_sf=True)), (x,))


@case("per_token_cast_back", f"e4m3 {TOKENS}x7168, 1x128 -> bf16", package="tk_quant")
def _cast_back():
    import tk_quant

    q = tk_quant.reference.cast(torch.randn(TOKENS, 7168, device=DEVICE), "e4m3", (1, 128), round_sf=True)
    return ((lambda: tk_quant.per_token_cast_back(q, "bf16", 128)),
            (lambda: tk_quant.reference.cast_back(q, "bf16", (1, 128))), (q,))


@case("swiglu_forward_and_per_token_cast", f"bf16 {TOKENS}x(2x3584) -> e4m3, 1x128", package="tk_quant")
def _swiglu():
    import tk_quant

    x = torch.randn(TOKENS, 2 * 3584, device=DEVICE, dtype=torch.bfloat16)
    return ((lambda: tk_quant.swiglu_forward_and_per_token_cast(x, "e4m3", 128, round_sf=True)),
            (lambda: tk_quant.reference.swiglu_forward_and_per_token_cast(x, "e4m3", 128, round_sf=True)), (x,))


@case("per_token_cast", f"bf16 {TOKENS}x7168 -> e5m6, 1x7168", package="tk_quant")
def _per_token_e5m6():
    import tk_quant

    x = torch.randn(TOKENS, 7168, device=DEVICE, dtype=torch.bfloat16)
    return ((lambda: tk_quant.per_token_cast(x, "e5m6", 7168, round_sf=True)),
            (lambda: tk_quant.reference.cast_to_e5m6(x, 7168, round_sf=True)), (x,))


@case("per_block_cast_lossless", f"e2m1 {TOKENS}x7168, 1x32 -> e4m3, 1x128", package="tk_quant")
def _lossless():
    import tk_quant

    q = tk_quant.reference.cast(torch.randn(TOKENS, 7168, device=DEVICE), "e2m1", (1, 32), round_sf=True)
    return ((lambda: tk_quant.per_block_cast_lossless(q, "e4m3", (1, 32), (1, 128))),
            (lambda: tk_quant.reference.per_block_cast_lossless(q, "e4m3", (1, 32), (1, 128))[:2]), (q,))


@case("per_channel_cast", f"bf16 {TOKENS}x7168 -> e4m3, 128x1", package="tk_quant")
def _per_channel():
    import tk_quant

    x = torch.randn(TOKENS, 7168, device=DEVICE, dtype=torch.bfloat16)
    return ((lambda: tk_quant.per_channel_cast(x, "e4m3", 128, True)),
            (lambda: tk_quant.reference.cast(x, "e4m3", (128, 1), round_sf=True)), (x,))


@case("per_channel_cast_and_transpose", f"bf16 {TOKENS // 32 * 32}x7168 -> e4m3 transposed, 32x1", package="tk_quant")
def _per_channel_transpose():
    import tk_quant

    x = torch.randn(TOKENS // 32 * 32, 7168, device=DEVICE, dtype=torch.bfloat16)

    def reference():
        out, sf = tk_quant.reference.cast(x, "e4m3", (32, 1), round_sf=True)
        return out.t().contiguous(), sf

    return (lambda: tk_quant.per_channel_cast_and_transpose(x, "e4m3", 32, True)), reference, (x,)


@case("swiglu_forward_and_per_channel_cast_and_transpose", f"bf16 {TOKENS // 32 * 32}x(2x7168) -> e4m3, 32x1",
      package="tk_quant")
def _swiglu_channel():
    import tk_quant

    x = torch.randn(TOKENS // 32 * 32, 2 * 7168, device=DEVICE, dtype=torch.bfloat16)
    args = (x, "e4m3", 32, True, True, 0.5)  # round_sf, without_transpose, clamp
    return ((lambda: tk_quant.swiglu_forward_and_per_channel_cast_and_transpose(*args)),
            (lambda: tk_quant.reference.swiglu_forward_and_per_channel_cast_and_transpose(*args)), (x,))


@case("swiglu_backward_and_per_token_cast", "MoE top-2 of 9 experts x 8 ranks, e4m3 x(2x7168), 1x128",
      package="tk_quant")
def _swiglu_backward():
    import tk_quant
    from tk_core.testing import generate_fused_mapping, generate_topk_idx

    moe = dict(num_send_tokens=TOKENS // 2, num_topk=2, num_experts=9, num_ep_ranks=8)
    idx = generate_topk_idx(moe, device=DEVICE)
    _, pos_to_token_topk, token_topk_to_pos = generate_fused_mapping(idx, moe["num_experts"], 128)
    rows = pos_to_token_topk.shape[0]
    x = tk_quant.per_token_cast(torch.randn(rows, 2 * 7168, device=DEVICE, dtype=torch.bfloat16), "e4m3", 128)
    grad = torch.randn(rows, 7168, device=DEVICE, dtype=torch.bfloat16)
    weight = torch.rand(idx.shape[0], 2, device=DEVICE)
    args = (x, grad, weight, pos_to_token_topk, token_topk_to_pos, 128, True, 0.5)
    return ((lambda: tk_quant.swiglu_backward_and_per_token_cast(*args)),
            (lambda: tk_quant.reference.swiglu_backward_and_per_token_cast(*args)), (x, grad, weight))


# --- tk-engram ------------------------------------------------------------------------------------


def _engram_inputs(tokens: int, hc: int = 4, hidden: int = 7168):
    x = torch.randn(tokens, hc, hidden, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(tokens, hc, hidden, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn(tokens, hidden, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(hc, hidden, device=DEVICE).abs() + 0.5
    return x, k, v, w


@case("engram_gate_fwd", f"bf16 {TOKENS}x4x7168", exact=False, package="tk_engram")
def _engram_fwd():
    import tk_engram

    x, k, v, w = _engram_inputs(TOKENS)
    return ((lambda: tk_engram.engram_gate_fwd(x, k, v, w, 1e-6, 1e-6)),
            (lambda: tk_engram.reference.engram_gate_fwd_ref(x, k, v, w, 1e-6, 1e-6)), (x, k, v, w))


@case("engram_gate_bwd", f"bf16 {TOKENS}x4x7168", exact=False, package="tk_engram")
def _engram_bwd():
    import tk_engram

    x, k, v, w = _engram_inputs(TOKENS)
    _, dot, score, rx, rk = tk_engram.reference.engram_gate_fwd_ref(x, k, v, w, 1e-6, 1e-6)
    g = torch.randn_like(x)
    args = (g, x, k, v, w, dot, score, rx, rk, 1e-6)
    return ((lambda: tk_engram.engram_gate_bwd(*args)[:3]),
            (lambda: tk_engram.reference.engram_gate_bwd_ref(*args)[:3]), (g, x, k, v))


GATE_CONV_SHAPE = (2, 4096, 4096) if GPU else (1, 512, 1024)  # M, T, d
DECODE_SHAPE = (1, 2048, 4096)  # batch, d_mem, d


def _gate_conv_weights(d: int):
    """rms_w_h, rms_w_v (d,) and 4 conv taps (4, d), bf16."""
    rw_h, rw_v = ((torch.rand(d, device=DEVICE) + 0.5).to(torch.bfloat16) for _ in range(2))
    return rw_h, rw_v, (torch.randn(4, d, device=DEVICE) * 0.5).to(torch.bfloat16)


def _gate_conv_inputs():
    m, t, d = GATE_CONV_SHAPE
    h, k, v = (torch.randn(m, t, d, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    return (h, k, v, *_gate_conv_weights(d))


@case("engram_gate_conv_fwd", "bf16 M={} T={} d={}, 4 taps".format(*GATE_CONV_SHAPE), exact=False, package="tk_engram")
def _gate_conv():
    import tk_engram

    x = _gate_conv_inputs()  # compared and counted: Y, vhat and the four saved statistics
    return ((lambda: tk_engram.engram_gate_conv_fwd(*x)[:6]),
            (lambda: tk_engram.reference.gate_conv_fwd_ref(*x)[:6]), x[:3])


@case("engram_gate_conv_bwd", "bf16 M={} T={} d={}, 4 taps".format(*GATE_CONV_SHAPE), exact=False, tol=1e-4,
      package="tk_engram")
def _gate_conv_bwd():
    import tk_engram

    x = _gate_conv_inputs()
    stats = tk_engram.reference.gate_conv_fwd_ref(*x)[2:6]  # alpha, rrms_h, rrms_k, rrms_v (float32)
    dy = torch.randn(x[0].shape, device=DEVICE, dtype=torch.bfloat16)
    return ((lambda: tk_engram.engram_gate_conv_bwd(dy, *x, *stats)),
            (lambda: tk_engram.reference.gate_conv_bwd_ref(dy, *x, *stats)), (dy, *x[:3], *stats))


@case("engram_decode_step", "bf16 B={} d_mem={} d={}, 4 taps".format(*DECODE_SHAPE), exact=False, package="tk_engram")
def _decode():
    import tk_engram

    b, d_mem, d = DECODE_SHAPE
    e = torch.randn(b, d_mem, device=DEVICE, dtype=torch.bfloat16)
    h = torch.randn(b, d, device=DEVICE, dtype=torch.bfloat16)
    w_k, w_v = ((torch.randn(d_mem, d, device=DEVICE) / d_mem**0.5).to(torch.bfloat16) for _ in range(2))
    weights = _gate_conv_weights(d)
    state = torch.randn(b, 4, d, device=DEVICE, dtype=torch.bfloat16)  # the ring of n for 4 positions
    pos = torch.full((b,), 5, device=DEVICE, dtype=torch.int32)
    ours, theirs = state.clone(), state.clone()  # the step writes n into its ring slot in place
    return ((lambda: (tk_engram.engram_decode_step(e, h, ours, pos, w_k, w_v, *weights), ours)),
            (lambda: (tk_engram.reference.decode_step_ref(e, h, theirs, pos, w_k, w_v, *weights), theirs)),
            (e, h, w_k, w_v))


def main() -> int:
    copy_gbps = None
    if GPU:
        from tk_core.testing.bench import copy_bandwidth_gbps

        copy_gbps = copy_bandwidth_gbps()
        print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_gbps:.0f} GB/s (1 GiB, read + write)")
    else:
        print("no CUDA device: running the plain-PyTorch references on the CPU")
    rows, failures = [], 0
    for op, shape, exact, tol, package, build in CASES:
        if importlib.util.find_spec(package) is None:
            continue
        run, reference, inputs = build()
        got, want = flatten(run()), flatten(reference())
        ok = len(got) == len(want) and all(same(a, b, exact, tol) for a, b in zip(got, want))
        failures += not ok
        us = timed_us(run)
        nbytes = count_bytes(inputs, got)
        gbps = nbytes / us / 1e3
        pct = f"{100 * gbps / copy_gbps:5.1f}%" if copy_gbps else "    -"
        rows.append((op, shape, DEVICE, f"{us:10.1f}", f"{gbps:8.1f}", pct, "ok" if ok else "MISMATCH"))
    header = ("op", "shape", "device", "time (us)", "GB/s", "% copy", "check")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    print(f"{len(rows) - failures} of {len(rows)} ops match their reference")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
