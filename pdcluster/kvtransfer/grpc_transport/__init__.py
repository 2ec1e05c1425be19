"""gRPC transport: the decode instance runs a server, the prefill instance streams each request to it.

One client-streaming call `KVTransfer.Transfer` per request (`pdcluster/protos/kv_transfer.proto`): Begin, the
layers as `LayerChunk`s (each layer split into chunks of at most `max_chunk_bytes`, below gRPC's 4 MiB message
limit), then Finish or Abort. The call's gRPC deadline is the handoff's lease.

Authentication. The call's metadata carries the handoff's id and secret (`HandoffMeta.secret`, which
decode's `expect` created): `pdcluster-handoff-id` and `pdcluster-handoff-secret-bin`. The receiver checks
them (`Reservations.claim`) as soon as the call arrives, before it reads a single message: a call without
them, with a wrong secret, or for a handoff that already has its sender (a replay) ends at once with
UNAUTHENTICATED and touches no reservation. The rest of the call is bound to that handoff (a layer header
naming another request is a protocol error). Optional TLS (`TLSCredentials`, mutual: both ends present a
certificate signed by the cluster's CA) encrypts the channel; without it, the secret and the KV travel in
clear, which on loopback only root can read.

Limits, so that idle or slow callers cannot exhaust the receiver. A call that is refused holds a worker
thread for microseconds (it is refused before reading). An admitted call is cut off by the server when
its handoff's lease ends (`claim`'s deadline), whatever deadline its client set, so a stalled sender frees
its thread with the lease. At most `max_concurrent_streams` calls are served at once (one worker thread
each) and `max_queued_streams` more wait for a thread; beyond that a call fails at once with
RESOURCE_EXHAUSTED, whichever connection it came on. (No HTTP/2 per-connection stream limit: a prefill
instance sends all its handoffs to one decode instance over one connection, and streams over such a limit
are reset, UNAVAILABLE, rather than queued.)

Threads. Sender: `send_layer` copies the layer onto the request's queue and returns (a float layer on a
float wire already checksummed, CRC-32C, and copied into its chunk messages: its one copy here); gRPC's own
thread for the call pulls from the queue, encodes the rest (INT8 quantization or dequantization, CRC-32C)
and streams, so the prefill forward overlaps encoding and transfer. Receiver: each in-flight call occupies
one server worker thread (`max_concurrent_streams` of them), which assembles layers and hands them to
`Reservations.on_layer` (verification and decode's `on_layer`); one more thread cuts admitted calls off at
their lease.

The receiver fails a call with a status decode's error maps to (DATA_LOSS: checksum mismatch,
UNAUTHENTICATED: sender refused (`HandoffRefused`: no reservation, missing or wrong secret, replay),
FAILED_PRECONDITION: a protocol error, DEADLINE_EXCEEDED: lease), so the sender stops sending a request
decode has given up on; `GrpcKVSender.flush` reports it. If the sender process dies or
`close()`s, the receiver sees the stream break and fails the request with SenderLost at once.

Modules:

    messages.py  limits, call-metadata keys, protobuf <-> kvtransfer types, gRPC status <-> error class
    tls.py       `TLSCredentials` (mutual TLS on the KV channel)
    sender.py    `GrpcKVSender` (prefill side)
    server.py    `KVReceiverServer` (decode side): admission, stream deadlines, layer assembly
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
