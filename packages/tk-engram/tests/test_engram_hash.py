"""engram_hash and make_offsets: cpu, compile and gpu tiers."""

import pytest
import torch

import tk_engram
from tk_core.jit import ARCHS
from tk_core.testing import assert_equal, capture_cuda_graph, generate_num_tokens
from tk_core.testing.compile_check import assert_compiles
from tk_engram import reference
from tk_engram.hash import _engram_hash_op, engram_hash_kernel

CUDA = torch.device("cuda")


def _params(t, n=3, L=2, J=8, device="cpu"):
    ids = torch.randint(0, 100_000, (t, n), dtype=torch.int32, device=device)
    mult = torch.randint(0, 100_000, (L, n), dtype=torch.int64, device=device)
    vocab = torch.randint(100_000, 1_000_000, (L, n - 1, J), dtype=torch.int32, device=device)
    return ids, mult, vocab, reference.make_offsets(vocab)


def _python_hash(ids, mult, vocab, offsets):
    """Plain Python integers: 64-bit wrapping product, XOR, Python floor-mod."""

    def wrap(x):
        x &= (1 << 64) - 1
        return x - (1 << 64) if x >> 63 else x

    L, N = mult.shape
    J = vocab.shape[2]
    out = torch.empty((L, ids.shape[0], (N - 1) * J), dtype=torch.int64)
    for l in range(L):
        for t in range(ids.shape[0]):
            h = 0
            for i in range(N):
                h = wrap(h ^ wrap(int(ids[t, i]) * int(mult[l, i])))
                if i >= 1:
                    for j in range(J):
                        out[l, t, (i - 1) * J + j] = h % int(vocab[l, i - 1, j]) + int(offsets[l, (i - 1) * J + j])
    return out.to(torch.int32)


# --- cpu tier -----------------------------------------------------------------------------------------


def test_make_offsets():
    vocab = torch.tensor([[[3, 5], [7, 11]], [[1, 2], [4, 8]]], dtype=torch.int32)
    assert_equal(reference.make_offsets(vocab), torch.tensor([[0, 3, 8, 15], [0, 1, 3, 7]], dtype=torch.int32))
    with pytest.raises(TypeError, match="make_offsets: vocab_sizes must be a torch.Tensor, got list"):
        reference.make_offsets(vocab.tolist())
    # 2**31 rows in one layer: int32 offsets would wrap negative
    vocab = torch.tensor([[[2**30, 2**30], [2**30, 1]], [[1, 2], [4, 8]]], dtype=torch.int32)
    with pytest.raises(ValueError, match="make_offsets: vocab_sizes must be at most 2147483647 rows per layer"):
        tk_engram.make_offsets(vocab)
    vocab = torch.tensor([[[2**30, 2**30 - 1]]], dtype=torch.int32)  # 2**31 - 1 rows: the largest that fits
    assert_equal(reference.make_offsets(vocab), torch.tensor([[0, 2**30]], dtype=torch.int32))


@pytest.mark.parametrize("n", [2, 3, 5])
def test_reference_vs_python_integers(n):
    ids, mult, vocab, offsets = _params(13, n=n, L=2, J=3)
    # huge multipliers and negative ids: the product wraps and h goes negative (floor-mod matters)
    mult[0] = torch.tensor([2**62 + 12345] * n)
    ids[0] = -ids[0]
    got = reference.engram_hash_ref(ids, mult, vocab, offsets)
    assert_equal(got, _python_hash(ids, mult, vocab, offsets))
    assert got.shape == (2, 13, (n - 1) * 3)
    col = got - offsets[:, None, :]
    assert bool(((col >= 0) & (col < vocab.reshape(2, 1, -1))).all())


def test_reference_image_token_mask():
    ids, mult, vocab, offsets = _params(6)
    mask = torch.tensor([True, False, False, True, False, True])
    got = reference.engram_hash_ref(ids, mult, vocab, offsets, mask)
    plain = reference.engram_hash_ref(ids, mult, vocab, offsets)
    assert bool((got[:, mask] == -1).all())
    assert_equal(got[:, ~mask], plain[:, ~mask])
    assert_equal(tk_engram.engram_hash(ids, mult, vocab, offsets, mask), got)
    with pytest.raises(TypeError, match="engram_hash: image_token_mask must be of dtype bool"):
        tk_engram.engram_hash(ids, mult, vocab, offsets, mask.int())
    with pytest.raises(ValueError, match=r"engram_hash: image_token_mask must be of shape \(6\)"):
        tk_engram.engram_hash(ids, mult, vocab, offsets, mask[:5])


