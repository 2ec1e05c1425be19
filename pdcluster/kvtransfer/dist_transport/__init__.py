"""torch.distributed transport: point-to-point sends from a prefill rank to a decode rank.

Backend and device come from `DistTransportConfig`; one sender per (group, peer) pair; messages as in
`framing`. A `begin` is admitted only with the handoff's secret, later data only from that peer; there is
no return path. The backends' connections are unauthenticated: use gRPC with TLS where that matters.
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
