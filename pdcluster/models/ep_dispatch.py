"""Expert-parallel dispatch/combine over one instance's torch.distributed process group.

Per MoE layer on every rank: pick a replica per (token, expert) pair, `allgather` the counts, send rows
with an uneven `alltoall_base` (gloo refuses the list form), and return them by the reverse all-to-all.
Failures raise `EPCollectiveError`. Two-micro-batch overlap: DeepSeek-V3 report, section 3.4.
"""

from __future__ import annotations

import datetime
import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist

from pdcluster.models.expert_placement import ExpertPlacement
from pdcluster.models.moe_dispatch import Dispatched, ExpertDispatcher, ExpertsFn, weighted_sum


class EPCollectiveError(RuntimeError):
    """A collective of the instance's EP group failed or timed out; every rank's step fails."""


WAIT_SLICE_S = 0.05  # a blocked gloo wait checks this often whether its group was abandoned


class _Waits:
    """This process's instance-group waits (one rank per process): since when one is blocked (`blocked_s`),
    and whether the group was given up (`abandon`: blocked and later waits raise). Gloo waits are timed
    slices (a timed wait on NCCL / HCCL would block the host; their watchdog abort is the way out)."""

    def __init__(self) -> None:
        self.sliced, self.since_s = True, None
        self.abandoned = threading.Event()

    def watch(self, group: dist.ProcessGroup) -> None:
        """Waits are on `group` from now: sliced when it is gloo; not abandoned."""
        self.sliced = group.name() == "gloo"
        self.abandoned.clear()

    def abandon(self) -> None:
        self.abandoned.set()

    def blocked_s(self) -> float:
        """Seconds the current wait has been blocked (0.0: none)."""
        since_s = self.since_s
        return 0.0 if since_s is None else time.monotonic() - since_s


WAITS = _Waits()


def wait(work: dist.Work, what: str, rank: int, sliced: bool = True) -> None:
    """`work.wait()`; raises EPCollectiveError when it failed, timed out or `WAITS.abandon()` was called.
    `sliced` False: waited whole, never abandoned (gloo's send / recv: a timed wait fails them)."""
    try:
        WAITS.since_s = time.monotonic()
        if not (sliced and WAITS.sliced) or work.is_completed():
            work.wait()
            return
        slice_ = datetime.timedelta(seconds=WAIT_SLICE_S)
        while not WAITS.abandoned.is_set():
            try:
                work.wait(slice_)
                return
            except RuntimeError:
                if work.is_completed():  # failed, or done just after this slice ran out
                    work.wait()
                    return
        raise RuntimeError("abandoned: the instance group is re-formed without a lost rank")
    except Exception as e:  # noqa: BLE001
        raise EPCollectiveError(f"EP rank {rank}: {what} failed: {e}") from e
    finally:
        WAITS.since_s = None


def start_alltoall(
    group: dist.ProcessGroup, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int]
) -> tuple[dist.Work, torch.Tensor]:
    """Start an uneven all-to-all of rows [sum(send_counts), ...]; returns the work and the output
    [sum(recv_counts), ...], valid once the work is done."""
    out = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
    work = group.alltoall_base(out, rows.contiguous(), recv_counts, send_counts, dist.AllToAllOptions())
    return work, out


def alltoall(
    group: dist.ProcessGroup, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int], what: str
) -> torch.Tensor:
    work, out = start_alltoall(group, rows, send_counts, recv_counts)
    wait(work, what, group.rank())
    return out


@dataclass
class DispatchStats:
    """One MoE layer's dispatch figures since the last `take`.

    logical_load: [num_logical_experts] int64, this rank's (token, expert) pairs per logical expert
    rank_rows: [num_ranks] int64, rows every rank computed
    dispatch_s / combine_s / expert_s: seconds; *_bytes: row bytes sent to other ranks
    """

    logical_load: torch.Tensor
    rank_rows: torch.Tensor
    num_calls: int = 0
    dispatch_s: float = 0.0
    combine_s: float = 0.0
    expert_s: float = 0.0
    dispatch_bytes: int = 0
    combine_bytes: int = 0
    counts_bytes: int = 0
    _expert_start_s: float = field(default=0.0, repr=False)

    @classmethod
    def zeros(cls, num_logical_experts: int, num_ranks: int) -> DispatchStats:
        return cls(
            torch.zeros(num_logical_experts, dtype=torch.int64), torch.zeros(num_ranks, dtype=torch.int64)
        )