def test_public_on_cpu_and_validation():
    ids, mult, vocab, offsets = _params(5)
    assert_equal(tk_engram.engram_hash(ids, mult, vocab, offsets), reference.engram_hash_ref(ids, mult, vocab, offsets))
    with pytest.raises(TypeError, match="engram_hash: ngram_token_ids must be of dtype int32, got"):
        tk_engram.engram_hash(ids.long(), mult, vocab, offsets)
    with pytest.raises(TypeError, match="engram_hash: multipliers must be of dtype int64"):
        tk_engram.engram_hash(ids, mult.int(), vocab, offsets)
    with pytest.raises(ValueError, match=r"engram_hash: multipliers must be of shape \(2, 3\)"):
        tk_engram.engram_hash(ids, mult[:, :2], vocab, offsets)
    with pytest.raises(ValueError, match=r"engram_hash: vocab_sizes must be of shape \(2, 2, 8\)"):
        tk_engram.engram_hash(ids, mult, vocab[:, :1], offsets)
    with pytest.raises(ValueError, match=r"engram_hash: offsets must be of shape \(2, 16\)"):
        tk_engram.engram_hash(ids, mult, vocab, offsets[:, :8])
    with pytest.raises(ValueError, match="N >= 2"):
        tk_engram.engram_hash(ids[:, :1], mult[:, :1], vocab[:, :0], offsets[:, :0])
    for bad in (0, -7):  # a zero size divides by zero, a negative one gives negative row ids
        vocab_bad = vocab.clone()
        vocab_bad[1, 0, 3] = bad
        with pytest.raises(ValueError, match=f"engram_hash: vocab_sizes must be positive, got minimum {bad}"):
            tk_engram.engram_hash(ids, mult, vocab_bad, offsets)


# --- compile tier -------------------------------------------------------------------------------------


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("masked", [False, True])
def test_compile(arch, masked):
    src = assert_compiles(engram_hash_kernel, arch, num_layers=2, max_ngram=3, tables=8, masked=masked)
    assert "uint64_t" in src and "%" in src
    assert ("Mask" in src) == masked


# --- gpu tier -----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 127, 128, 129, *generate_num_tokens()])
def test_gpu_vs_reference(num_tokens):
    ids, mult, vocab, offsets = _params(num_tokens, device=CUDA)
    ids[: num_tokens // 2] *= -1  # negative hashes exercise the floor-mod
    mult[1] = 2**62 + 7
    out = torch.full((2, num_tokens, 16), -7, dtype=torch.int32, device=CUDA)
    _engram_hash_op(ids, mult, vocab, offsets, out)
    ref = reference.engram_hash_ref(ids, mult, vocab, offsets)
    assert_equal(out, ref)
    assert_equal(tk_engram.engram_hash(ids, mult, vocab, offsets), ref)
    # strided ids (a column slice of a wider buffer): no copy, no recompile
    wide = torch.zeros(num_tokens, 5, dtype=torch.int32, device=CUDA)
    wide[:, 1:4] = ids
    assert_equal(tk_engram.engram_hash(wide[:, 1:4], mult, vocab, offsets), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 300, 8001])
def test_gpu_image_token_mask(num_tokens):
    ids, mult, vocab, offsets = _params(num_tokens, device=CUDA)
    mask = torch.rand(num_tokens, device=CUDA) < 0.3
    out = torch.full((2, num_tokens, 16), 7, dtype=torch.int32, device=CUDA)
    _engram_hash_op(ids, mult, vocab, offsets, out, mask)
    assert_equal(out, reference.engram_hash_ref(ids, mult, vocab, offsets, mask))
    torch.library.opcheck(_engram_hash_op.op, (ids, mult, vocab, offsets, out, mask))


@pytest.mark.gpu
def test_gpu_opcheck_and_compile():
    ids, mult, vocab, offsets = _params(100, device=CUDA)
    out = torch.empty(2, 100, 16, dtype=torch.int32, device=CUDA)
    torch.library.opcheck(_engram_hash_op.op, (ids, mult, vocab, offsets, out))
    compiled = torch.compile(tk_engram.engram_hash, fullgraph=True)
    assert_equal(compiled(ids, mult, vocab, offsets), reference.engram_hash_ref(ids, mult, vocab, offsets))
    replay, res = capture_cuda_graph(lambda: tk_engram.engram_hash(ids, mult, vocab, offsets))
    ids.copy_(torch.randint_like(ids, 0, 100_000))
    replay()
    assert_equal(res, reference.engram_hash_ref(ids, mult, vocab, offsets))
