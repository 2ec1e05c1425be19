"""Re-forming one rank's expert parallelism over a new group of survivors (elastic EP): the rank keeps its
engine, KV cache and experts, takes its part of `shrink_placement` and reads only the missing experts.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from pdcluster.engine.expert_parallel import ExpertParallelRuntime
from pdcluster.models.deepseek_v3 import DeepseekV3MLP
from pdcluster.models.elastic_placement import ShrunkPlacement, shrink_placement
from pdcluster.models.ep_dispatch import EPCollectiveError, wait
from pdcluster.models.expert_placement import ExpertPlacement
from pdcluster.models.loader import (
    FP8_DTYPES,
    SCALE_SUFFIX,
    _iter_tensors,
    dequantize_fp8_blockwise,
    inspect_checkpoint,
)

# NCCL / HCCL watchdog aborts (they cannot run here: no GPU / NPU): how torch's ProcessGroupNCCL and
# torch_npu's ProcessGroupHCCL report a collective their watchdog timed out or a communicator it aborted,
# raised from `Work.wait` or from the next op on the stream. The same lost-peer event as gloo's errors.
WATCHDOG_ABORTS = (
    "Watchdog caught collective operation timeout",  # WorkNCCL(...) / WorkHCCL(...) ran for N ms ...
    "NCCL communicator was aborted",
    "ncclRemoteError",
    "ncclSystemError",
    "HCCL function error",
)


def lost_peer(error: BaseException) -> bool:
    """`error` or one of its causes is an `EPCollectiveError` or an NCCL / HCCL watchdog abort."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, EPCollectiveError) or any(m in str(seen) for m in WATCHDOG_ABORTS):
            return True
        seen = seen.__cause__
    return False


def roll_back_step(scheduler: Any, output: Any, error: BaseException) -> bool:
    """Undo `scheduler.schedule()`'s `output` after it failed on a lost peer (`lost_peer(error)`, else False):
    each request is back at its step's start with its blocks and committed KV (drafts dropped), to run again
    on the re-formed group; the step's finished and preempted ids go to the next step."""
    if not lost_peer(error):
        return False
    for item in output.scheduled:
        request = item.request
        if scheduler.requests.get(request.request_id) is not request:
            continue
        request.num_computed_tokens = item.start_position
        if item.samples:
            request.num_output_placeholders -= len(item.spec_token_ids) + 1
        request.spec_token_ids = []
    scheduler._finished_request_ids[:0] = output.finished_request_ids + output.preempted_request_ids
    return True


def plan_shrink(
    runtime: ExpertParallelRuntime, lost_ranks: frozenset[int], max_local_experts: int | None
) -> ShrunkPlacement:
    """The survivors' placement with every expert weighted alike (`max_local_experts` None: a survivor may
    hold every logical expert): raises `PlacementRefused` before any collective when they cannot."""
    return shrink_placement(runtime.placement, lost_ranks, None, _max_slots(runtime, max_local_experts))


def _max_slots(runtime: ExpertParallelRuntime, max_local_experts: int | None) -> int:
    return runtime.placement.num_logical_experts if max_local_experts is None else max_local_experts


def shrink_runtime(
    runtime: ExpertParallelRuntime,
    group: dist.ProcessGroup,
    lost_ranks: frozenset[int],
    max_local_experts: int | None,
    checkpoint: str,
) -> tuple[ExpertParallelRuntime, ShrunkPlacement]:
    """A new `ExpertParallelRuntime` for this rank over `group` (the survivors, in old rank order) holding
    its share of the shrunk placement; collective over `group`. Raises PlacementRefused: the survivors
    cannot hold every logical expert; EPCollectiveError: the load allreduce failed or timed out;
    CheckpointError: an expert's tensors are missing from `checkpoint`."""
    load = sum(runtime._load_window, runtime._logical_zero.clone()).to(runtime.device)
    wait(group.allreduce([load]), "elastic EP load allreduce", group.rank())
    load = load.cpu().double() + 1.0  # +1: an expert never routed to still sorts by id, not at random
    base, mixed = _common_placement(runtime, group)
    shrunk = shrink_placement(base, lost_ranks, load, _max_slots(runtime, max_local_experts))
    new_rank = group.rank()
    if shrunk.survivors[new_rank] != runtime.rank or len(shrunk.survivors) != group.size():
        raise ValueError(
            f"group rank {new_rank} of {group.size()} is not old rank {runtime.rank} among survivors "
            f"{shrunk.survivors}"
        )
    _grow_slots(runtime, shrunk.placement.num_local_experts)
    loads = [(row, slot, e) for row, r, slot, e in shrunk.loads if r == new_rank]
    if mixed:  # this rank's slots may not be what `base` says: every one read again
        mine = shrunk.placement.local_logical_experts
        loads = [
            (row, slot, e) for row in range(base.num_moe_layers) for slot, e in enumerate(mine(row, new_rank))
        ]
    _load_experts(runtime, checkpoint, loads)
    placement = shrunk.placement
    parallel = dataclasses.replace(
        runtime.parallel,
        expert_parallel_size=group.size(),
        rank=new_rank,
        data_parallel_size=None,
        num_redundant_experts=placement.num_physical_experts - placement.num_logical_experts,
        eplb_num_nodes=1,
    )
    new = ExpertParallelRuntime(runtime.model, parallel, group, placement)
    new.num_rebalances = 0
    return new, shrunk


