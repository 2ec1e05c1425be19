"""`ShmKVReceiver`: the decode side of the shared-memory transport, one thread per connection."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdcluster.kvtransfer.base import HandoffMeta, HandoffRefused, KVTransferError, ProtocolError
from pdcluster.kvtransfer.reservations import ReservationReceiver, Reservations
from pdcluster.kvtransfer.shm_transport.channel import (
    SOCKET_NAME,
    Channel,
    LogThrottle,
    listen,
    peer_credentials,
    process_gone,
    sweep_stale_socket_dirs,
    wait_readable,
)
from pdcluster.kvtransfer.shm_transport.inplace import SharedKVCache, check_block_table, stored_checksum
from pdcluster.kvtransfer.shm_transport.segments import DEFAULT_MAX_FREE_BYTES, Segment, SegmentPool
from pdcluster.kvtransfer.wire import LayerHeader, meta_from_dict

logger = logging.getLogger(__name__)

POLL_S = 0.2
MAX_CONNECTIONS = 256
# A segment neither finished nor ended is closed, not reused, this long after its lease.
LEASE_GRACE_S = 5.0


def error_record(error: KVTransferError) -> list[str]:
    """A `done` record's error: `[class name, message]`."""
    return [type(error).__name__, str(error)]


@dataclass
class _Lent:
    meta: HandoffMeta
    segment: Segment | None
    begun_at_s: float
    failed: bool = False
    blocks: np.ndarray | None = None


class _Connection:
    def __init__(self, channel: Channel, pool: SegmentPool, pid: int = 0) -> None:
        self.channel = channel
        self.pool = pool
        self.pid = pid
        self.cache_sent = False
        self.lent: dict[str, _Lent] = {}

    def send(self, record: dict[str, Any], fds: list[int] | tuple[int, ...] = ()) -> None:
        try:
            self.channel.send(record, fds)
        except OSError as e:
            logger.info("kv shm: telling the sender failed: %r", e)

    def done(self, request_id: str, error: KVTransferError | None) -> None:
        self.send({"k": "done", "rid": request_id, "error": None if error is None else error_record(error)})

    def give_back(self, request_id: str, reuse: bool = True) -> _Lent | None:
        lent = self.lent.pop(request_id, None)
        if lent is not None and lent.segment is not None:
            dropped = self.pool.give_back(lent.segment, reuse=reuse)
            if dropped:
                self.send({"k": "drop", "segs": dropped})
        return lent


