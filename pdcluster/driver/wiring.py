"""Wiring a deployed `Cluster`: rendezvous addresses on the nodes that host them, and the KV transport."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from pdcluster.driver.instance import Instance
from pdcluster.kvtransfer.ports import free_ports

if TYPE_CHECKING:
    from pdcluster.kvtransfer.paired import PairedAddress

logger = logging.getLogger("pdcluster.driver.cluster")


def advertised_address(bound_address: str, node_ip: str) -> str:
    """The address prefill senders dial: `node_ip:port` (IPv6 bracketed) for a server on all interfaces."""
    host, _, port = bound_address.rpartition(":")
    if host not in ("0.0.0.0", "", "[::]", "::"):
        return bound_address
    if ":" in node_ip and not node_ip.startswith("["):
        node_ip = f"[{node_ip}]"
    return f"{node_ip}:{port}"


def probe_timeout_s(topology: Any) -> float:
    """Seconds a node probe (`ClusterWiring._probe_node`) or a KV wiring call at deploy may take: as long as
    a re-formed group's rendezvous (`driver.elastic`), twice the collective timeout plus a call, from
    kv_transfer.timeout_s."""
    from pdcluster.driver.dispatch import call_timeout_s, collective_timeout_s

    kv_timeout_s = topology.kv_transfer.timeout_s
    return 2 * collective_timeout_s(kv_timeout_s) + call_timeout_s(kv_timeout_s)


RANK_TRANSPORT_ENV = "PDCLUSTER_RANK_TRANSPORT"
RANK_TRANSPORTS = ("auto", "ray", "socket")


def rank_transport(topology: Any) -> str:
    """How the driver calls its ranks, chosen once per deployment: "socket" (`driver.socket_rank_client`)
    when every rank runs on the driver's host (`is_loopback_topology`), else "ray". The environment
    variable PDCLUSTER_RANK_TRANSPORT (auto | ray | socket) overrides it. ValueError: an unknown value, or
    socket for ranks on other hosts."""
    from pdcluster.driver.rank_actors import is_loopback_topology

    wanted = os.environ.get(RANK_TRANSPORT_ENV, "auto") or "auto"
    if wanted not in RANK_TRANSPORTS:
        raise ValueError(f"{RANK_TRANSPORT_ENV}={wanted!r}: must be one of {', '.join(RANK_TRANSPORTS)}")
    loopback = is_loopback_topology(topology)
    if wanted == "socket" and not loopback:
        raise ValueError(
            f"{RANK_TRANSPORT_ENV}=socket needs every rank on the driver's host (a cpu topology)"
        )
    if wanted == "auto":
        return "socket" if loopback else "ray"
    return wanted


def _node_ip_and_free_ports(count: int = 1) -> tuple[str, list[int]]:
    import ray

    return ray.util.get_node_ip_address(), free_ports("", count)


class ClusterWiring:
    """See the module docstring."""

    instances: dict[str, list[Instance]]
    _placement_groups: list[Any]
    _loopback: bool

    def _rendezvous(self, ray, spec_index: int, bundle_index: int = 0) -> tuple[str, int, str]:
        """A new rendezvous for instance `spec_index`'s group, hosted on the node of its placement group's
        bundle `bundle_index` (where the group's rank 0 runs): init method, barrier port, secret."""
        from pdcluster.driver.instance_group import new_rendezvous_secret

        if self._loopback:
            host, ports = "127.0.0.1", free_ports("127.0.0.1", 2)
        else:
            host, ports = self._probe_node(ray, spec_index, bundle_index, count=2)
        return f"tcp://{host}:{ports[0]}", ports[1], new_rendezvous_secret()

    def _probe_node(self, ray, spec_index: int, bundle_index: int = 0, count: int | None = None):
        """The IP of the node holding bundle `bundle_index` of instance `spec_index` and a free port there
        (`count` given: a list of `count`), from a task in that bundle, waited for `probe_timeout_s`.
        Raises GetTimeoutError past it."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        probe = ray.remote(_node_ip_and_free_ports).options(
            num_cpus=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self._placement_groups[spec_index], placement_group_bundle_index=bundle_index
            ),
        )
        ip, ports = ray.get(probe.remote(count or 1), timeout=probe_timeout_s(self.topology))
        return (ip, ports) if count is not None else (ip, ports[0])

    def _wire(self, ray, plan) -> list[list[str]] | list[list[PairedAddress]]:
        kv, timeout_s = self.topology.kv_transfer, probe_timeout_s(self.topology)  # (a rendezvous' wait)
        spec_index = {(spec.role, spec.index): i for i, spec in enumerate(plan.instances)}
        prefill_ranks = [a for p in self.instances["prefill"] for a in p.ranks]
        decodes = self.instances["decode"]
        self._kv_tls = None  # the gRPC TLS material, kept for rewiring restarted actors
        if self.topology.kv_transport in ("shm", "shm+grpc"):
            # shm: one node (topology rules), socket paths on this host. shm+grpc: each decode rank listens
            # on both (its gRPC address at its node's IP); each prefill rank picks per decode rank by node.
            transport = self.topology.kv_transport
            refs = [[d.start_receiver.remote(transport) for d in instance.ranks] for instance in decodes]
            addresses = [ray.get(rank_refs, timeout=timeout_s) for rank_refs in refs]
            ray.get(
                [p.connect_receivers.remote(transport, addresses) for p in prefill_ranks], timeout=timeout_s
            )
            return addresses
        if self.topology.kv_transport == "grpc":
            tls = None
            if kv.tls is not None:  # read here, sent to the actors over Ray (files need not be on every node)
                from pdcluster.kvtransfer.grpc_transport import TLSCredentials

                tls = TLSCredentials.from_files(
                    kv.tls.cert_file, kv.tls.key_file, kv.tls.ca_file, kv.tls.server_name
                )
            refs = [[d.start_grpc.remote(tls) for d in instance.ranks] for instance in decodes]
            addresses = [ray.get(rank_refs, timeout=timeout_s) for rank_refs in refs]
            if not self._loopback:  # bound to 0.0.0.0: senders dial the decode node's IP
                addresses = [
                    [
                        advertised_address(a, self._probe_node(ray, spec_index[("decode", j)], rank)[0])
                        for rank, a in enumerate(rank_addresses)
                    ]
                    for j, rank_addresses in enumerate(addresses)
                ]
            ray.get([p.connect_grpc.remote(addresses, tls) for p in prefill_ranks], timeout=timeout_s)
            self._kv_tls = tls
            return addresses
        num_prefill = len(prefill_ranks)
        world_size = num_prefill + sum(d.num_ranks for d in decodes)
        if self._loopback:
            host, port = "127.0.0.1", free_ports("127.0.0.1", 1)[0]
        else:  # the rendezvous store runs in rank 0 (prefill-0's rank 0): its node's IP and a port free there
            host, port = self._probe_node(ray, spec_index[("prefill", 0)])
        init_method = f"tcp://{host}:{port}"
        ranks = iter(range(num_prefill, world_size))
        decode_ranks = [[next(ranks) for _ in d.ranks] for d in decodes]  # [instance][rank] -> group rank
        refs = [
            p.connect_dist.remote(r, world_size, init_method, decode_ranks)
            for r, p in enumerate(prefill_ranks)
        ] + [
            actor.connect_dist.remote(r, world_size, init_method, list(range(num_prefill)))
            for d, rank_ids in zip(decodes, decode_ranks, strict=True)
            for actor, r in zip(d.ranks, rank_ids, strict=True)
        ]
        ray.get(refs, timeout=timeout_s)
        return []

    def _kv_addresses(self, joining: Instance | None = None) -> list[list[Any]]:
        """Each decode slot's receiver addresses for prefill senders; a slot whose actor serves the other
        pool (`driver.role_moves`; `joining` excepted) gets the first live slot's."""
        decodes = self.instances["decode"]
        live = [d.index for d in decodes if d.pool_state != "away" or d is joining] or [0]
        return [list(self._decode_addresses[d.index if d.index in live else live[0]]) for d in decodes]

    def rewire(self, ray, role: str, index: int, restarted: bool) -> None:
        """gRPC, shm and shm+grpc only (torch.distributed and multi-rank groups are fixed at deploy)."""
        if role == "decode":
            assert restarted
            decode = self.decode_actors[index]
            transport = self.topology.kv_transport
            address = ray.get(
                decode.start_receiver.remote(transport, self._kv_tls), timeout=self.call_timeout_s
            )
            if transport == "grpc" and not self._loopback:
                address = advertised_address(
                    address, ray.get(decode.node_ip.remote(), timeout=self.call_timeout_s)
                )
            self._decode_addresses[index][0] = address
            prefills = [a for p in self.instances["prefill"] if p.routable for a in p.ranks]
            ray.get(
                [p.set_decode_address.remote(index, address) for p in prefills], timeout=self.call_timeout_s
            )
        else:
            addresses = self._kv_addresses()
            ranks = self.instances["prefill"][index].ranks
            transport = self.topology.kv_transport
            ray.get(
                [a.connect_receivers.remote(transport, addresses, self._kv_tls) for a in ranks],
                timeout=self.call_timeout_s,
            )
