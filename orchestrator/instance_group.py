"""The torch.distributed group of one multi-rank instance, joined by its rank actors.

Each rank actor of an instance of N devices calls `join_instance_group(spec)` in its constructor, before it
builds its engine (an expert-parallel engine loads only its own experts and runs the MoE all-to-alls over
this group). The group is its own `ProcessGroup` over a `TCPStore` that rank 0 hosts at
`spec.init_method`, never the process's default group: the torch_distributed KV transport owns that one
(`kvtransfer.dist_transport`), and one process may be in both.

Every collective of the group carries `spec.timeout_s` (the rendezvous `spec.rendezvous_timeout_s`), so
a rank that died or stalled makes the others' collectives raise within that time instead of waiting
forever; the instance then fails as one unit (`orchestrator.health_monitor`). A handshake all-reduce
checks that every rank joined.
"""

from __future__ import annotations

import datetime
from typing import NamedTuple
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from orchestrator.messages import InstanceGroupSpec


class InstanceGroup(NamedTuple):
    """A joined instance group: `group` (the ProcessGroup), `store` (the rendezvous store, kept alive with
    it: rank 0's hosts the rendezvous), `rank`, `num_ranks`."""

    group: dist.ProcessGroup
    store: dist.TCPStore
    rank: int
    num_ranks: int


def _rendezvous(init_method: str) -> tuple[str, int]:
    parsed = urlparse(init_method)
    if parsed.scheme != "tcp" or parsed.hostname is None or parsed.port is None:
        raise ValueError(f"init_method must be tcp://host:port, got {init_method!r}")
    return parsed.hostname, parsed.port


def join_instance_group(spec: InstanceGroupSpec) -> InstanceGroup:
    """Join the instance's group (collective: every rank of the instance calls it at once).

    Returns the joined group (rank `spec.rank` of `spec.num_ranks`). Only `gloo` is built here; `nccl` /
    `hccl` groups are the engine's (`engine.parallel`) on accelerators.

    Raises:
        ValueError: a malformed `init_method`, a backend other than gloo, or a rank out of range.
        RuntimeError (torch.distributed's DistStoreError / DistError): a rank did not join within
            `rendezvous_timeout_s`, or the handshake failed.
    """
    if not 0 <= spec.rank < spec.num_ranks:
        raise ValueError(f"rank {spec.rank} is not in [0, {spec.num_ranks})")
    if spec.backend != "gloo":
        raise ValueError(f"instance groups are built over gloo here, not {spec.backend!r}")
    host, port = _rendezvous(spec.init_method)
    store = dist.TCPStore(
        host,
        port,
        spec.num_ranks,
        is_master=spec.rank == 0,
        timeout=datetime.timedelta(seconds=spec.rendezvous_timeout_s),
        wait_for_workers=True,
    )
    group = dist.ProcessGroupGloo(
        store, spec.rank, spec.num_ranks, datetime.timedelta(seconds=spec.timeout_s)
    )
    joined = torch.ones(1)
    group.allreduce([joined]).wait()
    if int(joined.item()) != spec.num_ranks:
        raise RuntimeError(f"instance group handshake: {int(joined.item())} of {spec.num_ranks} ranks")
    return InstanceGroup(group, store, spec.rank, spec.num_ranks)