class ShmKVReceiver(ReservationReceiver):
    """The decode instance's shared-memory endpoint; senders connect to `self.address` (a socket path).

    max_free_bytes: free segments each connection keeps for reuse.
    max_connections: connections served at once (one thread each); more are closed at accept.
    reservations: shared with another receiver (`kvtransfer.paired`), must copy kept layers; None: its own.
    """

    def __init__(
        self,
        *,
        int8_passthrough: bool = False,
        max_free_bytes: int = DEFAULT_MAX_FREE_BYTES,
        reservations: Reservations | None = None,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        if reservations is not None and not reservations.copy_kept_layers:
            raise ValueError("ShmKVReceiver: shared reservations must copy kept layers (copy_kept_layers)")
        sweep_stale_socket_dirs()
        self.max_free_bytes = max_free_bytes
        self.max_connections = max_connections
        self._refusals = LogThrottle()
        self._malformed = LogThrottle()
        self._reservations = (
            Reservations(int8_passthrough, copy_kept_layers=True) if reservations is None else reservations
        )
        self._listener, self._dir = listen()
        self.address = str(self._dir / SOCKET_NAME)
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._cache: SharedKVCache | None = None
        self._num_in_place_grants = 0
        self._connections: list[_Connection] = []
        self._threads: list[threading.Thread] = []
        self._accept_thread = threading.Thread(target=self._accept_loop, name="kv-shm-accept", daemon=True)
        self._accept_thread.start()

    @property
    def num_segments(self) -> int:
        with self._lock:
            return sum(c.pool.num_segments for c in self._connections)

    def share_kv_cache(self, cache: SharedKVCache) -> None:
        """Write float handoffs with a block table in place into `cache` from now on."""
        if cache.fd is None:
            raise ValueError("share_kv_cache: the cache's descriptor is closed")
        self._cache = cache

    def defer_until_writes_end(self, request_id: str, free: Callable[[], None]) -> bool:
        """After `release`: True when a sender may still write (`free` runs later); False: free now."""
        cache = self._cache
        return cache is not None and cache.fences.defer(request_id, free)

    @property
    def num_fenced(self) -> int:
        cache = self._cache
        return 0 if cache is None else len(cache.fences)

    @property
    def num_in_place_grants(self) -> int:
        with self._lock:
            return self._num_in_place_grants

    def _end_fence(self, request_id: str) -> None:
        if self._cache is not None:
            self._cache.fences.end(request_id)

    def close(self, join_timeout_s: float = 2.0) -> None:
        """Stop serving; connections close, segments unmap, the socket directory goes."""
        self._closed.set()
        self._accept_thread.join(join_timeout_s)
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(join_timeout_s)
        self._listener.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            if not wait_readable(self._listener, POLL_S):
                continue
            try:
                sock, _ = self._listener.accept()
            except OSError:
                continue
            pid, uid = peer_credentials(sock) or (0, None)
            if uid is not None and uid != os.getuid():
                logger.warning("kv shm: refused a connection from uid %d", uid)
                sock.close()
                continue
            with self._lock:
                full = len(self._connections) >= self.max_connections
            if full:
                self._refusals.warning(
                    logger,
                    "kv shm: refused %d connection(s) (logged at most every %g s): %d open already "
                    "(max_connections)",
                    self._refusals.interval_s,
                    self.max_connections,
                )
                sock.close()
                continue
            connection = _Connection(Channel(sock, max_fds=0), SegmentPool(self.max_free_bytes), pid)
            thread = threading.Thread(target=self._serve, args=(connection,), name="kv-shm-recv", daemon=True)
            with self._lock:
                self._connections.append(connection)
                self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            thread.start()

    def _serve(self, connection: _Connection) -> None:
        why = "the sender closed its connection"
        sender_closed = False
        try:
            while not self._closed.is_set():
                self._reclaim_expired(connection)
                if not wait_readable(connection.channel.sock, POLL_S):
                    continue
                try:
                    got = connection.channel.recv()
                except ConnectionResetError:
                    sender_closed = True
                    break
                except (OSError, ProtocolError) as e:
                    why = f"the sender's connection failed: {e}"
                    break
                if got is None:
                    sender_closed = True
                    break
                record, _ = got  # none: senders never pass descriptors (max_fds=0)
                try:
                    self._dispatch(connection, record)
                except (KeyError, TypeError, ValueError) as e:
                    self._malformed.warning(
                        logger,
                        "kv shm: dropped %d malformed record(s) (logged at most every %g s; latest: a %r "
                        "record: %r)",
                        self._malformed.interval_s,
                        record.get("k"),
                        e,
                    )
                except Exception as e:  # noqa: BLE001
                    logger.exception(
                        "kv shm: serving a %r record failed; closing the connection", record.get("k")
                    )
                    why = f"the receiver failed on a {record.get('k')!r} record: {e!r}"
                    break
            else:
                why = "the receiver closed"
        finally:
            fenced = []
            for request_id, lent in list(connection.lent.items()):
                self._reservations.on_sender_lost(request_id, why)
                if lent.blocks is not None:
                    fenced.append(request_id)
            connection.lent.clear()
            if fenced and not sender_closed:
                threading.Thread(
                    target=self._end_fences_at_sender_close,
                    args=(connection, fenced),
                    name="kv-shm-fences",
                    daemon=True,
                ).start()
            else:
                for request_id in fenced:
                    self._end_fence(request_id)
                connection.channel.close()
            connection.pool.close()
            with self._lock:
                self._connections.remove(connection)

    def _end_fences_at_sender_close(self, connection: _Connection, request_ids: list[str]) -> None:
        """Half-close, then end the fences once the sender closes its side or its process is gone."""
        sock = connection.channel.sock
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)
        logger.warning(
            "kv shm: %d in-place handoff(s) stay fenced until their sender (pid %d) closes its side: %s",
            len(request_ids),
            connection.pid,
            request_ids,
        )
        while not process_gone(connection.pid):
            try:
                if wait_readable(sock, POLL_S) and not sock.recv(1 << 16):
                    break
            except (OSError, ValueError):
                break
        for request_id in request_ids:
            self._end_fence(request_id)
        connection.channel.close()

    def _reclaim_expired(self, connection: _Connection) -> None:
        now_s = time.monotonic()
        for request_id, lent in list(connection.lent.items()):
            # in place: only the sender's end (or its connection's) frees the blocks, never the clock
            if lent.blocks is None and now_s > lent.begun_at_s + lent.meta.lease_s + LEASE_GRACE_S:
                connection.give_back(request_id, reuse=False)

    def _dispatch(self, connection: _Connection, record: dict[str, Any]) -> None:
        kind = record["k"]
        if kind == "begin":
            self._begin(connection, meta_from_dict(record["meta"]))
            return
        if kind == "layer":
            header = LayerHeader.from_dict(record["h"])
            lent = connection.lent.get(header.request_id)
            if lent is None or lent.failed:
                return
            try:
                self._reservations.check_header(header)
                if lent.blocks is not None:
                    assert self._cache is not None
                    crc = stored_checksum(
                        self._cache.layers[header.layer_idx], lent.blocks, header.num_tokens
                    )
                    self._reservations.on_layer_in_place(header, crc)
                else:
                    assert lent.segment is not None
                    offset_bytes = header.layer_idx * lent.meta.layer_wire_bytes
                    self._reservations.on_layer(header, lent.segment.view(offset_bytes, header.num_bytes))
            except KVTransferError as e:
                lent.failed = True
                connection.done(header.request_id, e)
            return
        request_id = record["rid"]
        lent = connection.lent.get(request_id)
        if kind not in ("finish", "abort", "end"):
            raise ValueError(f"unknown record kind {kind!r}")
        if lent is None:
            return
        if kind == "end" or lent.failed:
            self._give_back(connection, request_id)
            return
        error: KVTransferError | None = None
        try:
            if kind == "finish":
                self._reservations.on_finish_record(request_id, record["x"])
            else:
                self._reservations.on_abort(request_id, str(record["reason"]))
        except KVTransferError as e:
            error = e
        self._give_back(connection, request_id)
        connection.done(request_id, error)

    def _give_back(self, connection: _Connection, request_id: str) -> None:
        lent = connection.give_back(request_id)
        if lent is not None and lent.blocks is not None:
            self._end_fence(request_id)

    def _in_place_blocks(self, meta: HandoffMeta) -> np.ndarray | None:
        """The block table to grant `meta` in place, or None for a segment."""
        cache, block_ids = self._cache, self._reservations.block_ids(meta.request_id)
        if cache is None or block_ids is None:
            return None
        layout = cache.layout
        if not (meta.wire_dtype == meta.dtype == layout.dtype and meta.kv_dim == layout.kv_dim):
            return None
        if meta.num_layers > layout.num_layers:
            return None
        try:
            return check_block_table(layout, block_ids, meta.num_tokens)
        except ValueError as e:
            logger.warning("kv shm: %s: not in place: %s", meta.request_id, e)
            return None

    def _begin(self, connection: _Connection, meta: HandoffMeta) -> None:
        request_id = meta.request_id
        if request_id in connection.lent:
            connection.done(request_id, HandoffRefused(f"{request_id}: begun twice on one connection"))
            return
        try:
            self._reservations.claim(request_id, meta.secret)
            self._reservations.on_begin(meta)
        except KVTransferError as e:
            connection.done(request_id, e)
            return
        blocks, cache = self._in_place_blocks(meta), self._cache
        if blocks is not None and cache is not None:
            granted = blocks.tolist()

            def still_reserved() -> bool:
                table = self._reservations.block_ids(request_id)
                return table is not None and table[: len(granted)] == granted

            if not cache.fences.open(request_id, still_reserved):
                connection.done(request_id, HandoffRefused(f"{request_id}: released before its grant"))
                return
            with self._lock:
                self._num_in_place_grants += 1
            connection.lent[request_id] = _Lent(meta, None, time.monotonic(), blocks=blocks)
            grant = {"k": "grant", "rid": request_id, "blocks": blocks.tolist()}
            if not connection.cache_sent:
                grant["cache"] = cache.layout.to_dict()
                connection.send(grant, [cache.fd])
                connection.cache_sent = True
            else:
                connection.send(grant)
            return
        try:
            segment, is_new = connection.pool.acquire(meta.total_wire_bytes)
        except OSError as e:
            error = KVTransferError(
                f"{request_id}: decode could not map a {meta.total_wire_bytes} B segment: {e}"
            )
            logger.warning("kv shm: %s", error)
            self._reservations.on_error(request_id, error)
            connection.done(request_id, error)
            return
        connection.lent[request_id] = _Lent(meta, segment, time.monotonic())
        grant = {"k": "grant", "rid": request_id, "seg": segment.segment_id, "cap": segment.capacity_bytes}
        if is_new:
            connection.send(grant, [segment.fd])
            with contextlib.suppress(OSError):
                segment.close_fd()
        else:
            connection.send(grant)
