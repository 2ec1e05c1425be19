"""`Cluster`: the disaggregated serving backend on Ray (implements `orchestrator.backend.ServingBackend`).

    cluster = Cluster.deploy("clusters/local.yaml")          # ray.init, placement groups, actors, wiring
    async for delta in cluster.generate("r1", prompt_ids, SamplingParams(temperature=0)):
        ...                                                    # StreamDelta: tokens, phases, acceptance
    await cluster.abort("r1")
    cluster.shutdown()                                         # actors, placement groups, Ray if started

One request (DESIGN.md, request lifecycle), every driver <-> rank message through the rank's
`orchestrator.rank_client.RankClient` (Ray calls), the handoff's state in `orchestrator.handoff`:
1. The router policy picks a prefill and a decode rank from the driver's load board, with no call.
2. At once, prefill is sent the request awaiting its bind (it computes the prompt and holds its KV) and
   decode reserves KV blocks and binds the handoff to a fresh secret; no room: the reserve is retried until
   the transfer timeout, then `BackendUnavailable`.
3. The driver binds the prefill to the reservation (ordered after the prefill on that rank,
   `orchestrator.command_order`): prefill streams each layer's KV, then the first token and the MTP drafts,
   to that decode rank; the prefill call's reply streams the first token to the client.
4. Decode admits the handoff and streams the following tokens; one poll loop per decode rank hands them
   to the request.
Faults: a prefill that dies or a handoff that fails on decode is re-dispatched once to another live
prefill instance, else `BackendUnavailable` names the cause; an instance whose call times out or whose
actor died leaves routing (`orchestrator.registry`) and its in-flight decode requests fail; the health
monitor thread probes every instance each PROBE_INTERVAL_S and brings back (rewired) those that answer.
An abort ends the request with finish_reason "abort" (never a re-dispatch).

Timeouts (`kv_transfer.timeout_s` = T, `orchestrator.dispatch`): every actor call on the request path
gives up after `call_timeout_s` = max(CALL_TIMEOUT_MIN_S, T / 2); every wait for the request's next event
after T + EVENT_SLACK_S; the prefill call after T + (T + EVENT_SLACK_S). Nothing waits forever.

Where the code is: `orchestrator.deployment` + `orchestrator.wiring` (deploy, placement, rank actors, KV
wiring, shutdown; this class's base), `orchestrator.registry` (instances and health),
`orchestrator.request_dispatch` + `orchestrator.routing` (the request path over the pure policy of
`orchestrator.dispatch`), `orchestrator.health_monitor`, `orchestrator.cluster_stats`,
`orchestrator.messages` (what crosses the driver <-> rank boundary).

Instances of several ranks (`devices_per_instance` > 1): one rank actor per device, data-parallel
attention, routed experts split over the ranks (EP, the ranks stepping in lockstep) or replicated; the
router picks (instance, rank) and the request goes to that rank; a rank that dies, stalls or whose group
failed takes its whole instance out of routing and fails every request on it.

Limits: `deploy` refuses tensor-parallel attention and experts split over part of an instance (`pdcluster
deploy` refuses them before Ray, at their YAML line, see `orchestrator.preflight`); `pdcluster validate`
still checks such plans. With `torch_distributed`, and for multi-rank instances, the groups are fixed at
deploy time, so a dead rank is not replaced; prefix-aware routing estimates prefill cache hits from the
prompts the router sent. Multi-node: decode gRPC servers bind 0.0.0.0 and advertise their node's IP, and
the torch.distributed rendezvous is on rank 0's node; a single-node `cpu` topology stays on loopback.
Instances are pinned to their planned nodes when the Ray nodes carry `pdcluster_node_<i>` resources
(`orchestrator.placement.nodes_to_pin`); else Ray picks the nodes. tests/netns runs two Ray nodes in
network namespaces on one machine and cuts, slows and black-holes the link between them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.orchestrator.actor_errors import DeployError, actor_error_message, describe_error
from pdcluster.orchestrator.backend import StreamDelta
from pdcluster.orchestrator.cluster_stats import ClusterStats
from pdcluster.orchestrator.deployment import ClusterDeployment, advertised_address
from pdcluster.orchestrator.dispatch import CALL_TIMEOUT_MIN_S, EVENT_SLACK_S, MAX_DISPATCH_ATTEMPTS
from pdcluster.orchestrator.health_monitor import PROBE_INTERVAL_S, HealthMonitor
from pdcluster.orchestrator.load_board import LoadBoard
from pdcluster.orchestrator.rank_actors import (
    MAX_ACTOR_RESTARTS,
    actor_resource_options,
    check_deployable_parallelism,
    is_loopback_topology,
)
from pdcluster.orchestrator.registry import InstanceRegistry
from pdcluster.orchestrator.request_dispatch import Dispatcher
from pdcluster.orchestrator.router import ROUTER_CACHE_BLOCKS
from pdcluster.orchestrator.routing import ModelFacts

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
    """A deployed prefill pool + decode pool (`orchestrator.backend.ServingBackend`). Build it with
    `Cluster.deploy(topology)`; see the module docstring for what each part does and where it lives.
    The deployment (actors, placement groups, wiring) is this class's base; the parts with their own state
    are `registry` (instances and health), `dispatcher` (the request path), `monitor` (the health monitor
    thread) and `cluster_stats` (`stats`, `check_ready`)."""

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

    def _on_instance_failed(self, role: str, index: int, left_routing: bool) -> None:
        if role == "decode":
            self.dispatcher._loads.forget_decode(index)
        if left_routing:
            self.dispatcher.fail_attempts(role, index)

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[StreamDelta]:
        """`Dispatcher.generate` (its stream itself, so that closing it runs the dispatcher's cleanup)."""
        return self.dispatcher.generate(request_id, prompt_token_ids, params)

    async def abort(self, request_id: str) -> None:
        """`Dispatcher.abort`."""
        await self.dispatcher.abort(request_id)

    def stats(self) -> dict[str, Any]:
        return self.cluster_stats.stats()

    def check_ready(self) -> None:
        self.cluster_stats.check_ready()

    def health(self) -> dict[str, dict[str, Any]]:
        return self.registry.health()
