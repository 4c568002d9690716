"""Process-wide runtime settings shared by every tk package.

Each setting has a getter and a setter; ``reset()`` restores the defaults. Settings are read on the
host path of an op, so they are plain module state rather than environment look-ups.

- SM count override (``set_num_sms``): persistent kernels size their grid from ``get_num_sms()``.
- PDL switch (``set_pdl``): whether kernels may use programmatic dependent launch. No kernel of these packages
  uses it yet (TileLang 0.1.15 launches through its tvm_ffi runtime, which sets no PDL launch attribute), so
  turning it on warns that it has no effect; the setting exists for code written against TileKernels.
- Token alignment (``set_token_alignment``): the row alignment of expert segments in MoE layouts.
- Deterministic mode (``set_deterministic``): ops with a faster non-deterministic path (float atomics)
  take their deterministic path when it is on. Ops of this project are deterministic by default.
- amax clamp floors per output format (``set_amax_clamp``): the lower bound applied to a block's amax
  before the scale is derived, so that an all-zero block still gets a positive scale.
"""

import functools
import math
import warnings
from typing import NoReturn

import torch

from . import checks

DEFAULT_AMAX_CLAMP = {
    "e4m3": 1e-4,
    "e2m1": 6.0 * 2.0**-126,
    "e5m6": 1e-4,
    # 16-element blocks with e4m3 scales (NVFP4 style): the scale itself must stay e4m3-normal.
    "e2m1_e4m3sf": 6.0 * 2.0**-9,
    "e4m3_e4m3sf": 448.0 * 2.0**-9,
}

_num_sms_override: int | None = None
_pdl = False
_token_alignment = 128
_deterministic = True
_amax_clamp = dict(DEFAULT_AMAX_CLAMP)


OP = "tk_core.config"


def _fail(arg: str, expected: str, got, exc: type[Exception] = ValueError) -> NoReturn:
    checks.fail(OP, arg, expected, repr(got), exc)


@functools.cache
def get_device_num_sms(device_index: int | None = None) -> int:
    """Multiprocessor count of a CUDA device (the current one by default)."""
    if device_index is None:
        device_index = torch.cuda.current_device()
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def set_num_sms(num_sms: int | None) -> None:
    """Limits persistent kernels to ``num_sms`` multiprocessors; ``None`` removes the limit."""
    global _num_sms_override
    if num_sms is not None:
        checks.check_positive_int(OP, "num_sms", num_sms, "a positive int or None")
        if torch.cuda.is_available() and num_sms > get_device_num_sms():
            _fail("num_sms", f"at most the device's {get_device_num_sms()} SMs", num_sms)
    _num_sms_override = num_sms


def get_num_sms(device_index: int | None = None) -> int:
    """The SM count persistent kernels use: the override if set, else the device's count."""
    if _num_sms_override is not None:
        return _num_sms_override
    return get_device_num_sms(device_index)


def set_pdl(enabled: bool) -> None:
    """Records the PDL switch; turning it on warns, since no kernel launches with PDL yet (module docstring)."""
    global _pdl
    checks.check_bool(OP, "enabled", enabled)
    _pdl = enabled
    if _pdl:
        warnings.warn(
            "tk_core.config.set_pdl(True) has no effect: no tk kernel launches with programmatic dependent launch",
            UserWarning,
            stacklevel=2,
        )


def get_pdl() -> bool:
    return _pdl


def set_token_alignment(alignment: int) -> None:
    global _token_alignment
    checks.check_positive_int(OP, "alignment", alignment, "a positive power of two")
    if alignment & (alignment - 1):
        _fail("alignment", "a positive power of two", alignment)
    _token_alignment = alignment


def get_token_alignment() -> int:
    return _token_alignment


def set_deterministic(enabled: bool) -> None:
    global _deterministic
    checks.check_bool(OP, "enabled", enabled)
    _deterministic = enabled


def is_deterministic() -> bool:
    return _deterministic


def set_amax_clamp(fmt: str, value: float) -> None:
    """Sets the amax floor used when quantizing to ``fmt`` (a key of ``DEFAULT_AMAX_CLAMP``)."""
    if not isinstance(fmt, str) or fmt not in _amax_clamp:
        _fail("fmt", f"one of {sorted(_amax_clamp)}", fmt)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        _fail("value", "a finite float > 0", value, TypeError)
    if not 0.0 < value < math.inf:  # inf would give sf = inf and sf_inv = 0
        _fail("value", "a finite float > 0", value)
    _amax_clamp[fmt] = float(value)


def get_amax_clamp(fmt: str) -> float:
    if not isinstance(fmt, str) or fmt not in _amax_clamp:
        _fail("fmt", f"one of {sorted(_amax_clamp)}", fmt)
    return _amax_clamp[fmt]


def reset() -> None:
    """Restores every setting to its default."""
    global _num_sms_override, _pdl, _token_alignment, _deterministic
    _num_sms_override, _pdl, _token_alignment, _deterministic = None, False, 128, True
    _amax_clamp.clear()
    _amax_clamp.update(DEFAULT_AMAX_CLAMP)