def _common_placement(
    runtime: ExpertParallelRuntime, group: dist.ProcessGroup
) -> tuple[ExpertPlacement, bool]:
    """The placement the survivors shrink from (collective over `group`): theirs, or, when a rank was lost
    in the middle of an EPLB rebalance and only some survivors switched (`ExpertParallelRuntime.rebalance`
    applies moved weights once its own transfers are done), the newest one, broadcast by the first survivor
    that has it; True then (slots may differ from it on the others)."""
    rank, version = group.rank(), runtime.num_rebalances
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MAX
    flags = torch.tensor([version, -version], dtype=torch.int64, device=runtime.device)
    wait(group.allreduce([flags], options), "elastic EP placement agreement", rank)
    newest, oldest = int(flags[0]), -int(flags[1])
    if newest == oldest:
        return runtime.placement, False
    first = torch.tensor(
        [rank if version == newest else group.size()], dtype=torch.int64, device=flags.device
    )
    options.reduceOp = dist.ReduceOp.MIN
    wait(group.allreduce([first], options), "elastic EP placement agreement", rank)
    phy2log = runtime.placement.phy2log.to(device=flags.device, dtype=torch.int64, copy=True)
    root = dist.BroadcastOptions()
    root.rootRank = int(first)
    wait(group.broadcast([phy2log], root), "elastic EP placement broadcast", rank)
    placement = runtime.placement
    return ExpertPlacement.from_phy2log(
        phy2log.cpu(), placement.num_logical_experts, placement.num_ranks
    ), True


def grow_runtime(
    runtime: ExpertParallelRuntime, group: dist.ProcessGroup, num_redundant_experts: int, checkpoint: str
) -> tuple[ExpertParallelRuntime, int]:
    """A new runtime for this rank over the grown `group` with `ExpertPlacement.default` (experts held are
    kept, others read from `checkpoint`), keeping its load window for an EPLB rebalance at the first step
    with work. Returns it and how many experts were read. No collective.

    Raises ValueError: experts plus `num_redundant_experts` do not split over the group.
    """
    old, rank = runtime.placement, group.rank()
    new = ExpertPlacement.default(
        old.num_moe_layers, old.num_logical_experts, group.size(), num_redundant_experts
    )
    loads = []
    for row, moe in enumerate(runtime.moe):
        held = dict(zip(old.local_logical_experts(row, runtime.rank), moe.experts, strict=True))
        slots = []
        for slot, expert in enumerate(new.local_logical_experts(row, rank)):
            module = held.pop(expert, None)
            if module is None:
                module = copy.deepcopy(moe.experts[0])
                loads.append((row, slot, expert))
            slots.append(module)
        moe.experts = torch.nn.ModuleList(slots)
    _load_experts(runtime, checkpoint, loads)
    parallel = dataclasses.replace(
        runtime.parallel,
        expert_parallel_size=group.size(),
        rank=rank,
        data_parallel_size=None,
        num_redundant_experts=num_redundant_experts,
    )
    grown = ExpertParallelRuntime(runtime.model, parallel, group, new)
    grown._load_window.extend(runtime._load_window)  # (logical loads: placement-independent)
    grown.rebalance_requested = True
    return grown, len(loads)


def _grow_slots(runtime: ExpertParallelRuntime, num_slots: int) -> None:
    """Append empty expert slots to every MoE layer up to `num_slots` (same device and dtype)."""
    cfg = runtime.model.config
    for moe in runtime.moe:
        like = next(moe.experts[0].parameters())
        while len(moe.experts) < num_slots:
            expert = DeepseekV3MLP(cfg.hidden_size, cfg.moe_intermediate_size)
            moe.experts.append(expert.to(device=like.device, dtype=like.dtype))


@torch.no_grad()
def _load_experts(runtime: ExpertParallelRuntime, checkpoint: str, loads: list[tuple[int, int, int]]) -> None:
    """Read logical expert e's weights from `checkpoint` into local slot `slot` of MoE row `row`."""
    if not loads:
        return
    layout = inspect_checkpoint(checkpoint)
    block_size = tuple((layout.config.quantization_config or {}).get("weight_block_size", (128, 128)))
    targets: dict[str, list[torch.Tensor]] = {}
    for row, slot, expert in loads:
        layer = runtime.layer_indices[row]
        for proj, param in runtime.moe[row].experts[slot].named_parameters():
            targets.setdefault(f"model.layers.{layer}.mlp.experts.{expert}.{proj}", []).append(param)
    for name, tensor in _iter_tensors(layout.files, list(targets)):
        if tensor.dtype in FP8_DTYPES:
            ((_, scale_inv),) = _iter_tensors(layout.files, [name + SCALE_SUFFIX])
            tensor = dequantize_fp8_blockwise(tensor, scale_inv, block_size)  # type: ignore[arg-type]
        for param in targets[name]:
            param.copy_(tensor.to(param.dtype))
