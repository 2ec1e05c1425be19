"""torch.distributed transport: point-to-point sends from a prefill rank to a decode rank.

Backend and staging device come from `DistTransportConfig` (gloo, NCCL, HCCL). One sender per
(group, peer) pair. Each message is three sends (`framing`): a fixed-size frame, a msgpack header
(`begin`, `layer`, `finish`, `abort`, `bye`), and for layers the `kvtransfer.wire` payload.
A `begin` is admitted only with the handoff's secret (`Reservations.claim`); later data only from
the admitted peer. There is no return path: decode reports refused handoffs itself. The rendezvous
store binds `host` only, but the backends' connections are unauthenticated: use gRPC with TLS
where that matters. A blocked `recv` cannot be interrupted, so `DistKVReceiver.close` waits for `bye`.
"""

from pdcluster.kvtransfer.dist_transport.framing import FRAME_MAGIC, recv_message, send_message
from pdcluster.kvtransfer.dist_transport.group import (
    BACKEND_FOR_DEVICE,
    DEFAULT_GROUP_TIMEOUT_S,
    DistTransportConfig,
    init_transport_group,
    rendezvous_store,
)
from pdcluster.kvtransfer.dist_transport.receiver import DistKVReceiver
from pdcluster.kvtransfer.dist_transport.sender import DistKVSender

__all__ = [
    "BACKEND_FOR_DEVICE",
    "DEFAULT_GROUP_TIMEOUT_S",
    "FRAME_MAGIC",
    "DistKVReceiver",
    "DistKVSender",
    "DistTransportConfig",
    "init_transport_group",
    "recv_message",
    "rendezvous_store",
    "send_message",
]
