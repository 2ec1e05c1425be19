"""One step of a `PerfModel` priced: ops on the roofline or kernel tables, EP communication, overlap, host."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdcluster.planner.op_costs import OpCost, RankWork
from pdcluster.planner.overlap import overlapped_s
from pdcluster.planner.step_model import StepShape
from pdcluster.planner.step_ops import ROUTED, op_groups

if TYPE_CHECKING:
    from pdcluster.planner.kernel_tables import KernelTables
    from pdcluster.planner.perf_model import PerfModel


@dataclass(frozen=True)
class StepBreakdown:
    """One step priced in seconds: per op name, compute, communication, host, total, and `hidden_comm_s`."""

    op_s: dict[str, float]
    compute_s: float
    comm_s: float
    host_s: float
    total_s: float
    compute_bound_ops: tuple[str, ...] = field(default=())
    hidden_comm_s: float = 0.0


def gemm_time_s(
    tables: KernelTables, layout: str, op: OpCost, peak_flops_per_s: float, peak_bytes_per_s: float
) -> tuple[float, bool]:
    """`(seconds, compute-bound?)` of one run of a GEMM op, at the tables' fractions per shape."""
    kn = sum(n * k * g for _, n, k, g in op.gemms)
    mkn = sum(m * (n + k) * g for m, n, k, g in op.gemms) or 1.0
    seconds, bound = 0.0, False
    for m, n, k, g in op.gemms:
        compute, memory = tables.gemm_fractions(layout, m, n, k)
        nbytes = op.weight_bytes * n * k * g / kn + op.activation_bytes * m * (n + k) * g / mkn
        compute_s = 2.0 * m * n * k * g / (peak_flops_per_s * compute)
        memory_s = nbytes / (peak_bytes_per_s * memory)
        seconds += max(compute_s, memory_s)
        bound = bound or compute_s > memory_s
    return seconds, bound


def _halved(work: RankWork) -> RankWork:
    return RankWork(*(getattr(work, f.name) / 2 for f in dataclasses.fields(RankWork)))


def price_step(model: PerfModel, step: StepShape, record: bool) -> StepBreakdown:
    """`step` on `model`'s slowest rank: serial, or two micro-batches where faster (SGLang) or
    `microbatch_overlap == "always"`."""
    work = model.rank_work(step)
    if work.num_tokens == 0:
        return StepBreakdown({}, 0.0, 0.0, 0.0, 0.0)
    split = model.microbatch_overlap and model.parallel.expert_parallel_size > 1
    if split and model.microbatch_overlap == "always":
        return _price(model, step, work, True, record)
    serial = _price(model, step, work, False, record)
    if split:
        overlapped = _price(model, step, work, True, record)
        if overlapped.total_s < serial.total_s:
            return overlapped
    return serial


def _price(model: PerfModel, step: StepShape, work: RankWork, overlap: bool, record: bool) -> StepBreakdown:
    decode_only = not step.prefill
    grouped = "masked" if decode_only else "contiguous"
    halves = 2 if overlap else 1
    half = _halved(work) if overlap else work
    groups = op_groups(model, step, half, 1.0 / halves)
    op_s: dict[str, float] = {}
    bound: list[str] = []
    sums = [0.0, 0.0, 0.0]
    num_ops = 0
    for i, ops in enumerate(groups):
        for op in ops:
            layout = grouped if op.name.endswith(ROUTED) else "dense"
            seconds, is_compute = model.op_time_s(op, layout, not decode_only)
            sums[i] += seconds * op.count
            num_ops += op.count
            if record:
                op_s[op.name] = op_s.get(op.name, 0.0) + seconds * op.count * halves
                if is_compute:
                    bound.append(op.name)
    rest_s, attn_s, experts_s = sums
    layers = model.num_moe_layers if groups[1] else 0
    seqs = len(step.prefill) + len(step.decode)
    dispatch_s, combine_s = model._ep_layer_s(half.num_tokens, step.num_tokens / halves, decode_only, seqs)
    other_comm_s = model._other_comm_s(step, half) * halves
    launch_s = num_ops * halves * model.efficiency.op_overhead_s.value
    compute_s = halves * (rest_s + attn_s + experts_s) + launch_s
    moe_comm_s = halves * layers * (dispatch_s + combine_s)
    if overlap and layers:
        table = model.tables.ep_decode if model.tables and decode_only else None
        if model.tables and not decode_only:
            table = model.tables.ep_prefill
        slow = 1.0 / (1.0 - table.comm_sm_fraction) if table else 1.0
        per_layer = (attn_s / layers * slow, experts_s / layers * slow, dispatch_s, combine_s)
        moe_s = overlapped_s(layers, *per_layer)
        device_s = halves * rest_s + moe_s + other_comm_s + launch_s
        hidden_s = halves * (attn_s + experts_s) + moe_comm_s - moe_s
    else:
        device_s = compute_s + moe_comm_s + other_comm_s
        hidden_s = 0.0
    host_s = model.efficiency.host_overhead_s.value
    comm_s = moe_comm_s + other_comm_s
    return StepBreakdown(op_s, compute_s, comm_s, host_s, device_s + host_s, tuple(bound), hidden_s)
