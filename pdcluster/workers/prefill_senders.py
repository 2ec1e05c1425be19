"""`KVSenders`: a prefill rank's KV senders, one per decode rank, over the deployment's KV transport."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pdcluster.kvtransfer.base import KVSender
from pdcluster.kvtransfer.paired import PairedAddress, node_id

if TYPE_CHECKING:
    from pdcluster.kvtransfer.grpc_transport import TLSCredentials

logger = logging.getLogger("pdcluster.workers.prefill")

SENDER_TRANSPORTS = {"GrpcKVSender": "grpc", "ShmKVSender": "shm", "DistKVSender": "dist"}


class KVSenders:
    """`table[i][r]`: the sender to rank r of decode instance i. `name`: the prefill rank, for logs;
    `device`: its torch device (the torch.distributed transport's config)."""

    def __init__(self, name: str, device: str) -> None:
        self.name = name
        self.device = device
        self.table: list[list[KVSender]] = []
        self._addresses: dict[str | PairedAddress, KVSender] = {}  # `connect`'s senders by address
        self._transport = "grpc"  # what `connect` used, for `replace`
        self._node_id: str | None = None  # this rank's node (kvtransfer.paired.node_id), looked up once
        self._tls: TLSCredentials | None = None

    def all(self) -> list[KVSender]:
        return [sender for ranks in self.table for sender in ranks]

    def connect(
        self,
        transport: str,
        decode_addresses: list[list[str]] | list[list[PairedAddress]],
        tls: TLSCredentials | None = None,
    ) -> None:
        """One `transport` sender per decode rank (`decode_addresses[i][r]`: instance i, rank r). A rank
        still at an address it had keeps its sender (a handoff open on it goes on: an instance that grew
        back); the others are closed. Raises ValueError for another transport."""
        if transport not in ("grpc", "shm", "shm+grpc"):
            raise ValueError(
                f"transport: senders connect to grpc, shm or shm+grpc receivers, got {transport!r}"
            )
        reuse = (transport, tls) == (self._transport, self._tls)
        self._transport, self._tls = transport, tls
        old = self._addresses if reuse else {}
        kept: dict[str | PairedAddress, KVSender] = {}
        for address in (a for ranks in decode_addresses for a in ranks):
            kept[address] = old.pop(address, None) or kept.get(address) or self._new_sender(address)
        closing = [s for s in self.all() if all(s is not k for k in kept.values())]
        self.table = [[kept[a] for a in ranks] for ranks in decode_addresses]
        self._addresses = kept
        for sender in closing:
            sender.close()

    def connect_dist(
        self, rank: int, world_size: int, init_method: str, decode_ranks: list[list[int]]
    ) -> None:
        """Join the transfer process group (collective: every rank actor calls it at once); one sender per
        decode rank: `decode_ranks[i][r]` is decode instance i's rank r's rank in the transfer group."""
        from pdcluster.kvtransfer.dist_transport import (
            DistKVSender,
            DistTransportConfig,
            init_transport_group,
        )

        config = DistTransportConfig.for_device(self.device)
        init_transport_group(config, rank=rank, world_size=world_size, init_method=init_method)
        self.table = [[DistKVSender(peer, config) for peer in ranks] for ranks in decode_ranks]

    def replace(self, decode_index: int, address: str | PairedAddress, decode_rank: int = 0) -> None:
        """Rank `decode_rank` of decode instance `decode_index` was restarted and listens at `address` now:
        replace its sender (transfers in flight to the old one fail, as they would have anyway)."""
        old = self.table[decode_index][decode_rank]
        self.table[decode_index][decode_rank] = self._addresses[address] = self._new_sender(address)
        self._addresses = {a: s for a, s in self._addresses.items() if s is not old}
        old.close()

    def transports(self) -> list[list[str]]:
        """The transport of each decode rank's sender (`[instance][rank]`: `grpc`, `shm` or `dist`)."""
        return [
            [SENDER_TRANSPORTS.get(type(s).__name__, type(s).__name__) for s in ranks] for ranks in self.table
        ]

    def _new_sender(self, address: str | PairedAddress) -> KVSender:
        from pdcluster.kvtransfer.grpc_transport import GrpcKVSender
        from pdcluster.kvtransfer.shm_transport import ShmKVSender

        if isinstance(address, PairedAddress):  # shm+grpc: shm to a decode rank on this node, else gRPC
            if self._node_id is None:
                self._node_id = node_id()
            transport, picked = address.pick(self._node_id)
            if transport == "grpc":
                return GrpcKVSender(picked, tls=self._tls)
            sender = ShmKVSender(picked)
            if sender.connect_error is None:
                return sender
            # the same Ray node, yet its socket is out of reach (another temp dir, container or uid)
            logger.warning(
                "%s: decode's shm socket %s on this node is unreachable (%s); sending to it by gRPC at %s",
                self.name,
                picked,
                sender.connect_error,
                address.grpc,
            )
            sender.close()
            return GrpcKVSender(address.grpc, tls=self._tls)
        if self._transport == "shm":
            return ShmKVSender(address)
        return GrpcKVSender(address, tls=self._tls)
