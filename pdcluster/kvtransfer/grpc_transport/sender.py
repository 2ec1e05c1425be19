from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import torch

from pdcluster.kvtransfer.base import FailureLog, HandoffExtras, HandoffMeta, KVSender, KVTransferError
from pdcluster.kvtransfer.grpc_transport.framing import encode_chunk, serialize_message
from pdcluster.kvtransfer.grpc_transport.messages import (
    DEFAULT_MAX_CHUNK_BYTES,
    GRPC_MAX_MESSAGE_BYTES,
    HANDOFF_ID_KEY,
    HANDOFF_SECRET_KEY,
    MESSAGE_OVERHEAD_BYTES,
    TRANSFER_METHOD,
    error_from_rpc,
    extras_to_proto,
    header_to_proto,
    meta_to_proto,
)
from pdcluster.kvtransfer.grpc_transport.tls import TLSCredentials
from pdcluster.kvtransfer.sending import (
    TrackedHandoff,
    check_begin,
    close_handoff,
    flush_closed,
    forget_handoff,
    open_handoff,
)
from pdcluster.kvtransfer.wire import (
    FaultHook,
    LayerHeader,
    apply_fault_hook,
    check_layer,
    copy_layer,
    encode_layer,
)
from pdcluster.protos import kv_transfer_pb2 as pb


def _drain(messages: queue.SimpleQueue) -> None:
    while True:
        try:
            messages.get_nowait()
        except queue.Empty:
            return


@dataclass
class _Call(TrackedHandoff):
    """`ended` is set once `_on_done` recorded the outcome; flush waits on it, not on the future (a race)."""

    messages: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    future: grpc.Future | None = None


class GrpcKVSender(KVSender):
    """Streams handoffs to one `KVReceiverServer` at `target` ("host:port"); encoding runs on gRPC's thread.

    max_chunk_bytes: largest payload slice per gRPC message (under the 4 MiB limit).
    tls: mutual TLS, or None for plaintext; fault_hook: test-only fault injection.
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
        self._transfer = self._channel.stream_unary(
            TRANSFER_METHOD, request_serializer=serialize_message, response_deserializer=pb.Ack.FromString
        )
        self._lock = threading.Lock()
        self._calls: dict[str, _Call] = {}
        self._failures = FailureLog()
        self._closed = False

    def begin(self, handoff: HandoffMeta) -> None:
        with self._lock:
            check_begin(handoff, "GrpcKVSender", self._closed, self._calls)
            call = _Call(meta=handoff, begun_at_s=time.monotonic())
            self._calls[handoff.request_id] = call
        credentials = ((HANDOFF_ID_KEY, handoff.request_id), (HANDOFF_SECRET_KEY, handoff.secret))
        future = self._transfer.future(self._stream(call), timeout=handoff.lease_s, metadata=credentials)
        with self._lock:
            call.future = future
        future.add_done_callback(lambda _: self._on_done(call))

    def _on_done(self, call: _Call) -> None:
        """The RPC ended: drop queued layers, keep a failure for flush, forget a closed call."""
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
                forget_handoff(self._calls, call)
        call.ended.set()

    def send_layer(
        self, request_id: str, layer_idx: int, latent_kv: torch.Tensor, scale: torch.Tensor | None = None
    ) -> None:
        call = self._open_call(request_id)
        if call.done:
            check_layer(call.meta, layer_idx, latent_kv, scale)
            return
        if scale is None and not call.meta.is_int8_wire and self._fault_hook is None:
            check_layer(call.meta, layer_idx, latent_kv)
            layer = encode_layer(call.meta, layer_idx, latent_kv)  # a view of latent_kv, and its CRC-32C
            item: tuple = ("chunks", list(self._chunks(layer.header, layer.payload)))
        else:
            item = ("layer", layer_idx, *copy_layer(call.meta, layer_idx, latent_kv, scale))
        with self._lock:
            if not call.done:
                call.messages.put(item)

    def finish(self, request_id: str, extras: HandoffExtras) -> None:
        self._close_call(request_id, ("finish", extras))

    def abort(self, request_id: str, reason: str) -> None:
        self._close_call(request_id, ("abort", reason), abort_reason=reason)

    def _close_call(self, request_id: str, message: tuple, abort_reason: str | None = None) -> None:
        with self._lock:
            call = close_handoff(self._calls, request_id, abort_reason)
            if call.done:
                forget_handoff(self._calls, call)
            else:
                call.messages.put(message)

    def flush(self, timeout_s: float) -> dict[str, KVTransferError]:
        return flush_closed(self._lock, self._calls, self._failures, timeout_s)

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
            return open_handoff(self._calls, request_id)

    def _stream(self, call: _Call) -> Iterator[pb.KVMessage | bytes]:
        meta = call.meta
        yield pb.KVMessage(begin=meta_to_proto(meta))
        while True:
            try:
                item = call.messages.get(timeout=max(0.0, call.deadline_s - time.monotonic()))
            except queue.Empty:
                return
            kind = item[0]
            if kind == "cut":
                return
            if call.stalled:
                continue
            if kind == "chunks":
                if call.abort_reason is None:
                    yield from item[1]
            elif kind == "layer":
                if call.abort_reason is not None:
                    continue
                layer, keep_sending = apply_fault_hook(
                    self._fault_hook, encode_layer(meta, item[1], item[2], item[3])
                )
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

    def _chunks(self, header: LayerHeader, payload: torch.Tensor) -> Iterator[bytes]:
        data = memoryview(payload.numpy())
        for offset_bytes in range(0, max(len(data), 1), self.max_chunk_bytes):
            yield encode_chunk(
                header.layer_idx,
                offset_bytes,
                data[offset_bytes : offset_bytes + self.max_chunk_bytes],
                header_to_proto(header) if offset_bytes == 0 else None,
            )
