"""Joining the torch.distributed group of one multi-rank instance, from its rank actors.

TCPStore has no authentication, so every key of the rendezvous lives under a namespace derived from its
secret (`InstanceGroupSpec.secret`, fresh per rendezvous, sent to the ranks only), and each rank proves the
secret at the barrier (HMAC-SHA256 of its rank) before any group is made.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import secrets
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
    barrier_store: dist.Store
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


def new_rendezvous_secret() -> str:
    """A fresh rendezvous secret (256 random bits, hex)."""
    return secrets.token_hex(32)


def _digest(secret: str, what: str) -> str:
    return hmac.new(secret.encode(), what.encode(), hashlib.sha256).hexdigest()


def _namespace(spec: InstanceGroupSpec) -> str:
    """The store prefix of the rendezvous of `spec` (raises ValueError without a secret)."""
    if not spec.secret:
        raise ValueError("the instance group spec has no rendezvous secret (InstanceGroupSpec.secret)")
    return _digest(spec.secret, "namespace")[:32]


def join_instance_group(spec: InstanceGroupSpec) -> InstanceGroup:
    """Meet the other ranks at the barrier, then make the group (collective: every rank calls it at once).
    Raises ValueError: a malformed `init_method`, an unknown backend, a rank out of range, no secret.
    Raises RuntimeError (torch.distributed's DistStoreError / DistError): a rank did not reach the barrier
        within `rendezvous_timeout_s` or did not prove the secret, or the rendezvous or handshake failed."""
    return form_group(spec, meet(spec))


def meet(spec: InstanceGroupSpec, aborted: Callable[[], bool] | None = None) -> dist.Store:
    """The barrier of `join_instance_group`: returns once every rank reached it. With `aborted`, polled
    meanwhile: RuntimeError as soon as it says True.

    Raises ValueError / RuntimeError as `join_instance_group`.
    """
    if not 0 <= spec.rank < spec.num_ranks:
        raise ValueError(f"rank {spec.rank} is not in [0, {spec.num_ranks})")
    namespace = _namespace(spec)
    host, _ = rendezvous_address(spec.init_method)
    store = dist.TCPStore(
        host,
        spec.barrier_port,
        spec.num_ranks,
        is_master=spec.rank == 0,
        timeout=datetime.timedelta(seconds=spec.rendezvous_timeout_s),
        wait_for_workers=False,  # (a stranger's connection would count; the keys below are what is waited on)
    )
    barrier = dist.PrefixStore(f"{namespace}/", store)
    keys = [f"rank{r}" for r in range(spec.num_ranks)]
    barrier.set(keys[spec.rank], _digest(spec.secret, keys[spec.rank]))
    _wait_keys(barrier, keys, spec.rendezvous_timeout_s, aborted)
    for key in keys:
        if not hmac.compare_digest(barrier.get(key), _digest(spec.secret, key).encode()):
            raise RuntimeError(f"instance group rendezvous: {key} did not prove the rendezvous secret")
    return barrier


def _wait_keys(store: dist.Store, keys: list[str], timeout_s: float, aborted: Callable[[], bool] | None):
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


def form_group(spec: InstanceGroupSpec, barrier: dist.Store) -> InstanceGroup:
    """After `meet`: make the group and check it with one allreduce (collective)."""
    host, port = rendezvous_address(spec.init_method)
    group = make_instance_group(
        host, port, spec.rank, spec.num_ranks, spec.backend, spec.timeout_s, f"instance-{_namespace(spec)}"
    )
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