class EPDispatchHandle(NamedTuple):
    """What `combine` needs: each sent row's token and gate weight ([num_sent]), splits, the receive sort."""

    token_ids: torch.Tensor
    weights: torch.Tensor
    num_tokens: int
    send_counts: list[int]
    recv_counts: list[int]
    recv_order: torch.Tensor


class EPDispatcher(ExpertDispatcher):
    """`ExpertDispatcher` for one MoE layer of an EP rank.

    row: this layer's row in `placement` (`moe_layer_indices`); layer_idx: checked across ranks every call.
    """

    def __init__(
        self, group: dist.ProcessGroup, placement: ExpertPlacement, row: int, layer_idx: int
    ) -> None:
        if placement.num_ranks != group.size():
            raise ValueError(f"placement is for {placement.num_ranks} ranks, the group has {group.size()}")
        self.group = group
        self.rank = group.rank()
        self.row = row
        self.layer_idx = layer_idx
        self.stats = DispatchStats.zeros(placement.num_logical_experts, placement.num_ranks)
        self.overlap_micro_batches = False  # see `forward`; switch between steps on every rank alike
        self.set_placement(placement)

    def set_placement(self, placement: ExpertPlacement) -> None:
        """Use `placement` from the next call (between steps, on every rank alike)."""
        self.placement = placement
        self.num_local_experts = placement.num_local_experts
        self._log2phy = placement.log2phy[self.row]
        self._logcnt = placement.logcnt[self.row]

    def take_stats(self) -> DispatchStats:
        stats = self.stats
        self.stats = DispatchStats.zeros(self.placement.num_logical_experts, self.placement.num_ranks)
        return stats

    def choose_physical(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Physical expert [num_tokens * top_k] int64 of each flattened (token, logical expert) pair."""
        flat = topk_ids.reshape(-1)
        by_expert = flat.argsort(stable=True)
        sorted_ids = flat[by_expert]
        counts = torch.bincount(flat, minlength=self._logcnt.numel())
        first = counts.cumsum(0) - counts
        nth = torch.arange(flat.numel()) - first[sorted_ids]
        replica = (nth + self.rank) % self._logcnt[sorted_ids]
        physical = torch.empty_like(flat)
        physical[by_expert] = self._log2phy[sorted_ids, replica]
        return physical

    def plan(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, EPDispatchHandle, list[int]]:
        """Replica choice, counts exchange: rows to send [num_pairs, hidden_size], the handle, the rows each
        local expert gets. Raises EPCollectiveError: the exchange failed or ranks are at different layers."""
        num_tokens, top_k = topk_ids.shape
        num_ranks, num_local = self.group.size(), self.num_local_experts
        device = hidden.device
        flat_ids = topk_ids.reshape(-1).cpu()
        self.stats.logical_load += torch.bincount(flat_ids, minlength=self._logcnt.numel())
        physical = self.choose_physical(flat_ids)
        send_order = physical.argsort(stable=True)
        rows_per_physical = torch.bincount(physical, minlength=self.placement.num_physical_experts)

        # on the model's device: NCCL/HCCL collectives take device tensors only
        mine = torch.cat((torch.tensor([self.layer_idx]), rows_per_physical)).to(device)
        gathered = [torch.empty_like(mine) for _ in range(num_ranks)]
        what = f"counts exchange at MoE layer {self.layer_idx}"
        wait(self.group.allgather([gathered], [mine]), what, self.rank)
        table = torch.stack(gathered).cpu()  # [num_ranks, 1 + num_physical]
        if (table[:, 0] != self.layer_idx).any():
            raise EPCollectiveError(
                f"EP rank {self.rank}: ranks left lockstep: at MoE layer {self.layer_idx} here, layers "
                f"{table[:, 0].tolist()} by rank"
            )
        per_rank_slot = table[:, 1:].view(num_ranks, num_ranks, num_local)  # [src, dst, slot]
        send_counts = per_rank_slot[self.rank].sum(-1).tolist()
        from_sources = per_rank_slot[:, self.rank]  # [src, slot]
        recv_counts = from_sources.sum(-1).tolist()
        self.stats.rank_rows += per_rank_slot.sum((0, 2))
        slots = torch.arange(num_local).repeat(num_ranks)
        recv_order = slots.repeat_interleave(from_sources.reshape(-1)).argsort(stable=True).to(device)

        token_ids = (send_order // top_k).to(device)
        weights = topk_weights.reshape(-1)[send_order.to(device)].float()
        row_bytes = hidden.shape[-1] * hidden.dtype.itemsize
        self.stats.num_calls += 1
        self.stats.dispatch_bytes += (sum(send_counts) - send_counts[self.rank]) * row_bytes
        self.stats.counts_bytes += (num_ranks - 1) * mine.numel() * mine.dtype.itemsize
        handle = EPDispatchHandle(token_ids, weights, num_tokens, send_counts, recv_counts, recv_order)
        return hidden[token_ids], handle, from_sources.sum(0).tolist()

    def dispatch(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> Dispatched:
        """hidden: [num_tokens, hidden_size]; topk_ids/topk_weights: [num_tokens, top_k]. EPCollectiveError"""
        start_s = time.perf_counter()
        send_rows, handle, rows_per_expert = self.plan(hidden, topk_ids, topk_weights)
        what = f"dispatch at MoE layer {self.layer_idx}"
        recv_rows = alltoall(self.group, send_rows, handle.send_counts, handle.recv_counts, what)
        now_s = time.perf_counter()
        self.stats.dispatch_s += now_s - start_s
        self.stats._expert_start_s = now_s
        return Dispatched(recv_rows[handle.recv_order], rows_per_expert, handle)

    def _unsort(self, expert_out: torch.Tensor, handle: EPDispatchHandle) -> torch.Tensor:
        back = torch.empty_like(expert_out)
        back[handle.recv_order] = expert_out
        row_bytes = expert_out.shape[-1] * expert_out.dtype.itemsize
        self.stats.combine_bytes += (sum(handle.recv_counts) - handle.recv_counts[self.rank]) * row_bytes
        return back

    @staticmethod
    def _weighted_sum(returned: torch.Tensor, handle: EPDispatchHandle) -> torch.Tensor:
        return weighted_sum(returned, handle.token_ids, handle.weights, handle.num_tokens)

    def combine(self, expert_out: torch.Tensor, handle: EPDispatchHandle) -> torch.Tensor:  # type: ignore[override]
        """expert_out: [num_received_rows, hidden_size] -> [num_tokens, hidden_size]; EPCollectiveError."""
        start_s = time.perf_counter()
        self.stats.expert_s += start_s - self.stats._expert_start_s
        back = self._unsort(expert_out, handle)
        what = f"combine at MoE layer {self.layer_idx}"
        returned = alltoall(self.group, back, handle.recv_counts, handle.send_counts, what)
        out = self._weighted_sum(returned, handle)
        self.stats.combine_s += time.perf_counter() - start_s
        return out

    def forward(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, run_experts: ExpertsFn
    ) -> torch.Tensor:
        """With `overlap_micro_batches`, two halves whose all-to-alls overlap the other half's experts.

        Every rank issues the collectives in one order; a token's top-k rows stay in one micro-batch.
        """
        if not self.overlap_micro_batches:
            return super().forward(hidden, topk_ids, topk_weights, run_experts)
        start_s = time.perf_counter()
        half = (hidden.shape[0] + 1) // 2
        parts = [slice(0, half), slice(half, hidden.shape[0])]
        plans = [self.plan(hidden[p], topk_ids[p], topk_weights[p]) for p in parts]
        sends = [start_alltoall(self.group, rows, h.send_counts, h.recv_counts) for rows, h, _ in plans]
        self.stats.dispatch_s += time.perf_counter() - start_s
        combines = []
        for (work, received), (_, handle, rows_per_expert) in zip(sends, plans, strict=True):
            wait_s = time.perf_counter()
            wait(work, f"dispatch at MoE layer {self.layer_idx}", self.rank)
            expert_s = time.perf_counter()
            expert_out = run_experts(received[handle.recv_order], rows_per_expert)
            combine_s = time.perf_counter()
            back = self._unsort(expert_out, handle)
            combines.append(
                (*start_alltoall(self.group, back, handle.recv_counts, handle.send_counts), handle)
            )
            self.stats.dispatch_s += expert_s - wait_s
            self.stats.expert_s += combine_s - expert_s
            self.stats.combine_s += time.perf_counter() - combine_s
        combine_s = time.perf_counter()
        outs = []
        for work, returned, handle in combines:
            wait(work, f"combine at MoE layer {self.layer_idx}", self.rank)
            outs.append(self._weighted_sum(returned, handle))
        self.stats.combine_s += time.perf_counter() - combine_s
        return torch.cat(outs)
