"""Numeric comparison helpers for tests."""

import math
from fractions import Fraction

import torch

from ..formats import reinterpret


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """``sum((x-y)^2) / sum(x^2 + y^2)`` in float64: 0 for identical tensors, at most 2.

    Computed directly (not as ``1 - similarity``), so tiny differences do not cancel. Returns 0.0
    when both tensors are all zero. The shapes must be equal (a broadcast would let a truncated output pass).
    """
    if x.shape != y.shape:
        raise AssertionError(f"calc_diff: shape mismatch: {tuple(x.shape)} vs {tuple(y.shape)}")
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum().item()
    if denom == 0.0:
        return 0.0
    return ((x - y) ** 2).sum().item() / denom


def round_f32(q: Fraction) -> Fraction:
    """``q`` rounded to the nearest float32 (ties to even), in exact arithmetic; normal range. For checks of
    device sequences step by step (each step one IEEE rounding)."""
    if q == 0:
        return q
    e = math.floor(math.log2(abs(q)))
    e += (Fraction(2) ** (e + 1) <= abs(q)) - (Fraction(2) ** e > abs(q))
    ulp = Fraction(2) ** (e - 23)
    m = abs(q) / ulp
    k = math.floor(m)
    if m - k > Fraction(1, 2) or (m - k == Fraction(1, 2) and k % 2):
        k += 1
    return (1 if q > 0 else -1) * k * ulp


def _byte_view(x: torch.Tensor) -> torch.Tensor:
    return reinterpret(x, torch.uint8).flatten() if x.dim() else x.reshape(1).view(torch.uint8)


def assert_equal(x: torch.Tensor, y: torch.Tensor, check_dtype=True, check_shape=True, check_stride=False, max_report=8):
    """Asserts bit equality (NaN equals NaN with the same bits, +0 differs from -0).

    On failure the message gives the number of mismatching elements and the first ``max_report`` of them
    with their indices and both values. The mismatch report is only built on failure.
    """
    if check_dtype:
        assert x.dtype == y.dtype, f"dtype mismatch: {x.dtype} vs {y.dtype}"
    if check_shape:
        assert x.shape == y.shape, f"shape mismatch: {tuple(x.shape)} vs {tuple(y.shape)}"
    if check_stride and x.numel():
        assert x.stride() == y.stride(), f"stride mismatch: {x.stride()} vs {y.stride()}"
    assert x.device == y.device, f"device mismatch: {x.device} vs {y.device}"
    nbytes = (x.numel() * x.element_size(), y.numel() * y.element_size())
    assert nbytes[0] == nbytes[1], f"size mismatch: {nbytes[0]} vs {nbytes[1]} bytes"
    if x.numel() == 0 or torch.equal(_byte_view(x), _byte_view(y)):
        return
    elem = x.element_size()
    xb = _byte_view(x).view(-1, elem) if elem > 1 else _byte_view(x).view(-1, 1)
    yb = _byte_view(y).view(-1, elem) if elem > 1 else _byte_view(y).view(-1, 1)
    bad = (xb != yb).any(dim=1).nonzero().flatten()
    lines = []
    shape = tuple(x.shape)
    xf, yf = x.contiguous().flatten(), y.contiguous().flatten()
    for flat in bad[:max_report].tolist():
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), shape)) if shape else ()
        lines.append(f"  at {idx}: {_show(xf[flat])} vs {_show(yf[flat])}")
    raise AssertionError(f"{bad.numel()} of {x.numel()} elements differ; first mismatches:\n" + "\n".join(lines))


def _show(v: torch.Tensor) -> str:
    if v.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return f"{v.float().item()!r} (0x{v.view(torch.uint8).item():02x})"
    return repr(v.item())


def check_bias(x: torch.Tensor, ref: torch.Tensor) -> None:
    """Detects systematic rounding bias (e.g. truncation instead of RNE).

    ``r = (#(x < ref) + #(x == ref)/2) / n`` must satisfy ``|r - 0.5| < 10/sqrt(n)``.
    """
    assert x.shape == ref.shape, f"shape mismatch: {tuple(x.shape)} vs {tuple(ref.shape)}"
    n = x.numel()
    if n == 0:
        return
    x, ref = x.double().flatten(), ref.double().flatten()
    r = ((x < ref).sum().item() + (x == ref).sum().item() / 2) / n
    bound = 10 / math.sqrt(n)
    assert abs(r - 0.5) < bound, f"rounding bias: fraction below reference {r:.6f}, allowed 0.5 +- {bound:.6f}"


def count_bytes(*tensors) -> int:
    """Sum of ``numel * element_size`` over tensors, recursing into tuples and lists, skipping None."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        if isinstance(t, (tuple, list)):
            total += count_bytes(*t)
        else:
            total += t.numel() * t.element_size()
    return total


def opcheck(op, args: tuple, kwargs: dict | None = None):
    """``torch.library.opcheck`` of a registered op.

    torch's ``test_schema`` cannot run ops with float8 tensor arguments (it multiplies tensors, which
    torch does not implement for float8), so for those it is left out; the fake-tensor, autograd
    registration and AOT-dispatch checks still run.
    """
    tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if any(t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for t in tensors):
        utils = utils[1:]
    return torch.library.opcheck(op, args, kwargs, test_utils=utils)


def capture_cuda_graph(fn):
    """Captures one call of ``fn()`` into a CUDA graph and returns ``(replay, outputs)``.

    ``fn`` runs once first on a side stream (TileLang compiles and torch's allocator warms up outside the
    capture, as CUDA graphs require); ``outputs`` are the captured call's results, static buffers that each
    ``replay()`` (graph replay, then a device synchronize) rewrites from the inputs' current contents.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()

    def replay():
        graph.replay()
        torch.cuda.synchronize()

    return replay, outputs
