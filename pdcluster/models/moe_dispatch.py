"""Dispatch/combine interface between the MoE router and the experts.

The model computes routing (`kernels.moe.grouped_topk`), then hands tokens to an `ExpertDispatcher`:

1. `dispatch(hidden, topk_ids, topk_weights)` groups (token, expert) pairs by expert and returns the rows
   each *local* expert must process, plus a handle to undo the permutation.
2. The model runs each local expert over its contiguous slice (a grouped GEMM on accelerators).
3. `combine(expert_out, handle)` weights each row by its gate weight and sums it back into its token.

`LocalDispatcher` keeps everything on one device. An expert-parallel dispatcher (all-to-all over an EP
group, in the spirit of DeepEP's dispatch/combine) implements the same two methods, so the model code does
not change when experts are spread over devices.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import NamedTuple

import torch


class DispatchHandle(NamedTuple):
    """What `combine` needs to route expert outputs back.

    token_ids: `[num_rows]` int64, the source token of each dispatched row.
    weights: `[num_rows]` float32, the gate weight of each row.
    num_tokens: tokens in the batch before dispatch.
    """

    token_ids: torch.Tensor
    weights: torch.Tensor
    num_tokens: int


class Dispatched(NamedTuple):
    """Rows for the local experts, sorted by local expert id.

    hidden: `[num_rows, hidden_size]`; rows for local expert e are
        the e-th contiguous slice of `rows_per_expert[e]` rows.
    rows_per_expert: rows per local expert, `num_local_experts` ints.
    """

    hidden: torch.Tensor
    rows_per_expert: list[int]
    handle: DispatchHandle


def weighted_sum(
    rows: torch.Tensor, token_ids: torch.Tensor, weights: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """Each token's gate-weighted sum of its expert rows (the MoE combine).

    rows: `[num_rows, hidden_size]` expert outputs; token_ids: `[num_rows]` int64, each row's source
    token; weights: `[num_rows]` float32 gate weights. Returns `[num_tokens, hidden_size]` in `rows`'
    dtype; a token's rows are summed in row order.
    """
    weighted = rows * weights[:, None].to(rows.dtype)
    return rows.new_zeros(num_tokens, rows.shape[-1]).index_add_(0, token_ids, weighted)


class ExpertDispatcher(ABC):
    """Moves tokens to the experts that process them and back. See the module docstring."""

    num_local_experts: int

    @abstractmethod
    def dispatch(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> Dispatched:
        """hidden: `[num_tokens, hidden_size]`; topk_ids / topk_weights: `[num_tokens, top_k]`."""

    @abstractmethod
    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """expert_out: `[num_rows, hidden_size]` in dispatch order. Returns `[num_tokens, hidden_size]`."""

    def forward(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        run_experts: Callable[[torch.Tensor, list[int]], torch.Tensor],
    ) -> torch.Tensor:
        """The routed experts' weighted output `[num_tokens, hidden_size]`: `dispatch`, then
        `run_experts(rows, rows_per_expert)` (the model's local experts), then `combine`. A dispatcher
        may override it to overlap communication with expert compute (`EPDispatcher`'s micro-batches)."""
        dispatched = self.dispatch(hidden, topk_ids, topk_weights)
        return self.combine(run_experts(dispatched.hidden, dispatched.rows_per_expert), dispatched.handle)


class LocalDispatcher(ExpertDispatcher):
    """All experts live on this device: a stable sort of (token, expert) pairs by expert id."""

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
