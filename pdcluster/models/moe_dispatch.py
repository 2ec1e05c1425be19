"""Dispatch/combine interface between the MoE router and the experts (after DeepEP's dispatch/combine).

`dispatch` groups (token, expert) pairs by local expert, the model runs each expert over its slice, and
`combine` sums each row back into its token, gate-weighted. `LocalDispatcher` keeps all on one device.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import NamedTuple

import torch

# run_experts(rows, rows_per_expert): rows [num_rows, hidden_size] sorted by local expert -> the same shape.
ExpertsFn = Callable[[torch.Tensor, list[int]], torch.Tensor]


class DispatchHandle(NamedTuple):
    """token_ids: [num_rows] int64 source token; weights: [num_rows] float32 gate weight of each row."""

    token_ids: torch.Tensor
    weights: torch.Tensor
    num_tokens: int


class Dispatched(NamedTuple):
    """hidden: [num_rows, hidden_size] sorted by local expert, `rows_per_expert[e]` rows each."""

    hidden: torch.Tensor
    rows_per_expert: list[int]
    handle: DispatchHandle


def weighted_sum(
    rows: torch.Tensor, token_ids: torch.Tensor, weights: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """Each token's gate-weighted sum of its rows, in row order.

    rows: [num_rows, hidden_size]; token_ids: [num_rows] int64; weights: [num_rows] float32
    returns [num_tokens, hidden_size] in `rows`' dtype
    """
    weighted = rows * weights[:, None].to(rows.dtype)
    return rows.new_zeros(num_tokens, rows.shape[-1]).index_add_(0, token_ids, weighted)


class ExpertDispatcher(ABC):
    num_local_experts: int

    @abstractmethod
    def dispatch(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> Dispatched:
        """hidden: [num_tokens, hidden_size]; topk_ids / topk_weights: [num_tokens, top_k]."""

    @abstractmethod
    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """expert_out: [num_rows, hidden_size] in dispatch order -> [num_tokens, hidden_size]."""

    def forward(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, run_experts: ExpertsFn
    ) -> torch.Tensor:
        """`dispatch`, `run_experts`, `combine`: [num_tokens, hidden_size]; may overlap them."""
        dispatched = self.dispatch(hidden, topk_ids, topk_weights)
        return self.combine(run_experts(dispatched.hidden, dispatched.rows_per_expert), dispatched.handle)


class LocalDispatcher(ExpertDispatcher):
    def __init__(self, num_experts: int) -> None:
        self.num_local_experts = num_experts

    def dispatch(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> Dispatched:
        num_tokens, top_k = topk_ids.shape
        flat_ids = topk_ids.reshape(-1)
        order = flat_ids.argsort(stable=True)
        token_ids = order // top_k
        rows_per_expert = torch.bincount(flat_ids, minlength=self.num_local_experts).tolist()
        handle = DispatchHandle(token_ids, topk_weights.reshape(-1)[order].float(), num_tokens)
        return Dispatched(hidden[token_ids], rows_per_expert, handle)

    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        return weighted_sum(expert_out, handle.token_ids, handle.weights, handle.num_tokens)
