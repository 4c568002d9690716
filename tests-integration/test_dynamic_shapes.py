"""The public ops under ``torch.compile(dynamic=True, fullgraph=True)``: one graph serves every token count.

The kernels take the token count as a runtime argument; this checks that the Python around them (the input
checks, the output allocation, the fake implementations of the device ops) keeps it symbolic, so a model compiled
with dynamic shapes does not recompile (or fail) per batch. Each op runs at three token counts; the compiled
results must equal the eager ones bit for bit, and dynamo must have built exactly one frame.
"""

import pytest
import torch

import tk_engram
import tk_quant
import tk_transpose
from tk_core.testing import assert_equal

pytestmark = pytest.mark.gpu

# Multiples of 128 (the per-channel and per-block token blocks). Not 0 or 1, which dynamo specialises, nor equal to
# another dimension of the inputs, which duck sizing would tie to the token count.
TOKENS = (384, 640, 1152)
HIDDEN = 512


def _bf16(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


def _engram_gate_inputs(t):
    hc, h = 4, 256
    return (_bf16(t, hc, h), _bf16(t, hc, h), _bf16(t, h), torch.rand(hc, h, device="cuda").bfloat16() + 0.5,
            torch.rand(hc, h, device="cuda").bfloat16() + 0.5)


def _gate_conv_inputs(t):
    m, d = 2, 256
    return (_bf16(m, t, d), _bf16(m, t, d), _bf16(m, t, d), _bf16(d).abs() + 0.5, _bf16(d).abs() + 0.5,
            _bf16(4, d) * 0.5)


# name -> (inputs for t tokens, op)
CASES = {
    "per_token_cast": (lambda t: (_bf16(t, HIDDEN),), lambda x: tk_quant.per_token_cast(x, "e4m3", 128)),
    "per_token_cast_e2m1_packed_sf": (
        lambda t: (_bf16(t, HIDDEN),),
        lambda x: tk_quant.per_token_cast(x, "e2m1", 32, None, True, True, True),
    ),
    "per_token_cast_back": (
        lambda t: (_bf16(t, HIDDEN),),
        lambda x: tk_quant.per_token_cast_back(tk_quant.per_token_cast(x, "e4m3", 128), "bf16", 128),
    ),
    "per_block_cast": (lambda t: (_bf16(t, HIDDEN),), lambda x: tk_quant.per_block_cast(x, "e4m3", (128, 128), True, True, True)),
    "per_channel_cast": (lambda t: (_bf16(t, HIDDEN),), lambda x: tk_quant.per_channel_cast(x, "e4m3", 128, True)),
    "per_channel_cast_and_transpose": (
        lambda t: (_bf16(t, HIDDEN),),
        lambda x: tk_quant.per_channel_cast_and_transpose(x, "e4m3", 32, True),
    ),
    "cast": (lambda t: (_bf16(t, HIDDEN),), lambda x: tk_quant.cast(x, torch.float8_e4m3fn)),
    "swiglu_forward_and_per_token_cast": (
        lambda t: (_bf16(t, 2 * HIDDEN),),
        lambda x: tk_quant.swiglu_forward_and_per_token_cast(x, "e4m3", 128, round_sf=True, swiglu_clamp_value=0.5),
    ),
    "swiglu_forward_and_per_channel_cast_and_transpose": (
        lambda t: (_bf16(t, 2 * HIDDEN),),
        lambda x: tk_quant.swiglu_forward_and_per_channel_cast_and_transpose(x, "e4m3", 32, True),
    ),
    "transpose": (lambda t: (_bf16(t, HIDDEN),), tk_transpose.transpose),
    "batched_transpose": (lambda t: (_bf16(3, t, HIDDEN),), tk_transpose.batched_transpose),
    "engram_gate": (_engram_gate_inputs, lambda *a: tk_engram.engram_gate(*a, 1e-6, 1e-6)),
    "engram_gate_conv_fwd": (_gate_conv_inputs, lambda *a: tk_engram.engram_gate_conv_fwd(*a)),
}


def _flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [] if out is None else [t for o in out for t in _flat(o)]


class GraphRecorder:
    """A torch.compile backend (inductor underneath) that records each graph, the token count of the call that
    compiled it, and the code it was traced from."""

    def __init__(self):
        self.graphs = []
        self.tokens = None

    def __call__(self, gm, example_inputs):
        import inspect
        import types

        from torch._dynamo.backends.registry import lookup_backend

        code = next((f.frame.f_locals["code"] for f in inspect.stack(0)
                     if isinstance(f.frame.f_locals.get("code"), types.CodeType)), None)
        where = "?" if code is None else f"{code.co_name} ({code.co_filename}:{code.co_firstlineno})"
        self.graphs.append((self.tokens, where, gm))
        return lookup_backend("inductor")(gm, example_inputs)


@pytest.mark.parametrize("name", list(CASES))
def test_one_graph_for_every_token_count(name):
    """Every graph is built on the first call, and one of them holds all the work. (For most ops dynamo hands
    the backend an empty graph as well, on the same first call, for the same frame; it costs nothing per call.)"""
    make_inputs, op = CASES[name]
    torch._dynamo.reset()
    recorder = GraphRecorder()
    compiled = torch.compile(op, backend=recorder, dynamic=True, fullgraph=True)
    for t in TOKENS:
        args = make_inputs(t)
        recorder.tokens = t
        got = _flat(compiled(*args))
        want = _flat(op(*args))
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_equal(g, w)
    working = [g for g in recorder.graphs if any(n.op.startswith("call") for n in g[2].graph.nodes)]
    if len(working) != 1 or any(t != TOKENS[0] for t, _, _ in recorder.graphs):
        detail = "\n".join(f"graph {i}, compiled at {t} tokens from {where}:\n{gm.code[:1500]}"
                           for i, (t, where, gm) in enumerate(recorder.graphs))
        pytest.fail(f"{name}: {len(recorder.graphs)} graphs for token counts {TOKENS}\n{detail}")
