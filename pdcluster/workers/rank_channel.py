"""A rank's end of its one-host driver channel (`driver.socket_rank_client` is the driver's).

The rank listens on a Unix stream socket in a fresh 0700 directory (named like the shm KV channel's, so
`sweep_stale_socket_dirs` removes it after a crash). A connection is refused unless its peer runs under
this uid and its first record, within HELLO_TIMEOUT_S, presents the secret the driver got over Ray
(`RankWorker.serve_driver_channel`). One connection at a time: a newer authenticated one replaces it.

Its reader thread calls the same worker methods the Ray calls do: `load`, `reserve` and `bind` there
(they return promptly), `abort` and a prefill (both wait for the engine) on a thread pool as Ray's threaded
actor would. A subscribed decode rank's events are pushed by a pusher thread as the engine emits them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hmac
import logging
import os
import secrets
import shutil
import socket
import tempfile
import threading
from pathlib import Path
from typing import Any

from pdcluster.driver import rank_wire as wire
from pdcluster.kvtransfer.base import ProtocolError
from pdcluster.kvtransfer.shm_transport.channel import SOCKET_DIR_PREFIX, LogThrottle, peer_uid

logger = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 2.0  # a connection must present the secret this soon after it is accepted
ACCEPT_POLL_S = 0.2  # how often the accept thread looks at `close`
PUSH_IDLE_S = 0.05  # without events, a subscribed rank pushes its load this often
MAX_CALL_THREADS = 1024  # prefill calls wait on their thread for the whole prefill


def recv_exactly(sock: socket.socket, size: int) -> bytes | None:
    """`size` bytes from `sock`; None when the peer closed first."""
    parts, got = [], 0
    while got < size:
        chunk = sock.recv(min(size - got, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def recv_record(sock: socket.socket) -> Any:
    """The next record to this rank; None when the peer closed. ProtocolError, OSError."""
    header = recv_exactly(sock, wire.LENGTH.size)
    if header is None:
        return None
    body = recv_exactly(sock, wire.frame_length(header))
    if body is None:
        return None
    return wire.decode_to_rank(body)


class _Connection:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.closed = threading.Event()
        self.acked_seq = 0
        self._send_lock = threading.Lock()

    def send(self, record: Any) -> None:
        """Write one record; a broken connection is closed (its peer reconnects)."""
        data = wire.frame(record)
        try:
            with self._send_lock:
                self.sock.sendall(data)
        except OSError:
            self.close()

    def close(self) -> None:
        if not self.closed.is_set():
            self.closed.set()
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()


class RankChannelServer:
    """Serves `worker` (a rank actor's object: `PrefillWorker`, `DecodeWorker` or `RoleWorker`) to the
    driver; `address` goes to the driver over Ray."""

    def __init__(self, worker: Any, name: str) -> None:
        self.worker = worker
        self.name = name
        self.incarnation = secrets.token_hex(8)
        self._dir = Path(tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{os.getpid()}-"))  # mode 0700
        self.address = wire.ChannelAddress(str(self._dir / "rank.sock"), secrets.token_hex(16))
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.address.path)
        self._listener.listen(16)
        self._listener.settimeout(ACCEPT_POLL_S)
        self._closed = threading.Event()
        self._current: _Connection | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(MAX_CALL_THREADS, f"{name}-calls")
        self._refusals = LogThrottle()
        threading.Thread(target=self._accept_loop, name=f"{name}-channel", daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        if self._current is not None:
            self._current.close()
        self._listener.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        shutil.rmtree(self._dir, ignore_errors=True)

    # ---- connections -------------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            why = self._refusal(sock)
            if why is not None:
                self._refusals.warning(
                    logger, "%d driver-channel connections refused on " + self.name + ": %s", why
                )
                sock.close()
                continue
            connection = _Connection(sock)
            previous, self._current = self._current, connection
            if previous is not None:
                previous.close()
            connection.send(wire.Welcome(os.getpid(), self.incarnation))
            threading.Thread(
                target=self._serve, args=(connection,), name=f"{self.name}-reader", daemon=True
            ).start()

    def _refusal(self, sock: socket.socket) -> str | None:
        """Why `sock` may not speak to this rank (None: it authenticated)."""
        uid = peer_uid(sock)
        if uid is not None and uid != os.getuid():
            return f"peer uid {uid}"
        sock.settimeout(HELLO_TIMEOUT_S)
        try:
            hello = recv_record(sock)
        except (OSError, ProtocolError) as e:
            return f"no hello ({type(e).__name__})"
        if not isinstance(hello, wire.Hello) or not hmac.compare_digest(hello.secret, self.address.secret):
            return "a wrong secret"
        sock.settimeout(None)
        return None

    def _serve(self, connection: _Connection) -> None:
        """The connection's reader: each record in arrival order."""
        while not connection.closed.is_set():
            try:
                record = recv_record(connection.sock)
            except (OSError, ProtocolError) as e:
                if not connection.closed.is_set():
                    logger.warning("%s: driver channel closed: %r", self.name, e)
                record = None
            if record is None:
                connection.close()
                return
            self._take(connection, record)

    # ---- records -----------------------------------------------------------------------------------------
    def _take(self, connection: _Connection, record: Any) -> None:
        worker = self.worker
        if isinstance(record, wire.Reserve):
            self._answer(connection, record.call, worker.reserve, record.request)
        elif isinstance(record, wire.Load):
            self._answer(connection, record.call, worker.load)
        elif isinstance(record, wire.Bind):
            self._command(worker.bind, record.bind, record.order)
        elif isinstance(record, wire.Abort):
            args = (record.handoff_id,) if record.order is None else (record.handoff_id, record.order)
            self._pool.submit(self._command, worker.abort, *args)
        elif isinstance(record, wire.Prefill):
            self._pool.submit(self._prefill, connection, record)
        elif isinstance(record, wire.Subscribe):
            connection.acked_seq = record.acked_seq
            threading.Thread(
                target=self._push, args=(connection,), name=f"{self.name}-push", daemon=True
            ).start()
        elif isinstance(record, wire.Ack):
            connection.acked_seq = max(connection.acked_seq, record.seq)
        else:
            logger.warning("%s: driver channel: unexpected %s", self.name, type(record).__name__)

    def _answer(self, connection: _Connection, call: int, method: Any, *args: Any) -> bool:
        """Send `method(*args)`'s value, or what it raised; whether it returned."""
        try:
            value = method(*args)
        except Exception as e:  # noqa: BLE001 - the driver's call raises it
            connection.send(wire.failed(call, e))
            return False
        connection.send(wire.reply(call, value))
        return True

    def _command(self, method: Any, *args: Any) -> None:
        try:
            method(*args)
        except Exception:  # noqa: BLE001 - nobody waits on a bind or abort: its prefill shows the failure
            logger.exception("%s: %s failed", self.name, getattr(method, "__name__", method))

    def _prefill(self, connection: _Connection, record: wire.Prefill) -> None:
        """`prefill_first`'s reply, then `prefill_result`'s (called even after a failed first, to end it)."""
        request = record.request
        if self._answer(connection, record.call, self.worker.prefill_first, request, record.order):
            self._answer(connection, record.call, self.worker.prefill_result, request.handoff_id)
        else:
            with contextlib.suppress(Exception):
                self.worker.prefill_result(request.handoff_id)

    def _push(self, connection: _Connection) -> None:
        """Push the events after the driver's acknowledged one as they come, with the load (at least every
        PUSH_IDLE_S); stops with the connection or when the worker takes no polls (not a decode rank)."""
        sent_seq = connection.acked_seq
        while not connection.closed.is_set() and not self._closed.is_set():
            try:
                events = self.worker.poll(PUSH_IDLE_S, connection.acked_seq, sent_seq)
                load = self.worker.load()
            except Exception as e:  # noqa: BLE001 - e.g. a RoleWorker that became prefill
                logger.warning("%s: event pushes end: %r", self.name, e)
                return
            connection.send(wire.pushed(events, load))
            if events:
                sent_seq = events[-1].seq


_serving_lock = threading.Lock()


def serve_driver_channel(owner: Any, name: str) -> wire.ChannelAddress:
    """The address of `owner`'s channel server, started on the first call (one per process)."""
    with _serving_lock:
        server = getattr(owner, "_driver_channel", None)
        if server is None:
            server = owner._driver_channel = RankChannelServer(owner, name)
        return server.address


def close_driver_channel(owner: Any) -> None:
    server = getattr(owner, "_driver_channel", None)
    if server is not None:
        server.close()
