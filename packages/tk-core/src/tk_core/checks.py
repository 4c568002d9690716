"""Input validation for public ops.

Every failure reads ``"<op>: <arg> must be <expected>, got <actual>"`` so that a user sees which call,
which argument and what was wrong. Type problems raise ``TypeError``; value, shape, device and layout
problems raise ``ValueError``. The helpers are cheap enough for the host path of every op.
"""

from collections.abc import Iterable, Sequence

import torch

from .formats import dtype_name


def fail(op: str, arg: str, expected: str, got, exc: type[Exception] = ValueError):
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


def check_divisible(op: str, arg: str, value: int, divisor: int) -> None:
    if value % divisor:
        fail(op, arg, f"a multiple of {divisor}", value)


def check_one_of(op: str, arg: str, value, choices: Iterable) -> None:
    choices = tuple(choices)
    if value not in choices:
        fail(op, arg, f"one of {choices}", repr(value))


MAX_GRID_YZ = 65535  # CTAs along a grid's y or z dimension


def check_grid_extent(op: str, arg: str, value: int, unit: str = "", got=None) -> None:
    """A size that becomes a grid's y or z dimension: at most ``MAX_GRID_YZ`` (``unit`` names what is counted,
    ``got`` what the message shows; default the value)."""
    if value > MAX_GRID_YZ:
        fail(op, arg, f"at most {MAX_GRID_YZ}" + (f" {unit}" if unit else ""), value if got is None else got)


def check_positive_int(op: str, arg: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        fail(op, arg, "a positive int", repr(value), TypeError if not isinstance(value, int) else ValueError)
