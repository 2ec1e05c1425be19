"""`DecodeReceivers`: a decode rank's KV receiver, started over the deployment's KV transport."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from pdcluster.kvtransfer.base import KVReceiver
from pdcluster.kvtransfer.paired import PairedAddress

if TYPE_CHECKING:
    from pdcluster.kvtransfer.grpc_transport import TLSCredentials
    from pdcluster.workers.decode import DecodeWorker

logger = logging.getLogger("pdcluster.workers.decode")


class DecodeReceivers:
    """Starts `worker.receiver` (and replaces it); `worker`: the decode rank it listens for."""

    def __init__(self, worker: DecodeWorker) -> None:
        self.worker = worker

    @property
    def int8_cache(self) -> bool:
        """An int8 KV cache: the receiver hands an int8 wire's values and scales through as they are."""
        engine = self.worker.engine
        layout = engine.kv_layout
        return engine.config.kv_cache_dtype == "int8" or (
            layout is not None and any(torch.int8 in pool for pool in layout.pools)
        )

    def start_grpc(self, tls: TLSCredentials | None = None) -> str:
        """Start the gRPC receiver on a free port of `host` (mutual TLS with `tls`); returns the address
        prefill senders use."""
        from pdcluster.kvtransfer.grpc_transport import KVReceiverServer

        server = KVReceiverServer(
            self.worker.host, 0, int8_passthrough=self.int8_cache, max_concurrent_streams=64, tls=tls
        )
        self._set_receiver(server)
        return server.address

    def start_shm(self) -> str:
        """Start the shared-memory receiver (prefill on this host only); returns its socket path, the address
        prefill senders connect to."""
        from pdcluster.kvtransfer.shm_transport import ShmKVReceiver

        receiver = ShmKVReceiver(int8_passthrough=self.int8_cache)
        self._share_kv_cache(receiver)
        self._set_receiver(receiver)
        return receiver.address

    def start_paired(self) -> PairedAddress:
        """Start the shm receiver and the gRPC server over one set of reservations (`shm+grpc`: prefill on
        this node takes the first, prefill elsewhere the second, `kvtransfer.paired`); returns both
        addresses and this node's id, the gRPC one at this node's IP when bound to all interfaces."""
        from pdcluster.kvtransfer.paired import PairedReceiver

        host = self.worker.host
        receiver = PairedReceiver(host, int8_passthrough=self.int8_cache, max_concurrent_streams=64)
        self._share_kv_cache(receiver.shm)
        self._set_receiver(receiver)
        address = receiver.address
        if host in ("0.0.0.0", "", "::", "[::]"):
            address = address.with_grpc_host(self.node_ip())
        return address

    def _share_kv_cache(self, receiver: Any) -> None:
        """Let same-host senders write into this rank's KV cache (when it is in shared memory)."""
        cache = self.worker.engine.runner.shared_kv_cache
        if cache is not None:
            receiver.share_kv_cache(cache)

    def _set_receiver(self, receiver: KVReceiver) -> None:
        """Listen with `receiver` from now on; one started earlier in this process is closed, not leaked."""
        old, self.worker.receiver = self.worker.receiver, receiver
        if old is not None:
            try:
                old.close()
            except Exception:  # noqa: BLE001 - the new receiver is up; the old one is best effort
                logger.exception("%s: closing the previous receiver failed", self.worker.name)

    def start_receiver(self, transport: str, tls: TLSCredentials | None = None) -> str | PairedAddress:
        """`start_grpc(tls)`, `start_shm()` or `start_paired()` by `transport` (`grpc` / `shm` / `shm+grpc`);
        returns the address."""
        if transport == "shm":
            return self.start_shm()
        if transport == "shm+grpc":
            return self.start_paired()
        if transport != "grpc":
            raise ValueError(
                f"transport: a decode receiver listens for grpc, shm or shm+grpc, got {transport!r}"
            )
        return self.start_grpc(tls)

    @staticmethod
    def node_ip() -> str:
        """This actor's node IP (what prefill senders dial when the receiver binds 0.0.0.0)."""
        import ray

        return ray.util.get_node_ip_address()

    def connect_dist(self, rank: int, world_size: int, init_method: str, prefill_ranks: list[int]) -> None:
        """Join the transfer process group (collective) and listen to every prefill rank."""
        from pdcluster.kvtransfer.dist_transport import (
            DistKVReceiver,
            DistTransportConfig,
            init_transport_group,
        )

        config = DistTransportConfig.for_device(self.worker.engine.config.device)
        init_transport_group(config, rank=rank, world_size=world_size, init_method=init_method)
        self.worker.receiver = DistKVReceiver(prefill_ranks, config, int8_passthrough=self.int8_cache)

    def num_kv_segments(self) -> int:
        """For tests: shared-memory segments the shm receiver maps (its pools; 0 for other transports)."""
        return int(getattr(self.worker.receiver, "num_segments", 0))

    def kv_in_place_stats(self) -> dict[str, int]:
        """For tests: handoffs the shm receiver granted in place (`shm_transport.inplace`) so far, and those
        whose sender may still write this rank's cache (`fenced`: their blocks wait; 0 once all ended)."""
        receiver = self.worker.receiver
        shm = getattr(receiver, "shm", receiver)
        return {
            "granted": int(getattr(shm, "num_in_place_grants", 0)),
            "fenced": int(getattr(shm, "num_fenced", 0)),
        }
