"""Joining the torch.distributed group of one multi-rank instance, from its rank actors."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import NamedTuple
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from pdcluster.driver.messages import InstanceGroupSpec
from pdcluster.engine.parallel import make_instance_group


class InstanceGroup(NamedTuple):
    """A joined instance group: `group` (the ProcessGroup; call its methods directly), `barrier_store`
    (kept alive with the group: rank 0's hosts the barrier), `rank`, `num_ranks`."""

    group: dist.ProcessGroup
    barrier_store: dist.TCPStore
    rank: int
    num_ranks: int


def rendezvous_address(init_method: str) -> tuple[str, int]:
    """(host, port) of `tcp://host:port`.

    Raises ValueError: anything else.
    """
    parsed = urlparse(init_method)
    if parsed.scheme != "tcp" or parsed.hostname is None or parsed.port is None:
        raise ValueError(f"init_method must be tcp://host:port, got {init_method!r}")
    return parsed.hostname, parsed.port


def join_instance_group(spec: InstanceGroupSpec) -> InstanceGroup:
    """Meet the other ranks at the barrier, then make the group (collective: every rank of the instance
    calls it at once).

    Raises ValueError: a malformed `init_method`, an unknown backend, or a rank out of range.
    Raises RuntimeError (torch.distributed's DistStoreError / DistError): a rank did not reach the barrier
        within `rendezvous_timeout_s`, or the group's rendezvous or handshake failed.
    """
    return form_group(spec, meet(spec))


def meet(spec: InstanceGroupSpec, aborted: Callable[[], bool] | None = None) -> dist.TCPStore:
    """The barrier of `join_instance_group`: returns once every rank reached it. With `aborted`, polled
    meanwhile: RuntimeError as soon as it says True.

    Raises ValueError / RuntimeError as `join_instance_group`.
    """
    if not 0 <= spec.rank < spec.num_ranks:
        raise ValueError(f"rank {spec.rank} is not in [0, {spec.num_ranks})")
    host, _ = rendezvous_address(spec.init_method)
    barrier = dist.TCPStore(
        host,
        spec.barrier_port,
        spec.num_ranks,
        is_master=spec.rank == 0,
        timeout=datetime.timedelta(seconds=spec.rendezvous_timeout_s),
        wait_for_workers=aborted is None,  # (else the keys below are polled, so an abort is seen)
    )
    barrier.set(f"rank{spec.rank}", "ready")
    _wait_keys(barrier, [f"rank{r}" for r in range(spec.num_ranks)], spec.rendezvous_timeout_s, aborted)
    return barrier


def _wait_keys(store: dist.TCPStore, keys: list[str], timeout_s: float, aborted: Callable[[], bool] | None):
    if aborted is None:
        store.wait(keys)
        return
    deadline_s = time.monotonic() + timeout_s
    while not store.check(keys):
        if aborted():
            raise RuntimeError("joining the instance group was aborted")
        if time.monotonic() > deadline_s:
            raise RuntimeError(f"not every rank reached the instance group's barrier within {timeout_s:g} s")
        time.sleep(0.05)


def form_group(spec: InstanceGroupSpec, barrier: dist.TCPStore) -> InstanceGroup:
    """After `meet`: make the group and check it with one allreduce (collective)."""
    host, port = rendezvous_address(spec.init_method)
    group = make_instance_group(host, port, spec.rank, spec.num_ranks, spec.backend, spec.timeout_s)
    joined = torch.ones(1)
    group.allreduce([joined]).wait()
    if int(joined.item()) != spec.num_ranks:
        raise RuntimeError(f"instance group handshake: {int(joined.item())} of {spec.num_ranks} ranks")
    return InstanceGroup(group, barrier, spec.rank, spec.num_ranks)


def wait_until_loaded(
    joined: InstanceGroup, timeout_s: float = 0.0, aborted: Callable[[], bool] | None = None
):
    """Barrier after loading (collective), so no rank's first step starts while a peer still loads; with
    `aborted`, polled as in `meet` for up to `timeout_s` seconds.

    Raises RuntimeError (torch.distributed's DistStoreError): a rank did not finish loading in time.
    """
    joined.barrier_store.set(f"loaded{joined.rank}", "ready")
    _wait_keys(joined.barrier_store, [f"loaded{r}" for r in range(joined.num_ranks)], timeout_s, aborted)
