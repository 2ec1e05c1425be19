"""KV transfer from prefill to decode instances, layer by layer (DESIGN.md: "transactional P->D handoff").

`base` is the connector interface; the transports (`grpc_transport`, `shm_transport`, `dist_transport`,
`paired`) are imported from their packages, so importing `kvtransfer` pulls in neither gRPC nor
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
