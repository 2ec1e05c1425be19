"""`ShmKVSender`: the prefill side of the shared-memory transport.

After decode's grant, `send_layer` copies a layer into the segment (or decode's blocks, in place) with its
CRC-32C and sends the header itself when the socket takes it at once; otherwise the worker thread does,
and encodes layers that need INT8 (de)quantization. A reader thread takes grants, drops and `done`
outcomes, and ends handoffs whose lease ran out.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from pdcluster.kernels.paged_mla import gather_kv, write_prompt_kv
from pdcluster.kvtransfer.base import (
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
    check_begin,
)
from pdcluster.kvtransfer.shm_transport.channel import Channel, close_fds, connect, wait_readable
from pdcluster.kvtransfer.shm_transport.inplace import CacheLayout, SharedKVCache, check_block_table
from pdcluster.kvtransfer.shm_transport.segments import Segment
from pdcluster.kvtransfer.wire import (
    FaultHook,
    LayerHeader,
    check_layer,
    copy_with_checksum,
    encode_layer,
    extras_to_dict,
    layer_header,
    meta_to_dict,
    tensor_bytes,
)
from pdcluster.models.dtypes import torch_dtype

logger = logging.getLogger(__name__)

POLL_S = 0.05
ERROR_CLASSES = {
    cls.__name__: cls
    for cls in (
        HandoffRefused,
        ChecksumMismatch,
        SenderLost,
        TransferTimeout,
        TransferAborted,
        ProtocolError,
        KVTransferError,
    )
}


def error_from_record(record: list[str] | None) -> KVTransferError | None:
    """The error a `done` record carries, as its class; None: delivered."""
    if record is None:
        return None
    name, message = record
    return ERROR_CLASSES.get(name, KVTransferError)(message)


@dataclass
class _Request:
    meta: HandoffMeta
    begun_at_s: float
    segment: Segment | None = None
    blocks: np.ndarray | None = None
    cache: SharedKVCache | None = None
    granted: threading.Event = field(default_factory=threading.Event)
    sent_layers: set[int] = field(default_factory=set)
    closed: bool = False
    abort_reason: str | None = None
    stalled: bool = False
    done: bool = False
    ended: threading.Event = field(default_factory=threading.Event)
    write_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def deadline_s(self) -> float:
        return self.begun_at_s + self.meta.lease_s

    def region(self, layer_idx: int) -> torch.Tensor:
        assert self.segment is not None
        num_bytes = self.meta.layer_wire_bytes
        return self.segment.view(layer_idx * num_bytes, num_bytes)


def encoded_dtype(meta: HandoffMeta) -> torch.dtype:
    return torch_dtype(meta.wire_dtype)


def _header(meta: HandoffMeta, layer_idx: int, crc: int) -> LayerHeader:
    return layer_header(meta, layer_idx, None, crc)


def _is_raw(meta: HandoffMeta, scale: torch.Tensor | None) -> bool:
    return (scale is None) != meta.is_int8_wire


class ShmKVSender(KVSender):
    """Sends handoffs to the `ShmKVReceiver` at `address` (a socket path on this host).

    An unreachable receiver does not fail the constructor: every `begin` raises ConnectionError instead.
    fault_hook: test-only fault injection (`kvtransfer.wire.FaultHook`).
    """

    def __init__(self, address: str, *, fault_hook: FaultHook | None = None) -> None:
        self.address = address
        self._fault_hook = fault_hook
        self._connect_error: OSError | None = None
        try:
            self._channel = connect(address)
        except OSError as e:
            self._connect_error = e
        self._lock = threading.Lock()
        self._requests: dict[str, _Request] = {}
        self._segments: dict[int, Segment] = {}
        self._cache: SharedKVCache | None = None
        self._failures = FailureLog()
        self._closed = False
        self._lost: str | None = None
        self._reconnect_lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        if self._connect_error is None:
            self._start_threads()

    def _start_threads(self) -> None:
        self._worker = threading.Thread(
            target=self._run, args=(self._queue, self._channel), name="kv-shm-send", daemon=True
        )
        self._reader = threading.Thread(target=self._read, name="kv-shm-replies", daemon=True)
        self._worker.start()
        self._reader.start()

    def _reconnect(self) -> None:
        """Connect again with a fresh queue, worker and reader; ConnectionError if unreachable."""
        with self._reconnect_lock:
            with self._lock:
                why = self._lost
            if why is None or self._closed:
                return
            try:
                channel = connect(self.address)
            except OSError as e:
                raise ConnectionError(
                    f"shm receiver at {self.address}: the connection ended ({why}) and reconnecting "
                    f"failed: {e}"
                ) from e
            old_queue, self._queue = self._queue, queue.SimpleQueue()
            self._channel = channel
            with self._lock:
                self._lost = None
            old_queue.put(("bye", None))
            self._start_threads()
            logger.warning("kv shm: reconnected to %s after the connection ended (%s)", self.address, why)

    @property
    def connect_error(self) -> OSError | None:
        """Why the receiver could not be reached at construction; None: it was."""
        return self._connect_error

    def begin(self, handoff: HandoffMeta) -> None:
        if self._connect_error is not None:
            raise ConnectionError(
                f"shm receiver at {self.address} unreachable (prefill and decode must share a host): "
                f"{self._connect_error}"
            )
        if self._lost is not None:
            self._reconnect()
        with self._lock:
            check_begin(handoff, "ShmKVSender", self._closed, self._requests)
            if self._lost is not None:
                raise ConnectionError(f"shm receiver at {self.address}: the connection ended ({self._lost})")
            self._requests[handoff.request_id] = _Request(handoff, time.monotonic())
        self._queue.put(("begin", handoff.request_id))

    def send_layer(
        self, request_id: str, layer_idx: int, latent_kv: torch.Tensor, scale: torch.Tensor | None = None
    ) -> None:
        req = self._open_request(request_id)
        check_layer(req.meta, layer_idx, latent_kv, scale)
        if layer_idx in req.sent_layers:
            raise ValueError(f"{request_id}: layer {layer_idx} sent twice")
        req.sent_layers.add(layer_idx)
        if req.done:
            return
        if _is_raw(req.meta, scale) and req.granted.is_set():
            with req.write_lock:
                if req.done:
                    return
                if req.blocks is not None:  # straight into decode's blocks, CRC'd as copied
                    crc = self._write_in_place(req, layer_idx, latent_kv)
                else:
                    region = req.region(layer_idx)
                    num_value_bytes = latent_kv.numel() * latent_kv.element_size()
                    crc = copy_with_checksum(region[:num_value_bytes], tensor_bytes(latent_kv))
                    if scale is not None:
                        crc = copy_with_checksum(region[num_value_bytes:], tensor_bytes(scale), crc)
            header = _header(req.meta, layer_idx, crc)
            if self._fault_hook is not None or not self._try_send_header(req, header):
                self._queue.put(("written", request_id, layer_idx, crc))
        else:
            copies = (latent_kv.detach().clone(), None if scale is None else scale.detach().clone())
            self._queue.put(("layer", request_id, layer_idx, *copies))

    def finish(self, request_id: str, extras: HandoffExtras) -> None:
        self._close_request(request_id, ("finish", request_id, extras))

    def abort(self, request_id: str, reason: str) -> None:
        self._close_request(request_id, ("abort", request_id, reason), abort_reason=reason)

    def flush(self, timeout_s: float) -> dict[str, KVTransferError]:
        deadline_s = time.monotonic() + timeout_s
        with self._lock:
            closed = [r for r in self._requests.values() if r.closed]
        for req in closed:
            req.ended.wait(max(0.0, deadline_s - time.monotonic()))
        with self._lock:
            in_flight = sorted(rid for rid, r in self._requests.items() if r.closed and not r.done)
            if in_flight:
                raise TransferTimeout(
                    f"flush: {len(in_flight)} finished handoffs in flight after {timeout_s:g} s: {in_flight}"
                )
            return self._failures.pop_all()

    def pending_request_ids(self) -> list[str]:
        with self._lock:
            return sorted(self._requests)

    def close(self, join_timeout_s: float = 10.0) -> None:
        """Send what is queued, close the connection (decode fails open handoffs) and unmap everything."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._connect_error is not None:
            return
        self._queue.put(("bye", None))
        self._worker.join(join_timeout_s)
        self._stop_writing("the sender closed")  # before the socket: decode may then free in-place blocks
        self._channel.close()
        self._reader.join(join_timeout_s)
        with self._lock:
            self._requests.clear()
            segments, self._segments = list(self._segments.values()), {}
        for segment in segments:
            segment.close()

    def _open_request(self, request_id: str) -> _Request:
        with self._lock:
            req = self._requests.get(request_id)
        if req is None or req.closed:
            raise ValueError(f"{request_id}: no open handoff (never begun, or already finished/aborted)")
        return req

    def _close_request(self, request_id: str, item: tuple, abort_reason: str | None = None) -> None:
        with self._lock:
            req = self._requests.get(request_id)
            if req is None or req.closed:
                raise ValueError(f"{request_id}: no open handoff (never begun, or already finished/aborted)")
            req.closed = True
            if abort_reason is not None:
                req.abort_reason = abort_reason
            if req.done:
                self._forget(req)
                return
        self._queue.put(item)

    def _stop_writing(self, why: str) -> None:
        """End every open handoff (SenderLost) after its write in progress, before closing."""
        with self._lock:
            open_requests = [r for r in self._requests.values() if not r.done]
        for req in open_requests:
            self._conclude(req, SenderLost(f"{req.meta.request_id}: {why}"), tell_receiver=False)

    def _lose_connection(self, error: OSError, channel: Channel) -> None:
        logger.warning("kv shm send to %s failed: %r", self.address, error)
        self._stop_writing(f"a send to the receiver failed: {error!r}")
        channel.close()

    def _write_in_place(self, req: _Request, layer_idx: int, latent_kv: torch.Tensor) -> int:
        """Copy a layer into decode's granted blocks (write lock held); returns its CRC-32C."""
        assert req.cache is not None and req.blocks is not None
        crc = write_prompt_kv(
            req.cache.layers[layer_idx], latent_kv, torch.from_numpy(req.blocks), checksum_start=0
        )
        assert crc is not None
        return crc

    def _forget(self, req: _Request) -> None:
        if self._requests.get(req.meta.request_id) is req:
            del self._requests[req.meta.request_id]

    def _conclude(self, req: _Request, error: KVTransferError | None, tell_receiver: bool) -> None:
        """Record the outcome, stop writing, and tell decode the segment is free if it did not see the end."""
        with self._lock:
            if req.done:
                return
            req.done = True
            if error is not None:
                self._failures.add(req.meta.request_id, error)
            if req.closed:
                self._forget(req)
        with req.write_lock:
            pass
        if tell_receiver:
            with contextlib.suppress(OSError):
                self._channel.send({"k": "end", "rid": req.meta.request_id})
        req.ended.set()

    def _await_grant(self, req: _Request) -> bool:
        while not req.granted.wait(POLL_S):
            if req.done or self._closed or time.monotonic() >= req.deadline_s:
                return False
        return not req.done

    def _run(self, jobs: queue.SimpleQueue, channel: Channel) -> None:
        """The worker: begins, headers `send_layer` did not send, encoded layers, finishes, aborts."""
        while True:
            item = jobs.get()
            kind, request_id = item[0], item[1]
            if kind == "bye":
                return
            with self._lock:
                req = self._requests.get(request_id)
            if req is None or req.done:
                continue
            try:
                if kind == "begin":
                    channel.send({"k": "begin", "meta": meta_to_dict(req.meta)})
                elif kind in ("layer", "written"):
                    self._send_layer(req, item, channel)
                elif kind == "finish" and not req.stalled:
                    channel.send({"k": "finish", "rid": request_id, "x": extras_to_dict(item[2])})
                elif kind == "abort":
                    channel.send({"k": "abort", "rid": request_id, "reason": item[2]})
            except OSError as e:
                self._lose_connection(e, channel)
            except Exception as e:  # noqa: BLE001
                logger.exception("kv shm: a %r of %s failed", kind, request_id)
                self._conclude(
                    req, ProtocolError(f"{request_id}: the sender failed: {e!r}"), tell_receiver=True
                )

    def _send_layer(self, req: _Request, item: tuple, channel: Channel) -> None:
        meta, layer_idx = req.meta, item[2]
        if req.stalled or req.abort_reason is not None:
            return
        if item[0] == "layer":
            if not self._await_grant(req):
                return
            encoded = encode_layer(meta, layer_idx, item[3], item[4])
            with req.write_lock:
                if req.done:
                    return
                if req.blocks is not None:
                    latent = encoded.payload.view(encoded_dtype(meta)).view(meta.num_tokens, meta.kv_dim)
                    header = _header(meta, layer_idx, self._write_in_place(req, layer_idx, latent))
                else:
                    np.copyto(req.region(layer_idx).numpy(), encoded.payload.numpy())
                    header = encoded.header
        else:
            header = _header(meta, layer_idx, item[3])
        if self._fault_hook is not None:
            with req.write_lock:
                if req.done:
                    return
                data = bytearray(self._written_bytes(req, layer_idx))
            keep_sending = self._fault_hook(header, data)
            with req.write_lock:
                if req.done:
                    return
                self._rewrite(req, layer_idx, torch.frombuffer(data, dtype=torch.uint8))
            if not keep_sending:
                req.stalled = True
                return
        channel.send({"k": "layer", "h": header.to_dict()})

    def _written_bytes(self, req: _Request, layer_idx: int) -> bytes:
        if req.blocks is None:
            return req.region(layer_idx).numpy().tobytes()
        assert req.cache is not None
        layer = req.cache.layers[layer_idx]
        latent, _ = gather_kv(layer, torch.from_numpy(req.blocks), req.meta.num_tokens)
        return latent.contiguous().view(torch.uint8).numpy().tobytes()

    def _rewrite(self, req: _Request, layer_idx: int, data: torch.Tensor) -> None:
        if req.blocks is None:
            req.region(layer_idx).copy_(data)
            return
        latent = data.view(encoded_dtype(req.meta)).view(req.meta.num_tokens, req.meta.kv_dim)
        self._write_in_place(req, layer_idx, latent)

    def _try_send_header(self, req: _Request, header: LayerHeader) -> bool:
        """Send a header from this thread if the socket takes it now; False: the worker must."""
        if req.done:
            return True
        channel = self._channel
        try:
            return channel.try_send({"k": "layer", "h": header.to_dict()})
        except OSError as e:
            self._lose_connection(e, channel)
            return True

    def _read(self) -> None:
        """The reader: grants, drops, outcomes and leases; on connection end all open handoffs fail."""
        channel = self._channel
        why = "the receiver closed the connection"
        while True:
            self._expire_leases()
            try:
                if not wait_readable(channel.sock, POLL_S):
                    continue
                got = channel.recv()
            except (OSError, ValueError, KVTransferError) as e:
                why = f"the connection to the receiver failed: {e!r}"
                break
            if got is None:
                break
            record, fds = got
            try:
                self._on_record(record, fds)
            except (KeyError, TypeError, ValueError, OSError) as e:
                logger.warning("kv shm: malformed %r record from the receiver: %r", record.get("k"), e)
            except Exception:  # noqa: BLE001
                logger.exception("kv shm: taking a %r record from the receiver failed", record.get("k"))
            finally:
                close_fds(fds)
        # Stop writing, unmap, then mark the connection lost; the socket closes last, since decode
        # frees in-place blocks once it sees the close.
        self._stop_writing(why)
        with self._lock:
            segments, self._segments = list(self._segments.values()), {}
            self._cache = None
            self._lost = why
            late = [r for r in self._requests.values() if not r.done]
        for req in late:
            self._conclude(req, SenderLost(f"{req.meta.request_id}: {why}"), tell_receiver=False)
        for segment in segments:
            segment.close()
        channel.close()

    def _on_record(self, record: dict, fds: list[int]) -> None:
        """Take one of decode's records; a mapped grant's descriptor is popped from `fds`."""
        kind = record["k"]
        if kind == "grant" and "blocks" in record:
            self._on_in_place_grant(record, fds)
        elif kind == "grant":
            segment_id, capacity = record["seg"], record["cap"]
            if not isinstance(segment_id, int) or not isinstance(capacity, int):
                raise TypeError(f"a grant's seg and cap must be ints, got {segment_id!r}, {capacity!r}")
            if fds:
                segment = Segment(segment_id, capacity, fd=fds.pop(0))  # it owns the descriptor (closes it
                segment.close_fd()  # if it cannot map it); the mapping stays
                replaced = self._segments.pop(segment_id, None)
                if replaced is not None:
                    replaced.close()
                self._segments[segment_id] = segment
            with self._lock:
                req = self._requests.get(record["rid"])
            if req is not None and segment_id in self._segments:
                req.segment = self._segments[segment_id]
                req.granted.set()
        elif kind == "done":
            with self._lock:
                req = self._requests.get(record["rid"])
            if req is not None:
                error = error_from_record(record["error"])
                self._conclude(req, error, tell_receiver=error is not None)
        elif kind == "drop":
            for segment_id in record["segs"]:
                segment = self._segments.pop(segment_id, None)
                if segment is not None:
                    segment.close()

    def _on_in_place_grant(self, record: dict, fds: list[int]) -> None:
        """A grant in place; an unusable one fails the handoff (ProtocolError) and decode is told."""
        problem: str | None = None
        if "cache" in record:
            try:
                layout = CacheLayout.from_dict(record["cache"])
                if self._cache is not None:
                    raise ValueError("a second shared KV cache on one connection")
                if not fds:
                    raise ValueError("an in-place grant with a cache layout came without its descriptor")
                self._cache = SharedKVCache.map(fds.pop(0), layout)
            except (KeyError, TypeError, ValueError, OSError) as e:
                problem = f"its cache cannot be mapped: {e!r}"
        with self._lock:
            req = self._requests.get(record["rid"])
        if req is None or req.done or req.granted.is_set():
            return
        meta, cache = req.meta, self._cache
        try:
            if problem is not None:
                raise ValueError(problem)
            if cache is None:
                raise ValueError("no shared KV cache was mapped on this connection")
            layout = cache.layout
            fits = (meta.dtype, meta.wire_dtype, meta.kv_dim) == (layout.dtype, layout.dtype, layout.kv_dim)
            if not fits or meta.num_layers > layout.num_layers:
                raise ValueError(f"the handoff {meta} does not fit the cache {layout}")
            blocks = check_block_table(layout, record["blocks"], meta.num_tokens)
        except (TypeError, ValueError) as e:
            error = ProtocolError(f"{meta.request_id}: decode's in-place grant is unusable: {e}")
            self._conclude(req, error, tell_receiver=True)
            return
        req.blocks, req.cache = blocks, cache
        req.granted.set()

    def _expire_leases(self) -> None:
        now_s = time.monotonic()
        with self._lock:
            expired = [r for r in self._requests.values() if not r.done and now_s >= r.deadline_s]
        for req in expired:
            error = TransferTimeout(
                f"{req.meta.request_id}: the sender's lease of {req.meta.lease_s:g} s expired before "
                "the handoff was delivered"
            )
            self._conclude(req, error, tell_receiver=True)
