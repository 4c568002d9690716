"""torch.library glue: every package registers its device ops the same way.

``device_op`` registers a CUDA implementation as a ``torch.library`` custom op with a fake (meta)
implementation, so that ``torch.compile(fullgraph=True)`` traces it and CUDA graphs capture it. In eager
mode the returned object calls the implementation directly, which keeps the host path short (the
dispatcher round trip of a custom op costs several microseconds); while ``torch.compile`` traces, it
goes through the registered op.
"""

from collections.abc import Callable, Sequence

import torch


class DeviceOp:
    """A registered custom op; calling it runs the implementation directly unless compiling."""

    def __init__(self, qualname: str, impl: Callable, mutates_args: Sequence[str], fake: Callable | None):
        self.qualname = qualname
        self.impl = impl
        self.op = torch.library.custom_op(qualname, impl, mutates_args=tuple(mutates_args), device_types="cuda")
        if fake is not None:
            self.op.register_fake(fake)
        elif mutates_args:
            self.op.register_fake(lambda *args, **kwargs: None)

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return self.op(*args, **kwargs)
        return self.impl(*args, **kwargs)


def device_op(qualname: str, *, mutates_args: Sequence[str] = (), fake: Callable | None = None):
    """Decorator: registers ``fn`` as the CUDA op ``qualname`` (e.g. ``"tk_transpose::transpose_"``).

    ``fn`` needs type annotations (they give the schema). Ops that write into preallocated outputs
    list those arguments in ``mutates_args`` and return None; their fake implementation is a no-op.
    Ops that return new tensors pass ``fake``, which allocates outputs of the right shape.
    """

    def wrap(fn: Callable) -> DeviceOp:
        return DeviceOp(qualname, fn, mutates_args, fake)

    return wrap
