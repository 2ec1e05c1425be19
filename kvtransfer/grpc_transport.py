"""gRPC transport: the decode instance runs a server, the prefill instance streams each request to it.

One client-streaming call `KVTransfer.Transfer` per request (`protos/kv_transfer.proto`): Begin, the layers
as `LayerChunk`s (each layer split into chunks of at most `max_chunk_bytes`, below gRPC's 4 MiB message
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

Threads. Sender: `send_layer` copies the tensor onto the request's queue and returns; gRPC's own thread for
the call pulls from the queue, encodes (INT8 quantization, CRC-32) and streams, so the prefill forward
overlaps encoding and transfer. Receiver: each in-flight call occupies one server worker thread
(`max_concurrent_streams` of them), which assembles layers, verifies them and runs decode's `on_layer`;
one more thread cuts admitted calls off at their lease.

The receiver fails a call with a status decode's error maps to (DATA_LOSS: checksum mismatch,
UNAUTHENTICATED: sender refused (`HandoffRefused`: no reservation, missing or wrong secret, replay),
FAILED_PRECONDITION: a protocol error, DEADLINE_EXCEEDED: lease), so the sender stops sending a request
decode has given up on; `GrpcKVSender.flush` reports it. If the sender process dies or
`close()`s, the receiver sees the stream break and fails the request with SenderLost at once.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import torch

from kvtransfer.base import (
    ChecksumMismatch,
    FailureLog,
    HandoffExtras,
    HandoffMeta,
    HandoffRefused,
    KVSender,
    KVTransferError,
    ProtocolError,
    SenderLost,
    TransferAborted,
    TransferTimeout,
)
from kvtransfer.reservations import ReservationReceiver, Reservations
from kvtransfer.wire import (
    FaultHook,
    LayerHeader,
    apply_fault_hook,
    check_layer,
    encode_layer,
    extras_checksum,
    tensor_from_record,
    tensor_to_record,
    verify_extras,
)
from protos import kv_transfer_pb2 as pb
from protos import kv_transfer_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

GRPC_MAX_MESSAGE_BYTES = 4 << 20  # gRPC's default receive limit; both ends set it explicitly
MESSAGE_OVERHEAD_BYTES = 64 << 10  # room for the chunk's header and protobuf framing
DEFAULT_MAX_CHUNK_BYTES = 1 << 20
# Call metadata naming the handoff and carrying its secret (a `-bin` key: raw bytes, base64 on the wire).
HANDOFF_ID_KEY = "pdcluster-handoff-id"
HANDOFF_SECRET_KEY = "pdcluster-handoff-secret-bin"
QUEUED_STREAMS_PER_THREAD = 4  # default max_queued_streams per worker thread
REFUSAL_LOG_INTERVAL_S = 10.0  # refused calls are logged at most once per this, with a count

_ERROR_TO_CODE: list[tuple[type[KVTransferError], grpc.StatusCode]] = [
    (HandoffRefused, grpc.StatusCode.UNAUTHENTICATED),  # before its base class ProtocolError
    (ChecksumMismatch, grpc.StatusCode.DATA_LOSS),
    (SenderLost, grpc.StatusCode.CANCELLED),  # before its base class TransferTimeout: first match wins
    (TransferTimeout, grpc.StatusCode.DEADLINE_EXCEEDED),
    (TransferAborted, grpc.StatusCode.ABORTED),
    (KVTransferError, grpc.StatusCode.FAILED_PRECONDITION),  # ProtocolError and the rest
]
_CODE_TO_ERROR = {code: cls for cls, code in _ERROR_TO_CODE} | {
    grpc.StatusCode.FAILED_PRECONDITION: ProtocolError
}


# ---- TLS ----


@dataclass(frozen=True)
class TLSCredentials:
    """PEM material for mutual TLS on the KV channel: every decode server and prefill sender presents
    `certificate_chain` / `private_key`, and each accepts only a peer whose certificate `root_certificates`
    (the cluster's CA) signed.

    server_name: the name senders check the server's certificate against (its subjectAltName) instead of
        the host they dial; None: the dialled host (an IP address must then be in the certificate).
    """

    certificate_chain: bytes = field(repr=False)
    private_key: bytes = field(repr=False)
    root_certificates: bytes = field(repr=False)
    server_name: str | None = None

    @classmethod
    def from_files(
        cls, cert_file: str | Path, key_file: str | Path, ca_file: str | Path, server_name: str | None = None
    ) -> TLSCredentials:
        """Read the three PEM files. ValueError naming the file that cannot be read."""

        def read(what: str, path: str | Path) -> bytes:
            try:
                return Path(path).read_bytes()
            except OSError as e:
                raise ValueError(f"{what} {path}: cannot read: {e.strerror or e}") from None

        return cls(
            read("cert_file", cert_file), read("key_file", key_file), read("ca_file", ca_file), server_name
        )

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.certificate_chain)],
            root_certificates=self.root_certificates,
            require_client_auth=True,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates,
            private_key=self.private_key,
            certificate_chain=self.certificate_chain,
        )


# ---- protobuf <-> kvtransfer types ----


def meta_to_proto(meta: HandoffMeta) -> pb.Begin:
    return pb.Begin(
        request_id=meta.request_id,
        num_layers=meta.num_layers,
        num_tokens=meta.num_tokens,
        kv_dim=meta.kv_dim,
        dtype=meta.dtype,
        wire_dtype=meta.wire_dtype,
        lease_s=meta.lease_s,
    )


def meta_from_proto(begin: pb.Begin) -> HandoffMeta:
    try:
        return HandoffMeta(
            request_id=begin.request_id,
            num_layers=begin.num_layers,
            num_tokens=begin.num_tokens,
            kv_dim=begin.kv_dim,
            dtype=begin.dtype,
            wire_dtype=begin.wire_dtype,
            lease_s=begin.lease_s,
        )
    except ValueError as e:
        raise ProtocolError(f"malformed Begin for {begin.request_id!r}: {e}") from None


def header_to_proto(header: LayerHeader) -> pb.LayerHeader:
    return pb.LayerHeader(**header.to_dict())


def header_from_proto(header: pb.LayerHeader) -> LayerHeader:
    return LayerHeader(
        request_id=header.request_id,
        layer_idx=header.layer_idx,
        num_tokens=header.num_tokens,
        kv_dim=header.kv_dim,
        dtype=header.dtype,
        wire_dtype=header.wire_dtype,
        num_bytes=header.num_bytes,
        checksum=header.checksum,
    )


def _raw_tensor(tensor: torch.Tensor) -> pb.RawTensor:
    return pb.RawTensor(**tensor_to_record(tensor))


def extras_to_proto(extras: HandoffExtras) -> pb.Finish:
    finish = pb.Finish(
        first_token_id=extras.first_token_id,
        draft_token_ids=extras.draft_token_ids,
        checksum=extras_checksum(extras),
    )
    if extras.draft_probs is not None:
        finish.draft_probs.CopyFrom(_raw_tensor(extras.draft_probs))
    return finish


def extras_from_proto(request_id: str, finish: pb.Finish) -> HandoffExtras:
    def tensor(raw: pb.RawTensor) -> torch.Tensor:
        return tensor_from_record({"dtype": raw.dtype, "shape": list(raw.shape), "data": raw.data})

    try:
        extras = HandoffExtras(
            first_token_id=finish.first_token_id,
            draft_token_ids=list(finish.draft_token_ids),
            draft_probs=tensor(finish.draft_probs) if finish.HasField("draft_probs") else None,
        )
    except (ValueError, RuntimeError) as e:
        raise ProtocolError(f"{request_id}: malformed extras: {e}") from None
    verify_extras(request_id, extras, finish.checksum)
    return extras


def error_from_rpc(error: grpc.RpcError) -> KVTransferError:
    """The sender's view of a failed call: the receiver's error class where the status code names one."""
    code, details = error.code(), error.details()  # type: ignore[attr-defined]
    cls = _CODE_TO_ERROR.get(code, KVTransferError)
    return cls(f"gRPC {code.name}: {details}")


# ---- sender (prefill side) ----


def _drain(messages: queue.SimpleQueue) -> None:
    """Drop what is queued (layer tensors included)."""
    while True:
        try:
            messages.get_nowait()
        except queue.Empty:
            return


@dataclass
class _Call:
    """One request's stream on the sender."""

    meta: HandoffMeta
    begun_at_s: float
    messages: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    future: grpc.Future | None = None
    closed: bool = False  # finish() or abort() was called
    abort_reason: str | None = None
    stalled: bool = False  # the fault hook stopped it
    done: bool = False  # the RPC ended (delivered or failed): queued messages were dropped
    # Set once `_on_done` has recorded the outcome. gRPC runs done-callbacks after the future completes,
    # so waiting on the future alone can race with the bookkeeping; flush() waits on this.
    ended: threading.Event = field(default_factory=threading.Event)


class GrpcKVSender(KVSender):
    """Streams handoffs to one decode instance's `KVReceiverServer` at `target` (`"host:port"`).

    max_chunk_bytes: largest payload slice per gRPC message (must leave room under the 4 MiB limit).
    tls: mutual TLS (the server must use TLS too); None: a plaintext channel.
    fault_hook: test-only fault injection (`kvtransfer.wire.FaultHook`).
    """

    def __init__(
        self,
        target: str,
        *,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        tls: TLSCredentials | None = None,
        fault_hook: FaultHook | None = None,
    ) -> None:
        if not 0 < max_chunk_bytes <= GRPC_MAX_MESSAGE_BYTES - MESSAGE_OVERHEAD_BYTES:
            raise ValueError(
                f"max_chunk_bytes: must be in (0, {GRPC_MAX_MESSAGE_BYTES - MESSAGE_OVERHEAD_BYTES}], "
                f"got {max_chunk_bytes}"
            )
        self.target = target
        self.max_chunk_bytes = max_chunk_bytes
        self._fault_hook = fault_hook
        options: list[tuple[str, int | str]] = [
            ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
        ]
        if tls is None:
            self._channel = grpc.insecure_channel(target, options=options)
        else:
            if tls.server_name is not None:
                options.append(("grpc.ssl_target_name_override", tls.server_name))
            self._channel = grpc.secure_channel(target, tls.channel_credentials(), options=options)
        self._stub = pb_grpc.KVTransferStub(self._channel)
        self._lock = threading.Lock()
        self._calls: dict[str, _Call] = {}  # open, or closed and still in flight
        self._failures = FailureLog()
        self._closed = False

    def begin(self, handoff: HandoffMeta) -> None:
        if not handoff.secret:
            raise ValueError(
                f"{handoff.request_id}: the handoff has no secret; begin with what expect returned"
            )
        with self._lock:
            if self._closed:
                raise RuntimeError("GrpcKVSender is closed")
            if handoff.request_id in self._calls:
                raise ValueError(f"{handoff.request_id}: handoff already begun")
            call = _Call(meta=handoff, begun_at_s=time.monotonic())
            self._calls[handoff.request_id] = call
        credentials = ((HANDOFF_ID_KEY, handoff.request_id), (HANDOFF_SECRET_KEY, handoff.secret))
        future = self._stub.Transfer.future(self._stream(call), timeout=handoff.lease_s, metadata=credentials)
        with self._lock:
            call.future = future
        future.add_done_callback(lambda _: self._on_done(call))

    def _on_done(self, call: _Call) -> None:
        """The RPC ended. Its queued layers are dropped at once (the stream generator is woken so it
        ends), a failure is kept as an error only (for flush), and the call is forgotten if it is closed
        (else when finish/abort closes it)."""
        assert call.future is not None
        error: KVTransferError | None = None
        if not call.future.cancelled():
            exc = call.future.exception()
            if exc is not None:
                error = error_from_rpc(exc) if isinstance(exc, grpc.RpcError) else exc
        with self._lock:
            call.done = True
            _drain(call.messages)
            call.messages.put(("cut",))
            if error is not None:
                self._failures.add(call.meta.request_id, error)
            if call.closed:
                self._forget(call)
        call.ended.set()

    def _forget(self, call: _Call) -> None:
        if self._calls.get(call.meta.request_id) is call:
            del self._calls[call.meta.request_id]

    def send_layer(self, request_id: str, layer_idx: int, latent_kv: torch.Tensor) -> None:
        call = self._open_call(request_id)
        check_layer(call.meta, layer_idx, latent_kv)
        if call.done:  # failed in the background; flush() reports it
            return
        copy = latent_kv.detach().clone()
        with self._lock:
            if not call.done:
                call.messages.put(("layer", layer_idx, copy))

    def finish(self, request_id: str, extras: HandoffExtras) -> None:
        self._close_call(request_id, ("finish", extras))

    def abort(self, request_id: str, reason: str) -> None:
        self._close_call(request_id, ("abort", reason), abort_reason=reason)  # queued layers are dropped

    def _close_call(self, request_id: str, message: tuple, abort_reason: str | None = None) -> None:
        with self._lock:
            call = self._calls.get(request_id)
            if call is None or call.closed:
                raise ValueError(f"{request_id}: no open handoff (never begun, or already finished/aborted)")
            call.closed = True
            if abort_reason is not None:
                call.abort_reason = abort_reason
            if call.done:  # already ended (failed): nothing left to send
                self._forget(call)
            else:
                call.messages.put(message)

    def flush(self, timeout_s: float) -> dict[str, KVTransferError]:
        deadline_s = time.monotonic() + timeout_s
        with self._lock:
            calls = [c for c in self._calls.values() if c.closed and c.future is not None]
        for call in calls:
            call.ended.wait(max(0.0, deadline_s - time.monotonic()))
        with self._lock:
            in_flight = sorted(rid for rid, c in self._calls.items() if c.closed and not c.done)
            if in_flight:  # failures stay recorded for the next flush
                raise TransferTimeout(
                    f"flush: {len(in_flight)} finished handoffs in flight after {timeout_s:g} s: {in_flight}"
                )
            return self._failures.pop_all()

    def pending_request_ids(self) -> list[str]:
        with self._lock:
            return sorted(self._calls)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            calls = list(self._calls.values())
            self._calls.clear()
            for call in calls:
                _drain(call.messages)
                call.messages.put(("cut",))
        for call in calls:
            if call.future is not None:
                call.future.cancel()
        self._channel.close()

    def _open_call(self, request_id: str) -> _Call:
        with self._lock:
            call = self._calls.get(request_id)
        if call is None or call.closed:
            raise ValueError(f"{request_id}: no open handoff (never begun, or already finished/aborted)")
        return call

    def _stream(self, call: _Call) -> Iterator[pb.KVMessage]:
        """The call's messages; runs on gRPC's thread for the call, pulling from the request's queue."""
        meta = call.meta
        yield pb.KVMessage(begin=meta_to_proto(meta))
        while True:
            try:
                item = call.messages.get(timeout=max(0.0, call.begun_at_s + meta.lease_s - time.monotonic()))
            except queue.Empty:
                return  # lease over: the call's deadline fails it
            kind = item[0]
            if kind == "cut":
                return
            if call.stalled:
                continue
            if kind == "layer":
                if call.abort_reason is not None:
                    continue
                layer, keep_sending = apply_fault_hook(self._fault_hook, encode_layer(meta, item[1], item[2]))
                if not keep_sending:
                    call.stalled = True
                    continue
                yield from self._chunks(layer.header, layer.payload)
            elif kind == "finish":
                yield pb.KVMessage(finish=extras_to_proto(item[1]))
                return
            elif kind == "abort":
                yield pb.KVMessage(abort=pb.Abort(reason=item[1]))
                return

    def _chunks(self, header: LayerHeader, payload: torch.Tensor) -> Iterator[pb.KVMessage]:
        data = memoryview(payload.numpy())
        for offset_bytes in range(0, max(len(data), 1), self.max_chunk_bytes):
            chunk = pb.LayerChunk(
                layer_idx=header.layer_idx,
                offset_bytes=offset_bytes,
                data=bytes(data[offset_bytes : offset_bytes + self.max_chunk_bytes]),
            )
            if offset_bytes == 0:
                chunk.header.CopyFrom(header_to_proto(header))
            yield pb.KVMessage(chunk=chunk)


# ---- receiver (decode side) ----


class _LayerAssembly:
    """One layer's payload filled from in-order chunks."""

    def __init__(self, header: LayerHeader) -> None:
        self.header = header
        self.payload = torch.empty(header.num_bytes, dtype=torch.uint8)
        self._payload_np = self.payload.numpy()
        self.num_bytes_filled = 0

    def add(self, chunk: pb.LayerChunk) -> bool:
        """Copies the chunk in; True once the layer is whole."""
        if chunk.layer_idx != self.header.layer_idx or chunk.offset_bytes != self.num_bytes_filled:
            raise ProtocolError(
                f"{self.header.request_id}: chunk of layer {chunk.layer_idx} at byte {chunk.offset_bytes}, "
                f"expected layer {self.header.layer_idx} at byte {self.num_bytes_filled}"
            )
        end = self.num_bytes_filled + len(chunk.data)
        if end > self.header.num_bytes:
            raise ProtocolError(
                f"{self.header.request_id}: layer {self.header.layer_idx} overruns {self.header.num_bytes} B"
            )
        self._payload_np[self.num_bytes_filled : end] = np.frombuffer(chunk.data, dtype=np.uint8)
        self.num_bytes_filled = end
        return end == self.header.num_bytes


class _StreamDeadlines:
    """Cuts admitted calls off at their deadline (`ServicerContext.cancel`, which makes the call's blocked
    read raise), whatever deadline the client set: one daemon thread for the whole server."""

    def __init__(self, name: str) -> None:
        self._changed = threading.Condition()
        self._heap: list[tuple[float, int, grpc.ServicerContext]] = []  # (monotonic deadline, token, call)
        self._watched: set[int] = set()
        self._tokens = itertools.count()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(self, context: grpc.ServicerContext, deadline_s: float) -> int:
        """Cancel `context` at `deadline_s` (`time.monotonic()` seconds) unless `unwatch`ed first."""
        with self._changed:
            token = next(self._tokens)
            heapq.heappush(self._heap, (deadline_s, token, context))
            self._watched.add(token)
            self._changed.notify()
        return token

    def unwatch(self, token: int) -> None:
        with self._changed:
            self._watched.discard(token)

    def close(self) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify()
        self._thread.join(1.0)

    def _run(self) -> None:
        while True:
            with self._changed:
                while True:
                    while self._heap and self._heap[0][1] not in self._watched:
                        heapq.heappop(self._heap)  # ended by itself
                    if self._stopped:
                        return
                    now_s = time.monotonic()
                    if self._heap and self._heap[0][0] <= now_s:
                        _, token, context = heapq.heappop(self._heap)
                        self._watched.discard(token)
                        break
                    self._changed.wait(self._heap[0][0] - now_s if self._heap else None)
            context.cancel()


class _RefusalLog:
    """Counts refused calls and logs them at most once per `REFUSAL_LOG_INTERVAL_S`, so that a flood of
    forged calls cannot flood the log. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.num_refused = 0
        self._num_unlogged = 0
        self._logged_at_s = -float("inf")

    def add(self, peer: str, error: KVTransferError) -> None:
        with self._lock:
            self.num_refused += 1
            self._num_unlogged += 1
            now_s = time.monotonic()
            if now_s - self._logged_at_s < REFUSAL_LOG_INTERVAL_S:
                return
            count, self._num_unlogged, self._logged_at_s = self._num_unlogged, 0, now_s
        logger.warning("kv receiver refused %d call(s); latest from %r: %s", count, peer, error)


def _credentials(metadata: Sequence[tuple[str, str | bytes]] | None) -> tuple[str, bytes]:
    """(handoff id, secret) from a call's metadata; HandoffRefused when either is missing."""
    request_id, secret = "", b""
    for key, value in metadata or ():
        if key == HANDOFF_ID_KEY and isinstance(value, str):
            request_id = value
        elif key == HANDOFF_SECRET_KEY and isinstance(value, bytes):
            secret = value
    if not request_id or not secret:
        raise HandoffRefused(f"{request_id or 'a call'}: sender refused: no handoff credentials in the call")
    return request_id, secret


class _Servicer(pb_grpc.KVTransferServicer):
    def __init__(
        self, reservations: Reservations, deadlines: _StreamDeadlines, refusals: _RefusalLog
    ) -> None:
        self._reservations = reservations
        self._deadlines = deadlines
        self._refusals = refusals

    def Transfer(self, request_iterator: Iterator[pb.KVMessage], context: grpc.ServicerContext) -> pb.Ack:  # noqa: N802
        try:  # before reading any message: only the handoff's one sender gets further
            request_id, secret = _credentials(context.invocation_metadata())
            deadline_s = self._reservations.claim(request_id, secret)
        except HandoffRefused as e:
            self._refusals.add(context.peer(), e)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))
        token = self._deadlines.watch(context, deadline_s)
        try:
            return self._receive(request_id, request_iterator, context)
        finally:
            self._deadlines.unwatch(token)

    def _receive(
        self, request_id: str, request_iterator: Iterator[pb.KVMessage], context: grpc.ServicerContext
    ) -> pb.Ack:
        """The admitted sender's messages for `request_id`; every error is recorded on its reservation."""
        begun = False
        num_layers_received = 0
        assembly: _LayerAssembly | None = None
        error: KVTransferError | None = None
        try:
            while True:
                try:
                    message = next(request_iterator)
                except StopIteration:
                    lost = "the stream ended before finish"
                    break
                except Exception as e:  # cancelled (by the client or at the lease by us), connection lost
                    lost = f"the stream broke ({type(e).__name__}: {e})"
                    break
                kind = message.WhichOneof("kind")
                if not begun:
                    if kind != "begin":
                        raise ProtocolError(f"{request_id}: a stream must start with begin, got {kind}")
                    meta = meta_from_proto(message.begin)
                    if meta.request_id != request_id:
                        raise ProtocolError(f"{request_id}: the call's begin names another request")
                    self._reservations.on_begin(meta)
                    begun = True
                elif kind == "chunk":
                    chunk = message.chunk
                    if assembly is None:
                        if not chunk.HasField("header") or chunk.offset_bytes != 0:
                            raise ProtocolError(
                                f"{request_id}: layer {chunk.layer_idx} starts without its header"
                            )
                        header = header_from_proto(chunk.header)
                        if header.request_id != request_id:
                            raise ProtocolError(
                                f"{request_id}: layer {header.layer_idx} names another request"
                            )
                        self._reservations.check_header(header)  # before allocating header.num_bytes
                        assembly = _LayerAssembly(header)
                    if assembly.add(chunk):
                        self._reservations.on_layer(assembly.header, assembly.payload)
                        num_layers_received += 1
                        assembly = None
                elif kind == "finish":
                    self._reservations.on_finish(request_id, extras_from_proto(request_id, message.finish))
                    return pb.Ack(num_layers_received=num_layers_received)
                elif kind == "abort":
                    self._reservations.on_abort(request_id, message.abort.reason)
                    return pb.Ack(num_layers_received=num_layers_received)
                else:
                    raise ProtocolError(f"{request_id}: unexpected message {kind}")
            self._reservations.on_sender_lost(request_id, lost)
            error = self._reservations.failure(request_id) or SenderLost(f"{request_id}: {lost}")
        except KVTransferError as e:
            self._reservations.on_error(request_id, e)
            error = e
        logger.info("kv transfer %s failed: %s", request_id, error)
        code = next(code for cls, code in _ERROR_TO_CODE if isinstance(error, cls))
        context.abort(code, str(error))


