"""Testing utilities: comparisons, byte counts, generators, seeds."""

import random

import pytest
import torch

from tk_core.testing import (
    assert_equal,
    calc_diff,
    check_bias,
    count_bytes,
    generate_fused_mapping,
    generate_hidden_sizes,
    generate_moe_params,
    generate_num_tokens,
    generate_rand_float,
    generate_topk_idx,
)
from tk_core.testing.plugin import seed_for


def test_assert_equal_is_bitwise_and_reports_first_mismatches():
    x = torch.tensor([1.0, float("nan"), 0.0, 3.0])
    assert_equal(x, x.clone())
    with pytest.raises(AssertionError, match=r"(?s)1 of 4 elements differ.*at \(2,\): 0.0 vs -0.0"):
        assert_equal(x, torch.tensor([1.0, float("nan"), -0.0, 3.0]))
    with pytest.raises(AssertionError, match="dtype mismatch"):
        assert_equal(x, x.double())
    with pytest.raises(AssertionError, match="shape mismatch"):
        assert_equal(x, x[:3])
    fp8 = torch.tensor([1.0, 2.0]).to(torch.float8_e4m3fn)
    with pytest.raises(AssertionError, match=r"at \(1,\): 2.0 \(0x40\) vs 3.0 \(0x44\)"):
        assert_equal(fp8, torch.tensor([1.0, 3.0]).to(torch.float8_e4m3fn))
    assert_equal(torch.empty(0, 3), torch.empty(0, 3))


def test_calc_diff_values():
    x = torch.randn(100)
    assert calc_diff(x, x) == 0.0
    assert calc_diff(torch.zeros(3), torch.zeros(3)) == 0.0
    assert calc_diff(x, -x) == pytest.approx(2.0)
    y = x + 1e-6
    assert 0 < calc_diff(x, y) < 1e-10  # no cancellation to 0 for tiny differences


def test_comparisons_refuse_other_shapes():
    # a broadcast or a byte-count slip would let a truncated output pass
    with pytest.raises(AssertionError, match=r"calc_diff: shape mismatch: \(4,\) vs \(1,\)"):
        calc_diff(torch.ones(4), torch.ones(1))
    with pytest.raises(AssertionError, match="size mismatch: 0 vs 20 bytes"):
        assert_equal(torch.empty(0), torch.ones(5), check_shape=False)
    with pytest.raises(AssertionError, match="size mismatch: 16 vs 8 bytes"):
        assert_equal(torch.ones(4), torch.ones(4, dtype=torch.int16), check_dtype=False)
    assert_equal(torch.ones(4), torch.ones(4).view(torch.int32), check_dtype=False)  # same bytes, other dtype
    with pytest.raises(AssertionError, match="shape mismatch"):
        check_bias(torch.ones(100), torch.ones(1))


def test_check_bias_catches_truncation():
    ref = torch.rand(100000, dtype=torch.float64) + 1
    check_bias(torch.round(ref * 64) / 64, ref)  # round to nearest: unbiased
    with pytest.raises(AssertionError, match="rounding bias"):
        check_bias(torch.trunc(ref * 64) / 64, ref)  # truncation: always below
    check_bias(torch.empty(0), torch.empty(0))


def test_count_bytes_recurses_and_skips_none():
    a, b = torch.zeros(3, 4), torch.zeros(5, dtype=torch.bfloat16)
    assert count_bytes(a, (b, None), [a]) == 48 + 10 + 48


def test_generators(monkeypatch):
    monkeypatch.delenv("TK_FULL_TEST", raising=False)
    assert generate_num_tokens() == [4001, 8001]
    assert generate_num_tokens(alignment=64) == [4032, 8064]
    assert generate_hidden_sizes(256) == [2048, 2560, 3072, 4096, 6144, 7168]
    params = list(generate_moe_params())
    assert len(params) == 12 and all(p["num_send_tokens"] == 4001 for p in params)
    monkeypatch.setenv("TK_FULL_TEST", "1")
    assert generate_num_tokens() == [0, 4001, 8001]
    full = list(generate_moe_params())
    assert full[0]["num_send_tokens"] == 0 and len(full) == 79


def test_topk_idx_marks_other_ranks_and_drops_empty_rows():
    p = dict(num_send_tokens=50, num_topk=2, num_experts=4, num_ep_ranks=8)
    idx = generate_topk_idx(p)
    assert idx.dtype == torch.int64 and idx.shape[1] == 2
    assert ((idx >= -1) & (idx < 4)).all() and (idx >= 0).any(dim=1).all()


def test_rand_float_is_finite_and_seeded(seed):
    x = generate_rand_float((64, 64))
    assert torch.isfinite(x).all()
    random.seed(seed)
    torch.manual_seed(seed)
    first = generate_rand_float((64, 64))
    random.seed(seed)
    torch.manual_seed(seed)
    assert torch.equal(generate_rand_float((64, 64)), first)


def test_seed_depends_on_test_id_only(request, seed):
    assert seed == seed_for(request.node.nodeid, 0)
    assert seed_for("a::b") != seed_for("a::c")


def test_fused_mapping_hand_made_case():
    # 3 tokens, top-2 over 2 local experts; -1 routes to another rank
    topk = torch.tensor([[1, 0], [1, -1], [0, 1]])
    pos_to_expert, pos_to_token_topk, token_topk_to_pos = generate_fused_mapping(topk, 2, alignment=4)
    assert pos_to_expert.tolist() == [0, 0, -1, -1, 1, 1, 1, -1]
    assert pos_to_token_topk.tolist() == [1, 4, -1, -1, 0, 2, 5, -1]
    assert token_topk_to_pos.tolist() == [[4, 0], [5, -1], [1, 6]]
