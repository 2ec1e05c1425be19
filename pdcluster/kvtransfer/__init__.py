"""KV transfer from prefill to decode instances, layer by layer (DESIGN.md: "transactional P->D handoff").

`base` holds the connector interface; the transports live in `grpc_transport/`, `shm_transport/`
(one host), `dist_transport/` (torch.distributed) and `paired` (shm on the same node, else gRPC).
Transports are imported from their packages, so importing `kvtransfer` pulls in neither gRPC nor
torch.distributed.
"""

from pdcluster.kvtransfer.base import (
    ChecksumMismatch,
    HandoffExtras,
    HandoffMeta,
    HandoffRefused,
    KVReceiver,
    KVSender,
    KVTransferError,
    LayerCallback,
    ProtocolError,
    ReceivedKV,
    ReceivedLayer,
    SenderLost,
    TransferAborted,
    TransferTimeout,
    resolve_wire_dtype,
)

__all__ = [
    "ChecksumMismatch",
    "HandoffExtras",
    "HandoffMeta",
    "HandoffRefused",
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "LayerCallback",
    "ProtocolError",
    "ReceivedKV",
    "ReceivedLayer",
    "SenderLost",
    "TransferAborted",
    "TransferTimeout",
    "resolve_wire_dtype",
]