class KVReceiverServer(ReservationReceiver):
    """The decode instance's gRPC endpoint and its reservations.

    Serves on `host:port` (`port=0`: a free port; the bound one is `self.port`, the address to give prefill
    senders is `self.address`). `int8_passthrough` as in `kvtransfer.reservations.Reservations`.

    max_concurrent_streams: handoffs received at once (one server thread each).
    max_queued_streams: calls that may wait for a free thread beyond those (their leases running); None:
        `QUEUED_STREAMS_PER_THREAD * max_concurrent_streams`. Further calls fail at once with
        RESOURCE_EXHAUSTED. Refused calls pass through this queue too, briefly, so it is sized for a burst of
        them not to crowd out a real sender.
    tls: serve mutual TLS only (senders need `tls` too); None: plaintext.

    The module docstring says how senders are authenticated and how long a call may hold a thread.
    """

    def __init__(
        self,
        host: str,
        port: int = 0,
        *,
        int8_passthrough: bool = False,
        max_concurrent_streams: int = 16,
        max_queued_streams: int | None = None,
        tls: TLSCredentials | None = None,
    ):
        if max_concurrent_streams < 1:
            raise ValueError(f"max_concurrent_streams: must be >= 1, got {max_concurrent_streams}")
        num_queued = QUEUED_STREAMS_PER_THREAD * max_concurrent_streams
        if max_queued_streams is not None:
            num_queued = max_queued_streams
        if num_queued < 0:
            raise ValueError(f"max_queued_streams: must be >= 0, got {max_queued_streams}")
        self._reservations = Reservations(int8_passthrough)
        self._deadlines = _StreamDeadlines("kv-receiver-deadlines")
        self._refusals = _RefusalLog()
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_concurrent_streams, thread_name_prefix="kv-receiver"),
            options=[
                ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
            ],
            maximum_concurrent_rpcs=max_concurrent_streams + num_queued,
        )
        pb_grpc.add_KVTransferServicer_to_server(
            _Servicer(self._reservations, self._deadlines, self._refusals), self._server
        )
        address = f"{host}:{port}"
        if tls is None:
            self.port = self._server.add_insecure_port(address)
        else:
            self.port = self._server.add_secure_port(address, tls.server_credentials())
        if self.port == 0:
            self._deadlines.close()
            raise OSError(f"could not bind a gRPC server to {host}:{port}")
        self.address = f"{host}:{self.port}"
        self._server.start()

    @property
    def num_refused_streams(self) -> int:
        """Calls refused before any of their data was read (no, wrong or replayed credentials)."""
        return self._refusals.num_refused

    def close(self, grace_s: float = 1.0) -> None:
        self._server.stop(grace_s).wait()
        self._deadlines.close()
