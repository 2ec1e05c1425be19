"""`shm+grpc`: each prefill -> decode pair takes shared memory when both ranks run on one node, gRPC when
they do not (what `kv_transfer.transport: auto` resolves to on a topology of several nodes).

A decode rank listens on both at once: `PairedReceiver` runs a `ShmKVReceiver` (a socket path on its node)
and a `KVReceiverServer` (a TCP port) over one `Reservations`, so a handoff `expect`ed once may arrive on
either, and is claimed (its secret checked) by whichever carries it first. It advertises a
`PairedAddress`: both addresses and the id of the node it runs on. Each prefill rank then picks per decode
rank (`PairedAddress.pick`): the shm socket when the ids match (the same host, so the socket and the memfd
segments it passes are reachable), the gRPC address otherwise.

Node ids are Ray's (`ray.get_runtime_context().get_node_id()`: one per raylet), else this host's name
(`node_id()`). Two Ray nodes on one host (two raylets, as in a test cluster or network namespaces) count as
two nodes: their pairs take gRPC, which works between any two hosts.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from pdcluster.kvtransfer.reservations import ReservationReceiver, Reservations


def node_id() -> str:
    """The id of the node this process runs on: its Ray node id inside a Ray worker or driver, else
    `host:<hostname>`."""
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except ImportError:
        pass
    return f"host:{socket.gethostname()}"


@dataclass(frozen=True)
class PairedAddress:
    """Where a decode rank listens: `shm` (a socket path on node `node_id`) and `grpc` (`host:port`)."""

    node_id: str
    shm: str
    grpc: str

    def pick(self, sender_node_id: str) -> tuple[str, str]:
        """`(transport, address)` for a sender on node `sender_node_id`: shm on the same node, else grpc."""
        return ("shm", self.shm) if sender_node_id == self.node_id else ("grpc", self.grpc)

    def with_grpc_host(self, host: str) -> PairedAddress:
        """The same, the gRPC address's host replaced (a server bound to 0.0.0.0 is dialed at its node IP;
        an IPv6 address is bracketed)."""
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return PairedAddress(self.node_id, self.shm, f"{host}:{self.grpc.rpartition(':')[2]}")


class PairedReceiver(ReservationReceiver):
    """A decode rank's shm receiver and gRPC server over one set of reservations (the module docstring).

    grpc_host: the interface the gRPC server binds (port chosen freely); node: the node id to advertise
    (default `node_id()`); the other keywords as in `KVReceiverServer`. `self.address` is the
    `PairedAddress` (its gRPC host the bound one).

    Raises:
        OSError: either listener cannot start (the other is closed first).
    """

    def __init__(
        self,
        grpc_host: str,
        *,
        int8_passthrough: bool = False,
        max_concurrent_streams: int = 16,
        node: str | None = None,
    ) -> None:
        from pdcluster.kvtransfer.grpc_transport import KVReceiverServer
        from pdcluster.kvtransfer.shm_transport import ShmKVReceiver

        # copy_kept_layers: the shm receiver's segments are reused (decode's on_layer copies anyway)
        self._reservations = Reservations(int8_passthrough, copy_kept_layers=True)
        self.shm = ShmKVReceiver(reservations=self._reservations)
        try:
            self.grpc = KVReceiverServer(
                grpc_host, 0, max_concurrent_streams=max_concurrent_streams, reservations=self._reservations
            )
        except BaseException:
            self.shm.close()
            raise
        self.address = PairedAddress(node or node_id(), self.shm.address, self.grpc.address)

    @property
    def num_segments(self) -> int:
        """Shared-memory segments mapped (`ShmKVReceiver.num_segments`)."""
        return self.shm.num_segments

    def close(self) -> None:
        """Close both listeners (open handoffs fail as each transport fails them)."""
        try:
            self.grpc.close()
        finally:
            self.shm.close()
