"""The EP side of one rank's engine: lockstep agreement, expert-load window, EPLB rebalancing, EP figures."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.grow_vote import GrowVote
from pdcluster.engine.parallel import ParallelConfig
from pdcluster.models.config import DeepseekV3Config
from pdcluster.models.deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV3MoE
from pdcluster.models.ep_dispatch import WAITS, EPCollectiveError, EPDispatcher, wait
from pdcluster.models.eplb import rebalance_experts
from pdcluster.models.expert_placement import ExpertPlacement, moe_layer_indices
from pdcluster.models.loader import inspect_checkpoint, load_checkpoint


@dataclass(frozen=True)
class EPStats:
    """Expert-parallel figures of one rank (`LLMEngine.ep_stats()`), for /metrics and benchmarks.

    expert_load: `[num_moe_layers][num_logical_experts]` (token, expert) pairs of this rank per logical
    rank_rows: `[num_moe_layers][num_ranks]` rows each rank's experts computed since the last
    """

    rank: int
    num_ranks: int
    moe_layers: list[int]
    num_steps: int
    num_idle_steps: int
    expert_load: list[list[int]]
    rank_rows: list[list[int]]
    imbalance: list[float]
    total_imbalance: float
    dispatch_s: float
    combine_s: float
    expert_s: float
    dispatch_bytes: int
    combine_bytes: int
    counts_bytes: int
    num_rebalances: int
    rebalance_s: float
    last_rebalance_s: float
    rebalance_moved_bytes: int


def default_placement(config: DeepseekV3Config, parallel: ParallelConfig) -> ExpertPlacement:
    """The placement an instance starts with (`ExpertPlacement.default`: no load known yet).
    Raises ValueError: `n_routed_experts + num_redundant_experts` not a multiple of expert_parallel_size."""
    return ExpertPlacement.default(
        len(moe_layer_indices(config)),
        config.n_routed_experts,
        parallel.expert_parallel_size,
        parallel.num_redundant_experts,
    )


def load_rank_shard(
    path: str, parallel: ParallelConfig, device: str, dtype: torch.dtype
) -> tuple[DeepseekV3ForCausalLM, ExpertPlacement]:
    """This rank's model shard (its experts only, read from the checkpoint alone) and its placement."""
    placement = default_placement(inspect_checkpoint(path).config, parallel)
    model = load_checkpoint(path, device=device, dtype=dtype, placement=placement, ep_rank=parallel.rank)
    return model, placement


def setup_expert_parallel(
    config: EngineConfig,
    model: DeepseekV3ForCausalLM | None,
    group: dist.ProcessGroup | None,
    dtype: torch.dtype,
) -> tuple[DeepseekV3ForCausalLM | None, ExpertParallelRuntime | None]:
    """`(model, runtime)` for an engine: on one device `(model, None)` unchanged; with EP this rank's shard
    (`model` None: loaded with `load_rank_shard`; else a shard built for `default_placement`) and its
    `ExpertParallelRuntime`.
    Raises ValueError: EP without a process group, or a group/model that does not fit the config."""
    parallel = config.parallel
    if not parallel.enabled:
        return model, None
    if group is None:
        raise ValueError(
            f"expert_parallel_size {parallel.expert_parallel_size} needs the instance process group "
            "(LLMEngine(config, group=engine.parallel.make_instance_group(...)))"
        )
    if model is None:
        model, placement = load_rank_shard(config.model, parallel, config.device, dtype)
    else:
        placement = default_placement(model.config, parallel)
    return model, ExpertParallelRuntime(model, parallel, group, placement)


def max_over_mean(rows: torch.Tensor) -> torch.Tensor:
    """max / mean over the last dimension; 1.0 where the mean is 0."""
    mean = rows.float().mean(-1)
    return torch.where(mean > 0, rows.float().max(-1).values / mean.clamp(min=1e-12), torch.ones_like(mean))


