"""MLA cost rules shared by the kernels and the planner's performance model (no torch: the planner imports
it without loading torch)."""

from __future__ import annotations

import math
import sys

__all__ = ["expanded_crossover_queries"]


def expanded_crossover_queries(
    kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int
) -> int:
    """Queries per request above which the expanded form needs fewer multiply-adds than the absorbed one.

    Per (query, key, head) the absorbed form costs `2 * kv_lora_rank + qk_rope_head_dim` (scores over
    `[c_kv; k_pe]`, then `p . c_kv`) and the expanded form `qk_nope_head_dim + qk_rope_head_dim +
    v_head_dim`, plus `kv_lora_rank * (qk_nope_head_dim + v_head_dim)` per (key, head) to up-project.
    Crossover: `n = r (dn + dv) / (2r - dn - dv)`, rounded up; `sys.maxsize` when the expanded form never
    wins. DeepSeek-V3 (512, 128, 64, 128): 171. A FLOP count only; pass `expanded_min_queries` to
    `paged_mla_attention` to override it with a measured value.
    """
    saving_per_query = 2 * kv_lora_rank - qk_nope_head_dim - v_head_dim
    if saving_per_query <= 0:
        return sys.maxsize
    return math.ceil(kv_lora_rank * (qk_nope_head_dim + v_head_dim) / saving_per_query)
