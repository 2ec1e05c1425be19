"""`Cluster`: the disaggregated serving backend on Ray (implements `orchestrator.backend.ServingBackend`).

    cluster = Cluster.deploy("clusters/local.yaml")          # ray.init, placement groups, actors, wiring
    async for delta in cluster.generate("r1", prompt_ids, SamplingParams(temperature=0)):
        ...                                                    # StreamDelta: tokens, phases, acceptance
    await cluster.abort("r1")
    cluster.shutdown()                                         # actors, placement groups, Ray if started

One request (DESIGN.md, request lifecycle):
1. The router policy (`orchestrator.router`) picks a prefill and a decode rank from the driver's load board
   (`orchestrator.load_board`: decode loads piggy-backed on poll and reserve replies, prefill work the
   driver has in flight), with no Ray call of its own.
2. At once, prefill is sent the request awaiting its bind (`PrefillNode.prefill`, `awaiting_bind`: it
   computes the prompt and holds its KV) and decode reserves KV blocks and expects the handoff
   (`DecodeNode.reserve`); on one host both calls go on the rank's own connection to the driver's reply
   socket and are answered there, else they are Ray calls. The reserve returns the handoff bound to the
   reservation by a fresh secret; no room: the reserve is retried (the prefill waits) until the transfer
   timeout, then `BackendUnavailable`.
3. The driver binds the prefill to the reservation (`PrefillBind`), handing it the secret (to that prefill
   rank only: on its own connection to the driver's reply socket on one host, else `PrefillNode.bind`): it
   streams each layer's KV (MTP layer included; then the first token and the MTP drafts) to that decode
   rank, presenting the secret; decode refuses any other sender of that handoff.
4. Decode admits it and streams tokens; the driver has one poll loop per decode rank (a long poll that
   returns at once with the first event) that hands events to the request's queue.
Faults: a prefill actor that dies (its `prefill` call raises) or a handoff that fails on decode (lease
expired, sender lost, checksum) releases decode's reservation; the request is re-dispatched once to another
live prefill instance, else it fails with `BackendUnavailable` naming the cause. An instance whose call
times out is unresponsive, one whose actor died is dead (`orchestrator.health`): either leaves routing and
its in-flight decode requests fail with `BackendUnavailable`; with no decode (or no prefill) instance in
routing, requests, `stats()` and `check_ready()` (`/health`; it makes no call) raise `BackendUnavailable`.
A health monitor thread probes every instance each PROBE_INTERVAL_S: one that answers again rejoins, one
Ray restarted (grpc, shm) is rewired first.
An abort ends the request with finish_reason "abort" (never a re-dispatch).

Timeouts (`kv_transfer.timeout_s` = T, `orchestrator.dispatch`): every actor call in the request path
(load, reserve, abort, poll) gives up after `call_timeout_s` = max(CALL_TIMEOUT_MIN_S, T / 2); every wait
for the request's next event (before and after admission) after T + EVENT_SLACK_S; the prefill call
(awaiting its bind up to T, then queue + prompt + handoff) after T + (T + EVENT_SLACK_S). Nothing waits
forever.

Where the code is: `orchestrator.deployment` (deploy, placement, rank actors, shutdown),
`orchestrator.wiring` (rendezvous addresses, KV wiring), `orchestrator.instance_group` (a multi-rank
instance's torch.distributed group),
`orchestrator.health_monitor` (stats and health, marking failed instances, probing, rejoin, rewire),
`orchestrator.request_dispatch` (generate / abort / the poll loops: a thin loop over the pure policy of
`orchestrator.dispatch`), `orchestrator.messages` (what crosses the driver <-> actor boundary),
`orchestrator.instance` (an instance as a group of rank actors), `orchestrator.actor_errors`.

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

from typing import Any

from pdcluster.orchestrator.actor_errors import DeployError, actor_error_message, describe_error
from pdcluster.orchestrator.cluster_stats import ClusterStats
from pdcluster.orchestrator.deployment import (
    MAX_ACTOR_RESTARTS,
    ClusterDeployment,
    actor_resource_options,
    advertised_address,
    check_deployable_parallelism,
    is_loopback_topology,
)
from pdcluster.orchestrator.dispatch import CALL_TIMEOUT_MIN_S, EVENT_SLACK_S, MAX_DISPATCH_ATTEMPTS
from pdcluster.orchestrator.health_monitor import PROBE_INTERVAL_S, HealthMonitor
from pdcluster.orchestrator.registry import InstanceRegistry
from pdcluster.orchestrator.request_dispatch import RequestDispatch
from pdcluster.orchestrator.router import ROUTER_CACHE_BLOCKS
from pdcluster.orchestrator.routing import RouteAndReserve

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


class Cluster(ClusterDeployment, RequestDispatch, RouteAndReserve):
    """A deployed prefill pool + decode pool (`orchestrator.backend.ServingBackend`). Build it with
    `Cluster.deploy(topology)`; see the module docstring for what each part does and where it lives.
    Parts with their own state: `registry` (instances and health), `monitor` (the health monitor thread),
    `cluster_stats` (`stats`, `check_ready`)."""

    registry: InstanceRegistry
    monitor: HealthMonitor
    cluster_stats: ClusterStats

    def __init__(self) -> None:
        raise TypeError("use Cluster.deploy(topology)")

    def _compose(self) -> None:
        """At the end of `deploy`: the registry, the stats and the health monitor (started)."""
        self.registry = InstanceRegistry(self.instances, self.call_timeout_s, self._on_instance_failed)
        self.cluster_stats = ClusterStats(self.registry, self.call_timeout_s, self, lambda: self._closed)
        self.monitor = HealthMonitor(self.registry, self, self._loads, self.fail_attempts)
        self.monitor.start()

    def _on_instance_failed(self, role: str, index: int, left_routing: bool) -> None:
        if role == "decode":
            self._loads.forget_decode(index)
        if left_routing:
            self.fail_attempts(role, index)

    def stats(self) -> dict[str, Any]:
        return self.cluster_stats.stats()

    def check_ready(self) -> None:
        self.cluster_stats.check_ready()

    def health(self) -> dict[str, dict[str, Any]]:
        return self.registry.health()
