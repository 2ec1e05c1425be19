"""Deploying a `Cluster`: placement, actor start, KV transport wiring, and tearing it down."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any

from pdcluster.config import ROLES, Topology, load_topology
from pdcluster.config.placement import nodes_to_pin, plan_placement, to_ray_placement_group_args
from pdcluster.driver.actor_errors import DeployError, actor_error_message
from pdcluster.driver.dispatch import call_timeout_s, collective_timeout_s, event_timeout_s
from pdcluster.driver.elastic import elastic_ep
from pdcluster.driver.health import InstanceHealth
from pdcluster.driver.instance import Instance
from pdcluster.driver.messages import InstanceGroupSpec, NodeReady
from pdcluster.driver.rank_actors import (
    MAX_ACTOR_RESTARTS,
    PROBE_GROUP,
    actor_resource_options,
    check_deployable,
    is_loopback_topology,
    load_summary,
    rank_actor_class,
    ray_restarts,
    ready_timeout_s,
)
from pdcluster.driver.ray_runtime import gcs_reachable, init_local_ray, keeping_sigterm_handler
from pdcluster.driver.request_state import rank_name
from pdcluster.driver.role_moves import movable_issue
from pdcluster.driver.router import RankRef
from pdcluster.driver.wiring import ClusterWiring, advertised_address, free_ports, rank_transport
from pdcluster.models.tokenizer import Tokenizer

__all__ = ["PROBE_GROUP", "ClusterDeployment", "advertised_address", "free_ports", "ray_restarts"]

logger = logging.getLogger("pdcluster.driver.cluster")


class ClusterDeployment(ClusterWiring):
    """The deployment half of `driver.cluster.Cluster` (a mixin: `Cluster.deploy` builds it)."""

    instances: dict[str, list[Instance]]

    @classmethod
    def deploy(
        cls,
        topology: Topology | str | Path,
        *,
        num_cpus: int | None = None,
        log=logger.info,
        worker_classes: dict[str, type] | None = None,
    ):
        """Start the cluster: `ray.init` (RAY_ADDRESS if set, else a local Ray with `num_cpus`, default the
        devices the topology uses), one placement group per instance (`plan_placement`; pinned to its node
        where Ray nodes carry `pdcluster_node_<i>` resources), its actors loading weights in parallel, then
        the KV transports wired. `worker_classes`: the rank class per role (default `PrefillWorker`,
        `DecodeWorker`, and `RoleWorker` as "role" where instances can move).
        Raises ValueError: an invalid topology, parallelism the actor layer cannot run or an 8-bit
        `model.weight_dtype` (`check_deployable`); DeployError (a RuntimeError, one line): an actor failed
        to start (named with the rank), or a Ray call failed."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        from pdcluster.workers.decode import DecodeWorker
        from pdcluster.workers.prefill import PrefillWorker
        from pdcluster.workers.role_rank import RoleWorker

        classes = {
            "prefill": PrefillWorker,
            "decode": DecodeWorker,
            "role": RoleWorker,
            **(worker_classes or {}),
        }
        self = object.__new__(cls)
        topo = topology if isinstance(topology, Topology) else load_topology(topology)
        check_deployable(topo)
        self.topology = topo
        self._loopback = is_loopback_topology(topo)
        self.rank_transport = rank_transport(topo)  # the driver's one way to call ranks
        plan = plan_placement(topo)
        self._started_ray = False
        self._started_ray_head = False
        if not ray.is_initialized():
            with keeping_sigterm_handler():
                if os.environ.get("RAY_ADDRESS"):
                    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
                else:
                    needed = int(plan.num_devices_used * topo.hardware.cpus_per_device + 0.999)
                    init_local_ray(num_cpus or max(needed, 1))
                    self._started_ray_head = True
            self._started_ray = True
        self._placement_groups = []
        self.instances = {"prefill": [], "decode": []}
        self.collective_timeout_s = collective_timeout_s(topo.kv_transfer.timeout_s)
        started_s = time.monotonic()
        try:
            pin = nodes_to_pin(plan, ray.cluster_resources())
            log(
                f"deploying {topo.name}: {topo.summary()}; {len(plan.instances)} placement groups"
                + (" pinned to their planned nodes (pdcluster_node_<i> resources)" if pin else "")
            )
            for spec in plan.instances:
                self._placement_groups.append(placement_group(**to_ray_placement_group_args(spec, pin)))
            try:
                ray.get([pg.ready() for pg in self._placement_groups], timeout=120)
            except ray.exceptions.GetTimeoutError:
                raise DeployError(
                    f"placement groups not ready after 120 s: the Ray cluster lacks the resources "
                    f"{plan.instances[0].bundles[0]} per device for {plan.num_devices_used} devices"
                ) from None
            compiling = [r for r in ROLES if topo.compiles(r) and topo.pool(r).expert_parallel_size == 1]
            eager_ep = [r for r in ROLES if topo.compiles(r) and topo.pool(r).expert_parallel_size > 1]
            log(
                f"placement groups ready in {time.monotonic() - started_s:.1f} s; loading weights"
                + (
                    f", then compiling the decode forward on the {' and '.join(compiling)} instances "
                    "(compile; tens of seconds, less with inductor's cache from an earlier load)"
                    if compiling
                    else ""
                )
                + (
                    f"; the {' and '.join(eager_ep)} instances are expert-parallel and run their decode "
                    "forward eagerly (compile does not cover expert dispatch)"
                    if eager_ep
                    else ""
                )
            )
            names = self._start_rank_actors(ray, plan, classes)
            ready_refs = {a.ready.remote(): n for a, n in zip(self._actors, names, strict=True)}
            pending = list(ready_refs)
            infos: dict[str, NodeReady] = {}
            timeout_s = ready_timeout_s(topo)
            while pending:
                done, pending = ray.wait(pending, num_returns=1, timeout=timeout_s)
                if not done:
                    waiting = [ready_refs[r] for r in pending]
                    raise DeployError(f"actors not ready after {timeout_s:g} s: {waiting}")
                try:
                    info = ray.get(done[0])
                except ray.exceptions.RayError as exc:
                    raise DeployError(
                        f"{ready_refs[done[0]]} failed to start: {actor_error_message(exc)}"
                    ) from None
                infos[info.name] = info
                log(f"  {info.name} ready: {load_summary(info)} ({len(infos)}/{len(ready_refs)})")
            # the driver's state, inside this try: a Ctrl-C anywhere here tears down what started
            first = infos["prefill-0"]
            self.num_hidden_layers = first.num_hidden_layers
            self.kv_dim = first.kv_dim
            config = topo.engine_config("decode")
            self.num_speculative_tokens = config.num_speculative_tokens
            self.tokenizer = Tokenizer.from_dir(config.model)
            self.model_name = Path(config.model).resolve().name
            self.max_model_len = config.max_model_len or _max_position_embeddings(config.model)
            self._dtype = config.dtype
            self._decode_kv_cache_dtype = config.kv_cache_dtype
            self._kv_precision = config.kv_precision
            up_s = time.monotonic()
            for instance in self.instances["prefill"] + self.instances["decode"]:
                instance.health = InstanceHealth(since_s=up_s, pid=infos[instance.name].pid)
            self.call_timeout_s = call_timeout_s(topo.kv_transfer.timeout_s)
            self.event_timeout_s = event_timeout_s(topo.kv_transfer.timeout_s)
            self._closed = False
            decode_addresses = self._wire(ray, plan)
            if topo.kv_transport == "shm+grpc":
                log(f"  KV pairs ({topo.kv_transport}): {self._pair_transports(ray)}")
            log(
                f"cluster {topo.name} up in {time.monotonic() - started_s:.1f} s "
                f"({topo.kv_transport}, layerwise={topo.kv_transfer.layerwise})"
            )
            self._decode_addresses = decode_addresses
            self._compose()
        except BaseException as exc:
            self._teardown(ray, remove_placement_group)
            if isinstance(exc, ray.exceptions.RayError):
                raise DeployError(f"deploying {topo.name} failed: {actor_error_message(exc)}") from None
            raise
        return self

    def _pair_transports(self, ray) -> str:
        """Each prefill instance's rank-0 sender transport to each decode instance's rank 0."""
        pairs = []
        for prefill in self.instances["prefill"]:
            transports = ray.get(prefill.ranks[0].sender_transports.remote(), timeout=120)
            for decode, ranks in zip(self.instances["decode"], transports, strict=True):
                pairs.append(f"{prefill.name} -> {decode.name} {ranks[0]}")
        return ", ".join(pairs)

    def _start_rank_actors(self, ray, plan, classes: dict[str, type]) -> list[str]:
        """Create every instance's rank actors without waiting; returns their names in `_actors` order."""
        self._plan = plan
        self._rank_classes = {
            "prefill": rank_actor_class(ray, classes["prefill"]),
            "decode": rank_actor_class(ray, classes["decode"]),
        }
        if movable_issue(self.topology) is None:  # dynamic P:D: every rank can change role in place
            self._rank_classes = dict.fromkeys(ROLES, rank_actor_class(ray, classes["role"]))
        names: dict[tuple[str, int], list[str]] = {}
        for spec_index, spec in enumerate(plan.instances):
            num_ranks = spec.num_devices
            init_method, barrier_port, secret = (
                self._rendezvous(ray, spec_index) if num_ranks > 1 else ("", 0, "")
            )
            instance = Instance(
                spec.role,
                spec.index,
                [],
                deployed_ranks=num_ranks,
                may_recover=num_ranks > 1 and elastic_ep(self.topology, spec.role),
                transport=self.rank_transport,
            )
            for rank in range(num_ranks):
                group = None
                if num_ranks > 1:
                    group = InstanceGroupSpec(
                        rank=rank,
                        num_ranks=num_ranks,
                        init_method=init_method,
                        barrier_port=barrier_port,
                        backend=plan.collective_backend,
                        timeout_s=self.collective_timeout_s,
                        rendezvous_timeout_s=ready_timeout_s(self.topology),
                        secret=secret,
                    )
                instance.ranks.append(self._new_rank_actor(ray, spec_index, rank, group))
            self.instances[spec.role].append(instance)
            names[(spec.role, spec.index)] = [instance.rank_name(r) for r in range(num_ranks)]
        return [
            n for role in ROLES for instance in self.instances[role] for n in names[(role, instance.index)]
        ]

    def _new_rank_actor(
        self,
        ray,
        spec_index: int,
        rank: int,
        group: InstanceGroupSpec | None = None,
        bundle: int | None = None,
    ) -> Any:
        """A new actor for rank `rank` of instance `spec_index`, in bundle `bundle` (default `rank`) of its
        placement group."""
        bundle = rank if bundle is None else bundle
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        topo, plan = self.topology, self._plan
        spec, pg = plan.instances[spec_index], self._placement_groups[spec_index]
        options = {
            "num_cpus": spec.bundles[bundle].get("CPU", 1),
            "max_concurrency": 256,
            # A crashed actor is restarted by Ray in its bundle, then rewired by the health monitor.
            "max_restarts": MAX_ACTOR_RESTARTS if ray_restarts(topo.kv_transport, spec.num_devices) else 0,
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": "1"}},
            "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle),
        }
        options.update(actor_resource_options(plan.ray_resource))
        config = topo.engine_config(spec.role, rank)
        name = rank_name(spec.role, RankRef(spec.index, rank))
        host = "127.0.0.1" if self._loopback else "0.0.0.0"
        if movable_issue(topo) is None:  # a RoleWorker: not restarted by Ray (it would come back in its
            options["max_restarts"] = 0  # deploy role while the driver has it in the other pool)
            configs = {role: topo.engine_config(role, rank) for role in ROLES}
            cls = self._rank_classes[spec.role].options(**options)
            return cls.remote(configs, name, spec.role, topo.kv_transfer.layerwise, host)
        cls = self._rank_classes[spec.role].options(**options)
        if spec.role == "prefill":
            return cls.remote(config, name, topo.kv_transfer.layerwise, group)
        return cls.remote(config, name, host, group)

    @property
    def prefill_actors(self) -> list[Any]:
        """Each prefill instance's leader rank actor, in pool order."""
        return [instance.leader for instance in self.instances["prefill"]]

    @property
    def decode_actors(self) -> list[Any]:
        """Each decode instance's leader rank actor, in pool order."""
        return [instance.leader for instance in self.instances["decode"]]

    @property
    def _actors(self) -> list[Any]:
        """Every rank actor of every instance."""
        return [actor for role in ROLES for instance in self.instances[role] for actor in instance.ranks]

    def check_no_leaks(self) -> dict[str, dict[str, Any]]:
        """Per live instance: blocks held, reservations, open handoffs (all zero/empty when idle)."""
        import ray

        actors = [
            (instance.rank_name(rank), actor)
            for role in ROLES
            for instance in self.instances[role]
            if instance.routable
            for rank, actor in enumerate(instance.ranks)
        ]
        results = ray.get([a.check_no_leaks.remote() for _, a in actors], timeout=self.call_timeout_s)
        return {name: r for (name, _), r in zip(actors, results, strict=True)}

    def shutdown(self) -> None:
        """Stop the poll loops, close and kill the actors, remove the placement groups, and stop Ray if
        `deploy` started it.
        """
        import ray
        from ray.util.placement_group import remove_placement_group

        self._closed = True
        autoscaler = getattr(self, "autoscaler", None)
        if autoscaler is not None:
            autoscaler.stop(self.call_timeout_s + 5.0)
        monitor = getattr(self, "monitor", None)
        if monitor is not None:
            monitor.stop(self.call_timeout_s + 5.0)
        dispatcher = getattr(self, "dispatcher", None)
        if dispatcher is not None:
            dispatcher.close()
        self._teardown(ray, remove_placement_group)

    def _teardown(self, ray, remove_placement_group) -> None:
        if self._actors or self._placement_groups:
            if not self._started_ray_head or gcs_reachable():
                self._stop_actors(ray, remove_placement_group)
            else:
                logger.warning(
                    "Ray's GCS is gone (a signal to the whole process group stops Ray's processes too): "
                    "the actors and placement groups went with it; nothing of Ray's left to stop"
                )
        for role in ROLES:
            self.instances[role] = []
        self._placement_groups = []
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def _stop_actors(self, ray, remove_placement_group) -> None:
        closes = []
        for actor in self._actors:
            with contextlib.suppress(Exception):
                closes.append(actor.close.remote())
        with contextlib.suppress(Exception):
            ray.wait(closes, num_returns=len(closes), timeout=15)
        if self._started_ray_head and not gcs_reachable():
            logger.warning("Ray's GCS went away during the teardown: nothing of Ray's left to stop")
            return
        for actor in self._actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        for pg in self._placement_groups:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)


def _max_position_embeddings(model_dir: str) -> int:
    import json

    return json.loads((Path(model_dir) / "config.json").read_text())["max_position_embeddings"]
