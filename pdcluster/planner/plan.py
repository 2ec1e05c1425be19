"""What `pdcluster plan` runs: workload, step models, simulation, P:D sweep, search and report."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdcluster.config import Topology, check_topology
from pdcluster.planner import DEFAULT_ACCEPTANCE
from pdcluster.planner.op_costs import dtype_bytes
from pdcluster.planner.rank_loss import RankLoss, describe_loss
from pdcluster.planner.search import (
    Evaluated,
    describe,
    fits_in_memory,
    memory_overflows,
    plan_yaml,
    search,
    spread_counts,
)
from pdcluster.planner.sim_options import SimOptions
from pdcluster.planner.sim_results import SimResult
from pdcluster.planner.simulator import pool_sizing, simulate
from pdcluster.planner.step_model import StepTimeModel
from pdcluster.planner.trace import TraceRequest
from pdcluster.planner.workload import plan_workload


@dataclass(frozen=True)
class PlanOptions:
    """The inputs of one plan besides the topology (see `pdcluster plan --help`); None means the default:
    DEFAULT_ACCEPTANCE per draft position, the file's weight dtype, `os.cpu_count()` cores per `cpu` node."""

    trace: str
    num_requests: int | None = None
    rate_per_s: float | None = None
    max_tokens_cap: int = 128
    scale_to_context: int | None = None
    acceptance_per_position: tuple[float, ...] | None = None
    seed: int = 0
    calibration: Path | None = None
    weight_dtype: str | None = None
    ep_imbalance: float | None = None
    search: bool = False
    search_num_requests: int = 500
    sweep: bool = True
    cores_per_node: float | None = None
    rank_losses: tuple[RankLoss, ...] = ()  # the plan's own simulation only (not the sweep or search)


def step_models(topology: Topology, options: PlanOptions) -> tuple[StepTimeModel, StepTimeModel]:
    """The performance model of one prefill and one decode instance (`planner.topology_models`)."""
    from pdcluster.planner.topology_models import perf_model_for

    kwargs: dict[str, Any] = {
        "calibration": options.calibration,
        "weight_dtype": weight_dtype_for(topology, options),
    }
    if options.ep_imbalance is not None:
        kwargs["ep_imbalance"] = options.ep_imbalance
    return perf_model_for(topology, "prefill", **kwargs), perf_model_for(topology, "decode", **kwargs)


def weight_dtype_for(topology: Topology, options: PlanOptions) -> str:
    """The plan's weight dtype: `options.weight_dtype`, else the file's `model.weight_dtype` resolved."""
    return options.weight_dtype or topology.model.resolved_weight_dtype(topology.hardware.spec)


def acceptance_for(topology: Topology, options: PlanOptions) -> tuple[float, ...]:
    """The acceptance per draft position, one per MTP draft of the decode pool."""
    k = topology.decode.num_speculative_tokens
    given = options.acceptance_per_position
    if given is None:
        return (DEFAULT_ACCEPTANCE,) * k
    if len(given) < k:  # the last given probability for the deeper positions
        return given + (given[-1],) * (k - len(given))
    return given


def simulate_topology(
    topology: Topology,
    requests: Sequence[TraceRequest],
    options: PlanOptions,
    rank_losses: Sequence[RankLoss] = (),
) -> SimResult:
    """`simulate` with `sim_options` and `rank_losses` (`planner.rank_loss`)."""
    return simulate(topology, requests, sim_options(topology, options), rank_losses=rank_losses)


def sim_options(topology: Topology, options: PlanOptions) -> SimOptions:
    """The perf model, the options' acceptance and seed, the calibration's control plane, the node's cores."""
    from pdcluster.planner.control_plane import control_plane_from_calibration

    prefill_model, decode_model = step_models(topology, options)
    return SimOptions(
        prefill_model,
        decode_model,
        acceptance_for(topology, options),
        options.seed,
        control_plane_from_calibration(options.calibration),
        cores_per_node(topology, options),
    )


def cores_per_node(topology: Topology, options: PlanOptions) -> float | None:
    """The cores a `cpu` node's instances share (`PlanOptions.cores_per_node`); None on accelerators."""
    if topology.hardware.spec.is_accelerator:
        return None
    return options.cores_per_node or float(os.cpu_count() or 1)


