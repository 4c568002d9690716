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


def case(op: str, shape: str, exact: bool = True, package: str = "tk_core"):
    """Registers a demo case: ``build()`` returns ``(run, reference)``, two callables returning tensors."""

    def register(build):
        CASES.append((op, shape, exact, package, build))
        return build

    return register


def flatten(result) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    return [t for item in result if item is not None for t in flatten(item)]


def same(a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    if exact:
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.contiguous().flatten().view(torch.uint8), b.contiguous().flatten().view(torch.uint8))
    return calc_diff(a.float(), b.float()) < 1e-5


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


GATE_CONV_SHAPE = (2, 4096, 4096) if GPU else (1, 512, 1024)


@case("engram_gate_conv_fwd", "bf16 M={} T={} d={}, 4 taps".format(*GATE_CONV_SHAPE), exact=False, package="tk_engram")
def _gate_conv():
    import tk_engram

    m, t, d = GATE_CONV_SHAPE
    h, k, v = (torch.randn(m, t, d, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    rw_h, rw_v = ((torch.rand(d, device=DEVICE) + 0.5).to(torch.bfloat16) for _ in range(2))
    conv = (torch.randn(4, d, device=DEVICE) * 0.5).to(torch.bfloat16)
    return ((lambda: tk_engram.engram_gate_conv_fwd(h, k, v, rw_h, rw_v, conv)[0]),
            (lambda: tk_engram.reference.gate_conv_fwd_ref(h, k, v, rw_h, rw_v, conv)[0]), (h, k, v))


def main() -> int:
    copy_gbps = None
    if GPU:
        from tk_core.testing.bench import copy_bandwidth_gbps

        copy_gbps = copy_bandwidth_gbps()
        print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_gbps:.0f} GB/s (1 GiB, read + write)")
    else:
        print("no CUDA device: running the plain-PyTorch references on the CPU")
    rows, failures = [], 0
    for op, shape, exact, package, build in CASES:
        if importlib.util.find_spec(package) is None:
            continue
        run, reference, inputs = build()
        got, want = flatten(run()), flatten(reference())
        ok = len(got) == len(want) and all(same(a, b, exact) for a, b in zip(got, want))
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
