from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent import futures

import grpc
import numpy as np
import torch

from pdcluster.kvtransfer.base import HandoffRefused, KVTransferError, ProtocolError, SenderLost
from pdcluster.kvtransfer.grpc_transport.framing import RawChunk, deserialize_message
from pdcluster.kvtransfer.grpc_transport.messages import (
    GRPC_MAX_MESSAGE_BYTES,
    HANDOFF_ID_KEY,
    HANDOFF_SECRET_KEY,
    TRANSFER_METHOD,
    extras_from_proto,
    header_from_proto,
    meta_from_proto,
    status_code_for,
)
from pdcluster.kvtransfer.grpc_transport.tls import TLSCredentials
from pdcluster.kvtransfer.reservations import ReservationReceiver, Reservations
from pdcluster.kvtransfer.wire import LayerHeader
from pdcluster.protos import kv_transfer_pb2 as pb
from pdcluster.protos import kv_transfer_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

QUEUED_STREAMS_PER_THREAD = 4
REFUSAL_LOG_INTERVAL_S = 10.0


class _LayerAssembly:
    def __init__(self, header: LayerHeader) -> None:
        self.header = header
        self.payload = torch.empty(header.num_bytes, dtype=torch.uint8)
        self._payload_np = self.payload.numpy()
        self.num_bytes_filled = 0

    def add(self, chunk: RawChunk) -> bool:
        """Copy the chunk in; True once the layer is whole."""
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


def _raw(chunk: pb.LayerChunk) -> RawChunk:
    header = chunk.header if chunk.HasField("header") else None
    return RawChunk(chunk.layer_idx, chunk.offset_bytes, memoryview(chunk.data), header)


class _StreamDeadlines:
    """Cancels admitted calls at their deadline, whatever the client set (one daemon thread)."""

    def __init__(self, name: str) -> None:
        self._changed = threading.Condition()
        self._heap: list[tuple[float, int, grpc.ServicerContext]] = []
        self._watched: set[int] = set()
        self._tokens = itertools.count()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(self, context: grpc.ServicerContext, deadline_s: float) -> int:
        """Cancel `context` at `deadline_s` (`time.monotonic()` seconds) unless unwatched first."""
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
                        heapq.heappop(self._heap)
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
    """Logs refused calls at most once per `REFUSAL_LOG_INTERVAL_S` with a count. Thread-safe."""

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
                except Exception as e:
                    lost = f"the stream broke ({type(e).__name__}: {e})"
                    break
                kind = "chunk" if isinstance(message, RawChunk) else message.WhichOneof("kind")
                if not begun:
                    if kind != "begin":
                        raise ProtocolError(f"{request_id}: a stream must start with begin, got {kind}")
                    meta = meta_from_proto(message.begin)
                    if meta.request_id != request_id:
                        raise ProtocolError(f"{request_id}: the call's begin names another request")
                    self._reservations.on_begin(meta)
                    begun = True
                elif kind == "chunk":
                    chunk = message if isinstance(message, RawChunk) else _raw(message.chunk)
                    if assembly is None:
                        if chunk.header is None or chunk.offset_bytes != 0:
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
        context.abort(status_code_for(error), str(error))


class KVReceiverServer(ReservationReceiver):
    """The decode instance's gRPC endpoint on `host:port` (`port=0`: free; see `self.address`).

    max_concurrent_streams: handoffs received at once, one server thread each.
    max_queued_streams: calls waiting for a thread beyond those (None: `QUEUED_STREAMS_PER_THREAD` each);
        further calls fail with RESOURCE_EXHAUSTED.
    tls: serve mutual TLS only; reservations: shared with another receiver (`kvtransfer.paired`), or None.
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
        reservations: Reservations | None = None,
    ):
        if max_concurrent_streams < 1:
            raise ValueError(f"max_concurrent_streams: must be >= 1, got {max_concurrent_streams}")
        num_queued = QUEUED_STREAMS_PER_THREAD * max_concurrent_streams
        if max_queued_streams is not None:
            num_queued = max_queued_streams
        if num_queued < 0:
            raise ValueError(f"max_queued_streams: must be >= 0, got {max_queued_streams}")
        self._reservations = Reservations(int8_passthrough) if reservations is None else reservations
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
        servicer = _Servicer(self._reservations, self._deadlines, self._refusals)
        handler = grpc.stream_unary_rpc_method_handler(
            servicer.Transfer,
            request_deserializer=deserialize_message,
            response_serializer=pb.Ack.SerializeToString,
        )
        service, method = TRANSFER_METHOD.strip("/").split("/")
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {method: handler}),)
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
        return self._refusals.num_refused

    def close(self, grace_s: float = 1.0) -> None:
        self._server.stop(grace_s).wait()
        self._deadlines.close()
