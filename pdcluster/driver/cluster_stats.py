"""`ClusterStats`: the read side of a `Cluster` for `/metrics` and `/health` (`stats`, `check_ready`)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from pdcluster.config import ROLES
from pdcluster.driver.backend import BackendUnavailable
from pdcluster.driver.instance import check_instance_group
from pdcluster.driver.messages import DecodeNodeLoad, PrefillNodeLoad
from pdcluster.driver.rank_actors import PROBE_GROUP
from pdcluster.driver.registry import InstanceRegistry


def rank_stats(load: PrefillNodeLoad | DecodeNodeLoad) -> dict[str, Any]:
    """One rank's load for `stats()["ranks"]`: its load fields by name, plus `ep` when its engine has EP."""
    fields = {f.name: getattr(load, f.name) for f in dataclasses.fields(load)}
    stats = {k: v for k, v in fields.items() if isinstance(v, int) and not isinstance(v, bool) and k != "pid"}
    if fields.get("ep") is not None:
        stats["ep"] = fields["ep"]
    return stats


class ClusterStats:
    """`registry`: the instances and their health (a rank that does not answer a stats round is marked
    there); `totals`: what has `kv_transfer_bytes_total`, `kv_transfer_seconds_total`,
    `requests_recomputed_total` and `recomputed_tokens_total` (the dispatcher);
    `closed()`: whether the cluster is shut down."""

    def __init__(
        self, registry: InstanceRegistry, call_timeout_s: float, totals: Any, closed: Callable[[], bool]
    ) -> None:
        self.registry = registry
        self.call_timeout_s = call_timeout_s
        self.totals = totals
        self.closed = closed

    def stats(self) -> dict[str, Any]:
        """Load of the instances in routing (`ranks`, `kv_blocks`, totals) and every instance's health.

        Raises BackendUnavailable: no prefill or no decode instance is in routing;
            the message names each instance's state and why.
        """
        import ray

        if self.closed():
            raise BackendUnavailable("the cluster is shut down")
        targets = [  # every rank of every instance in routing
            (role, instance.index, actor)
            for role in ROLES
            for instance in self.registry.instances[role]
            if instance.routable
            for actor in instance.ranks
        ]
        sent_s = time.monotonic()
        refs = [actor.load.options(concurrency_group=PROBE_GROUP).remote() for _, _, actor in targets]
        ray.wait(refs, num_returns=len(refs), timeout=self.call_timeout_s)
        loads: dict[str, list[Any]] = {"prefill": [], "decode": []}
        for (role, i, _), ref in zip(targets, refs, strict=True):
            try:
                load = ray.get(ref, timeout=0)
                check_instance_group([load])
                loads[role].append(load)
            except Exception as e:  # noqa: BLE001 - GetTimeoutError, an actor error, a failed group
                self.registry.mark_failed(role, i, e, "load", sent_s)
        for role in ("prefill", "decode"):
            if not loads[role]:
                raise BackendUnavailable(f"no live {role} instance ({self.registry.summary(role)})")
        prefill_loads: list[PrefillNodeLoad] = loads["prefill"]
        decode_loads: list[DecodeNodeLoad] = loads["decode"]
        return {
            "ranks": {load.name: rank_stats(load) for load in prefill_loads + decode_loads},
            "num_waiting_requests": sum(p.num_requests for p in prefill_loads),
            "num_running_requests": sum(d.num_running for d in decode_loads),
            "kv_blocks": {
                d.name: {
                    "num_used_blocks": d.num_total_blocks - d.num_free_blocks,
                    "num_total_blocks": d.num_total_blocks,
                }
                for d in decode_loads
            },
            "kv_transfer_bytes_total": self.totals.kv_transfer_bytes_total,
            "kv_transfer_seconds_total": self.totals.kv_transfer_seconds_total,
            "requests_recomputed_total": self.totals.requests_recomputed_total,
            "recomputed_tokens_total": self.totals.recomputed_tokens_total,
            "instances": self.registry.health(),
        }

    def check_ready(self) -> None:
        """`ServingBackend.check_ready` from the health last recorded by the monitor and the request path.

        Raises BackendUnavailable: shut down, or no prefill or no decode instance in routing; the message
            names each instance's state and why.
        """
        if self.closed():
            raise BackendUnavailable("the cluster is shut down")
        for role in ROLES:
            if not any(self.registry.routable(role)):
                raise BackendUnavailable(f"no live {role} instance ({self.registry.summary(role)})")