class ExpertParallelRuntime:
    """See the module docstring.
    Raises ValueError: the group's size or rank disagree with `parallel`, or the model is not such a shard."""

    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        parallel: ParallelConfig,
        group: dist.ProcessGroup,
        placement: ExpertPlacement,
    ) -> None:
        if group.size() != parallel.expert_parallel_size or group.rank() != parallel.rank:
            raise ValueError(
                f"process group is rank {group.rank()} of {group.size()}, but the parallel config says rank "
                f"{parallel.rank} of expert_parallel_size {parallel.expert_parallel_size}"
            )
        self.model, self.parallel, self.group, self.placement = model, parallel, group, placement
        WAITS.watch(group)
        self.rank, self.num_ranks = parallel.rank, parallel.expert_parallel_size
        self.device = next(model.parameters()).device
        self.layer_indices = moe_layer_indices(model.config)
        self.moe: list[DeepseekV3MoE] = [model.model.layers[i].mlp for i in self.layer_indices]
        for layer_idx, moe in zip(self.layer_indices, self.moe, strict=True):
            if len(moe.experts) != placement.num_local_experts:
                raise ValueError(
                    f"MoE layer {layer_idx} holds {len(moe.experts)} experts; this rank's shard needs "
                    f"{placement.num_local_experts} (models.loader.load_checkpoint(placement=...) builds it)"
                )
        self.dispatchers = [
            EPDispatcher(group, placement, row, layer_idx) for row, layer_idx in enumerate(self.layer_indices)
        ]
        for moe, dispatcher in zip(self.moe, self.dispatchers, strict=True):
            moe.dispatcher = dispatcher
        self.set_micro_batch_overlap(parallel.enable_micro_batch_overlap)
        num_layers, num_logical = len(self.moe), placement.num_logical_experts
        self._load_window: deque[torch.Tensor] = deque(maxlen=parallel.eplb_window_steps)
        self._rank_rows = torch.zeros(num_layers, self.num_ranks, dtype=torch.int64)
        self._logical_zero = torch.zeros(num_layers, num_logical, dtype=torch.int64)
        self._totals = dict.fromkeys(
            ("dispatch_s", "combine_s", "expert_s", "dispatch_bytes", "combine_bytes", "counts_bytes"), 0
        )
        self.num_steps = self.num_idle_steps = self.num_rebalances = 0
        self.last_stepped = False
        self.rebalance_requested = False  # one rank asking is enough: every rank rebalances at its next step
        self.failure: str | None = None
        self.grow_vote: GrowVote | None = None  # a survivor's vote to switch to a grown group
        self.rebalance_s = self.last_rebalance_s = 0.0
        self.rebalance_moved_bytes = 0

    def begin_step(self, has_work: bool, num_speculative_tokens: int) -> bool:
        """The step's agreement (one collective; see the module docstring), then a rebalance when due.
        Raises EPCollectiveError: the collective failed or timed out, the ranks disagree on k or placement,
        or the instance failed before (`failure`)."""
        if self.failure is not None:
            raise EPCollectiveError(self.failure)
        k, version, vote = num_speculative_tokens, self.num_rebalances, self.grow_vote
        ready = vote.contribute() if vote is not None else 0
        flags = torch.tensor(
            [int(has_work), k, -k, version, -version, int(self.rebalance_requested), -ready],
            dtype=torch.int64,
            device=self.device,
        )
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        agreed = False
        try:
            wait(self.group.allreduce([flags], options), "step agreement", self.rank)
            flags, agreed = flags.cpu(), True
        finally:
            if vote is not None:  # every rank voted ready: the MIN of the votes is 1
                vote.resolve(agreed and int(flags[-1]) == -1)
        any_work, max_k, min_k, max_version, min_version, requested, _ = flags.tolist()
        min_k, min_version = -min_k, -min_version
        if max_k != min_k:
            raise EPCollectiveError(
                f"EP rank {self.rank}: ranks disagree on num_speculative_tokens (from {min_k} to {max_k}); "
                "every rank of an instance needs the same engine settings"
            )
        if max_version != min_version:
            raise EPCollectiveError(
                f"EP rank {self.rank}: ranks at different expert placements (rebalances {min_version} to "
                f"{max_version}): lockstep was lost"
            )
        stepped = self.last_stepped = bool(any_work)
        if stepped and (self.rebalance_due() or requested):
            self.rebalance()
            self.rebalance_requested = False
        return stepped

    def end_step(self, stepped: bool, was_idle: bool) -> None:
        """Fold the dispatchers' figures of the step just run into the window and totals."""
        if not stepped:
            return
        self.num_steps += 1
        self.num_idle_steps += int(was_idle)
        loads = []
        for row, dispatcher in enumerate(self.dispatchers):
            stats = dispatcher.take_stats()
            loads.append(stats.logical_load)
            self._rank_rows[row] += stats.rank_rows
            for name in self._totals:
                self._totals[name] += getattr(stats, name)
        self._load_window.append(torch.stack(loads))

    def set_micro_batch_overlap(self, enabled: bool) -> None:
        """Switch two-micro-batch overlap on or off (between steps, on every rank alike: the collectives'
        order changes with it).
        """
        for dispatcher in self.dispatchers:
            dispatcher.overlap_micro_batches = enabled

    def reset_window(self) -> None:
        """Forget the expert-load window and the rows per rank (benchmarks: measure a phase alone)."""
        self._load_window.clear()
        self._rank_rows.zero_()

    def rebalance_due(self) -> bool:
        interval = self.parallel.eplb_interval_steps
        return interval is not None and self.num_steps > 0 and self.num_steps % interval == 0

    def rebalance(self) -> ExpertPlacement:
        """Compute the new placement from the window's instance-wide load, move expert weights, switch the
        dispatch maps (see the module docstring).
        Raises EPCollectiveError: a collective or transfer failed or timed out."""
        start_s = time.perf_counter()
        load = sum(self._load_window, self._logical_zero.clone()).to(self.device)
        wait(self.group.allreduce([load]), "EPLB load allreduce", self.rank)
        load = load.cpu()
        cfg = self.model.config
        phy2log, log2phy, logcnt = rebalance_experts(
            load,
            self.placement.num_physical_experts,
            cfg.n_group,
            self.parallel.eplb_num_nodes,
            self.num_ranks,
        )
        new = ExpertPlacement(phy2log, log2phy, logcnt, self.num_ranks)
        self._move_weights(self.placement, new)
        self.placement = new
        for dispatcher in self.dispatchers:
            dispatcher.set_placement(new)
        self._rank_rows.zero_()
        self.num_rebalances += 1
        self.last_rebalance_s = time.perf_counter() - start_s
        self.rebalance_s += self.last_rebalance_s
        return new

    def _move_weights(self, old: ExpertPlacement, new: ExpertPlacement) -> None:
        """Give every local slot the weights of its new logical expert."""
        n = old.num_local_experts
        works: list[tuple[dist.Work, str]] = []
        received: list[tuple[int, int, torch.Tensor]] = []
        copies: list[tuple[int, int, torch.Tensor]] = []
        tag = 0
        for row in range(old.num_moe_layers):
            experts = self.moe[row].experts
            for phy in range(old.num_physical_experts):
                logical = int(new.phy2log[row, phy])
                if int(old.phy2log[row, phy]) == logical:
                    continue
                src_phy = int(old.log2phy[row, logical, 0])
                dst_rank, src_rank = phy // n, src_phy // n
                tag += 1
                if dst_rank == src_rank == self.rank:
                    copies.append((row, phy % n, _flat(experts[src_phy % n])))
                elif src_rank == self.rank:
                    buf = _flat(experts[src_phy % n])
                    works.append((self.group.send([buf], dst_rank, tag), f"EPLB send of layer row {row}"))
                    copies.append((-1, -1, buf))
                elif dst_rank == self.rank:
                    buf = torch.empty_like(_flat(experts[phy % n]))
                    works.append((self.group.recv([buf], src_rank, tag), f"EPLB recv of layer row {row}"))
                    received.append((row, phy % n, buf))
        for work, what in works:
            wait(work, what, self.rank, sliced=False)
        for row, slot, flat in copies + received:
            if row >= 0:
                _unflat(self.moe[row].experts[slot], flat)
        self.rebalance_moved_bytes += sum(buf.numel() * buf.element_size() for _, _, buf in received)

    def stats(self) -> EPStats:
        window = sum(self._load_window, self._logical_zero.clone())
        per_layer = max_over_mean(self._rank_rows)
        total = float(max_over_mean(self._rank_rows.sum(0)))
        return EPStats(
            rank=self.rank,
            num_ranks=self.num_ranks,
            moe_layers=list(self.layer_indices),
            num_steps=self.num_steps,
            num_idle_steps=self.num_idle_steps,
            expert_load=window.tolist(),
            rank_rows=self._rank_rows.tolist(),
            imbalance=per_layer.tolist(),
            total_imbalance=total,
            dispatch_s=float(self._totals["dispatch_s"]),
            combine_s=float(self._totals["combine_s"]),
            expert_s=float(self._totals["expert_s"]),
            dispatch_bytes=int(self._totals["dispatch_bytes"]),
            combine_bytes=int(self._totals["combine_bytes"]),
            counts_bytes=int(self._totals["counts_bytes"]),
            num_rebalances=self.num_rebalances,
            rebalance_s=self.rebalance_s,
            last_rebalance_s=self.last_rebalance_s,
            rebalance_moved_bytes=self.rebalance_moved_bytes,
        )


def _flat(expert: torch.nn.Module) -> torch.Tensor:
    """An expert's parameters as one flat tensor (a copy; parameter order as in `parameters()`)."""
    return torch.cat([p.detach().reshape(-1) for p in expert.parameters()])


@torch.no_grad()
def _unflat(expert: torch.nn.Module, flat: torch.Tensor) -> None:
    """Write `_flat`'s layout back into the expert's parameters."""
    offset = 0
    for p in expert.parameters():
        p.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
