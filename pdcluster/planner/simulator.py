"""Discrete-event simulation of a disaggregated cluster from the topology YAML the live cluster runs.

A heapq event loop (after Vidur's `simulator.py`) replays a trace through the live router, dispatch and
scheduler policies, imported, never copied. Events: arrival / reserve retry (router picks a pair, decode
reserves the prompt's blocks, `dispatch.after_reserve` decides), prefill step end (first token = TTFT, then
the KV handoff), handoff done (decode admits at its next step), decode step end (MTP verify, stream tokens).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence

from pdcluster.config import Topology
from pdcluster.driver.dispatch import Fail, ReserveOutcome, RetryReserve, StartPrefill, after_reserve
from pdcluster.driver.router import POLICIES, DecodeLoad, PrefillLoad
from pdcluster.engine.scheduler_policy import check_request_fits
from pdcluster.entrypoints.bench_client import summarize
from pdcluster.models.elastic_placement import PlacementRefused
from pdcluster.planner.control_plane import ControlPlane
from pdcluster.planner.core_sharing import NodeCores
from pdcluster.planner.rank_loss import (
    RankLoss,
    check_rank_loss,
    lose_rank,
    loss_report,
    requeue,
    shrunk_model,
)
from pdcluster.planner.sim_engine import LengthOnlyPrompt, SimEngine, SimRequest
from pdcluster.planner.sim_options import SimOptions
from pdcluster.planner.sim_results import SimResult, to_results
from pdcluster.planner.sizing import PoolSizing, pool_sizing
from pdcluster.planner.trace import TraceRequest

# event kinds, in tie-break order at equal times: steps end before handoffs land before arrivals
_STEP_END, _HANDOFF_DONE, _ARRIVAL, _PREFILL_QUEUED, _RANK_LOST, _RECOVERED = 0, 1, 2, 3, 4, 5


class ClusterSimulator:
    """The event loop over one topology, run with `options` (`SimOptions`)."""

    def __init__(
        self,
        topology: Topology,
        options: SimOptions,
        prefill_sizing: PoolSizing,
        decode_sizing: PoolSizing,
        rank_losses: Sequence[RankLoss] = (),
    ) -> None:
        self.topology = topology
        self.rank_losses = list(rank_losses)
        self.rank_loss_reports: list[dict] = []
        self.control_plane = cp = options.control_plane or ControlPlane()
        self.policy = POLICIES[topology.router.policy]
        self.prefill_model, self.decode_model = options.prefill_model, options.decode_model
        self.prefill_sizing, self.decode_sizing = prefill_sizing, decode_sizing
        self.acceptance = tuple(options.acceptance_per_position)
        self.seed = options.seed
        self.block_size = topology.prefill.block_size
        self.timeout_s = topology.kv_transfer.timeout_s
        k = topology.decode.num_speculative_tokens
        rng = random.Random(self.seed)
        self.prefills = [
            SimEngine(
                "prefill", i, prefill_sizing.scheduler, prefill_sizing.num_blocks, options.prefill_model, k
            )
            for i in range(topology.prefill.num_instances)
        ]
        self.decodes = [
            SimEngine(
                "decode",
                i,
                decode_sizing.scheduler,
                decode_sizing.num_blocks,
                self.decode_model,
                k,
                self.acceptance,
                rng,
            )
            for i in range(topology.decode.num_instances)
        ]
        for engine in self.prefills:
            engine.finishing_extra_s = cp.prefill_extra_s
        for engine in self.decodes:
            engine.step_extra_s, engine.admission_step_extra_s = (
                cp.decode_step_extra_s,
                cp.first_decode_step_extra_s,
            )
        self._ranks: dict[int, int] = {}  # id(engine) -> ranks left after losses
        self._nodes: dict[int, NodeCores] | None = None
        if options.cores_per_node is not None and not topology.hardware.spec.is_accelerator:
            self._share_cores(options.cores_per_node)
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self._counter = 0
        self._num_in_flight = 0  # arrived, neither finished nor failed (`_route`: an idle arrival)
        self.num_events = 0

    def _share_cores(self, cores_per_node: float) -> None:
        """Each engine's node and the cores its busy ranks demand (one torch thread per rank actor)."""
        self._nodes, self._node_of, self._demand, self._version = {}, {}, {}, {}
        offset, per_node = 0, self.topology.hardware.devices_per_node
        for engine in (*self.prefills, *self.decodes):
            devices, node = self.topology.pool(engine.role).devices_per_instance, offset // per_node
            offset += devices
            self._nodes.setdefault(node, NodeCores(cores_per_node, self.control_plane.background_cores))
            self._node_of[id(engine)], self._demand[id(engine)], self._version[id(engine)] = node, devices, 0

    def _reschedule(self, ends: list[tuple[object, float]]) -> None:
        for engine, end_s in ends:
            self._version[id(engine)] += 1
            self._push(end_s, _STEP_END, (engine, self._version[id(engine)]))

    def _push(self, time_s: float, kind: int, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._events, (time_s, kind, self._seq, payload))

    def run(self, requests: Sequence[TraceRequest]) -> list[SimRequest]:
        """Simulate `requests`; returns their final states in trace order."""
        sims = [
            SimRequest(i, r.num_input_tokens, r.num_output_tokens, r.arrival_s)
            for i, r in enumerate(requests)
        ]
        for sim in sims:
            sim.deadline_s = sim.arrival_s + self.timeout_s
            self._push(sim.arrival_s, _ARRIVAL, sim)
        first_s = min((sim.arrival_s for sim in sims), default=0.0)
        for loss in self.rank_losses:
            pool = self.topology.pool(loss.role)
            check_rank_loss(loss, pool.num_instances, pool.devices_per_instance, pool.tensor_parallel_size)
            self._push(first_s + loss.at_s, _RANK_LOST, loss.with_recovery(pool.elastic_stall_s))
        events, pop = self._events, heapq.heappop
        while events:
            now_s, kind, _, payload = pop(events)
            self.num_events += 1
            if kind == _STEP_END:
                if self._nodes is not None:
                    engine, version = payload  # type: ignore[misc]
                    if version != self._version[id(engine)]:
                        continue
                    self._reschedule(self._nodes[self._node_of[id(engine)]].finish(engine, now_s))
                    payload = engine
                self._step_end(payload, now_s)  # type: ignore[arg-type]
            elif kind == _HANDOFF_DONE:
                self._handoff_done(payload, now_s)  # type: ignore[arg-type]
            elif kind == _PREFILL_QUEUED:
                self._queue_prefill(payload, now_s)  # type: ignore[arg-type]
            elif kind == _RANK_LOST:
                self._rank_lost(payload, now_s)  # type: ignore[arg-type]
            elif kind == _RECOVERED:
                self._recovered(payload, now_s)  # type: ignore[arg-type]
            else:
                self._route(payload, now_s)  # type: ignore[arg-type]
        return sims

    def _route(self, request: SimRequest, now_s: float) -> None:
        """Route + reserve (`RouteAndReserve._dispatch`), then `after_reserve`."""
        if request.prefill_queued_s is None:  # first round: a request that can never fit fails alone
            try:
                check_request_fits(
                    self.decode_sizing.scheduler,
                    self.decode_sizing.num_blocks,
                    request.num_prompt_tokens,
                    request.max_tokens,
                )
            except ValueError as exc:
                request.error = str(exc)
                return
            request.prefill_queued_s = now_s
            request.arrived_idle = self._num_in_flight == 0
            self._num_in_flight += 1
        choice = self.policy(
            [PrefillLoad(e.instance, e.num_queued_prefill_tokens) for e in self.routable(self.prefills)],
            [DecodeLoad(e.instance, e.num_free_blocks, e.batch_load) for e in self.routable(self.decodes)],
            counter=self._counter,
            prompt_token_ids=LengthOnlyPrompt(request.num_prompt_tokens),
            block_size=self.block_size,
        )
        self._counter += 1
        request.prefill_instance = choice.prefill.instance
        decode = self.decodes[choice.decode.instance]
        if decode.busy:  # `DecodeWorker.reserve` takes the engine lock, which a step holds until it ends
            decode.pending_reserves.append(request)
        else:
            self._reserve(decode, request, now_s)

    def routable(self, engines: list[SimEngine]) -> list[SimEngine]:
        """The engines the router may pick: those not recovering from a rank loss while another is up
        (`planner.autoscale_sim` also leaves out moving ones)."""
        return [e for e in engines if not e.down] or engines

    def _reserve(self, decode: SimEngine, request: SimRequest, now_s: float) -> None:
        """Reserve on `decode`, then start the prefill, retry, or fail as `after_reserve` says."""
        bound = decode.reserve(request)
        outcome = ReserveOutcome.BOUND if bound else ReserveOutcome.NO_ROOM
        action = after_reserve(request.request_id, outcome, now_s, request.deadline_s)
        if isinstance(action, StartPrefill):
            request.decode_instance = decode.instance
            if self.control_plane.dispatch_s > 0:
                self._push(now_s + self.control_plane.dispatch_s, _PREFILL_QUEUED, request)
            else:
                self._queue_prefill(request, now_s)
        elif isinstance(action, RetryReserve):
            self._push(now_s + action.delay_s, _ARRIVAL, request)
        elif isinstance(action, Fail):
            request.error = action.message
            self._num_in_flight -= 1
        else:  # RouteAgain / EndAborted: no instance is lost nor a request aborted in the simulation
            raise AssertionError(f"unexpected dispatch action {action!r}")

    def _queue_prefill(self, request: SimRequest, now_s: float) -> None:
        prefill = self.prefills[request.prefill_instance]
        prefill.add(request)
        if not prefill.busy:
            self._start(prefill, now_s)

    def _start(self, engine: SimEngine, now_s: float) -> None:
        duration_s, key = engine.start_step(now_s), id(engine)
        if duration_s > 0 and self._nodes is not None:
            node_index = self._node_of[key]
            demand = self._demand[key]
            if engine.role == "prefill":  # what runs beside a prefill step (`derive_from_probes`)
                demand += self.control_plane.prefill_corunner_cores
            if node_index == 0:  # the driver's node: its CPU for this step's requests competes too
                cp = self.control_plane
                host_s = cp.host_cpu_per_decode_step_s * engine.num_step_rows  # a delta per decoded request
                host_s += cp.host_cpu_per_request_s * engine.num_step_finishing  # (prefill's)
                demand += min(1.0, host_s / duration_s)  # one driver process: at most a core
            self._reschedule(self._nodes[node_index].start(engine, duration_s, demand, now_s))
        elif duration_s > 0:
            self._push(now_s + duration_s, _STEP_END, engine)

    def _step_end(self, engine: SimEngine, now_s: float) -> None:
        done = engine.finish_step(now_s)
        if engine.role == "prefill":
            model, cp = self.prefill_model, self.control_plane
            # the first token is sampled before the tail (MTP pass, KV send) the step's wall also holds
            tail_s = engine.step_tail_s
            if tail_s > 0:
                tail_s *= (now_s - engine.step_started_s) / engine.step_full_s
            for request in done:
                assert request.prefill_start_s is not None
                if request.first_token_s is None:  # (else a recompute after a rank loss: streamed already)
                    request.first_token_s = now_s - tail_s + cp.first_token_extra_s
                    if request.arrived_idle:
                        request.first_token_s += cp.idle_first_token_extra_s
                # MTP state (drafts) travels with the KV; decode starts at full acceptance
                compute_s = now_s - request.prefill_start_s
                handoff_s = model.kv_handoff_s(request.num_prompt_tokens, compute_s) + cp.handoff_extra_s
                self._push(now_s + handoff_s, _HANDOFF_DONE, request)
        else:
            self._num_in_flight -= len(done)
            if engine.pending_reserves:
                reserves, engine.pending_reserves = engine.pending_reserves, []
                for request in reserves:
                    self._reserve(engine, request, now_s)
        if engine.pending_loss is not None:
            loss, engine.pending_loss = engine.pending_loss, None
            self._rank_lost(loss, now_s)
            return
        self._start(engine, now_s)

    def _rank_lost(self, loss: RankLoss, now_s: float) -> None:
        """`loss` at a step boundary of its instance (`planner.rank_loss`): down for `recovery_s`."""
        engine = (self.prefills if loss.role == "prefill" else self.decodes)[loss.instance]
        if engine.busy:  # a step in flight, or a recovery: the loss lands when it ends
            engine.pending_loss = loss
            return
        key = id(engine)
        num_ranks = self._ranks.get(key, self.topology.pool(loss.role).devices_per_instance)
        if num_ranks < 2:
            raise ValueError(f"--fail-rank {loss.label}: the instance has one rank left")
        blocks_before = engine.num_blocks
        try:
            engine.model, experts = shrunk_model(engine.model, loss.rank % num_ranks, self._slots(loss))
        except PlacementRefused as e:
            raise PlacementRefused(
                f"--fail-rank {loss.label}: live, the instance would not shrink: {e}"
            ) from e
        lost = lose_rank(engine, loss, num_ranks)
        self.rank_loss_reports.append(
            loss_report(loss, now_s, num_ranks, lost, blocks_before, engine, experts)
        )
        for request in lost:
            requeue(request, now_s, self.timeout_s)
            self._push(now_s, _ARRIVAL, request)
        self._ranks[key] = num_ranks - 1
        if self._nodes is not None:
            self._demand[key] = max(1, self._demand[key] - 1)
        engine.busy = engine.down = True
        self._push(now_s + loss.recovery_s, _RECOVERED, engine)

    def _slots(self, loss: RankLoss) -> int:
        """A survivor's expert slots as the live driver allows them (`survivor_expert_slots`)."""
        from pdcluster.driver.elastic_budget import survivor_expert_slots

        try:
            return survivor_expert_slots(self.topology, loss.role)
        except ValueError as e:
            raise ValueError(f"--fail-rank {loss.label}: {e}") from e

    def _recovered(self, engine: SimEngine, now_s: float) -> None:
        engine.busy = engine.down = False
        if engine.pending_loss is not None:
            loss, engine.pending_loss = engine.pending_loss, None
            self._rank_lost(loss, now_s)
            return
        reserves, engine.pending_reserves = engine.pending_reserves, []
        for request in reserves:
            self._reserve(engine, request, now_s)
        self._start(engine, now_s)

    def _handoff_done(self, request: SimRequest, now_s: float) -> None:
        self.prefills[request.prefill_instance].release_prefill(request)
        if request.max_tokens <= 1:  # its first token finishes it at the admission
            self._num_in_flight -= 1
        decode = self.decodes[request.decode_instance]
        decode.handoff_done(request)
        if not decode.busy:
            self._start(decode, now_s)


