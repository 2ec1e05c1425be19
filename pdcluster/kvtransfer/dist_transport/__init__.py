"""torch.distributed transport: point-to-point sends from a prefill rank to a decode rank of a process group.

The backend comes from configuration (`DistTransportConfig`: gloo on CPU, NCCL on CUDA, HCCL on Ascend NPU),
as does the device of the staging tensors; nothing here names a device. The actor layer creates the group
(`init_transport_group`) and gives each prefill actor a `DistKVSender(peer_rank=<decode rank>)` and each
decode actor a `DistKVReceiver(peer_ranks=<its prefill ranks>)`. One sender per (group, peer) pair: two
would interleave their frames.

Every message is three sends, in order, on the pair:

    frame   int64 [2] = [FRAME_MAGIC, header_num_bytes]   (fixed size: the receiver always posts it first)
    header  uint8 [header_num_bytes]: msgpack {"kind": "begin" | "layer" | "finish" | "abort" | "bye", ...}
    payload uint8 [header["header"]["num_bytes"]]         (layer messages only: `kvtransfer.wire` layout)

`begin` carries the `HandoffMeta` (its `secret` included), `layer` a `LayerHeader` (CRC-32C of the payload),
`finish` the extras (with their CRC-32C), `abort` the reason, `bye` ends the receiver's loop for that peer
(`DistKVSender.close`) and fails the peer's unfinished handoffs with SenderLost.

Authentication. The receiver admits a `begin` only with the secret decode's `expect` created, for a
handoff that has no sender yet (`Reservations.claim`); a begin without it, with a wrong one, or a second
begin (a replay) is dropped and the reservation is left alone. Layers, finish and abort are taken only from
the peer rank whose begin was admitted for that request; from any other rank they are dropped unrecorded.
The secret travels in clear inside the group (gloo/NCCL/HCCL neither authenticate nor encrypt), but it is
used up by the begin that carries it, so seeing it later gains nothing.

Rendezvous (`init_transport_group`, `tcp://host:port`): rank 0's TCPStore listens on `host` only (a
socket bound to that address, not torch's default of every interface), so a loopback topology's store
and, with gloo, its pairs (`GLOO_SOCKET_IFNAME` set to the loopback interface) are not reachable from
other machines. What stays open: any process on the host (or, for a routable `host`, on the network) can
connect to the store while the group exists and read or write its keys, and the backends' own
connections are unauthenticated. A process that joins or disturbs the rendezvous can break the group
(every handoff then fails, visibly) and may receive KV a prefill rank sends to the rank it impersonates;
it still cannot forge a handoff decode admits. Where that matters, use the grpc transport with TLS.

Threads: the sender's worker thread encodes (INT8, CRC-32C) and sends, fed by a queue, so `send_layer`
returns at once. The receiver runs one thread per peer rank, blocked in `recv`, which hands each layer to
`Reservations.on_layer` (verification and decode's `on_layer`). There is no return path: a request decode
refuses (checksum, no reservation) is dropped on the receiver and the sender does not learn of it; the
decode actor reports it (decode is the one that decides). If the peer process dies, gloo's `recv` fails and
the peer's handoffs fail with SenderLost.

Limits: a blocked `recv` cannot be interrupted (gloo closes the pair on a wait timeout), so
`DistKVReceiver.close` returns once each peer said `bye`, or after `join_timeout_s` leaving its daemon
thread; and an idle pair is closed by the backend after the group's timeout (`init_transport_group`'s
`timeout_s`, default one day). Checksums are computed on host bytes: with NCCL/HCCL that is one
device-to-host copy per layer on each side.

Modules:

    group.py     `DistTransportConfig` (backend and device), `init_transport_group`, `rendezvous_store`
    framing.py   `send_message` / `recv_message`: one message as frame, msgpack header and payload
    sender.py    `DistKVSender` (prefill side)
    receiver.py  `DistKVReceiver` (decode side)
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
