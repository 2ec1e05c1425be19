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

import torch

from pdcluster.kvtransfer.base import (
    FailureLog,
    HandoffExtras,
    HandoffMeta,
    KVSender,
    KVTransferError,
    ProtocolError,
    SenderLost,
    TransferTimeout,
)
from pdcluster.kvtransfer.sending import (
    check_begin,
    close_handoff,
    flush_closed,
    forget_handoff,
    open_handoff,
)
from pdcluster.kvtransfer.shm_transport.channel import Channel, close_fds, connect, wait_readable
from pdcluster.kvtransfer.shm_transport.handoff import (
    SenderMappings,
    SendingHandoff,
    error_from_record,
    in_place_blocks,
    is_raw,
    written_header,
)
from pdcluster.kvtransfer.wire import (
    FaultHook,
    LayerHeader,
    check_layer,
    encode_layer,
    extras_to_dict,
    meta_to_dict,
)

logger = logging.getLogger(__name__)

POLL_S = 0.05
RECONNECT_JOIN_S = 10.0  # the most a `begin` waits for the lost connection's reader to end


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
        self._requests: dict[str, SendingHandoff] = {}
        self._mapped = SenderMappings()
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
        """Connect again (fresh queue, worker, reader) once the old reader ended; ConnectionError if not."""
        with self._reconnect_lock:
            with self._lock:
                why = self._lost
            if why is None or self._closed:
                return
            self._channel.close()  # the old reader sees it within POLL_S
            self._reader.join(RECONNECT_JOIN_S)
            if self._reader.is_alive():
                raise ConnectionError(f"shm receiver at {self.address}: the old reader is stuck")
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
            self._requests[handoff.request_id] = SendingHandoff(handoff, time.monotonic())
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
        if is_raw(req.meta, scale) and req.granted.is_set():
            with req.write_lock:
                if req.done:
                    return
                crc = req.write_raw(layer_idx, latent_kv, scale)
            header = written_header(req.meta, layer_idx, crc)
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
        return flush_closed(self._lock, self._requests, self._failures, timeout_s)

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
            segments = self._mapped.take_segments()
        for segment in segments:
            segment.close()

    def _open_request(self, request_id: str) -> SendingHandoff:
        with self._lock:
            return open_handoff(self._requests, request_id)

    def _close_request(self, request_id: str, item: tuple, abort_reason: str | None = None) -> None:
        with self._lock:
            req = close_handoff(self._requests, request_id, abort_reason)
            if req.done:
                forget_handoff(self._requests, req)
                return
        self._queue.put(item)

    def _stop_writing(self, why: str) -> None:
        """End every open handoff (SenderLost) after its write in progress, before closing."""
        with self._lock:
            open_requests = [r for r in self._requests.values() if not r.done]
        for req in open_requests:
            self._conclude(req, SenderLost(f"{req.meta.request_id}: {why}"), tell_receiver=False)

    def _lose_connection(self, error: OSError, channel: Channel) -> None:
        """Mark the connection lost first: whoever sees its handoffs fail and begins again reconnects."""
        logger.warning("kv shm send to %s failed: %r", self.address, error)
        why = f"a send to the receiver failed: {error!r}"
        with self._lock:
            if channel is self._channel and self._lost is None:
                self._lost = why
        self._stop_writing(why)
        channel.close()

    def _conclude(self, req: SendingHandoff, error: KVTransferError | None, tell_receiver: bool) -> None:
        """Record the outcome, stop writing, and tell decode the segment is free if it did not see the end."""
        with self._lock:
            if req.done:
                return
            req.done = True
            if error is not None:
                self._failures.add(req.meta.request_id, error)
            if req.closed:
                forget_handoff(self._requests, req)
        with req.write_lock:
            pass
        if tell_receiver:
            with contextlib.suppress(OSError):
                self._channel.send({"k": "end", "rid": req.meta.request_id})
        req.ended.set()

    def _await_grant(self, req: SendingHandoff) -> bool:
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

    def _send_layer(self, req: SendingHandoff, item: tuple, channel: Channel) -> None:
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
                header = req.write_encoded(layer_idx, encoded)
        else:
            header = written_header(meta, layer_idx, item[3])
        if self._fault_hook is not None and not req.run_fault_hook(layer_idx, header, self._fault_hook):
            return
        channel.send({"k": "layer", "h": header.to_dict()})

    def _try_send_header(self, req: SendingHandoff, header: LayerHeader) -> bool:
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
        # Lost first (a `begin` waits for this thread), unmap, close the socket last (decode frees then).
        with self._lock:
            if self._lost is None:
                self._lost = why
        self._stop_writing(why)
        with self._lock:
            segments = self._mapped.take_segments()
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
            segment = self._mapped.map_segment(record, fds)
            with self._lock:
                req = self._requests.get(record["rid"])
            if req is not None and segment is not None:
                req.segment = segment
                req.granted.set()
        elif kind == "done":
            with self._lock:
                req = self._requests.get(record["rid"])
            if req is not None:
                error = error_from_record(record["error"])
                self._conclude(req, error, tell_receiver=error is not None)
        elif kind == "drop":
            self._mapped.drop(record["segs"])

    def _on_in_place_grant(self, record: dict, fds: list[int]) -> None:
        """A grant in place; an unusable one fails the handoff (ProtocolError) and decode is told."""
        problem = self._mapped.map_cache(record, fds) if "cache" in record else None
        with self._lock:
            req = self._requests.get(record["rid"])
        if req is None or req.done or req.granted.is_set():
            return
        meta, cache = req.meta, self._mapped.cache
        try:
            if problem is not None:
                raise ValueError(problem)
            blocks = in_place_blocks(meta, cache, record["blocks"])
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
