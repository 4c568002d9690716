"""Shape and data generators shared by the test suites.

``TK_FULL_TEST`` in ``{"1", "true", "True"}`` switches on the full grids (0-token cases, more MoE
configurations). Random data comes from torch's generator, which the pytest plugin seeds per test id;
Python's ``random`` is seeded the same way, so every case reproduces.
"""

import os
import random

import torch

from ..layout import align

HIDDEN_SIZES = (576, 2048, 2560, 3072, 4096, 6144, 7168)


def full_test() -> bool:
    return os.environ.get("TK_FULL_TEST", "") in ("1", "true", "True")


def generate_num_tokens(alignment: int = 1, is_benchmark: bool = False) -> list[int]:
    """``[4001, 8001]`` rounded up to ``alignment``; the full grid adds 0 (not for benchmarks)."""
    base = [0, 4001, 8001] if full_test() and not is_benchmark else [4001, 8001]
    return [align(t, alignment) if t else 0 for t in base]


def generate_hidden_sizes(align_to: int = 64) -> list[int]:
    return [h for h in HIDDEN_SIZES if h % align_to == 0]


def generate_moe_params(is_benchmark: bool = False):
    """MoE layouts of one EP rank: dicts ``num_send_tokens, num_topk, num_experts, num_ep_ranks``."""
    full = full_test()
    if full and not is_benchmark:
        yield dict(num_send_tokens=0, num_topk=1, num_experts=1, num_ep_ranks=1)
    topks = (2, 6, 8, 9) + ((1, 7) if full else ())
    experts = (72, 256) + ((288, 384) if full else ())
    ranks = (8, 64) + ((1, 72, 256) if full else ())
    for k in topks:
        for e in experts:
            for r in ranks:
                if e % r == 0:
                    yield dict(num_send_tokens=4001, num_topk=k, num_experts=e // r, num_ep_ranks=r)


def generate_topk_idx(params: dict, device="cpu") -> torch.Tensor:
    """Top-k routing of one EP rank: int64 ``(n, topk)``, experts of other ranks marked -1, rows that
    route nowhere on this rank dropped."""
    k, e, r = params["num_topk"], params["num_experts"], params["num_ep_ranks"]
    n = params["num_send_tokens"] * r
    if n == 0:
        return torch.empty((0, k), dtype=torch.int64, device=device)
    scores = torch.rand((n, e * r), device=device)
    idx = torch.topk(scores, k, dim=1, sorted=False).indices
    idx = torch.where(idx < e, idx, -1)
    return idx[(idx >= 0).any(dim=1)].contiguous()


def generate_fused_mapping(topk_idx: torch.Tensor, num_experts: int, alignment: int):
    """The expert-major ("fused") MoE layout of a routing: each expert's rows form a segment padded to a
    multiple of ``alignment``; rows are ordered by (expert, token, k).

    Returns int32 ``(pos_to_expert, pos_to_token_topk, token_topk_to_pos)``: per position its expert and its
    flat ``token * num_topk + k`` index (-1 on padding rows), and per ``(token, k)`` its position (-1 where
    the route goes to another rank).
    """
    t, k = topk_idx.shape
    dev = topk_idx.device
    flat = topk_idx.reshape(-1)
    valid = (flat >= 0).nonzero().squeeze(1)
    experts = flat[valid]
    counts = torch.bincount(experts, minlength=num_experts)
    aligned = (counts + alignment - 1) // alignment * alignment
    starts = torch.cumsum(aligned, 0) - aligned
    raw_starts = torch.cumsum(counts, 0) - counts
    order = torch.argsort(experts, stable=True)
    routes, experts = valid[order], experts[order]
    pos = starts[experts] + torch.arange(routes.numel(), device=dev) - raw_starts[experts]
    p = int(aligned.sum())
    pos_to_expert = torch.full((p,), -1, dtype=torch.int32, device=dev)
    pos_to_token_topk = torch.full((p,), -1, dtype=torch.int32, device=dev)
    token_topk_to_pos = torch.full((t * k,), -1, dtype=torch.int32, device=dev)
    pos_to_expert[pos] = experts.int()
    pos_to_token_topk[pos] = routes.int()
    token_topk_to_pos[routes] = pos.int()
    return pos_to_expert, pos_to_token_topk, token_topk_to_pos.view(t, k)


def generate_rand_float(shape, device="cpu") -> torch.Tensor:
    """float32 ``randn * 2**e`` with one random exponent ``e`` in ``[-110, 126]``, finite, clamped to
    ``+-FLT_MAX/8``."""
    e = random.randint(-110, 126)
    x = torch.randn(shape, device=device) * (2.0**e)
    x = torch.where(torch.isfinite(x), x, torch.randn(shape, device=device))
    limit = torch.finfo(torch.float32).max / 8
    return x.clamp(-limit, limit)


def generate_e5m6_inputs(num_tokens: int, hidden: int, dtype: torch.dtype, device="cpu"):
    """Yields ``(x, is_special)``: one ``randn`` and three constant inputs at the e5m6 subnormal and
    normal boundaries (2**-20, 2**-14*63/64, 2**-14), each with its last column 65024 so the scale is 1."""
    yield torch.randn((num_tokens, hidden), device=device).to(dtype), False
    for v in (2.0**-20, 2.0**-14 * 63 / 64, 2.0**-14):
        x = torch.full((num_tokens, hidden), v, device=device)
        x[:, -1] = 65024.0
        yield x.to(dtype), True
