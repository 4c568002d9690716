"""Input validation for public ops.

Every failure reads ``"<op>: <arg> must be <expected>, got <actual>"`` so that a user sees which call,
which argument and what was wrong. Type problems raise ``TypeError``; value, shape, device and layout
problems raise ``ValueError``. The helpers are cheap enough for the host path of every op.
"""

import math
import numbers
from collections.abc import Iterable, Sequence
from typing import NoReturn

import torch

_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.int32: "int32",
    torch.int64: "int64",
}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def fail(op: str, arg: str, expected: str, got, exc: type[Exception] = ValueError) -> NoReturn:
    """Raises ``exc`` with the project's message format."""
    raise exc(f"{op}: {arg} must be {expected}, got {got}")


def check_tensor(op: str, arg: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        fail(op, arg, "a torch.Tensor", type(x).__name__, TypeError)


def check_dtype(op: str, arg: str, x: torch.Tensor, allowed: torch.dtype | Iterable[torch.dtype]) -> None:
    check_tensor(op, arg, x)
    allowed = (allowed,) if isinstance(allowed, torch.dtype) else tuple(allowed)
    if x.dtype not in allowed:
        names = " or ".join(dtype_name(d) for d in allowed)
        fail(op, arg, f"of dtype {names}", dtype_name(x.dtype), TypeError)


def check_ndim(op: str, arg: str, x: torch.Tensor, ndim: int) -> None:
    if x.dim() != ndim:
        fail(op, arg, f"{ndim}-D", f"shape {tuple(x.shape)}")


def check_shape(op: str, arg: str, x: torch.Tensor, shape: Sequence[int | None]) -> None:
    """Checks ``x.shape`` against ``shape``; ``None`` entries match any size."""
    if x.dim() != len(shape) or any(e is not None and e != s for e, s in zip(shape, x.shape)):
        want = "(" + ", ".join("*" if e is None else str(e) for e in shape) + ")"
        fail(op, arg, f"of shape {want}", f"shape {tuple(x.shape)}")


def check_same_device(op: str, arg: str, x: torch.Tensor, device: torch.device) -> None:
    if x.device != device:
        fail(op, arg, f"on device {device}", f"device {x.device}")


def check_inner_contiguous(op: str, arg: str, x: torch.Tensor) -> None:
    if x.dim() and x.shape[-1] > 1 and x.stride(-1) != 1:
        fail(op, arg, "unit-stride in its last dimension", f"strides {tuple(x.stride())}")


def check_contiguous(op: str, arg: str, x: torch.Tensor) -> None:
    if not x.is_contiguous():
        fail(op, arg, "contiguous", f"shape {tuple(x.shape)} with strides {tuple(x.stride())}")


def _byte_span(x: torch.Tensor) -> tuple[int, int]:
    """The first and one-past-last byte addresses that ``x``'s elements occupy (non-negative strides)."""
    start = x.data_ptr()
    last = sum((n - 1) * s for n, s in zip(x.shape, x.stride()))
    return start, start + (last + 1) * x.element_size()


def check_disjoint(op: str, arg: str, x: torch.Tensor, other_arg: str, other: torch.Tensor) -> None:
    """Fails when the output buffer ``x`` shares memory with the input ``other``: a kernel would read elements it
    has already overwritten. Compares the byte ranges the two span, as torch's own ``out=`` overlap check does.
    Skipped while torch.compile traces (its tensors have no memory; the compiled graph passes fresh buffers)."""
    if torch.compiler.is_compiling() or not x.numel() or not other.numel():
        return
    (a0, a1), (b0, b1) = _byte_span(x), _byte_span(other)
    if a0 < b1 and b0 < a1:
        fail(op, arg, f"memory disjoint from {other_arg}", f"a tensor whose bytes [{a0:#x}, {a1:#x}) overlap "
             f"{other_arg}'s [{b0:#x}, {b1:#x})")


def check_divisible(op: str, arg: str, value: int, divisor: int) -> None:
    if value % divisor:
        fail(op, arg, f"a multiple of {divisor}", value)


def _same_kind(value, choice) -> bool:
    """Whether ``value`` may stand for ``choice``: a bool only for a bool, an integral number (not a bool, not a
    float equal to it) for an int, never a tensor; other kinds compare by equality alone."""
    if isinstance(value, torch.Tensor):
        return False
    if isinstance(choice, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(choice, bool)
    if isinstance(choice, numbers.Integral):
        return isinstance(value, numbers.Integral)
    return True


def check_one_of(op: str, arg: str, value, choices: Iterable) -> None:
    """``value`` equals one of ``choices`` and is of its kind (``128.0`` or ``True`` is not the int ``128`` or ``1``:
    ``TypeError``); an unhashable or otherwise incomparable value is a ``TypeError`` too."""
    choices = tuple(choices)
    try:
        match = [c for c in choices if value == c]
    except (TypeError, RuntimeError):  # e.g. a tensor, whose == does not give one bool
        fail(op, arg, f"one of {choices}", repr(value), TypeError)
    if not match:
        fail(op, arg, f"one of {choices}", repr(value),
             TypeError if choices and not any(_same_kind(value, c) for c in choices) else ValueError)
    if not any(_same_kind(value, c) for c in match):
        fail(op, arg, f"one of {choices}", f"{value!r} ({type(value).__name__})", TypeError)


def check_bool(op: str, arg: str, value) -> None:
    """A flag: a Python bool (a string like ``"False"`` or a number is not read by its truthiness)."""
    if not isinstance(value, bool):
        fail(op, arg, "a bool", f"{value!r} ({type(value).__name__})", TypeError)


MAX_GRID_YZ = 65535  # CTAs along a grid's y or z dimension


def check_grid_extent(op: str, arg: str, value: int, unit: str = "", got=None) -> None:
    """A size that becomes a grid's y or z dimension: at most ``MAX_GRID_YZ`` (``unit`` names what is counted,
    ``got`` what the message shows; default the value)."""
    if value > MAX_GRID_YZ:
        fail(op, arg, f"at most {MAX_GRID_YZ}" + (f" {unit}" if unit else ""), value if got is None else got)


def check_int(op: str, arg: str, value, minimum: int, expected: str) -> None:
    """An int (not a bool) >= ``minimum``; ``expected`` is the message's wording of the rule."""
    wrong_type = not isinstance(value, int) or isinstance(value, bool)
    if wrong_type or value < minimum:
        fail(op, arg, expected, repr(value), TypeError if wrong_type else ValueError)


def check_positive_int(op: str, arg: str, value, expected: str = "a positive int") -> None:
    check_int(op, arg, value, 1, expected)


def check_float(op: str, arg: str, value, minimum: float = 0.0, strict: bool = False, kind: str = "a float",
                expected: str | None = None) -> float:
    """``value`` as a float: a real number (not a bool; else ``TypeError``, "must be ``kind``"), finite and ``>=
    minimum`` (``> minimum`` with ``strict``; else ``ValueError``, "must be ``expected``", by default "a finite
    float >= minimum"). Comparisons only (NaN fails them): under torch.compile a float argument may be symbolic,
    and ``math.isfinite`` of a SymFloat breaks the graph."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        fail(op, arg, kind, type(value).__name__, TypeError)
    value = float(value)
    above = minimum < value if strict else minimum <= value
    if not (above and value < math.inf):
        fail(op, arg, expected or f"a finite float {'>' if strict else '>='} {minimum:g}", value)
    return value
