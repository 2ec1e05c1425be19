"""A lost rank of a multi-rank instance, as the simulator prices it (elastic expert parallelism).

At `at_s` the instance stops stepping for `recovery_s` (given, or the pool's `elastic_stall_s`: how long the
live driver lets a silent rank's peers wait before it is lost; re-forming is not priced); the requests the
lost rank held lose their KV and go back through a prefill instance, the tokens already streamed kept as
prompt (a recompute). After it the instance serves on `n - 1` ranks: KV blocks `(n - 1) / n` of before, and
the routed experts re-placed on the survivors by `models.elastic_placement.shrink_placement` within the
slots a survivor's device memory holds (`driver.elastic_budget.survivor_expert_slots`, as live), whose
slowest rank carries more than EPLB's own placement would.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
from dataclasses import dataclass
from statistics import NormalDist

_SPEC = re.compile(r"^(prefill|decode)(\d+):(\d+)@([0-9.eE+-]+?)(?:\+([0-9.eE+-]+))?$")


@dataclass(frozen=True)
class RankLoss:
    """Rank `rank` of instance `instance` of pool `role` lost at `at_s` (seconds from the first arrival);
    the instance serves nothing for `recovery_s` (None: the pool's `elastic_stall_s`, `with_recovery`)."""

    role: str
    instance: int
    rank: int
    at_s: float
    recovery_s: float | None = None

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"rank loss: role must be prefill or decode, got {self.role!r}")
        if self.instance < 0 or self.rank < 0:
            raise ValueError(f"rank loss: instance and rank must be >= 0, got {self.instance}:{self.rank}")
        for name in ("at_s", "recovery_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"rank loss: {name} must be a finite number >= 0, got {value!r}")

    @property
    def label(self) -> str:
        recovery = "" if self.recovery_s is None else f"+{self.recovery_s:g}"
        return f"{self.role}{self.instance}:{self.rank}@{self.at_s:g}{recovery}"

    def with_recovery(self, elastic_stall_s: float) -> RankLoss:
        """This loss with `recovery_s` set: its own, else the pool's `elastic_stall_s`."""
        recovery_s = elastic_stall_s if self.recovery_s is None else self.recovery_s
        return dataclasses.replace(self, recovery_s=recovery_s)


def parse_rank_loss(text: str) -> RankLoss:
    """`ROLE INSTANCE:RANK@T[+R]`, e.g. `decode0:3@60` or `decode0:3@60+8` (seconds). Raises ValueError."""
    match = _SPEC.match(text.strip())
    if match is None:
        raise ValueError(
            f"--fail-rank {text!r}: expected ROLE INSTANCE:RANK@T[+RECOVERY_S], e.g. decode0:3@60 or "
            "prefill1:0@30+5 (ROLE prefill or decode; T and RECOVERY_S in seconds)"
        )
    role, instance, rank, at_s, recovery_s = match.groups()
    try:
        at, recovery = float(at_s), None if recovery_s is None else float(recovery_s)
    except ValueError:
        raise ValueError(f"--fail-rank {text!r}: T and RECOVERY_S must be numbers of seconds") from None
    return RankLoss(role, int(instance), int(rank), at, recovery)


def check_rank_loss(loss: RankLoss, num_instances: int, devices_per_instance: int, tp: int) -> None:
    """Raises ValueError unless the pool has that instance and rank and can lose one rank."""
    if loss.instance >= num_instances:
        raise ValueError(f"--fail-rank {loss.label}: the {loss.role} pool has {num_instances} instance(s)")
    if loss.rank >= devices_per_instance:
        raise ValueError(
            f"--fail-rank {loss.label}: a {loss.role} instance has ranks 0..{devices_per_instance - 1}"
        )
    if devices_per_instance < 2:
        raise ValueError(f"--fail-rank {loss.label}: a one-rank instance has no survivor to shrink to")
    if tp != 1:
        raise ValueError(
            f"--fail-rank {loss.label}: only instances of tensor_parallel_size 1 (DP attention + EP) shrink "
            f"by one rank; this pool has tensor_parallel_size {tp}"
        )


@dataclass(frozen=True)
class ShrunkExperts:
    """Routed experts after the loss: `num_physical` on the survivors, `num_loaded` read from the checkpoint,
    the slowest survivor's long-run load over the mean for the shrunk placement and for EPLB's own."""

    num_physical: int
    num_loaded: int
    shrunk_imbalance: float
    eplb_imbalance: float

    @property
    def relative_imbalance(self) -> float:
        """How much more the shrunk placement's slowest rank carries than EPLB's placement would (>= 1)."""
        return max(1.0, self.shrunk_imbalance / self.eplb_imbalance)


def shrink_experts(
    num_logical: int, num_physical: int, num_groups: int, num_nodes: int, num_ranks: int,
    popularity_sigma: float, lost_rank: int, max_local_experts: int,
) -> ShrunkExperts:  # fmt: skip
    """EPLB's placement of `num_physical` replicas on `num_ranks` (lognormal popularity, as
    `planner.imbalance.eplb_imbalance`), shrunk by `shrink_placement` after `lost_rank` is lost, the
    survivors' slots growing up to `max_local_experts`. Raises ValueError (`PlacementRefused`) as
    `shrink_placement`."""
    import torch

    from pdcluster.models.elastic_placement import shrink_placement
    from pdcluster.models.eplb import rebalance_experts
    from pdcluster.models.expert_placement import ExpertPlacement

    num_physical -= num_physical % num_ranks
    normal = NormalDist()
    loads = [math.exp(popularity_sigma * normal.inv_cdf((i + 0.5) / num_logical)) for i in range(num_logical)]
    random.Random(0).shuffle(loads)
    popularity = torch.tensor([loads], dtype=torch.float64)
    if num_physical >= num_logical:
        phy2log, _, _ = rebalance_experts(popularity, num_physical, num_groups, num_nodes, num_ranks)
    else:  # fewer slots than experts cannot serve: `ExpertPlacement` refuses it below
        phy2log = torch.arange(num_physical).view(1, -1)
    placement = ExpertPlacement.from_phy2log(phy2log, num_logical, num_ranks)
    # as the live instance shrinks (`engine.elastic_ep.plan_shrink`): experts alike, slots within budget
    shrunk = shrink_placement(placement, {lost_rank}, None, max_local_experts)
    survivors = num_ranks - 1
    after = shrunk.placement.rank_loads(popularity)[0].double()
    physical_after = shrunk.placement.num_physical_experts
    if physical_after >= num_logical and survivors > 1:
        phy2log, _, _ = rebalance_experts(popularity, physical_after, num_groups, 1, survivors)
        fresh = ExpertPlacement.from_phy2log(phy2log, num_logical, survivors).rank_loads(popularity)[0]
        eplb = float(fresh.max() / fresh.mean())
    else:
        eplb = 1.0
    return ShrunkExperts(physical_after, len(shrunk.loads), float(after.max() / after.mean()), eplb)


def shrunk_model(model, lost_rank: int, max_local_experts: int):
    """`(model of the instance on its survivors, ShrunkExperts or None without EP)`, a survivor holding at
    most `max_local_experts` slots. Raises ValueError for a step model with no roofline to shrink,
    `PlacementRefused` as `shrink_experts`."""
    from pdcluster.planner.perf_model import Parallelism, PerfModel

    if not isinstance(model, PerfModel):
        raise ValueError(
            f"--fail-rank prices the shrunk instance with the roofline model, not a {type(model).__name__}"
        )
    par, cfg = model.parallel, model.config
    ep, devices = par.expert_parallel_size, par.devices - 1
    if ep <= 1:
        return model.shrunk(
            Parallelism(devices, par.tensor_parallel_size, 1, par.num_redundant_experts), 1.0
        ), None
    nodes = max(1, ep // model.node_forwarding[0]) if model.node_forwarding else 1
    num_logical, sigma = cfg.n_routed_experts, model.efficiency.popularity_sigma.value
    physical = num_logical + par.num_redundant_experts
    groups = max(cfg.n_group, 1)
    experts = shrink_experts(num_logical, physical, groups, nodes, ep, sigma, lost_rank, max_local_experts)
    parallel = Parallelism(devices, 1, ep - 1, experts.num_physical - cfg.n_routed_experts)
    return model.shrunk(parallel, experts.relative_imbalance), experts


def lose_rank(engine, loss: RankLoss, num_ranks: int) -> list:
    """Take the lost rank's requests (`index % num_ranks == loss.rank`: DP attention spreads them) off
    `engine` and shrink its KV blocks to `(n - 1) / n`; running requests past the survivors' blocks are
    preempted. Prefill: the lost rank's jobs restart from their first token. Decode: returns the requests to
    dispatch again (see `requeue`)."""
    on_rank = [r for r in (*engine.running, *engine.waiting) if r.index % num_ranks == loss.rank]
    lost = []
    if engine.role == "prefill":
        for request in on_rank:
            if request in engine.running:
                engine._preempt(request)
    else:
        seated = [
            r
            for r in (*engine.waiting_for_seat, *engine.pending_admissions)
            if r.index % num_ranks == loss.rank
        ]
        for request in (*on_rank, *seated):
            engine._free(request)
            if request.num_reserved_blocks:  # its KV arrived, not admitted yet: the reservation is gone
                engine.num_free_blocks += request.num_reserved_blocks
                request.num_reserved_blocks = 0
                engine.num_reserved -= 1
            engine.requests.pop(request.request_id, None)
            lost.append(request)
        gone = set(lost)
        for name in ("running", "waiting", "waiting_for_seat", "pending_admissions"):
            setattr(engine, name, [r for r in getattr(engine, name) if r not in gone])
    num_after = engine.num_blocks * (num_ranks - 1) // num_ranks
    engine.num_free_blocks -= engine.num_blocks - num_after
    engine.num_blocks = num_after
    while engine.num_free_blocks < 0 and engine.running:
        engine._preempt(max(engine.running, key=lambda r: r.arrival_index))
    return lost


def loss_report(
    loss: RankLoss, now_s: float, num_ranks: int, lost: list, blocks_before: int, engine, experts
):
    """What `SimResult.rank_losses` says of one loss (`lost`: the decode requests sent back to prefill,
    counted before `requeue`)."""
    decode = loss.role == "decode"
    return {
        "loss": loss.label,
        "lost_at_s": now_s,
        "served_again_at_s": now_s + loss.recovery_s,
        "num_ranks_after": num_ranks - 1,
        "num_requests_recomputed": len(lost) if decode else None,
        "num_streamed_tokens_recomputed": sum(r.num_output_tokens for r in lost) if decode else None,
        "num_kv_blocks_before": blocks_before,
        "num_kv_blocks_after": engine.num_blocks,
        "experts": None if experts is None else {
            "num_physical_after": experts.num_physical,
            "num_loaded_from_checkpoint": experts.num_loaded,
            "ep_imbalance_shrunk": round(experts.shrunk_imbalance, 4),
            "ep_imbalance_eplb": round(experts.eplb_imbalance, 4),
        },
    }  # fmt: skip


def describe_loss(report: dict) -> str:
    """One line of `pdcluster plan`'s text for a `loss_report`."""
    text = (
        f"rank loss {report['loss']}: lost at {report['lost_at_s']:.3f} s, serving again at "
        f"{report['served_again_at_s']:.3f} s on {report['num_ranks_after']} ranks; KV blocks "
        f"{report['num_kv_blocks_before']} -> {report['num_kv_blocks_after']}"
    )
    if report["num_requests_recomputed"] is not None:
        text += (
            f"; {report['num_requests_recomputed']} requests lost their KV and were prefilled again "
            f"({report['num_streamed_tokens_recomputed']} streamed tokens recomputed)"
        )
    experts = report["experts"]
    if experts is not None:
        text += (
            f"; experts re-placed: {experts['num_physical_after']} replicas, "
            f"{experts['num_loaded_from_checkpoint']} loaded from the checkpoint, slowest EP rank "
            f"{experts['ep_imbalance_shrunk']:.3f} x the mean (EPLB's own placement on the survivors: "
            f"{experts['ep_imbalance_eplb']:.3f})"
        )
    return text


def requeue(request, now_s: float, timeout_s: float) -> None:
    """A decode request whose KV was lost: its streamed tokens become prompt, to prefill again (kept in
    `num_kept_tokens`; its first token time stays the one the client saw)."""
    kept = request.num_output_tokens
    request.num_kept_tokens += kept
    request.num_prompt_tokens += kept
    request.max_tokens -= kept
    request.num_output_tokens = request.num_computed_tokens = request.num_spec_tokens = 0
    request.num_blocks_held = request.num_reserved_blocks = 0
    request.prefill_start_s = request.prefill_end_s = request.admitted_s = None
    request.prefill_instance = request.decode_instance = -1
    request.deadline_s = now_s + timeout_s
