"""`shm+grpc`: a prefill -> decode pair takes shared memory on one node, gRPC otherwise.

A decode rank's `PairedReceiver` listens on both over one `Reservations`. Node ids are Ray's, so two
raylets on one host count as two nodes and their pairs take gRPC.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from pdcluster.kvtransfer.reservations import ReservationReceiver, Reservations


def node_id() -> str:
    """This process's Ray node id, else `host:<hostname>`."""
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
        return ("shm", self.shm) if sender_node_id == self.node_id else ("grpc", self.grpc)

    def with_grpc_host(self, host: str) -> PairedAddress:
        """The same, with the gRPC host replaced (IPv6 bracketed)."""
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return PairedAddress(self.node_id, self.shm, f"{host}:{self.grpc.rpartition(':')[2]}")


class PairedReceiver(ReservationReceiver):
    """A decode rank's shm receiver and gRPC server over one set of reservations.

    grpc_host: the interface the gRPC server binds; node: the node id to advertise (default `node_id()`).
    Raises OSError if either listener cannot start (the other is closed first).
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
        return self.shm.num_segments

    def close(self) -> None:
        try:
            self.grpc.close()
        finally:
            self.shm.close()
