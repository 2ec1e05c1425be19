"""`Cluster`: the disaggregated serving backend on Ray (implements `driver.backend.ServingBackend`).

A request's lifecycle and fault handling: DESIGN.md; the request path is `driver.request_dispatch`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from pdcluster.driver.actor_errors import DeployError, actor_error_message, describe_error
from pdcluster.driver.autoscale_live import LiveAutoscaler
from pdcluster.driver.backend import StreamDelta
from pdcluster.driver.cluster_stats import ClusterStats
from pdcluster.driver.deployment import ClusterDeployment, advertised_address
from pdcluster.driver.dispatch import CALL_TIMEOUT_MIN_S, EVENT_SLACK_S, MAX_DISPATCH_ATTEMPTS
from pdcluster.driver.health_monitor import PROBE_INTERVAL_S, HealthMonitor
from pdcluster.driver.load_board import LoadBoard
from pdcluster.driver.rank_actors import (
    MAX_ACTOR_RESTARTS,
    actor_resource_options,
    check_deployable_parallelism,
    is_loopback_topology,
)
from pdcluster.driver.registry import InstanceRegistry
from pdcluster.driver.request_dispatch import Dispatcher
from pdcluster.driver.role_moves import RoleMover
from pdcluster.driver.router import ROUTER_CACHE_BLOCKS
from pdcluster.driver.routing import ModelFacts
from pdcluster.engine.sampling_params import SamplingParams

__all__ = [
    "CALL_TIMEOUT_MIN_S",
    "EVENT_SLACK_S",
    "MAX_ACTOR_RESTARTS",
    "MAX_DISPATCH_ATTEMPTS",
    "PROBE_INTERVAL_S",
    "ROUTER_CACHE_BLOCKS",
    "Cluster",
    "DeployError",
    "actor_error_message",
    "actor_resource_options",
    "advertised_address",
    "check_deployable_parallelism",
    "describe_error",
    "is_loopback_topology",
]


class Cluster(ClusterDeployment):
    """A deployed prefill pool + decode pool (`driver.backend.ServingBackend`)."""

    registry: InstanceRegistry
    dispatcher: Dispatcher
    monitor: HealthMonitor
    cluster_stats: ClusterStats

    def __init__(self) -> None:
        raise TypeError("use Cluster.deploy(topology)")

    def _compose(self) -> None:
        """At the end of `deploy`: the parts, wired to each other; the health monitor starts."""
        loads = LoadBoard([d.num_ranks for d in self.instances["decode"]])
        self.registry = InstanceRegistry(self.instances, self.call_timeout_s, self._on_instance_failed)
        model = ModelFacts(
            self.num_hidden_layers,
            self.kv_dim,
            self.num_speculative_tokens,
            self._dtype,
            self._decode_kv_cache_dtype,
            self._kv_precision,
        )
        self.dispatcher = Dispatcher(
            self.registry, loads, self.topology, model, self.call_timeout_s, self.event_timeout_s
        )
        self.cluster_stats = ClusterStats(
            self.registry, self.call_timeout_s, self.dispatcher, lambda: self._closed
        )
        self.monitor = HealthMonitor(self.registry, self, loads, self.dispatcher.fail_attempts)
        self.monitor.start()
        self.mover = RoleMover(self)
        self.autoscaler: LiveAutoscaler | None = None
        if self.mover.issue is None and self.topology.autoscale.controller:
            self.autoscaler = LiveAutoscaler(self)
            self.autoscaler.start()

    def _on_instance_failed(self, role: str, index: int, left_routing: bool) -> None:
        if role == "decode":
            self.dispatcher._loads.forget_decode(index)
        if left_routing:
            instance = self.registry.instances[role][index]
            # an elastic decode instance keeps its requests' KV until it re-forms (`driver.elastic`)
            held = role == "decode" and instance.may_recover
            self.dispatcher.fail_attempts(
                role, index, {r: r for r in range(instance.num_ranks)} if held else None
            )

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[StreamDelta]:
        """`Dispatcher.generate` (its stream itself, so that closing it runs the dispatcher's cleanup;
        through `LiveAutoscaler.observe` when the controller runs)."""
        stream = self.dispatcher.generate(request_id, prompt_token_ids, params)
        autoscaler = getattr(self, "autoscaler", None)
        if autoscaler is None:
            return stream
        return autoscaler.observe(stream, len(prompt_token_ids), params.max_tokens)

    async def abort(self, request_id: str) -> None:
        """`Dispatcher.abort`."""
        await self.dispatcher.abort(request_id)

    def stats(self) -> dict[str, Any]:
        return self.cluster_stats.stats()

    def check_ready(self) -> None:
        self.cluster_stats.check_ready()

    def health(self) -> dict[str, dict[str, Any]]:
        return self.registry.health()
