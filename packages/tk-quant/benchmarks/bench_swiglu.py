"""Benchmarks of the fused SwiGLU + quantization ops, one case per anchor line of
shared/spec/anchor-figures.md, each with the kernel ("tk"), the eager reference ("torch") and
torch.compile(reference) ("torch.compile").

MoE layouts come from ``generate_topk_idx`` (4001 tokens per rank, 8 ranks, 9 experts per rank, top-2) and
the expert-major mapping of moe-engram-mhc.md §4.0 (segments aligned to 16 rows for the forward, to
``num_per_channels`` for the backward); ``num_tokens`` is the routed token count, as the anchor records it.

Bytes as the anchor counts them:
- ``swiglu_forward_and_per_token_cast``: x + out + sf (the clamp-count variant, timed with clamp 0.5, also
  counts; the maps are not counted);
- ``swiglu_forward_and_per_channel_cast_and_transpose``: x + out + sf;
- ``swiglu_backward_and_per_token_cast``: every input and output: x (data + sf), grad, weights, both maps,
  out, the fp8 gradient (data + sf), x_grad, weight_grad.
"""

import pytest
import torch

import tk_quant
from tk_core.testing import count_bytes, generate_fused_mapping, generate_topk_idx
from tk_core.testing.plugin import seed_for
from tk_quant import reference

IMPLS = ["tk", "torch", "torch.compile"]
MOE = dict(num_send_tokens=4001, num_topk=2, num_experts=9, num_ep_ranks=8)


def moe_inputs(hidden: int, alignment: int):
    """One routing and one input per ``(hidden, alignment)``, whatever the test id: the "tk", "torch" and
    "torch.compile" rows of a case (and the clamp / pos_to_expert variants) time the same rows."""
    torch.manual_seed(seed_for(f"bench_swiglu.moe_inputs[{hidden},{alignment}]"))
    idx = generate_topk_idx(MOE, device="cuda")
    pe, ptt, ttp = generate_fused_mapping(idx, MOE["num_experts"], alignment)
    x = torch.zeros((pe.numel(), 2 * hidden), dtype=torch.bfloat16, device="cuda")
    real = ptt >= 0
    x[real] = torch.randn(idx.shape[0], 2 * hidden, device="cuda").bfloat16()[ptt[real].long() // MOE["num_topk"]]
    return idx, pe, ptt, ttp, x


def _fns(tk_fn, ref_fn, *args):
    compiled = torch.compile(ref_fn)
    return {"tk": lambda: tk_fn(*args), "torch": lambda: ref_fn(*args), "torch.compile": lambda: compiled(*args)}


@pytest.mark.benchmark
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("clamp", [None, 0.5])
@pytest.mark.parametrize("enable_pos_to_expert", [True, False])
def test_bench_swiglu_forward_and_per_token_cast(gpu_benchmark, impl, clamp, enable_pos_to_expert):
    h, bk = 3584, 128
    idx, pe, ptt, ttp, x = moe_inputs(h, 16)
    cnt = torch.zeros(3, dtype=torch.int64, device="cuda") if clamp is not None else None
    pe_arg = pe if enable_pos_to_expert else None
    args = (x, "e4m3", bk, None, None, pe_arg, True, True, True, clamp, cnt)
    fns = _fns(tk_quant.swiglu_forward_and_per_token_cast, reference.swiglu_forward_and_per_token_cast, *args)
    out, sf = tk_quant.swiglu_forward_and_per_token_cast(*args)
    gpu_benchmark(
        fns[impl], kernel="swiglu_forward_and_per_token_cast", impl=impl, bytes=count_bytes(x, out, sf),
        enable_pos_to_expert=enable_pos_to_expert, hidden=h, num_ep_ranks=8, num_experts=9, num_per_channels=bk,
        num_tokens=idx.shape[0], num_topk=2, round_sf=True, swiglu_clamp_value=clamp, use_packed_ue8m0=True,
        use_tma_aligned_col_major_sf=True, with_weights=False,
    )


@pytest.mark.benchmark
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("clamp", [None, 0.5])
@pytest.mark.parametrize("round_sf", [True, False])
def test_bench_swiglu_forward_and_per_channel_cast_and_transpose(gpu_benchmark, impl, clamp, round_sf):
    t, h, bm = 8064, 7168, 32
    x = torch.randn(t, 2 * h, device="cuda").bfloat16()
    args = (x, "e4m3", bm, round_sf, True, clamp)
    fns = _fns(
        tk_quant.swiglu_forward_and_per_channel_cast_and_transpose,
        reference.swiglu_forward_and_per_channel_cast_and_transpose, *args,
    )
    out, sf = tk_quant.swiglu_forward_and_per_channel_cast_and_transpose(*args)
    gpu_benchmark(
        fns[impl], kernel="swiglu_forward_and_per_channel_cast_and_transpose", impl=impl,
        bytes=count_bytes(x, out, sf), hidden=h, num_per_tokens=bm, num_tokens=t, round_sf=round_sf,
        swiglu_clamp_value=clamp, without_transpose=True,
    )


@pytest.mark.benchmark
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("clamp", [None, 0.5])
@pytest.mark.parametrize("bk", [32, 128])
def test_bench_swiglu_backward_and_per_token_cast(gpu_benchmark, impl, clamp, bk):
    h = 7168
    idx, pe, ptt, ttp, x = moe_inputs(h, bk)
    q = tk_quant.per_token_cast(x, "e4m3", bk)
    weight = torch.rand(idx.shape[0], 2, device="cuda")
    grad = torch.randn(x.shape[0], h, device="cuda").bfloat16()
    args = (q, grad, weight, ptt, ttp, bk, True, clamp)
    fns = _fns(tk_quant.swiglu_backward_and_per_token_cast, reference.swiglu_backward_and_per_token_cast, *args)
    out, xq, xg, wg = tk_quant.swiglu_backward_and_per_token_cast(*args)
    gpu_benchmark(
        fns[impl], kernel="swiglu_backward_and_per_token_cast", impl=impl,
        bytes=count_bytes(q, grad, weight, ptt, ttp, out, xq, xg, wg),
        hidden=h, num_ep_ranks=8, num_experts=9, num_per_channels=bk, num_tokens=idx.shape[0], num_topk=2,
        round_sf=True, swiglu_clamp_value=clamp,
    )