def pd_sweep(base: Topology) -> list[Topology]:
    """The file's split with the prefill instance count varied over what the hardware holds, each valid."""
    free = base.hardware.num_devices - base.decode.num_devices
    counts = set(spread_counts(free // base.prefill.devices_per_instance, 5)) | {base.prefill.num_instances}
    out = []
    for count in sorted(counts):
        candidate = dataclasses.replace(base, prefill=dataclasses.replace(base.prefill, num_instances=count))
        if count == base.prefill.num_instances or not check_topology(candidate):
            out.append(candidate)
    return out


@dataclass
class PlanOutcome:
    """What a plan produced."""

    description: str
    result: SimResult
    report_path: Path
    wall_s: float
    searched: list[Evaluated] = field(default_factory=list)
    plan_path: Path | None = None
    notes: list[str] = field(default_factory=list)
    num_devices: int = 0

    def per_device(self) -> dict[str, float]:
        """Output tokens/s, requests/s and goodput requests/s per device of the simulated cluster."""
        summary, n = self.result.summary, max(self.num_devices, 1)
        return {
            "output_tokens_per_s_per_device": summary["output_tokens_per_s"] / n,
            "requests_per_s_per_device": summary["requests_per_s"] / n,
            "goodput_requests_per_s_per_device": summary["goodput_requests_per_s"] / n,
        }

    def as_text(self) -> str:
        text = self.result.as_table(self.description)
        d = self.per_device()
        text += (
            f"\nper device ({self.num_devices} devices): {d['output_tokens_per_s_per_device']:.4g} output "
            f"tokens/s, {d['requests_per_s_per_device']:.4g} requests/s, "
            f"{d['goodput_requests_per_s_per_device']:.4g} goodput requests/s"
        )
        text += f"\nsimulated {len(self.result.results)} requests in {self.wall_s:.1f} s wall"
        for loss in self.result.rank_losses:
            text += "\n" + describe_loss(loss)
        if self.searched:
            best = self.searched[0]
            text += (
                f"\nsearch: {len(self.searched)} candidates; best {describe(best.topology)}: "
                f"{best.goodput_per_device:.4f} goodput req/s per device -> {self.plan_path}"
            )
        return "\n".join([text, *self.notes])

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"workload": self.description, **self.result.summary, "wall_s": self.wall_s}
        out["num_devices"] = self.num_devices
        out.update(self.per_device())
        out["report"] = str(self.report_path)
        if self.result.rank_losses:
            out["rank_losses"] = self.result.rank_losses
        if self.notes:
            out["notes"] = self.notes
        if self.searched:
            out["search"] = [
                {
                    "split": describe(e.topology),
                    "num_devices": e.num_devices,
                    "goodput_per_device": e.goodput_per_device,
                }
                for e in self.searched
            ]
            out["plan"] = str(self.plan_path)
        return out


def options_workload(topology: Topology, options: PlanOptions) -> Any:
    """The options' trace as `plan_workload` reads it for `topology`'s decode pool (its max_model_len)."""
    max_model_len = pool_sizing(topology, "decode").scheduler.max_model_len
    return plan_workload(
        options.trace,
        max_model_len,
        options.num_requests,
        options.rate_per_s,
        options.max_tokens_cap,
        options.scale_to_context,
    )


def run_plan(
    path: str | Path, topology: Topology, options: PlanOptions, out_dir: Path, show_progress: bool = True
) -> PlanOutcome:
    """Simulate `topology` on the options' trace, sweep P:D, search the splits that fit memory if asked, and
    write the report (and `out_dir/plan.yaml`). Raises FileNotFoundError or ValueError for a bad trace,
    option, calibration or model config, or a search with no valid split that fits."""
    from tqdm import tqdm

    from pdcluster.planner.report import write_report

    workload = options_workload(topology, options)
    weight_dtype = weight_dtype_for(topology, options)
    notes = [
        f"note: {path}'s own split does not fit device memory: {line}"
        for line in memory_overflows(topology, weight_dtype)
    ]
    candidates: list[Topology] = []
    if options.search:  # before any simulation: a search with nothing to rank fails at once
        from pdcluster.planner.search import candidate_topologies

        candidates, too_big = fits_in_memory(list(candidate_topologies(topology)), weight_dtype)
        if not candidates and not too_big:
            raise ValueError(f"{path}: no split of the hardware passes the topology rules")
        if not candidates:
            hint = "try --weight-dtype int8 (or model.weight_dtype: int8), or "
            hint = "" if dtype_bytes(weight_dtype) == 1 else hint
            raise ValueError(
                f"{path}: none of the {len(too_big)} splits that pass the topology rules fits device memory "
                f"with {weight_dtype} weights (e.g. {describe(too_big[0])}: "
                f"{'; '.join(memory_overflows(too_big[0], weight_dtype))}); {hint}lower kv_cache_memory_bytes"
            )
        notes.append(
            f"search: {len(too_big)} of {len(candidates) + len(too_big)} splits dropped because their "
            f"{weight_dtype} weights + kv_cache_memory_bytes exceed one device's memory"
        )
    start_s = time.perf_counter()
    result = simulate_topology(topology, workload.requests, options, options.rank_losses)
    wall_s = time.perf_counter() - start_s
    few = workload.requests[: options.search_num_requests]

    def evaluate(splits: list[Topology], what: str) -> list[Evaluated]:
        progress = tqdm(total=len(splits), desc=what, unit="split", disable=not show_progress)
        try:
            return search(
                topology,
                few,
                lambda t, r: simulate_topology(t, r, options),
                splits,
                lambda done, total: progress.update(1),
            )
        finally:
            progress.close()

    sweep = evaluate(pd_sweep(topology), "P:D sweep") if options.sweep else []
    searched: list[Evaluated] = []
    plan_path = None
    if options.search:
        searched = evaluate(candidates, "search")
        out_dir.mkdir(parents=True, exist_ok=True)
        plan_path = out_dir / "plan.yaml"
        best = searched[0]
        header = (
            f"Written by `pdcluster plan {path} --search` on {len(few)} requests of {workload.description}\n"
            f"best of {len(searched)} splits by goodput per device under the SLO: {describe(best.topology)}, "
            f"{best.goodput_per_device:.4f} req/s per device"
        )
        if weight_dtype != topology.model.resolved_weight_dtype(topology.hardware.spec):
            header += f"\nranked with {weight_dtype} weights (--weight-dtype; model.weight_dtype below)"
        plan_path.write_text(plan_yaml(path, best.topology, header, weight_dtype))
    report_path = write_report(
        out_dir,
        f"Capacity plan: {path}",
        f"{workload.description}. Step times: planner.perf_model "
        f"(calibration: {options.calibration or 'the catalog'}; "
        f"weights {weight_dtype}); "
        f"MTP acceptance per position {acceptance_for(topology, options)}."
        + "".join(f"\n\n{note}." for note in notes),
        result,
        sweep or searched,
        searched,
        plan_path,
    )
    devices = topology.prefill.num_devices + topology.decode.num_devices
    return PlanOutcome(workload.description, result, report_path, wall_s, searched, plan_path, notes, devices)
