"""Dynamic P:D simulated: `ClusterSimulator` with the live controller (`driver.autoscale.decide`) moving
single-device instances between the pools every `autoscale.interval_s`.

A move as the live cluster makes it: the instance leaves routing; a leaving prefill instance finishes its
queue and handoffs, a leaving decode instance its reserved and running requests (its new reserves are
routed again), within `drain_timeout_s` or the move is aborted and it serves on; then after `switch_s`
it serves in the other role with that pool's scheduler and KV size, or is parked.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdcluster.config import Topology
from pdcluster.config.autoscale import AutoscaleConfig
from pdcluster.config.slo import DEFAULT_TPOT_SLO_MS, DEFAULT_TTFT_SLO_MS
from pdcluster.driver.autoscale import DECODE, PARKED, PREFILL, Capacity, InstanceView, SignalWindow, decide
from pdcluster.driver.autoscale_capacity import capacity_from_models, tokens_per_step
from pdcluster.planner.sim_engine import SimEngine, SimRequest
from pdcluster.planner.sim_options import SimOptions
from pdcluster.planner.sim_results import SimResult
from pdcluster.planner.simulator import ClusterSimulator, run_simulation
from pdcluster.planner.sizing import pool_sizing
from pdcluster.planner.step_model import DecodeRow, StepShape
from pdcluster.planner.trace import TraceRequest

DEFAULT_SWITCH_S = 1.0  # seconds from drained to serving in the other role (role object swapped, no reload)
_TICK = object()  # the controller's tick, queued as an arrival


@dataclass
class MoveRecord:
    """One move: decided at `decided_s`, serving in its new role from `done_s`; outcome done / aborted."""

    decided_s: float
    instance_id: int
    source: str
    target: str
    reason: str
    done_s: float | None = None
    outcome: str = "in progress"


@dataclass
class AutoscaleResult:
    """A simulation with the controller: the usual result, its moves, and (time_s, prefill, decode, parked)
    active instance counts after each change."""

    result: SimResult
    moves: list[MoveRecord] = field(default_factory=list)
    roles: list[tuple[float, int, int, int]] = field(default_factory=list)

    def as_json(self) -> dict:
        moves = [{k: getattr(m, k) for k in MoveRecord.__dataclass_fields__} for m in self.moves]
        return {**self.result.summary, "moves": moves, "roles": [list(r) for r in self.roles]}

    def as_text(self) -> str:
        s = self.result.summary
        lines = [f"with autoscale: goodput {s['goodput_requests_per_s']:.4g} req/s, {s['num_failed']} lost"]
        lines += [
            f"  move at {m.decided_s:.1f} s: instance {m.instance_id} {m.source} -> {m.target}, {m.outcome}"
            + (f" at {m.done_s:.1f} s" if m.done_s is not None else "")
            + f" ({m.reason})"
            for m in self.moves
        ]
        return "\n".join(lines)


@dataclass
class _Device:
    instance_id: int
    role: str
    engine: SimEngine | None
    last_move_s: float = -math.inf
    move: MoveRecord | None = None
    ready_s: float | None = None  # switching: serves from then on
    steps: tuple[int, float] = (0, 0.0)  # (num_steps, busy_s) at the last tick
    busy_base_s: float = 0.0  # busy seconds of the engines it ran before this one
    busy: deque[tuple[float, float]] = field(default_factory=deque)  # (time_s, busy seconds so far)

    def busy_fraction(self, now_s: float, window_s: float) -> float:
        """The fraction of the last `window_s` it computed steps."""
        total_s = self.busy_base_s + (self.engine.busy_s if self.engine is not None else 0.0)
        self.busy.append((now_s, total_s))
        while len(self.busy) > 1 and self.busy[1][0] <= now_s - window_s:
            self.busy.popleft()
        start_s, start_busy_s = self.busy[0]
        return min(1.0, (total_s - start_busy_s) / (now_s - start_s)) if now_s > start_s else 0.0


class AutoscaleSimulator(ClusterSimulator):
    """`ClusterSimulator` whose instances the controller moves (see the module docstring)."""

    def __init__(
        self,
        topology: Topology,
        *args: Any,
        config: AutoscaleConfig | None = None,
        switch_s: float = DEFAULT_SWITCH_S,
        **kwargs: Any,
    ) -> None:
        """`ClusterSimulator`'s arguments, plus the controller's `config` (default: enabled) and the seconds a
        role switch takes (`switch_s`)."""
        super().__init__(topology, *args, **kwargs)
        self.config = config or AutoscaleConfig(enabled=True)
        self.switch_s = switch_s
        self._rng = random.Random(self.seed + 1)
        self.ttft_slo_s = (topology.slo.ttft_ms or DEFAULT_TTFT_SLO_MS) / 1000
        self.tpot_slo_s = (topology.slo.tpot_ms or DEFAULT_TPOT_SLO_MS) / 1000
        self.devices = [_Device(i, e.role, e) for i, e in enumerate((*self.prefills, *self.decodes))]
        self.autoscale_policy = self.config.policy(self.ttft_slo_s, self.tpot_slo_s, len(self.devices))
        self._active = {id(e) for e in (*self.prefills, *self.decodes)}
        self.window = SignalWindow(self.config.window_s)
        self._per_step = tokens_per_step(self.acceptance[: topology.decode.num_speculative_tokens])
        self._capacity: dict[tuple[int, int], Capacity] = {}
        self.moves: list[MoveRecord] = []
        self.roles: list[tuple[float, int, int, int]] = []

    def routable(self, engines: list[SimEngine]) -> list[SimEngine]:
        return [e for e in super().routable(engines) if id(e) in self._active]

    def run(self, requests: Sequence[TraceRequest]) -> list[SimRequest]:
        if requests:
            self._record_roles(min(r.arrival_s for r in requests))
            self._push(min(r.arrival_s for r in requests), 2, _TICK)
        return super().run(requests)

    def _route(self, request: SimRequest, now_s: float) -> None:
        if request is _TICK:
            self._tick(now_s)
            return
        if request.prefill_queued_s is None:
            self.window.add_prompt(now_s, request.num_prompt_tokens, request.max_tokens)
        super()._route(request, now_s)

    def _reserve(self, decode: SimEngine, request: SimRequest, now_s: float) -> None:
        if id(decode) not in self._active:  # a leaving decode takes no new reserve: route it again
            self._push(now_s, 2, request)
            return
        super()._reserve(decode, request, now_s)

    def _handoff_done(self, request: SimRequest, now_s: float) -> None:
        if request.first_token_s is not None:
            self.window.add_ttft(now_s, request.first_token_s - request.arrival_s)
        super()._handoff_done(request, now_s)

    def _tick(self, now_s: float) -> None:
        for device in self.devices:
            self._progress(device, now_s)
            self._sample_tpot(device, now_s)
        views = [self._view(d, now_s) for d in self.devices]  # every tick: the busy windows advance
        move = decide(
            now_s,
            views,
            self._signals(now_s),
            self._cap(),
            self.autoscale_policy,
        )
        if move is not None:
            device = self.devices[move.instance_id]
            device.move = record = MoveRecord(now_s, move.instance_id, move.source, move.target, move.reason)
            self.moves.append(record)
            if device.engine is not None:
                self._active.discard(id(device.engine))
            self._progress(device, now_s)
        if self._events:  # other work remains: tick again
            self._push(now_s + self.config.interval_s, 2, _TICK)

    def _progress(self, device: _Device, now_s: float) -> None:
        """Advance `device`'s move: drained -> switching -> serving, or aborted past the drain bound."""
        record = device.move
        if record is None:
            return
        engine = device.engine
        if device.ready_s is None:
            if engine is not None and not _drained(engine):
                if record.source == DECODE and now_s - record.decided_s > self.config.drain_timeout_s:
                    record.outcome, record.done_s, device.move = "aborted", now_s, None
                    self._active.add(id(engine))
                return
            device.ready_s = now_s + (self.switch_s if record.target != PARKED else 0.0)
        if now_s < device.ready_s:
            return
        device.role, device.ready_s, device.move, device.last_move_s = record.target, None, None, now_s
        record.outcome, record.done_s = "done", now_s
        if engine is not None:
            device.busy_base_s += engine.busy_s
        device.busy.clear()  # the window of its new role starts now
        if record.target == PARKED:
            device.engine = None
        else:
            device.engine = self._new_engine(record.target, engine)
            self._active.add(id(device.engine))
        self._record_roles(now_s)

    def _new_engine(self, role: str, old: SimEngine | None) -> SimEngine:
        if role == PREFILL:
            sizing, engines = self.prefill_sizing, self.prefills
            engine = SimEngine(role, len(engines), sizing.scheduler, sizing.num_blocks, self.prefill_model, 0)
        else:
            sizing, engines, k = self.decode_sizing, self.decodes, self.topology.decode.num_speculative_tokens
            engine = SimEngine(
                role,
                len(engines),
                sizing.scheduler,
                sizing.num_blocks,
                self.decode_model,
                k,
                self.acceptance,
                self._rng,
            )
            cp = self.control_plane
            engine.step_extra_s, engine.admission_step_extra_s = (
                cp.decode_step_extra_s,
                cp.first_decode_step_extra_s,
            )
        engines.append(engine)
        if self._nodes is not None:  # the device's node and cores, as the engine it replaces
            key = id(old) if old is not None else next(iter(self._node_of))
            self._node_of[id(engine)], self._demand[id(engine)] = self._node_of[key], self._demand[key]
            self._version[id(engine)] = 0
        return engine

    def _sample_tpot(self, device: _Device, now_s: float) -> None:
        engine = device.engine
        if engine is None or engine.role != DECODE:
            return
        num_steps, busy_s = device.steps
        device.steps = (engine.num_steps, engine.busy_s)
        if engine.num_steps > num_steps:
            step_s = (engine.busy_s - busy_s) / (engine.num_steps - num_steps)
            self.window.add_tpot(now_s, step_s / self._per_step)

    def _view(self, device: _Device, now_s: float) -> InstanceView:
        engine = device.engine
        available = device.move is None
        moving_to = device.move.target if device.move is not None else None
        if engine is None:
            return InstanceView(
                device.instance_id, device.role, available, device.last_move_s, moving_to=moving_to
            )
        if device.role == PREFILL:
            queued = engine.num_queued_prefill_tokens
            drain_s = queued / self._cap().prefill_tokens_per_s
            return InstanceView(
                device.instance_id,
                PREFILL,
                available,
                device.last_move_s,
                queued_tokens=queued,
                queued_output_tokens=sum(r.max_tokens for r in engine.requests.values()),
                drain_s=drain_s,
                busy_fraction=device.busy_fraction(now_s, self.config.window_s),
                moving_to=moving_to,
            )
        running = engine.running
        remaining = max((r.max_tokens - r.num_output_tokens for r in running), default=0)
        context = sum(r.num_prompt_tokens + r.num_output_tokens for r in running) // max(1, len(running))
        step_s = self.decode_model.step_time_s(
            StepShape((), (DecodeRow(max(1, context), 1 + engine.k),) * max(1, len(running)), engine.k)
        )
        drain_s = remaining / self._per_step * step_s
        if engine.num_reserved:  # its reserved requests wait for the prefill pool's backlog first
            prefills = self.routable(self.prefills)
            backlog = sum(e.num_queued_prefill_tokens for e in prefills)
            drain_s += backlog / (self._cap().prefill_tokens_per_s * max(1, len(prefills)))
        return InstanceView(
            device.instance_id,
            DECODE,
            available,
            device.last_move_s,
            batch=len(running) + len(engine.waiting_for_seat) + len(engine.pending_admissions),
            drain_s=drain_s,
            moving_to=moving_to,
        )

    def _signals(self, now_s: float):  # noqa: ANN202
        decodes = self.routable(self.decodes)
        total = sum(e.num_blocks for e in decodes)
        used = sum(r.num_blocks_held for e in decodes for r in e.requests.values())  # admitted, not reserved
        return self.window.signals(now_s, used / total if total else 0.0)

    def _cap(self) -> Capacity:
        running = [r for e in self.routable(self.decodes) for r in e.running]
        mean = (
            sum(r.num_prompt_tokens + r.num_output_tokens for r in running) / len(running) if running else 256
        )
        prompt = self.window.mean_prompt_tokens() or 256
        key = (max(64, int(mean) // 64 * 64), max(16, int(prompt) // 16 * 16))  # priced on a grid
        if key not in self._capacity:
            self._capacity[key] = capacity_from_models(
                self.topology, self.prefill_model, self.decode_model, self.acceptance, self.tpot_slo_s, *key
            )
        return self._capacity[key]

    def _record_roles(self, now_s: float) -> None:
        count = {
            r: sum(1 for d in self.devices if d.role == r and d.move is None)
            for r in (PREFILL, DECODE, PARKED)
        }
        self.roles.append((now_s, count[PREFILL], count[DECODE], count[PARKED]))


def _drained(engine: SimEngine) -> bool:
    """No work left on `engine`: queue, handoffs, reserves, running requests."""
    idle = not (engine.busy or engine.running or engine.waiting or engine.pending_reserves)
    if engine.role == PREFILL:
        return idle and engine.num_queued_prefill_tokens == 0
    return idle and not (engine.waiting_for_seat or engine.pending_admissions or engine.num_reserved)


def simulate_autoscale(
    topology: Topology,
    requests: Sequence[TraceRequest],
    options: SimOptions,
    config: AutoscaleConfig | None = None,
    switch_s: float = DEFAULT_SWITCH_S,
) -> AutoscaleResult:
    """`simulator.simulate` with the controller (`config`, default the topology's `autoscale` enabled);
    the topology's split is the start. Raises ValueError as `simulate` does."""
    from dataclasses import replace

    simulator = AutoscaleSimulator(
        topology,
        options,
        pool_sizing(topology, "prefill"),
        pool_sizing(topology, "decode"),
        config=config or replace(topology.autoscale, enabled=True),
        switch_s=switch_s,
    )
    result = run_simulation(simulator, requests, simulator.ttft_slo_s * 1000, simulator.tpot_slo_s * 1000)
    return AutoscaleResult(result, simulator.moves, simulator.roles)


def plan_autoscale(topology: Topology, options) -> AutoscaleResult:  # noqa: ANN001
    """`pdcluster plan --autoscale`: `options`' workload (`planner.plan.PlanOptions`) on `topology` with the
    controller (its `autoscale` section, enabled), the same models as the plan's own simulation."""
    from pdcluster.planner.plan import options_workload, sim_options

    workload = options_workload(topology, options)
    return simulate_autoscale(topology, workload.requests, sim_options(topology, options))