def simulate(
    topology: Topology,
    requests: Sequence[TraceRequest],
    options: SimOptions,
    prefill_sizing: PoolSizing | None = None,
    decode_sizing: PoolSizing | None = None,
    ttft_slo_ms: float | None = None,
    tpot_slo_ms: float | None = None,
    rank_losses: Sequence[RankLoss] = (),
) -> SimResult:
    """Simulate `requests` (num_output_tokens = max_tokens, ignore_eos) on `topology`, summarized as
    `pdcluster bench` does; SLO defaults to the topology's `slo`. Raises ValueError for
    acceptance_per_position shorter than k, or a topology the sizing refuses."""
    from pdcluster.config.slo import DEFAULT_TPOT_SLO_MS, DEFAULT_TTFT_SLO_MS

    simulator = ClusterSimulator(
        topology,
        options,
        prefill_sizing or pool_sizing(topology, "prefill"),
        decode_sizing or pool_sizing(topology, "decode"),
        rank_losses,
    )
    ttft = ttft_slo_ms or topology.slo.ttft_ms or DEFAULT_TTFT_SLO_MS
    tpot = tpot_slo_ms or topology.slo.tpot_ms or DEFAULT_TPOT_SLO_MS
    return run_simulation(simulator, requests, ttft, tpot)


def run_simulation(
    simulator: ClusterSimulator, requests: Sequence[TraceRequest], ttft_slo_ms: float, tpot_slo_ms: float
) -> SimResult:
    """Run `simulator` over `requests`; its results summarized as `pdcluster bench` does, and its pools'
    counters (those of the engines it ends with)."""
    results, duration_s = to_results(simulator.run(requests))
    summary = summarize(results, duration_s, ttft_slo_ms, tpot_slo_ms)
    pools = {"prefill": simulator.prefills, "decode": simulator.decodes}
    return SimResult(
        results,
        duration_s,
        summary,
        num_steps={role: sum(e.num_steps for e in engines) for role, engines in pools.items()},
        busy_fraction={
            role: sum(e.busy_s for e in engines) / (len(engines) * duration_s)
            if duration_s > 0 and engines
            else 0.0
            for role, engines in pools.items()
        },
        num_preemptions={role: sum(e.num_preemptions for e in engines) for role, engines in pools.items()},
        num_events=simulator.num_events,
        rank_losses=simulator.rank_loss_reports,
    )
