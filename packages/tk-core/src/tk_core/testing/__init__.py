"""Testing utilities: numeric comparisons, shape/data generators, GPU timing and the pytest plugin."""

from .generators import (
    full_test,
    generate_e5m6_inputs,
    generate_fused_mapping,
    generate_hidden_sizes,
    generate_moe_params,
    generate_num_tokens,
    generate_rand_float,
    generate_topk_idx,
)
from .numeric import assert_equal, calc_diff, capture_cuda_graph, check_bias, count_bytes, opcheck, round_f32

__all__ = [
    "assert_equal",
    "calc_diff",
    "capture_cuda_graph",
    "check_bias",
    "count_bytes",
    "full_test",
    "generate_e5m6_inputs",
    "generate_fused_mapping",
    "generate_hidden_sizes",
    "generate_moe_params",
    "generate_num_tokens",
    "generate_rand_float",
    "generate_topk_idx",
    "opcheck",
    "round_f32",
]
