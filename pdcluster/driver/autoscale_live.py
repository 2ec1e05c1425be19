"""The dynamic P:D controller on a live `Cluster`: the driver's signals in, `driver.role_moves` moves out.

Every `autoscale.interval_s` a thread gives `driver.autoscale.decide` each instance's prefill queued tokens
and decode batch, the window's prompt tokens/s, TTFT/TPOT samples and KV occupancy, and each pool's capacity
from the planner's perf model; `RoleMover.move` executes what it decides (parking included: a parked
instance stays loaded in its pool, out of routing).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from pdcluster.config.slo import DEFAULT_TPOT_SLO_MS, DEFAULT_TTFT_SLO_MS
from pdcluster.driver.autoscale import PARKED, Capacity, InstanceView, Move, SignalWindow, decide
from pdcluster.driver.periodic import PeriodicThread
from pdcluster.driver.role_moves import MoveFailed, MoveRefused
from pdcluster.driver.router import RankRef

logger = logging.getLogger("pdcluster.driver.cluster")

DEFAULT_PROMPT_TOKENS = 256  # prompt length capacity is priced at before the window has a prompt


def perf_model_capacity(topology: Any) -> Callable[[float, int], Capacity]:
    """`(mean context tokens, mean prompt tokens) -> Capacity` priced by `planner.topology_models`' model
    of one instance of each pool (`autoscale.calibration` when set; cached on a grid of 64 / 16 tokens)."""
    from pdcluster.driver.autoscale_capacity import capacity_from_models
    from pdcluster.planner import DEFAULT_ACCEPTANCE
    from pdcluster.planner.topology_models import perf_model_for

    calibration = topology.autoscale.calibration
    prefill, decode = (perf_model_for(topology, r, calibration=calibration) for r in ("prefill", "decode"))
    acceptance = (DEFAULT_ACCEPTANCE,) * topology.decode.num_speculative_tokens
    tpot_slo_s = (topology.slo.tpot_ms or DEFAULT_TPOT_SLO_MS) / 1000
    cache: dict[tuple[int, int], Capacity] = {}

    def capacity(context_tokens: float, prompt_tokens: int) -> Capacity:
        key = (max(64, int(context_tokens) // 64 * 64), max(16, prompt_tokens // 16 * 16))
        if key not in cache:
            cache[key] = capacity_from_models(topology, prefill, decode, acceptance, tpot_slo_s, *key)
        return cache[key]

    return capacity


class LiveAutoscaler(PeriodicThread):
    """See the module docstring. `capacity`: as `perf_model_capacity` returns; `clock`: seconds."""

    thread_name = "autoscale"

    def __init__(
        self,
        cluster: Any,
        capacity: Callable[[float, int], Capacity] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        topo = cluster.topology
        self.cluster = cluster
        self.config = topo.autoscale
        super().__init__(self.config.interval_s)
        self.clock = clock
        self._capacity = capacity  # priced on the first decision (the perf model takes a while to build)
        self.ttft_slo_s = (topo.slo.ttft_ms or DEFAULT_TTFT_SLO_MS) / 1000
        self.tpot_slo_s = (topo.slo.tpot_ms or DEFAULT_TPOT_SLO_MS) / 1000
        homes = [s.home or s.name for role in ("prefill", "decode") for s in cluster.instances[role]]
        self.ids = {home: i for i, home in enumerate(homes)}  # stable across moves
        self.policy = self.config.policy(self.ttft_slo_s, self.tpot_slo_s, len(homes))
        self.window = SignalWindow(self.config.window_s)
        self._busy: dict[str, deque[tuple[float, bool]]] = {}
        self._outputs: deque[tuple[float, int]] = deque(maxlen=4096)  # (when finished, output tokens)
        self._lock = threading.Lock()
        self.decisions: list[tuple[float, Move, str]] = []  # (when, the move, "done" | why it was not)

    async def observe(
        self, stream: AsyncIterator[Any], num_prompt_tokens: int, max_tokens: int = 0
    ) -> AsyncIterator[Any]:
        """`stream` (a `Cluster.generate` stream) passed through, its prompt (and `max_tokens`, the decode
        load it forecasts), TTFT and TPOT recorded."""
        started_s = self.clock()
        with self._lock:
            self.window.add_prompt(started_s, num_prompt_tokens, max_tokens)
        first_s, num_tokens = None, 0
        try:
            async for delta in stream:
                if delta.new_token_ids and first_s is None:
                    first_s = self.clock()
                    with self._lock:
                        self.window.add_ttft(first_s, first_s - started_s)
                num_tokens += len(delta.new_token_ids)
                yield delta
        finally:
            await stream.aclose()
        now_s = self.clock()
        with self._lock:
            self._outputs.append((now_s, num_tokens))
            if first_s is not None and num_tokens > 1:
                self.window.add_tpot(now_s, (now_s - first_s) / (num_tokens - 1))

    def views(self, now_s: float, capacity: Capacity) -> tuple[list[InstanceView], float]:
        """Each instance in a pool as the controller sees it, and the decode pool's KV occupancy (0..1).
        drain_s: prefill, its queued prompt tokens at `capacity`; decode, the most output tokens one of its
        requests has left, at the TPOT SLO."""
        mover, loads = self.cluster.mover, self.cluster.dispatcher._loads
        left: dict[int, int] = {}  # decode instance -> most output tokens a request of it has left
        coming: dict[int, int] = {}  # prefill instance -> max_tokens of the requests it has not handed off
        for r in list(self.cluster.dispatcher._requests.values()):
            if r.attempt is not None and r.params is not None:
                n = r.params.max_tokens - len(r.streamed_token_ids)
                left[r.attempt.decode_index] = max(left.get(r.attempt.decode_index, 0), n)
                if not r.attempt.prefill_reported:
                    coming[r.attempt.prefill_index] = coming.get(r.attempt.prefill_index, 0) + n
        views, used, total = [], 0, 0
        for role in ("prefill", "decode"):
            for slot in self.cluster.instances[role]:
                if slot.pool_state == "away" or not slot.routable:
                    continue
                home = slot.home or slot.name
                parked = slot.pool_state == PARKED
                available = (slot.accepting or parked) and mover.moving is None
                last_s = mover.last_move_s.get(home, float("-inf"))
                view = InstanceView(self.ids[home], PARKED if parked else role, available, last_s)
                if parked:
                    views.append(view)
                    continue
                if role == "prefill":
                    queued = loads.prefill_queued_tokens(RankRef(slot.index, 0))
                    busy = self._busy.setdefault(home, deque())
                    busy.append((now_s, queued > 0))
                    while busy and busy[0][0] < now_s - self.config.window_s:
                        busy.popleft()
                    fraction = sum(b for _, b in busy) / len(busy)
                    drain_s = queued / capacity.prefill_tokens_per_s
                    view = dataclasses.replace(
                        view,
                        queued_tokens=queued,
                        busy_fraction=fraction,
                        drain_s=drain_s,
                        queued_output_tokens=coming.get(slot.index, 0),
                    )
                else:
                    try:
                        (snap,) = loads.decode_snapshots(slot.index)
                    except KeyError:  # no snapshot yet: counted as idle
                        views.append(view)
                        continue
                    used += snap.num_total_blocks - snap.num_free_blocks
                    total += snap.num_total_blocks
                    view = dataclasses.replace(
                        view,
                        batch=snap.num_running + snap.num_waiting_for_seat,
                        drain_s=left.get(slot.index, 0) * self.tpot_slo_s,
                    )
                views.append(view)
        return views, (used / total if total else 0.0)

    def tick(self) -> Move | None:
        """One decision: build the view, `decide`, and execute the move (blocking); returns it or None."""
        now_s = self.clock()
        with self._lock:
            self.window.signals(now_s, 0.0)  # (drops the samples older than the window)
            prompt = int(self.window.mean_prompt_tokens() or DEFAULT_PROMPT_TOKENS)
            outputs = [n for t, n in self._outputs if t >= now_s - self.config.window_s]
        if self._capacity is None:
            self._capacity = perf_model_capacity(self.cluster.topology)
        # a running request's mean context: its prompt and half its output
        capacity = self._capacity(prompt + 0.5 * (sum(outputs) / len(outputs) if outputs else 0), prompt)
        views, kv_occupancy = self.views(now_s, capacity)
        with self._lock:
            signals = self.window.signals(now_s, kv_occupancy)
        move = decide(now_s, views, signals, capacity, self.policy)
        if move is None:
            return None
        home = next(h for h, i in self.ids.items() if i == move.instance_id)
        try:
            self.cluster.mover.move(home, move.target, move.reason, trigger="controller")
            outcome = "done"
        except (MoveRefused, MoveFailed, KeyError) as e:
            outcome = f"not made: {e}"
            logger.warning("autoscale: the move of %s to %s was not made: %s", home, move.target, e)
        self.decisions.append((now_s, move, outcome))
        return move

    def run_round(self) -> None:
        self.tick()
