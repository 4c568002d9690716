"""An MoE FP8 expert layer across tk-quant and tk-transpose: route tokens into the expert-major layout,
quantize activations per token, run the expert up-projection on dequantized FP8 data, apply SwiGLU with a
fused FP8 cast, dequantize, and check the result against the same layer in float32 arithmetic.

The CPU case runs the references through the public API; the GPU case runs the kernels, compares them
with the CPU result bit for bit where the ops are bit-exact, and captures the whole layer with
torch.compile(fullgraph=True) and a CUDA graph.
"""

import pytest
import torch

import tk_quant
import tk_transpose
from tk_core.testing import assert_equal, calc_diff, capture_cuda_graph, generate_fused_mapping, generate_topk_idx

HIDDEN, INTER, EXPERTS, TOPK = 512, 256, 4, 2


def make_layer(device):
    params = dict(num_send_tokens=96, num_topk=TOPK, num_experts=EXPERTS, num_ep_ranks=2)
    topk_idx = generate_topk_idx(params).to(device)
    pos_to_expert, pos_to_token_topk, _ = generate_fused_mapping(topk_idx, EXPERTS, alignment=16)
    x = torch.randn(topk_idx.shape[0], HIDDEN).to(device=device, dtype=torch.bfloat16)
    w_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN) / HIDDEN**0.5).to(device=device, dtype=torch.bfloat16)
    return x, w_up, pos_to_expert, pos_to_token_topk


def expert_layer(x, w_up, pos_to_expert, pos_to_token_topk):
    """FP8 activations into the up-projection, SwiGLU with FP8 output, then dequantized. Every shape is
    static (padding rows are masked, not dropped), so the layer compiles with fullgraph=True and captures
    into a CUDA graph."""
    real = (pos_to_token_topk >= 0).unsqueeze(1)
    rows = x[pos_to_token_topk.clamp(min=0).long() // TOPK] * real
    xq = tk_quant.per_token_cast(rows, "e4m3", 128, round_sf=True)
    xd = tk_quant.per_token_cast_back(xq, "fp32", 128)
    # the up-projection of each row by its expert's weight; the weight is stored (out, in) and transposed
    # once per expert with tk-transpose; every expert is applied and the row's own is gathered
    w_t = tk_transpose.batched_transpose(w_up).float()  # (E, HIDDEN, 2 * INTER)
    h_all = torch.einsum("ph,ehi->pei", xd, w_t)
    expert = pos_to_expert.clamp(min=0).long().view(-1, 1, 1).expand(-1, 1, 2 * INTER)
    h = (h_all.gather(1, expert).squeeze(1) * real).bfloat16()
    act_q = tk_quant.swiglu_forward_and_per_token_cast(h, "e4m3", 128, round_sf=True)
    return tk_quant.per_token_cast_back(act_q, "fp32", 128), act_q, h


def float_reference(x, w_up, pos_to_expert, pos_to_token_topk):
    real = pos_to_token_topk >= 0
    rows = torch.zeros(pos_to_token_topk.numel(), HIDDEN, device=x.device)
    rows[real] = x[pos_to_token_topk[real].long() // TOPK].float()
    h = torch.einsum("ph,pih->pi", rows, w_up[pos_to_expert.clamp(min=0).long()].float()) * real.unsqueeze(1)
    g, u = h[:, :INTER], h[:, INTER:]
    return torch.nn.functional.silu(g) * u


def test_moe_fp8_layer_on_cpu_matches_float_math():
    layer = make_layer("cpu")
    out, (data, sf), _ = expert_layer(*layer)
    assert data.dtype == torch.float8_e4m3fn and sf.shape == (data.shape[0], INTER // 128)
    assert calc_diff(out, float_reference(*layer)) < 2e-3  # two FP8 roundings


@pytest.mark.gpu
def test_moe_fp8_layer_on_gpu_matches_cpu_and_captures():
    layer_cpu = make_layer("cpu")
    layer = tuple(t.cuda() for t in layer_cpu)
    out, act_q, h = expert_layer(*layer)
    assert calc_diff(out.cpu(), float_reference(*layer_cpu)) < 2e-3
    # the matmuls round differently on the two devices; the fused cast on the same input is bit-exact
    _, act_q_cpu, h_cpu = expert_layer(*layer_cpu)
    act_q_same = tk_quant.swiglu_forward_and_per_token_cast(h_cpu.cuda(), "e4m3", 128, round_sf=True)
    assert_equal(act_q_same[0].cpu(), act_q_cpu[0])
    assert_equal(act_q_same[1].cpu(), act_q_cpu[1])
    compiled = torch.compile(expert_layer, fullgraph=True)
    assert_equal(compiled(*layer)[0], out)
    replay, (static_out, *_) = capture_cuda_graph(lambda: expert_layer(*layer))
    static_out.fill_(float("nan"))
    replay()
    assert_equal(static_out, out)
