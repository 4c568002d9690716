"""An Engram block across tk-engram: n-gram hashing into the embedding tables, the projection of the
looked-up embeddings to a key and a value, the RMSNorm-fused gate, and a loss backward through all of it.

On the CPU the public ops run the references, checked against the same block written in plain float64
autograd. On the GPU the kernels are checked against the CPU block and the forward is compiled with
torch.compile(fullgraph=True).
"""

import pytest
import torch

import tk_engram
from tk_core.testing import calc_diff

TOKENS, HC, HIDDEN, NGRAM, LAYERS, TABLES = 64, 4, 256, 3, 1, 2
CLAMP, EPS = 1e-6, 1e-6


def make_block(device, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50000, (TOKENS, NGRAM), generator=g, dtype=torch.int32)
    mult = torch.randint(1, 2**40, (LAYERS, NGRAM), generator=g, dtype=torch.int64)
    vocab = torch.tensor([[[1009, 1013], [1019, 1021]]], dtype=torch.int32)
    offsets = tk_engram.make_offsets(vocab)
    rows = int(vocab.sum())
    table = torch.randn(rows, 32, generator=g)
    proj_k = torch.randn(32 * (NGRAM - 1) * TABLES, HC * HIDDEN, generator=g) * 0.05
    proj_v = torch.randn(32 * (NGRAM - 1) * TABLES, HIDDEN, generator=g) * 0.05
    x = torch.randn(TOKENS, HC, HIDDEN, generator=g)
    w_h = torch.rand(HC, HIDDEN, generator=g) + 0.5
    w_e = torch.rand(HC, HIDDEN, generator=g) + 0.5
    tensors = dict(ids=ids, mult=mult, vocab=vocab, offsets=offsets, table=table, proj_k=proj_k,
                   proj_v=proj_v, x=x, w_h=w_h, w_e=w_e)
    floats = ("table", "proj_k", "proj_v", "x", "w_h", "w_e")
    return {k: (t.to(device=device, dtype=dtype) if k in floats else t.to(device)) for k, t in tensors.items()}


def engram_block(b, gate):
    rows = tk_engram.engram_hash(b["ids"], b["mult"], b["vocab"], b["offsets"])[0]  # (T, (N-1)*J)
    emb = b["table"][rows.long()].flatten(1)  # (T, 32 * (N-1) * J)
    k = (emb @ b["proj_k"]).view(TOKENS, HC, HIDDEN)
    v = emb @ b["proj_v"]
    return gate(b["x"], k, v, b["w_h"], b["w_e"], CLAMP, EPS)


def gate_float64(x, k, v, w_h, w_e, clamp, eps):
    """The gate of moe-engram-mhc.md §5 in plain autograd."""
    rx = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    rk = torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps)
    s = (x * rx * w_h * k * rk * w_e).sum(-1, keepdim=True) / HIDDEN**0.5
    g = torch.sigmoid(torch.sign(s) * torch.sqrt(torch.clamp(s.abs(), min=clamp)))
    return x + g * v.unsqueeze(1)


def run_backward(block):
    leaves = [block[k].requires_grad_() for k in ("x", "w_h", "w_e", "proj_k", "proj_v", "table")]
    return leaves


def test_engram_block_forward_backward_on_cpu_matches_float64():
    block = make_block("cpu", torch.float64)
    leaves = run_backward(block)
    out = engram_block(block, tk_engram.engram_gate)
    out.square().sum().backward()
    grads = [t.grad.clone() for t in leaves]
    ref_block = {k: (t.detach().clone().requires_grad_() if t.is_floating_point() else t) for k, t in block.items()}
    ref_leaves = [ref_block[k] for k in ("x", "w_h", "w_e", "proj_k", "proj_v", "table")]
    ref = engram_block(ref_block, gate_float64)
    ref.square().sum().backward()
    assert calc_diff(out, ref) < 1e-20
    for got, want in zip(grads, [t.grad for t in ref_leaves]):
        assert calc_diff(got, want) < 1e-20


@pytest.mark.gpu
def test_engram_block_on_gpu_matches_cpu_and_compiles():
    cpu, gpu = make_block("cpu", torch.bfloat16), make_block("cuda", torch.bfloat16)
    for b in (cpu, gpu):
        run_backward(b)
    outs = []
    for b in (cpu, gpu):
        out = engram_block(b, tk_engram.engram_gate)
        out.float().square().sum().backward()
        outs.append(out)
    assert calc_diff(outs[1].cpu(), outs[0]) < 1e-5
    for name in ("x", "w_h", "w_e", "proj_k", "proj_v"):
        assert calc_diff(gpu[name].grad.cpu(), cpu[name].grad) < 1e-4, name
    with torch.no_grad():
        compiled = torch.compile(lambda b: engram_block(b, tk_engram.engram_gate), fullgraph=True)
        assert calc_diff(compiled(gpu).cpu(), outs[0].detach()) < 1e-5
