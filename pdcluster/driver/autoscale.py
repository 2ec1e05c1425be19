"""Dynamic P:D: the controller that moves instances between the prefill and decode pools, and parks them.

A pure policy shared by the live cluster and the simulator (`planner.autoscale_sim`): no Ray, no torch.
Each pool's demand is counted in instances from the window's signals and a per-instance `Capacity`:

    arrivals(P) = prompt tokens/s arriving / prompt tokens/s of one instance (or the busy fraction summed,
                  where higher and its queue is within one TTFT SLO)
    arrivals(D) = max(requests in flight / batch one instance holds within the TPOT SLO,
                      KV blocks used / (blocks of one instance × KV_HIGH),
                      output tokens/s arriving / output tokens/s of one instance)
    prefill demand = max(arrivals(P) + queued prompt tokens / (prompt tokens/s of one instance × H), busy)
    decode demand  = arrivals(D) + output tokens queued in prefill / (output tokens/s of one instance × H)

with H = the TTFT SLO (a backlog drained within one, as its requests wait). Output tokens are
forecast at admission: each prompt entering prefill becomes a decode request of its max_tokens, so a prompt
burst that will become decode load raises both pools' demand (no such terms where the capacity has no
output tokens/s). Each demand is scaled up by how far the window's p90 TTFT (prefill) or TPOT (decode) is
over its SLO (at most SLO_PRESSURE_CAP). Utilization u = demand / instances (a moving instance counts in
the pool it goes to). A move from pool A to B is made when B's utilization, the higher, exceeds
`target_utilization`, the best split reachable by moves from A to B (the k minimizing
max(dA / (nA - k), dB / (nB + k))) lowers it by at least `hysteresis`, and A's arrivals (its backlog
passes; decode's held batch and KV, not the forecast, which lags a load moving away from it by the window)
stay within `target_utilization` after this move unless B is HOT_DONOR_RATIO times hotter; the
move's own cost (the leaving instance drains for `drain_s`, serving neither pool after it stops taking
work) is counted against its gain over one dwell time. At most one move per decision and
`max_moves_in_flight` under way at once (they may overlap); while moves are under way only more to the same
pool; within `dwell_s` of the last move's end the same, or a reversal to a pool its arrivals alone
overload (arrivals >= its instances); no parking then (unparking excepted: the SLO comes first); pools
kept within their bounds (>= 1).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

PREFILL, DECODE, PARKED = "prefill", "decode", "parked"
ROLES = (PREFILL, DECODE)
KV_HIGH = 0.9  # KV occupancy one decode instance is planned to reach at most
SLO_PRESSURE_CAP = 2.0  # the most a missed SLO multiplies a pool's demand
HOT_DONOR_RATIO = 3.0  # a donor left above target only for a pool this many times hotter


@dataclass(frozen=True)
class InstanceView:
    """One instance as the controller sees it; `instance_id` is stable across moves.
    role: `prefill`, `decode` or `parked`; `available`: False while it drains or switches (a move of it is
    in progress, to `moving_to`; None: its role); last_move_s: when its last move ended (-inf: never moved);
    queued_tokens: prefill prompt tokens queued or computing; batch: decode requests running or admitted
    waiting for a seat (not those reserved awaiting their prefill: prefill's load);
    drain_s: the seconds it needs to finish its work if it leaves its pool now; busy_fraction: of the
    window it spent computing steps (prefill; 0..1); queued_output_tokens: the expected output tokens
    (max_tokens) of the requests its queue holds (prefill: decode load on its way).
    """

    instance_id: int
    role: str
    available: bool = True
    last_move_s: float = -math.inf
    queued_tokens: int = 0
    batch: int = 0
    drain_s: float = 0.0
    busy_fraction: float = 0.0
    moving_to: str | None = None
    queued_output_tokens: int = 0


@dataclass(frozen=True)
class Signals:
    """The window's live signals: prompt tokens/s entering prefill, decode KV blocks held by admitted
    requests / total (0..1; blocks reserved for requests still in prefill are prefill's backlog),
    p90 TTFT and TPOT in seconds (None: no sample in the window); `window_full`: False until a whole
    window of samples exists (no decision then); `decode_tokens_per_s`: expected output tokens/s (their
    max_tokens) of the prompts entering prefill, the decode load on its way."""

    prefill_tokens_per_s: float
    kv_occupancy: float = 0.0
    ttft_p90_s: float | None = None
    tpot_p90_s: float | None = None
    window_full: bool = True
    decode_tokens_per_s: float = 0.0


@dataclass(frozen=True)
class Capacity:
    """One instance's capacity (`planner.autoscale_sim.capacity_from_models` prices it with the perf model):
    prompt tokens/s of a prefill instance, requests a decode instance holds within the TPOT SLO, and the
    output tokens/s it emits at that batch (0: unknown, no decode demand forecast from arrivals)."""

    prefill_tokens_per_s: float
    decode_batch: float
    decode_tokens_per_s: float = 0.0

    def __post_init__(self) -> None:
        if not (self.prefill_tokens_per_s > 0 and self.decode_batch > 0 and self.decode_tokens_per_s >= 0):
            raise ValueError(f"Capacity: prefill_tokens_per_s, decode_batch must be > 0, got {self}")


@dataclass(frozen=True)
class Policy:
    """The controller's knobs (`config.autoscale.AutoscaleConfig.policy` builds one from the YAML);
    bounds are (min, max) active instances per pool."""

    ttft_slo_s: float
    tpot_slo_s: float
    dwell_s: float = 30.0
    hysteresis: float = 0.15
    target_utilization: float = 0.8
    drain_timeout_s: float = 60.0
    park: bool = False
    park_below_utilization: float = 0.4
    max_moves_in_flight: int = 1
    prefill_bounds: tuple[int, int] = (1, 1 << 16)
    decode_bounds: tuple[int, int] = (1, 1 << 16)

    def bounds(self, role: str) -> tuple[int, int]:
        return self.prefill_bounds if role == PREFILL else self.decode_bounds


@dataclass(frozen=True)
class Move:
    """Move `instance_id` from `source` to `target` (a role or `parked`); `reason` is for the log."""

    instance_id: int
    source: str
    target: str
    reason: str


def arrival_demand(
    instances: Sequence[InstanceView],
    signals: Signals,
    capacity: Capacity,
    policy: Policy,
    forecast: bool = True,
) -> dict[str, float]:
    """Each pool's demand in instances from the load arriving and held, no backlog nor SLO pressure: prompt
    tokens/s over prefill's (or the busy fraction summed, unless a queue over one TTFT SLO keeps it busy);
    decode's max of its batch, KV and (`forecast`) output tokens/s terms."""
    prefills = [i for i in instances if i.role == PREFILL]
    prefill = signals.prefill_tokens_per_s / capacity.prefill_tokens_per_s
    queued_s = sum(i.queued_tokens for i in prefills) / (
        capacity.prefill_tokens_per_s * max(1, len(prefills))
    )
    if queued_s <= policy.ttft_slo_s:
        prefill = max(prefill, sum(i.busy_fraction for i in prefills))
    batch = sum(i.batch for i in instances if i.role == DECODE)
    num_decode = sum(1 for i in instances if i.role == DECODE)
    decode = max(batch / capacity.decode_batch, signals.kv_occupancy * num_decode / KV_HIGH)
    if forecast and capacity.decode_tokens_per_s > 0:
        decode = max(decode, signals.decode_tokens_per_s / capacity.decode_tokens_per_s)
    return {PREFILL: prefill, DECODE: decode}


def pool_demand(
    instances: Sequence[InstanceView], signals: Signals, capacity: Capacity, policy: Policy
) -> dict[str, float]:
    """Each pool's demand in instances (the formula in the module docstring)."""
    prefills = [i for i in instances if i.role == PREFILL]
    horizon_s = policy.ttft_slo_s
    arrivals = arrival_demand(instances, signals, capacity, policy)
    backlog = sum(i.queued_tokens for i in prefills) / (capacity.prefill_tokens_per_s * horizon_s)
    prefill = max(arrivals[PREFILL] + backlog, sum(i.busy_fraction for i in prefills))
    decode = arrivals[DECODE]
    if capacity.decode_tokens_per_s > 0:
        decode += sum(i.queued_output_tokens for i in prefills) / (capacity.decode_tokens_per_s * horizon_s)
    if signals.ttft_p90_s is not None and signals.ttft_p90_s > policy.ttft_slo_s:
        prefill *= min(signals.ttft_p90_s / policy.ttft_slo_s, SLO_PRESSURE_CAP)
    if signals.tpot_p90_s is not None and signals.tpot_p90_s > policy.tpot_slo_s:
        decode *= min(signals.tpot_p90_s / policy.tpot_slo_s, SLO_PRESSURE_CAP)
    return {PREFILL: prefill, DECODE: decode}


def decide(
    now_s: float,
    instances: Sequence[InstanceView],
    signals: Signals,
    capacity: Capacity,
    policy: Policy,
) -> Move | None:
    """The one move to make now, or None. Raises ValueError for an unknown role or duplicate ids."""
    ids = [i.instance_id for i in instances]
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate instance ids: {sorted(ids)}")
    for i in instances:
        if i.role not in (*ROLES, PARKED):
            raise ValueError(f"instance {i.instance_id}: unknown role {i.role!r}")
    moving = [i for i in instances if not i.available]
    if len(moving) >= policy.max_moves_in_flight or not signals.window_full:
        return None  # as many moves as allowed have not ended
    settled = [i for i in instances if i.available]
    count = {r: sum(1 for i in settled if i.role == r) for r in ROLES}
    if any(count[r] == 0 for r in ROLES):
        return None  # a pool without instances: nothing to measure (bounds keep a live one at >= 1)
    for i in moving:
        count[i.moving_to or i.role] = count.get(i.moving_to or i.role, 0) + 1
    demand = pool_demand(settled, signals, capacity, policy)
    arrivals = arrival_demand(settled, signals, capacity, policy)
    held = arrival_demand(settled, signals, capacity, policy, forecast=False)  # a donor's own load
    util = {r: demand[r] / count[r] for r in ROLES}
    peak = max(util.values())
    parked = [i for i in settled if i.role == PARKED]
    if parked and peak >= policy.target_utilization:
        return _unpark(parked, count, util, policy)
    last = max(instances, key=lambda i: i.last_move_s)
    direction = (moving[0].moving_to or moving[0].role) if moving else None
    if direction is None and now_s - last.last_move_s < policy.dwell_s:
        direction = last.role
    if direction is not None:
        # moves in flight or within the dwell: only one continuing them (to the same pool); a reversal waits
        move = (
            _rebalance(settled, count, demand, held, util, policy)
            if peak >= policy.target_utilization
            else None
        )
        if move is None:
            return None
        # a reversal within the dwell only for a pool its arrivals alone overload (the SLO comes first)
        overloaded = not moving and arrivals[move.target] >= count[move.target]
        return move if move.target == direction or overloaded else None
    if peak >= policy.target_utilization:
        return _rebalance(instances, count, demand, held, util, policy)
    if policy.park and peak < policy.park_below_utilization:
        return _park(settled, count, demand, policy)
    return None


def _cheapest(instances: Iterable[InstanceView], role: str, policy: Policy) -> InstanceView | None:
    """`role`'s instance cheapest to drain, then least loaded, if it drains within the policy's timeout."""
    ready = [i for i in instances if i.role == role]
    best = min(ready, key=lambda i: (i.drain_s, i.queued_tokens + i.batch, i.instance_id), default=None)
    return best if best is not None and best.drain_s <= policy.drain_timeout_s else None


def _rebalance(
    instances: Sequence[InstanceView],
    count: dict[str, int],
    demand: dict[str, float],
    arrivals: dict[str, float],
    util: dict[str, float],
    policy: Policy,
) -> Move | None:
    target = max(ROLES, key=lambda r: util[r])
    source = PREFILL if target == DECODE else DECODE
    most = min(count[source] - policy.bounds(source)[0], policy.bounds(target)[1] - count[target])
    if most < 1:
        return None
    peak = util[target]
    best = min(
        max(demand[source] / (count[source] - k), demand[target] / (count[target] + k))
        for k in range(1, most + 1)
    )
    if best > peak - policy.hysteresis:
        return None
    source_after = demand[source] / (count[source] - 1)
    after = max(source_after, demand[target] / (count[target] + 1))
    donor_after = arrivals[source] / (count[source] - 1)  # its backlog passes; its arrivals stay
    if donor_after > policy.target_utilization and peak < HOT_DONOR_RATIO * donor_after:
        return None  # both pools hot: the move would shift the backlog, and the next decision undo it
    candidate = _cheapest(instances, source, policy)
    if candidate is None:
        return None
    gain = (peak - after) * max(policy.dwell_s - candidate.drain_s, 0.0)
    loss = (source_after - util[source]) * candidate.drain_s  # the donor runs short while it drains
    if gain <= loss:
        return None
    return Move(
        candidate.instance_id,
        source,
        target,
        f"{target} utilization {peak:.2f} >= target {policy.target_utilization:.2f} "
        f"({target} demand {demand[target]:.2f} on {count[target]}, {source} demand "
        f"{demand[source]:.2f} on {count[source]}); after the move max {after:.2f}, best reachable "
        f"{best:.2f}, "
        f"drain {candidate.drain_s:.1f} s",
    )


def _park(
    instances: Sequence[InstanceView], count: dict[str, int], demand: dict[str, float], policy: Policy
) -> Move | None:
    for role in sorted(ROLES, key=lambda r: demand[r] / count[r]):
        if count[role] <= policy.bounds(role)[0]:
            continue
        after = demand[role] / (count[role] - 1)
        candidate = _cheapest(instances, role, policy)
        if after < policy.park_below_utilization and candidate is not None:
            return Move(
                candidate.instance_id,
                role,
                PARKED,
                f"low load: {role} utilization {demand[role] / count[role]:.2f}, {after:.2f} on "
                f"{count[role] - 1} (< {policy.park_below_utilization:.2f})",
            )
    return None


def _unpark(
    parked: Sequence[InstanceView], count: dict[str, int], util: dict[str, float], policy: Policy
) -> Move | None:
    hot = [r for r in ROLES if util[r] >= policy.target_utilization and count[r] < policy.bounds(r)[1]]
    if not hot:
        return None
    role = max(hot, key=lambda r: util[r])
    return Move(
        min(parked, key=lambda i: i.instance_id).instance_id,
        PARKED,
        role,
        f"load rose: {role} utilization {util[role]:.2f} >= {policy.target_utilization:.2f}",
    )


class SignalWindow:
    """The live signals over the last `window_s` seconds: prompt tokens entering prefill and their expected
    output tokens, TTFT and TPOT samples (seconds). Times are the caller's clock (seconds); samples older
    than the window are dropped."""

    def __init__(self, window_s: float) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._start_s: float | None = None
        self._prompts: deque[tuple[float, int, int]] = deque()  # (time, prompt tokens, expected output)
        self._ttft: deque[tuple[float, float]] = deque()
        self._tpot: deque[tuple[float, float]] = deque()

    def add_prompt(self, now_s: float, num_tokens: int, expected_output_tokens: int = 0) -> None:
        self._first(now_s)
        self._prompts.append((now_s, num_tokens, expected_output_tokens))

    def add_ttft(self, now_s: float, ttft_s: float) -> None:
        self._first(now_s)
        self._ttft.append((now_s, ttft_s))

    def add_tpot(self, now_s: float, tpot_s: float) -> None:
        self._first(now_s)
        self._tpot.append((now_s, tpot_s))

    def full(self, now_s: float) -> bool:
        """Whether a whole window has passed since the first sample (decide on nothing shorter)."""
        return self._start_s is not None and now_s - self._start_s >= self.window_s

    def mean_prompt_tokens(self) -> float | None:
        """Mean prompt length of the window's prompts (as of the last `signals`), None for none."""
        return sum(p[1] for p in self._prompts) / len(self._prompts) if self._prompts else None

    def _first(self, now_s: float) -> None:
        if self._start_s is None:
            self._start_s = now_s

    def signals(self, now_s: float, kv_occupancy: float) -> Signals:
        """The window ending at `now_s`; the rate divides by the window, or by the time since the first
        sample while that is shorter."""
        cutoff = now_s - self.window_s
        for samples in (self._prompts, self._ttft, self._tpot):
            while samples and samples[0][0] < cutoff:
                samples.popleft()
        span_s = self.window_s if self._start_s is None else min(self.window_s, now_s - self._start_s)
        num_tokens = sum(p[1] for p in self._prompts)
        num_output = sum(p[2] for p in self._prompts)
        rate, output_rate = (num_tokens / span_s, num_output / span_s) if span_s > 0 else (0.0, 0.0)
        ttft, tpot = p90(v for _, v in self._ttft), p90(v for _, v in self._tpot)
        return Signals(rate, kv_occupancy, ttft, tpot, self.full(now_s), output_rate)


def p90(values: Iterable[float]) -> float | None:
    """The 90th percentile (nearest rank), None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]
