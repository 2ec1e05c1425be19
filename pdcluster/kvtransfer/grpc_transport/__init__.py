"""gRPC transport: one client-streaming `KVTransfer.Transfer` call per handoff (`protos/kv_transfer.proto`).

The stream is Begin, the layers as `LayerChunk`s of at most `max_chunk_bytes`, then Finish or Abort; the
call's deadline is the lease. The handoff id and secret travel as call metadata and are checked before
any message is read: a refused call ends with UNAUTHENTICATED. The server cuts admitted calls off at
their lease, serves `max_concurrent_streams` at once and queues `max_queued_streams` (then
RESOURCE_EXHAUSTED). Errors travel as status codes (`messages.status_code_for`). Optional mutual TLS.
"""

from pdcluster.kvtransfer.grpc_transport.messages import (
    DEFAULT_MAX_CHUNK_BYTES,
    GRPC_MAX_MESSAGE_BYTES,
    HANDOFF_ID_KEY,
    HANDOFF_SECRET_KEY,
    error_from_rpc,
    extras_from_proto,
    extras_to_proto,
    header_from_proto,
    header_to_proto,
    meta_from_proto,
    meta_to_proto,
)
from pdcluster.kvtransfer.grpc_transport.sender import GrpcKVSender
from pdcluster.kvtransfer.grpc_transport.server import KVReceiverServer
from pdcluster.kvtransfer.grpc_transport.tls import TLSCredentials

__all__ = [
    "DEFAULT_MAX_CHUNK_BYTES",
    "GRPC_MAX_MESSAGE_BYTES",
    "HANDOFF_ID_KEY",
    "HANDOFF_SECRET_KEY",
    "GrpcKVSender",
    "KVReceiverServer",
    "TLSCredentials",
    "error_from_rpc",
    "extras_from_proto",
    "extras_to_proto",
    "header_from_proto",
    "header_to_proto",
    "meta_from_proto",
    "meta_to_proto",
]
