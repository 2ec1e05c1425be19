"""MLA cost rules shared by the kernels and the planner (no torch import)."""

from __future__ import annotations

import math
import sys

__all__ = ["expanded_crossover_queries"]


def expanded_crossover_queries(
    kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int
) -> int:
    """Queries per request above which the expanded form needs fewer multiply-adds than the absorbed.

    `n = r (dn + dv) / (2r - dn - dv)` rounded up, with r = kv_lora_rank, dn = qk_nope_head_dim,
    dv = v_head_dim; `sys.maxsize` when the expanded form never wins.
    """
    saving_per_query = 2 * kv_lora_rank - qk_nope_head_dim - v_head_dim
    if saving_per_query <= 0:
        return sys.maxsize
    return math.ceil(kv_lora_rank * (qk_nope_head_dim + v_head_dim) / saving_per_query)
