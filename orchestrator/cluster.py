"""`Cluster`: the disaggregated serving backend on Ray (implements `orchestrator.backend.ServingBackend`).

    cluster = Cluster.deploy("clusters/local.yaml")          # ray.init, placement groups, actors, wiring
    async for delta in cluster.generate("r1", prompt_ids, SamplingParams(temperature=0)):
        ...                                                    # StreamDelta: tokens, phases, acceptance
    await cluster.abort("r1")
    cluster.shutdown()                                         # actors, placement groups, Ray if started

One request (DESIGN.md, request lifecycle):
1. The router policy (`orchestrator.router`) picks a prefill and a decode instance from load snapshots.
2. Decode reserves KV blocks and expects the handoff (`DecodeNode.reserve`), which returns the handoff
   bound to the reservation by a fresh secret; no room: retried until the transfer timeout, then
   `BackendUnavailable`.
3. Prefill runs the prompt and streams each layer's KV (MTP layer, first token, drafts, last hidden
   state) to that decode instance (`PrefillNode.prefill`), presenting the secret, which the driver gives
   to that prefill instance only (over Ray); decode refuses any other sender of that handoff.
4. Decode admits it and streams tokens; the driver has one poll loop per decode instance that hands
   events to the request's queue.
Faults: a prefill actor that dies (its `prefill` call raises) or a handoff that fails on decode (lease
expired, sender lost, checksum) releases decode's reservation; the request is re-dispatched once to another
live prefill instance, else it fails with `BackendUnavailable` naming the cause. An instance whose call
times out is unresponsive, one whose actor died is dead (`orchestrator.health`): either leaves routing and
its in-flight decode requests fail with `BackendUnavailable`; with no decode (or no prefill) instance in
routing, requests and `stats()` raise `BackendUnavailable`. A health monitor thread probes every instance
each PROBE_INTERVAL_S: one that answers again rejoins, one Ray restarted (grpc) is rewired first.
An abort ends the request with finish_reason "abort" (never a re-dispatch).

Timeouts (`kv_transfer.timeout_s` = T): every actor call in the request path (load, reserve, abort, poll)
gives up after `call_timeout_s` = max(CALL_TIMEOUT_MIN_S, T / 2); the prefill call (queue + prompt +
handoff) and every wait for the request's next event (before and after admission) after T + EVENT_SLACK_S.
Nothing waits forever.

Limits: one actor per instance: `deploy` refuses instances of more than one device (tensor/expert
parallel; `pdcluster deploy` refuses them before Ray, at their YAML line, see `orchestrator.preflight`);
`pdcluster validate` still checks such plans. With `torch_distributed` the group is fixed at
deploy time, so a dead rank is not replaced; prefix-aware routing estimates prefill cache hits from the
prompts the router sent. Multi-node: decode gRPC servers bind 0.0.0.0 and advertise their node's IP, and
the torch.distributed rendezvous is on rank 0's node; a single-node `cpu` topology stays on loopback.
Instances are pinned to their planned nodes when the Ray nodes carry `pdcluster_node_<i>` resources
(`orchestrator.placement.nodes_to_pin`); else Ray picks the nodes. tests/netns runs two Ray nodes in
network namespaces on one machine and cuts, slows and black-holes the link between them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import re
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from engine.block_manager import compute_block_hashes
from engine.sampling_params import SamplingParams
from kvtransfer.base import HandoffMeta, resolve_wire_dtype
from models.tokenizer import Tokenizer
from orchestrator.backend import BackendUnavailable, StreamDelta
from orchestrator.health import InstanceHealth, ProbeOutcome, after_answer, after_failure
from orchestrator.placement import nodes_to_pin, plan_placement, to_ray_placement_group_args
from orchestrator.preflight import one_line, pool_parallelism
from orchestrator.ray_runtime import init_local_ray, keeping_sigterm_handler
from orchestrator.router import POLICIES, DecodeLoad, PrefillLoad
from orchestrator.topology import ROLES, Topology, load_topology

logger = logging.getLogger(__name__)

MAX_DISPATCH_ATTEMPTS = 2  # the first try plus one re-dispatch to another prefill instance
CALL_TIMEOUT_MIN_S = 2.0  # floor of the per-call timeout (max(this, kv_transfer.timeout_s / 2))
EVENT_SLACK_S = 5.0  # a prefill call / a wait for the next event gives up after kv_transfer.timeout_s + this
PROBE_INTERVAL_S = 1.0  # the health monitor probes every instance this often (seconds)
MAX_ACTOR_RESTARTS = 5  # Ray restarts a crashed actor (grpc transport) this often; then it stays dead
ROUTER_CACHE_BLOCKS = 4096  # block hashes remembered per prefill instance for prefix-aware routing


class DeployError(RuntimeError):
    """`Cluster.deploy` (or `serve`) failed after it started: an actor did not start (its own exception,
    named, e.g. a CheckpointError from loading weights), a Ray call failed, the HTTP server could not
    bind. The message is one line; everything started is torn down before it is raised."""


_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def _raised_in_traceback(text: str) -> str | None:
    """The exception a formatted Python traceback in `text` ends with (`Type: message`, the module path of
    the type dropped), or None when `text` holds no traceback frame."""
    lines = _ANSI_ESCAPE.sub("", text).splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith('  File "')]
    if not frames:
        return None
    rest = lines[frames[-1] + 1 :]
    while rest and rest[0].startswith("    "):  # the frame's source line and caret annotation
        rest = rest[1:]
    raised = one_line("\n".join(rest))
    return re.sub(r"^(?:\w+\.)+(\w+: )", r"\1", raised) or None


def actor_error_message(exc: BaseException) -> str:
    """One line for an exception out of a Ray call, without Ray's traceback or the actor's ids.

    The exception raised inside the actor or task as `Type: message`: a RayTaskError's cause (also when Ray
    raises it as the dual `RayTaskError(X)`), or, for an actor whose `__init__` raised (Ray 2.60 raises an
    ActorDiedError that keeps only the formatted traceback), the exception that traceback ends with. Else
    Ray's own message without the lines that only identify the actor (ids, pid, node IP).
    """
    from ray.exceptions import RayActorError, RayError, RayTaskError

    cause: BaseException = exc
    for _ in range(8):  # a task error inside a task error: the innermost cause
        inner = getattr(cause, "cause", None) if isinstance(cause, RayTaskError) else None
        if not isinstance(inner, BaseException):
            break
        cause = inner
    if cause is not exc and not isinstance(cause, RayError):
        return f"{type(cause).__name__}: {one_line(str(cause))}"
    text = exc.error_msg if isinstance(exc, RayActorError) else str(exc)
    raised = _raised_in_traceback(str(text))
    if raised is not None:
        return raised
    kept = [line for line in str(text).splitlines() if line.strip() and not line.startswith("\t")]
    return f"{type(exc).__name__}: {one_line(chr(10).join(kept))}"


class _Attempt:
    """One dispatch of a request: its handoff id (unique per attempt), the pair, and its event queue."""

    def __init__(self, handoff_id: str, prefill_index: int, decode_index: int) -> None:
        self.handoff_id = handoff_id
        self.prefill_index = prefill_index
        self.decode_index = decode_index
        self.meta: HandoffMeta | None = None  # as decode's reserve bound it (with the secret), once reserved
        self.events: asyncio.Queue = asyncio.Queue()


def check_single_device_instances(topology: Topology) -> None:
    """Raise ValueError for instances of more than one device (or TP/EP > 1): the actor layer runs one
    actor on one device per instance, so deploying them would silently ignore the parallelism.
    `pdcluster deploy` refuses them before this, at their YAML lines (`orchestrator.preflight`)."""
    problems = [p for role in ROLES if (p := pool_parallelism(role, topology.pool(role))) is not None]
    if problems:
        raise ValueError(
            f"instances of more than one device ({'; '.join(problems)}) are not supported by the actor layer "
            "yet; `pdcluster validate` checks the plan only"
        )


def is_loopback_topology(topology: Topology) -> bool:
    """A single-node `cpu` topology: every transport endpoint stays on 127.0.0.1."""
    return topology.hardware.spec.ray_resource is None and topology.hardware.num_nodes == 1


def actor_resource_options(ray_resource: str | None) -> dict[str, Any]:
    """The device part of an actor's Ray options: `num_gpus=1` for GPUs (Ray refuses "GPU" in
    `resources`), `resources={"NPU": 1}` for custom accelerators, nothing on `cpu`."""
    if ray_resource is None:
        return {}
    if ray_resource == "GPU":
        return {"num_gpus": 1}
    return {"resources": {ray_resource: 1}}


def advertised_address(bound_address: str, node_ip: str) -> str:
    """The address prefill senders dial: `node_ip:port` for a server bound to all interfaces."""
    host, _, port = bound_address.rpartition(":")
    return f"{node_ip}:{port}" if host in ("0.0.0.0", "", "[::]", "::") else bound_address


def _node_ip_and_free_port() -> tuple[str, int]:
    """Run as a Ray task inside an instance's placement group bundle: that node's IP and a free port."""
    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port


class Cluster:
    """A deployed prefill pool + decode pool. Build it with `Cluster.deploy`."""

    def __init__(self) -> None:
        raise TypeError("use Cluster.deploy(topology)")

    # ---- deployment -------------------------------------------------------------------------------------
    @classmethod
    def deploy(
        cls, topology: Topology | str | Path, *, num_cpus: int | None = None, log=logger.info
    ) -> Cluster:
        """Start the cluster: `ray.init` (RAY_ADDRESS if set, else a local Ray with `num_cpus`, default the
        devices the topology uses), one placement group per instance (`plan_placement`; pinned to its
        planned node where the Ray nodes carry `pdcluster_node_<i>` resources), one actor per instance in
        it, loading weights in parallel, then the KV connectors. Logs progress via `log`.

        Raises:
            ValueError: an invalid topology, or instances of more than one device (not supported by the
                actor layer yet); DeployError (a RuntimeError, one line): an actor failed to start (what
                it raised, e.g. loading its weights, named with the instance), a Ray call failed.
        """
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from decode_node.actor import DecodeNode
        from prefill_node.actor import PrefillNode

        self = object.__new__(cls)
        topo = topology if isinstance(topology, Topology) else load_topology(topology)
        check_single_device_instances(topo)
        self.topology = topo
        self._loopback = is_loopback_topology(topo)
        plan = plan_placement(topo)
        self._started_ray = False
        if not ray.is_initialized():
            with keeping_sigterm_handler():  # the caller's clean shutdown on SIGTERM, not Ray's sys.exit
                if os.environ.get("RAY_ADDRESS"):
                    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
                else:
                    needed = int(plan.num_devices_used * topo.hardware.cpus_per_device + 0.999)
                    init_local_ray(num_cpus or max(needed, 1))
            self._started_ray = True
        self._placement_groups = []
        self.prefill_actors: list[Any] = []
        self.decode_actors: list[Any] = []
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
            log(f"placement groups ready in {time.monotonic() - started_s:.1f} s; loading weights")
            env = {"env_vars": {"OMP_NUM_THREADS": "1"}}
            names: list[str] = []
            for spec, pg in zip(plan.instances, self._placement_groups, strict=True):
                options = {
                    "num_cpus": spec.bundles[0].get("CPU", 1),
                    "max_concurrency": 256,
                    # A crashed actor is restarted by Ray in its bundle, then rewired by the health monitor.
                    # A torch.distributed group is fixed at deploy time: a restarted rank could not rejoin.
                    "max_restarts": MAX_ACTOR_RESTARTS if topo.kv_transfer.transport == "grpc" else 0,
                    "runtime_env": env,
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        pg, placement_group_bundle_index=0
                    ),
                }
                options.update(actor_resource_options(plan.ray_resource))
                name = f"{spec.role}-{spec.index}"
                names.append(name)
                config = topo.engine_config(spec.role)
                if spec.role == "prefill":
                    actor = (
                        ray.remote(PrefillNode)
                        .options(**options)
                        .remote(config, name, topo.kv_transfer.layerwise)
                    )
                    self.prefill_actors.append(actor)
                else:
                    host = "127.0.0.1" if self._loopback else "0.0.0.0"
                    actor = ray.remote(DecodeNode).options(**options).remote(config, name, host)
                    self.decode_actors.append(actor)
            ready_refs = {a.ready.remote(): n for a, n in zip(self._actors, names, strict=True)}
            pending = list(ready_refs)
            infos: dict[str, dict] = {}
            while pending:
                done, pending = ray.wait(pending, num_returns=1, timeout=300)
                if not done:
                    raise DeployError(f"actors not ready after 300 s: {[ready_refs[r] for r in pending]}")
                try:
                    info = ray.get(done[0])
                except ray.exceptions.RayError as exc:
                    raise DeployError(
                        f"{ready_refs[done[0]]} failed to start: {actor_error_message(exc)}"
                    ) from None
                infos[info["name"]] = info
                log(
                    f"  {info['name']} ready: weights loaded in {info['load_s']:.1f} s "
                    f"({len(infos)}/{len(ready_refs)})"
                )
            decode_addresses = self._wire(ray, plan)
            log(
                f"cluster {topo.name} up in {time.monotonic() - started_s:.1f} s "
                f"({topo.kv_transfer.transport}, layerwise={topo.kv_transfer.layerwise})"
            )
        except BaseException as exc:
            self._teardown(ray, remove_placement_group)
            if isinstance(exc, ray.exceptions.RayError):  # e.g. wiring the KV transfer
                raise DeployError(f"deploying {topo.name} failed: {actor_error_message(exc)}") from None
            raise
        first = infos["prefill-0"]
        self.num_hidden_layers = first["num_hidden_layers"]
        self.kv_dim = first["kv_dim"]
        config = topo.engine_config("decode")
        self.num_speculative_tokens = config.num_speculative_tokens
        self.tokenizer = Tokenizer.from_dir(config.model)
        self.model_name = Path(config.model).resolve().name
        self.max_model_len = config.max_model_len or _max_position_embeddings(config.model)
        self._dtype = config.dtype
        self._decode_kv_cache_dtype = config.kv_cache_dtype
        self._policy = POLICIES[topo.router.policy]
        up_s = time.monotonic()
        self._health = {
            "prefill": [
                InstanceHealth(since_s=up_s, pid=infos[f"prefill-{i}"]["pid"])
                for i in range(len(self.prefill_actors))
            ],
            "decode": [
                InstanceHealth(since_s=up_s, pid=infos[f"decode-{j}"]["pid"])
                for j in range(len(self.decode_actors))
            ],
        }
        self._health_lock = threading.Lock()
        self._decode_addresses = decode_addresses
        self._poll_acked_seq = [0] * len(self.decode_actors)
        self._aborted: set[str] = set()
        self.call_timeout_s = max(CALL_TIMEOUT_MIN_S, topo.kv_transfer.timeout_s / 2)
        self.event_timeout_s = topo.kv_transfer.timeout_s + EVENT_SLACK_S
        self._prefill_hashes: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in self.prefill_actors]
        self._counter = itertools.count()
        self._active: dict[str, _Attempt | None] = {}  # None: between attempts
        self._by_handoff: dict[str, _Attempt] = {}
        self._pollers: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._kv_transfer_bytes_total = 0
        self._kv_transfer_seconds_total = 0.0
        self._closed = False
        self._monitor_stop = threading.Event()
        self._monitor = threading.Thread(target=self._monitor_health, name="health-monitor", daemon=True)
        self._monitor.start()
        return self

    @property
    def _actors(self) -> list[Any]:
        return self.prefill_actors + self.decode_actors

    def _probe_node(self, ray, spec_index: int) -> tuple[str, int]:
        """(node IP, a free port there) of instance `spec_index`'s placement group (where its actor runs)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        probe = ray.remote(_node_ip_and_free_port).options(
            num_cpus=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self._placement_groups[spec_index], placement_group_bundle_index=0
            ),
        )
        return ray.get(probe.remote(), timeout=60)

    def _wire(self, ray, plan) -> list[str]:
        """Connect the KV transport; returns the decode instances' gRPC addresses (grpc; else [])."""
        kv = self.topology.kv_transfer
        spec_index = {(spec.role, spec.index): i for i, spec in enumerate(plan.instances)}
        self._kv_tls = None  # the gRPC TLS material, kept for rewiring restarted actors
        if kv.transport == "grpc":
            tls = None
            if kv.tls is not None:  # read here, sent to the actors over Ray (files need not be on every node)
                from kvtransfer.grpc_transport import TLSCredentials

                tls = TLSCredentials.from_files(
                    kv.tls.cert_file, kv.tls.key_file, kv.tls.ca_file, kv.tls.server_name
                )
            addresses = ray.get([d.start_grpc.remote(tls) for d in self.decode_actors], timeout=120)
            if not self._loopback:  # bound to 0.0.0.0: senders dial the decode node's IP
                addresses = [
                    advertised_address(a, self._probe_node(ray, spec_index[("decode", j)])[0])
                    for j, a in enumerate(addresses)
                ]
            ray.get([p.connect_grpc.remote(addresses, tls) for p in self.prefill_actors], timeout=120)
            self._kv_tls = tls
            return addresses
        num_prefill, num_decode = len(self.prefill_actors), len(self.decode_actors)
        world_size = num_prefill + num_decode
        if self._loopback:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                host, port = "127.0.0.1", s.getsockname()[1]
        else:  # the rendezvous store runs in rank 0 (prefill-0): its node's IP and a port free there
            host, port = self._probe_node(ray, spec_index[("prefill", 0)])
        init_method = f"tcp://{host}:{port}"
        prefill_ranks = list(range(num_prefill))
        decode_ranks = list(range(num_prefill, world_size))
        refs = [
            p.connect_dist.remote(r, world_size, init_method, decode_ranks)
            for p, r in zip(self.prefill_actors, prefill_ranks, strict=True)
        ] + [
            d.connect_dist.remote(r, world_size, init_method, prefill_ranks)
            for d, r in zip(self.decode_actors, decode_ranks, strict=True)
        ]
        ray.get(refs, timeout=120)
        return []

    # ---- serving ----------------------------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[StreamDelta]:
        """Stream one request's output through prefill -> KV transfer -> decode.

        Every delta carries the phases known so far (`queue_s`, `prefill_s`, `kv_transfer_s`,
        `first_decode_step_s`, `total_s`, and `kv_transfer_bytes`) and cumulative acceptance counts.
        An `abort` ends the stream with an empty delta, finish_reason "abort".

        Raises:
            ValueError: an empty prompt, a duplicate id, or a request no decode instance could hold.
            BackendUnavailable: no live instance, no KV room within the timeout, the handoff failed
                twice / with no other prefill instance to re-dispatch to, the decode instance died or
                stopped answering, or no event came within `event_timeout_s`.
        """

        if self._closed:
            raise BackendUnavailable("the cluster is shut down")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty (no tokens)")
        if request_id in self._active:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._ensure_pollers()
        arrival_s = time.monotonic()
        phases: dict[str, float] = {}
        excluded: set[int] = set()
        errors: list[str] = []
        num_sent = 0
        finished = False

        def aborted_delta() -> StreamDelta:
            phases["total_s"] = time.monotonic() - arrival_s
            return StreamDelta(new_token_ids=[], finished=True, finish_reason="abort", phases=dict(phases))

        self._active[request_id] = None  # reserved: abort() may come before the first attempt exists
        try:
            for attempt_index in range(MAX_DISPATCH_ATTEMPTS):
                try:
                    attempt = await self._dispatch(
                        request_id, attempt_index, prompt_token_ids, params, excluded
                    )
                except BackendUnavailable as e:
                    if not errors:
                        raise
                    # A failed attempt and nowhere to re-dispatch: the client hears the attempt's cause.
                    raise BackendUnavailable(
                        f"{request_id}: KV handoff failed: {'; '.join(errors)}; {e}"
                    ) from e
                if attempt is None:  # aborted while dispatching (its reservation, if any, is released)
                    yield aborted_delta()
                    return
                prefill_ref = self.prefill_actors[attempt.prefill_index].prefill.remote(
                    attempt.handoff_id,
                    list(prompt_token_ids),
                    params,
                    attempt.meta,
                    attempt.decode_index,
                )
                prefill_task = asyncio.ensure_future(self._await_prefill(prefill_ref))
                error: str | None = None
                decode_lost = False
                owner_gone = False
                try:
                    while True:
                        getter = asyncio.ensure_future(attempt.events.get())
                        waits = {getter} if prefill_task.done() else {getter, prefill_task}
                        done, _ = await asyncio.wait(
                            waits, timeout=self.event_timeout_s, return_when=asyncio.FIRST_COMPLETED
                        )
                        if request_id in self._aborted:
                            getter.cancel()
                            self._abort_after_prefill(attempt, prefill_task)
                            yield aborted_delta()
                            return
                        if not done:
                            getter.cancel()
                            error = (
                                f"no event from decode-{attempt.decode_index} / prefill-"
                                f"{attempt.prefill_index} within {self.event_timeout_s:.0f} s"
                            )
                            break
                        if getter not in done:  # the prefill call returned first
                            getter.cancel()
                            exc = prefill_task.exception()
                            if exc is None:
                                phases.update(prefill_task.result())
                                continue
                            if isinstance(exc, asyncio.TimeoutError):
                                exc = TimeoutError(f"no answer within {self.event_timeout_s:.0f} s")
                            error = f"prefill-{attempt.prefill_index}: {describe_error(exc)}"
                            if self._is_lost(exc):
                                self._mark_failed("prefill", attempt.prefill_index, exc, "prefill")
                            break
                        if prefill_task.done() and prefill_task.exception() is None:
                            phases.update(prefill_task.result())
                        event = getter.result()
                        if event[0] == "abort":
                            self._abort_after_prefill(attempt, prefill_task)
                            yield aborted_delta()
                            return
                        if event[0] == "decode_lost":
                            error, decode_lost = event[2], True
                            break
                        if event[0] == "error":
                            error = event[2]
                            break
                        _, _, new_token_ids, finished, finish_reason, info = event
                        phases.update({k: v for k, v in info.items() if k.endswith(("_s", "_bytes"))})
                        if "kv_transfer_s" in info and num_sent == 0:
                            self._kv_transfer_seconds_total += info["kv_transfer_s"]
                            self._kv_transfer_bytes_total += int(info.get("kv_transfer_bytes", 0))
                        num_sent += len(new_token_ids)
                        phases["total_s"] = time.monotonic() - arrival_s
                        yield StreamDelta(
                            new_token_ids=list(new_token_ids),
                            finished=finished,
                            finish_reason=finish_reason,
                            phases=dict(phases),
                            num_draft_tokens=info.get("num_draft_tokens", 0),
                            num_accepted_tokens=info.get("num_accepted_tokens", 0),
                            num_draft_tokens_per_position=info.get("num_draft_tokens_per_position", []),
                            num_accepted_tokens_per_position=info.get("num_accepted_tokens_per_position", []),
                        )
                        if finished:
                            return
                except (asyncio.CancelledError, GeneratorExit):
                    owner_gone = True  # the consumer went away (the HTTP client disconnected)
                    raise
                finally:
                    self._by_handoff.pop(attempt.handoff_id, None)
                    if not finished and not prefill_task.done():
                        if owner_gone:  # released by the outer `finally`, and again after the prefill call
                            self._abort_after_prefill(attempt, prefill_task)
                        elif request_id not in self._aborted:  # (an aborted one runs on, likewise)
                            prefill_task.cancel()
                assert error is not None
                errors.append(
                    f"attempt {attempt_index + 1} (prefill-{attempt.prefill_index} -> "
                    f"decode-{attempt.decode_index}): {error}"
                )
                self._release(attempt)
                if decode_lost or not self._decode_alive[attempt.decode_index]:
                    reason = self._health["decode"][attempt.decode_index].reason
                    if not decode_lost:
                        error = (
                            f"decode-{attempt.decode_index} died or stopped answering ({reason}); the "
                            f"request was lost ({error})"
                        )
                    raise BackendUnavailable(f"{request_id}: {error}")
                if num_sent:  # tokens already streamed: never restart silently
                    raise BackendUnavailable(f"{request_id}: decode failed mid-stream: {error}")
                excluded.add(attempt.prefill_index)
                logger.warning("%s: %s", request_id, errors[-1])
            raise BackendUnavailable(f"{request_id}: KV handoff failed: " + "; ".join(errors))
        finally:
            attempt = self._active.pop(request_id, None)
            self._aborted.discard(request_id)
            if attempt is not None and not finished:
                self._release(attempt)

    async def abort(self, request_id: str) -> None:
        """End the request with finish_reason "abort" and free it on both pools (prefill job and handoff,
        decode reservation or running request). Never re-dispatched. Unknown or finished ids: no-op."""
        if request_id not in self._active or request_id in self._aborted:
            return
        self._aborted.add(request_id)
        attempt = self._active[request_id]
        if attempt is None:  # between attempts / still routing: `_dispatch` sees `_aborted`
            return
        self._release(attempt)
        attempt.events.put_nowait(("abort", attempt.handoff_id))

    def stats(self) -> dict[str, Any]:
        """Load snapshot of the instances in routing, and every instance's health.

        The snapshots are taken in parallel, waiting at most `call_timeout_s` (derived from
        kv_transfer.timeout_s, like every call on the request path): an instance that does not answer in
        time leaves routing as unresponsive (its requests fail), one whose actor died as dead; the health
        monitor brings either back once it answers again.

        Raises:
            BackendUnavailable: no prefill or no decode instance is in routing (so `/health` answers 503);
                the message names each instance's state and why.
        """
        import ray

        if self._closed:
            raise BackendUnavailable("the cluster is shut down")
        targets = [
            (role, i, actor)
            for role, actors in (("prefill", self.prefill_actors), ("decode", self.decode_actors))
            for i, actor in enumerate(actors)
            if self._health[role][i].routable
        ]
        refs = [actor.load.remote() for _, _, actor in targets]
        ray.wait(refs, num_returns=len(refs), timeout=self.call_timeout_s)
        loads: dict[str, list[dict[str, Any]]] = {"prefill": [], "decode": []}
        for (role, i, _), ref in zip(targets, refs, strict=True):
            try:
                loads[role].append(ray.get(ref, timeout=0))
            except Exception as e:  # noqa: BLE001 - GetTimeoutError or an actor error: out of routing
                self._mark_failed(role, i, e, "load")
        for role in ("prefill", "decode"):
            if not loads[role]:
                raise BackendUnavailable(f"no live {role} instance ({self._health_summary(role)})")
        prefill_loads, loads = loads["prefill"], loads["decode"]
        return {
            "num_waiting_requests": sum(p["num_requests"] for p in prefill_loads),
            "num_running_requests": sum(d["num_running"] for d in loads),
            "kv_blocks": {
                d["name"]: {
                    "num_used_blocks": d["num_total_blocks"] - d["num_free_blocks"],
                    "num_total_blocks": d["num_total_blocks"],
                }
                for d in loads
            },
            "kv_transfer_bytes_total": self._kv_transfer_bytes_total,
            "kv_transfer_seconds_total": self._kv_transfer_seconds_total,
            "instances": self.health(),
        }

    def health(self) -> dict[str, dict[str, Any]]:
        """Every instance's health: `{name: {"state": "healthy" | "unresponsive" | "dead", "reason": str,
        "for_s": seconds in that state}}` (no calls made)."""
        now_s = time.monotonic()
        return {
            f"{role}-{i}": {"state": h.state.value, "reason": h.reason, "for_s": round(now_s - h.since_s, 3)}
            for role in ("prefill", "decode")
            for i, h in enumerate(self._health[role])
        }

    def check_no_leaks(self) -> dict[str, dict[str, Any]]:
        """Per live instance: blocks held, reservations, open handoffs (all zero/empty when idle)."""
        import ray

        actors = [
            (f"prefill-{i}", a) for i, a in enumerate(self.prefill_actors) if self._prefill_alive[i]
        ] + [(f"decode-{i}", a) for i, a in enumerate(self.decode_actors) if self._decode_alive[i]]
        results = ray.get([a.check_no_leaks.remote() for _, a in actors], timeout=self.call_timeout_s)
        return {name: r for (name, _), r in zip(actors, results, strict=True)}

    def shutdown(self) -> None:
        """Stop the poll loops, close and kill the actors, remove the placement groups, and stop Ray if
        `deploy` started it."""
        import ray
        from ray.util.placement_group import remove_placement_group

        self._closed = True
        self._monitor_stop.set()
        for task in self._pollers:
            task.cancel()
        self._pollers = []
        self._teardown(ray, remove_placement_group)

    # ---- internals --------------------------------------------------------------------------------------
    def _teardown(self, ray, remove_placement_group) -> None:
        closes = []
        for actor in self._actors:
            with contextlib.suppress(Exception):
                closes.append(actor.close.remote())
        with contextlib.suppress(Exception):
            ray.wait(closes, num_returns=len(closes), timeout=15)
        for actor in self._actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        for pg in self._placement_groups:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
        self.prefill_actors, self.decode_actors, self._placement_groups = [], [], []
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def _meta(self, attempt: _Attempt, prompt_token_ids: list[int]) -> HandoffMeta:
        kv = self.topology.kv_transfer
        return HandoffMeta(
            request_id=attempt.handoff_id,
            num_layers=self.num_hidden_layers + (1 if self.num_speculative_tokens else 0),
            num_tokens=len(prompt_token_ids),
            kv_dim=self.kv_dim,
            dtype=self._dtype,
            wire_dtype=resolve_wire_dtype(kv.wire_dtype, self._dtype, self._decode_kv_cache_dtype),
            lease_s=kv.timeout_s,
        )

    async def _call(self, ref, timeout_s: float | None = None):
        """Await one actor call; asyncio.TimeoutError after `timeout_s` (default `call_timeout_s`)."""
        return await asyncio.wait_for(ref, timeout_s if timeout_s is not None else self.call_timeout_s)

    @staticmethod
    def _is_lost(exc: BaseException) -> bool:
        """The actor died or stopped answering (as opposed to a method that raised)."""
        import ray

        return isinstance(exc, (ray.exceptions.RayActorError, asyncio.TimeoutError, TimeoutError))

    # ---- health -----------------------------------------------------------------------------------------
    @property
    def _prefill_alive(self) -> list[bool]:
        """Per prefill instance: in routing (healthy)."""
        return [h.routable for h in self._health["prefill"]]

    @property
    def _decode_alive(self) -> list[bool]:
        """Per decode instance: in routing (healthy)."""
        return [h.routable for h in self._health["decode"]]

    def _health_summary(self, role: str) -> str:
        return "; ".join(
            f"{role}-{i} {h.state.value}" + (f": {h.reason}" if h.reason else "")
            for i, h in enumerate(self._health[role])
        )

    @staticmethod
    def _outcome(exc: BaseException) -> ProbeOutcome:
        import ray

        if isinstance(exc, (asyncio.TimeoutError, TimeoutError, ray.exceptions.GetTimeoutError)):
            return ProbeOutcome.TIMED_OUT
        return ProbeOutcome.DIED

    def _mark_failed(self, role: str, index: int, exc: BaseException, call: str) -> None:
        """A call `call` on instance (`role`, `index`) timed out or raised an actor error: take it out of
        routing (unresponsive or dead) and, for decode, fail its in-flight requests. Idempotent."""
        if self._outcome(exc) is ProbeOutcome.TIMED_OUT:
            reason = f"{call}: no answer within {self.call_timeout_s:g} s"
        else:
            reason = f"{call}: {describe_error(exc)}"
        with self._health_lock:
            before = self._health[role][index]
            after = after_failure(before, self._outcome(exc), reason, time.monotonic())
            self._health[role][index] = after
        if after is before:
            return
        logger.error("%s-%d is %s (%s); taken out of routing", role, index, after.state.value, reason)
        if role == "decode":
            self._fail_decode_attempts(index)

    def _monitor_health(self) -> None:
        """Health monitor thread: every PROBE_INTERVAL_S, probe every instance with one `load` call (all
        at once, waiting `call_timeout_s`). One that does not answer leaves routing, so a crash or stall is
        noticed with no request in flight; one out of routing that answers rejoins, after rewiring its KV
        transport if Ray restarted it (a new process id)."""
        while not self._monitor_stop.wait(PROBE_INTERVAL_S):
            try:
                self._probe_all()
            except Exception:  # noqa: BLE001 - Ray going away under a shutdown, or a bug: never die silently
                if self._closed:
                    return
                logger.exception("health monitor: a probe round failed; trying again")

    def _probe_all(self) -> None:
        """One round of the health monitor (see `_monitor_health`)."""
        import ray

        targets = [
            (role, i, actor)
            for role, actors in (("prefill", self.prefill_actors), ("decode", self.decode_actors))
            for i, actor in enumerate(actors)
        ]
        if not targets or self._closed:
            return
        refs = [actor.load.remote() for _, _, actor in targets]
        ray.wait(refs, num_returns=len(refs), timeout=self.call_timeout_s)
        for (role, i, _), ref in zip(targets, refs, strict=True):
            if self._closed:
                return
            try:
                pid = ray.get(ref, timeout=0)["pid"]
            except Exception as e:  # noqa: BLE001 - stalled, restarting, or dead
                self._mark_failed(role, i, e, "probe")
                continue
            health = self._health[role][i]
            if not health.routable or health.pid != pid:
                self._rejoin(role, i, pid)

    def _rejoin(self, role: str, index: int, pid: int) -> None:
        import ray

        before = self._health[role][index]
        after, needs_rewire = after_answer(before, pid, time.monotonic())
        if needs_rewire and role == "decode":  # what ran on the old process is gone
            self._fail_decode_attempts(index)
        if self.topology.kv_transfer.transport == "grpc" and (needs_rewire or role == "prefill"):
            try:
                self._rewire(ray, role, index, needs_rewire)
            except Exception as e:  # noqa: BLE001 - try again at the next probe
                logger.error("%s-%d answers again but could not be rewired: %s", role, index, e)
                return
        with self._health_lock:
            self._health[role][index] = after
        if role == "decode":
            self._poll_acked_seq[index] = 0 if needs_rewire else self._poll_acked_seq[index]
        logger.warning(
            "%s-%d rejoined routing after %.1f s %s (%s)",
            role,
            index,
            after.since_s - before.since_s,
            before.state.value,
            "restarted and rewired" if needs_rewire else "answering again",
        )

    def _rewire(self, ray, role: str, index: int, restarted: bool) -> None:
        """gRPC only (restarts are off for torch.distributed). A restarted decode starts its receiver on a
        new port, which the prefill instances in routing learn at once (the others when they rejoin); a
        rejoining prefill (re)connects to every decode's current address, in case one moved meanwhile."""
        if role == "decode":
            assert restarted
            decode = self.decode_actors[index]
            address = ray.get(decode.start_grpc.remote(self._kv_tls), timeout=self.call_timeout_s)
            if not self._loopback:
                address = advertised_address(
                    address, ray.get(decode.node_ip.remote(), timeout=self.call_timeout_s)
                )
            self._decode_addresses[index] = address
            prefills = [p for i, p in enumerate(self.prefill_actors) if self._health["prefill"][i].routable]
            ray.get(
                [p.set_decode_address.remote(index, address) for p in prefills], timeout=self.call_timeout_s
            )
        else:
            ray.get(
                self.prefill_actors[index].connect_grpc.remote(list(self._decode_addresses), self._kv_tls),
                timeout=self.call_timeout_s,
            )

    def _fail_decode_attempts(self, decode_index: int) -> None:
        """End every in-flight attempt on decode `decode_index` with a "decode_lost" event. Safe from any
        thread: off the requests' event loop (the health monitor, stats() in a worker thread) it is
        handed to that loop, since asyncio queues are not thread-safe."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                on_loop = asyncio.get_running_loop() is loop
            except RuntimeError:
                on_loop = False
            if not on_loop:
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    loop.call_soon_threadsafe(self._fail_decode_attempts_on_loop, decode_index)
                return
        self._fail_decode_attempts_on_loop(decode_index)

    def _fail_decode_attempts_on_loop(self, decode_index: int) -> None:
        reason = self._health["decode"][decode_index].reason or "unknown"
        for attempt in list(self._by_handoff.values()):
            if attempt.decode_index == decode_index:
                message = f"decode-{decode_index} died or stopped answering ({reason}); the request was lost"
                with contextlib.suppress(RuntimeError):  # a queue of another (closed) event loop
                    attempt.events.put_nowait(("decode_lost", attempt.handoff_id, message))

    async def _dispatch(
        self,
        request_id: str,
        attempt_index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        excluded: set[int],
    ) -> _Attempt | None:
        """Route, then reserve on decode (retrying while no decode instance has room). None: aborted.

        Instances whose load/reserve call dies or times out are marked dead and routing continues with
        the others."""
        deadline_s = time.monotonic() + self.topology.kv_transfer.timeout_s
        block_size = self.topology.prefill.block_size
        hashes = compute_block_hashes(list(prompt_token_ids), block_size)
        while True:
            if request_id in self._aborted:
                return None
            live = [i for i, alive in enumerate(self._prefill_alive) if alive and i not in excluded]
            if not live:
                if excluded:  # after a failed attempt (generate adds that attempt's cause)
                    raise BackendUnavailable("no other live prefill instance to re-dispatch to")
                summary = self._health_summary("prefill")
                raise BackendUnavailable(f"{request_id}: no live prefill instance ({summary})")
            live_decode = [j for j, alive in enumerate(self._decode_alive) if alive]
            if not live_decode:
                raise BackendUnavailable(
                    f"{request_id}: no live decode instance ({self._health_summary('decode')})"
                )
            prefill_results, decode_results = await asyncio.gather(
                asyncio.gather(
                    *[self._call(self.prefill_actors[i].load.remote()) for i in live], return_exceptions=True
                ),
                asyncio.gather(
                    *[self._call(self.decode_actors[j].load.remote()) for j in live_decode],
                    return_exceptions=True,
                ),
            )
            lost = False
            for i, r in zip(live, prefill_results, strict=True):
                if isinstance(r, BaseException):
                    if not self._is_lost(r):
                        raise r
                    self._mark_failed("prefill", i, r, "load")
                    lost = True
            for j, r in zip(live_decode, decode_results, strict=True):
                if isinstance(r, BaseException):
                    if not self._is_lost(r):
                        raise r
                    self._mark_failed("decode", j, r, "load")
                    lost = True
            if lost:
                continue  # route again over the instances that answered
            if request_id in self._aborted:
                return None
            choice = self._policy(
                [
                    PrefillLoad(i, p["num_queued_prefill_tokens"], frozenset(self._prefill_hashes[i]))
                    for i, p in zip(live, prefill_results, strict=True)
                ],
                [
                    DecodeLoad(
                        k,
                        d["num_free_blocks"],
                        d["num_running"] + d["num_reserved"] + d["num_waiting_for_seat"],
                    )
                    for k, d in enumerate(decode_results)
                ],
                counter=next(self._counter),
                prompt_token_ids=prompt_token_ids,
                block_size=block_size,
            )
            prefill_index, decode_index = live[choice.prefill_index], live_decode[choice.decode_index]
            attempt = _Attempt(f"{request_id}@{attempt_index}", prefill_index, decode_index)
            self._by_handoff[attempt.handoff_id] = attempt
            self._active[request_id] = attempt
            reserve_call = asyncio.ensure_future(
                self._call(
                    self.decode_actors[decode_index].reserve.remote(
                        attempt.handoff_id,
                        list(prompt_token_ids),
                        params,
                        self._meta(attempt, prompt_token_ids),
                        self.num_speculative_tokens,
                    )
                )
            )
            try:
                bound = await asyncio.shield(reserve_call)
            except asyncio.CancelledError:
                # The request's owner went away (the HTTP client disconnected) while decode reserved:
                # the reservation is released now, and again once the reserve call has returned (Ray runs
                # a threaded actor's calls unordered, so this abort may overtake the reserve).
                self._by_handoff.pop(attempt.handoff_id, None)
                self._active[request_id] = None
                self._release(attempt)
                self._release_when_done(attempt, reserve_call)
                raise
            except BaseException as e:
                self._by_handoff.pop(attempt.handoff_id, None)
                self._active[request_id] = None
                if not self._is_lost(e):
                    raise
                self._release(attempt)  # a reservation that did go through after the timeout
                self._mark_failed("decode", decode_index, e, "reserve")
                continue
            if request_id in self._aborted:  # aborted while reserving: abort() saw this attempt
                self._by_handoff.pop(attempt.handoff_id, None)
                self._release(attempt)
                return None
            if bound is not None:
                attempt.meta = bound
                remembered = self._prefill_hashes[prefill_index]
                for h in hashes:
                    remembered[h] = None
                    remembered.move_to_end(h)
                while len(remembered) > ROUTER_CACHE_BLOCKS:
                    remembered.popitem(last=False)
                return attempt
            self._by_handoff.pop(attempt.handoff_id, None)
            self._active[request_id] = None
            if time.monotonic() > deadline_s:
                raise BackendUnavailable(f"{request_id}: no decode instance had KV blocks free in time")
            await asyncio.sleep(0.05)

    async def _await_prefill(self, ref) -> dict[str, float]:
        result = await self._call(ref, self.event_timeout_s)
        return {"queue_s": result["queue_s"], "prefill_s": result["prefill_s"]}

    def _abort_after_prefill(self, attempt: _Attempt, prefill_task: asyncio.Future) -> None:
        """Ray runs a threaded actor's calls unordered, so abort() may overtake the `prefill` call it is
        meant to stop (and find nothing to abort): release the attempt again once that call returns."""
        self._release_when_done(attempt, prefill_task)

    def _release_when_done(self, attempt: _Attempt, call: asyncio.Future) -> None:
        """Release `attempt` (`_release`) again once the actor call `call` has ended, whatever its outcome
        (its result or error is consumed here): what the call set up after an earlier release is freed."""
        if call.done():
            return

        def again(task: asyncio.Future) -> None:
            if not task.cancelled():
                task.exception()  # consumed: the request that made the call is gone
            if not self._closed:
                self._release(attempt)

        call.add_done_callback(again)

    def _release(self, attempt: _Attempt) -> None:
        """Best effort, fire and forget: drop the attempt on its prefill and decode instances. Sent to
        instances out of routing too: a stalled actor runs the call when it resumes (so what it still held
        for the attempt is freed before it rejoins), a dead one drops it."""
        with contextlib.suppress(Exception):
            self.decode_actors[attempt.decode_index].abort.remote(attempt.handoff_id)
        with contextlib.suppress(Exception):
            self.prefill_actors[attempt.prefill_index].abort.remote(attempt.handoff_id)

    def _ensure_pollers(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._pollers:
            return
        self._loop = loop
        self._pollers = [loop.create_task(self._poll(j)) for j in range(len(self.decode_actors))]

    async def _poll(self, decode_index: int) -> None:
        """Hand decode instance `decode_index`'s events to their requests. A poll that fails or takes over
        `call_timeout_s` takes the instance out of routing (its requests fail); polling resumes once the
        health monitor has brought it back. Each poll acknowledges the events received so far, so a reply
        lost to a timeout is sent again by the next poll (`DecodeNode.poll`)."""
        actor = self.decode_actors[decode_index]
        while not self._closed:
            if not self._decode_alive[decode_index]:
                await asyncio.sleep(PROBE_INTERVAL_S / 4)
                continue
            try:
                events = await self._call(
                    actor.poll.remote(0.05, self._poll_acked_seq[decode_index]), self.call_timeout_s + 0.05
                )
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a dead or stuck decode instance fails its requests
                self._mark_failed("decode", decode_index, e, "poll")
                continue
            for seq, event in events:
                if seq <= self._poll_acked_seq[decode_index]:
                    continue  # sent again after a lost reply; already handed over
                self._poll_acked_seq[decode_index] = seq
                attempt = self._by_handoff.get(event[1])
                if attempt is not None:
                    attempt.events.put_nowait(event)


def describe_error(exc: BaseException) -> str:
    """A one-line description of `exc` fit for a client, for errors on the request path: an exception a
    remote method raised is described by itself (`actor_error_message`); Ray's own errors, which carry
    actor ids, process ids and node IPs, become what happened."""
    import ray

    if isinstance(exc, ray.exceptions.RayTaskError):  # the method raised: describe its own exception
        return actor_error_message(exc)
    if isinstance(exc, ray.exceptions.ActorUnavailableError):
        return "the actor is unavailable (restarting or unreachable)"
    if isinstance(exc, ray.exceptions.ActorDiedError):
        return "the actor process died"
    if isinstance(exc, ray.exceptions.RayActorError):
        return "the actor died or is unreachable"
    if isinstance(exc, TimeoutError) and isinstance(exc, ray.exceptions.RayError):
        return "no answer in time"
    if isinstance(exc, ray.exceptions.RayError):
        return f"Ray error ({type(exc).__name__})"
    text = one_line(str(exc))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _max_position_embeddings(model_dir: str) -> int:
    import json

    return json.loads((Path(model_dir) / "config.json").read_text())["max_position_embeddings"]
