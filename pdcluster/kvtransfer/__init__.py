"""KV transfer from prefill to decode instances, layer by layer (DESIGN.md: "transactional P->D handoff").

    base.py            connector interface (`KVSender`, `KVReceiver`), handoff types, errors; who calls what
    wire.py            per-layer header + payload, CRC-32C checksums, INT8 on the wire, extras encoding
    reservations.py    receiver-side reservations, leases, per-layer completion (shared by the transports)
    grpc_transport/    `GrpcKVSender` -> `KVReceiverServer` (client-streaming gRPC,
                       pdcluster/protos/kv_transfer.proto)
    shm_transport/     `ShmKVSender` -> `ShmKVReceiver` (one host: memfd segments owned by decode, headers
                       over a Unix socket; what `transport: auto` picks on one node)
    dist_transport/    `DistKVSender` -> `DistKVReceiver` (torch.distributed P2P; gloo/NCCL/HCCL by config)
    paired.py          `shm+grpc` (`auto` on several nodes): a decode rank listens on shm and gRPC over one
                       set of reservations; each prefill rank picks shm on its own node, gRPC elsewhere

The transports are imported from their packages, so importing `kvtransfer` pulls in neither gRPC nor
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
