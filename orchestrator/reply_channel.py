"""Prefill results pushed to the driver over a Unix socket on its host, beside the prefill call's Ray reply.

Why. The first token of a request comes back in the prefill call's reply (`orchestrator.dispatch.
EmitFirstToken`). Measured on this 2-core host under the Azure replay, that Ray reply took 2.3-2.6 ms (p50)
from the actor method's return to the driver's event loop; one record on a Unix socket read by a driver
thread and handed to the loop takes a fraction of that. So each prefill rank on the driver's host pushes the
`PrefillResult` it is about to return (`ReplyPusher.push`, from the prefill engine thread once the handoff is
finished on its side) and the driver takes whichever comes first as the attempt's `PrefillDone`
(`RequestDispatch._on_prefill_reply`); the other is dropped. The Ray call stays the authority for
everything else: failures, timeouts, the prefill load accounting.

Who may connect. The socket is `kvtransfer.shm_transport.channel`'s (a fresh 0700 directory, the peer's uid
checked, msgpack records on SOCK_SEQPACKET), and a connection's first record must present the secret the
driver handed the prefill rank over Ray (`ReplyListener.secret`); anything else closes it. A malformed
record from an authenticated peer is dropped with a warning.

Where. Only when every prefill rank runs on the driver's host (a single-node cpu topology); elsewhere
the Ray reply alone carries the result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import logging
import os
import secrets
import select
import shutil
import socket
import threading
from collections.abc import Callable
from typing import Any

from kvtransfer.base import ProtocolError
from kvtransfer.shm_transport.channel import (
    SOCKET_NAME,
    Channel,
    connect,
    listen,
    peer_uid,
    sweep_stale_socket_dirs,
)
from orchestrator.messages import PrefillResult

logger = logging.getLogger(__name__)

POLL_S = 0.2  # how often the listener thread looks at close()
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "first_token_id": (int,),
    "num_drafts": (int,),
    "queue_s": (int, float),
    "prefill_s": (int, float),
    "last_layer_sent_s": (int, float, type(None)),
    "first_token_text": (str, type(None)),
    "cpu_wait_s": (int, float, type(None)),
}


def result_to_record(handoff_id: str, result: PrefillResult) -> dict[str, Any]:
    return {"k": "done", "rid": handoff_id, "r": dataclasses.asdict(result)}


def result_from_record(record: dict[str, Any]) -> tuple[str, PrefillResult]:
    """(handoff id, result) of a `done` record. ValueError naming the field when it is malformed."""
    handoff_id, fields = record.get("rid"), record.get("r")
    if not isinstance(handoff_id, str) or not isinstance(fields, dict):
        raise ValueError("a done record needs a string rid and a mapping r")
    if set(fields) != set(_FIELD_TYPES):
        raise ValueError(f"fields {sorted(fields)} are not {sorted(_FIELD_TYPES)}")
    for name, types in _FIELD_TYPES.items():
        if not isinstance(fields[name], types) or isinstance(fields[name], bool):
            raise ValueError(f"{name} is {type(fields[name]).__name__}")
    return handoff_id, PrefillResult(**fields)


class ReplyListener:
    """The driver's end: accepts prefill ranks' connections and calls `on_result(handoff_id, result)` on its
    own thread for every result an authenticated rank pushes (`on_result` must hand it to the event loop).
    `address` (a socket path) and `secret` go to the prefill ranks (`PrefillNode.connect_reply_channel`)."""

    def __init__(self, on_result: Callable[[str, PrefillResult], None]) -> None:
        sweep_stale_socket_dirs()
        self._on_result = on_result
        self._listener, self._dir = listen()
        self.address = str(self._dir / SOCKET_NAME)
        self.secret = secrets.token_hex(16)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prefill-replies", daemon=True)
        self._thread.start()

    def close(self, join_timeout_s: float = 2.0) -> None:
        self._closed.set()
        self._thread.join(join_timeout_s)
        self._listener.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _run(self) -> None:
        channels: dict[socket.socket, Channel] = {}
        authenticated: set[socket.socket] = set()

        def drop(sock: socket.socket) -> None:
            channels.pop(sock).close()
            authenticated.discard(sock)

        try:
            while not self._closed.is_set():
                readable, _, _ = select.select([self._listener, *channels], [], [], POLL_S)
                for sock in readable:
                    if sock is self._listener:
                        self._accept(channels)
                        continue
                    try:
                        got = channels[sock].recv()
                    except (OSError, ProtocolError) as e:
                        logger.warning("prefill reply channel: a connection failed: %r", e)
                        drop(sock)
                        continue
                    if got is None:
                        drop(sock)
                        continue
                    record, fds = got
                    for fd in fds:  # prefill ranks never pass descriptors
                        os.close(fd)
                    if sock not in authenticated:
                        secret = record.get("secret")
                        if record.get("k") == "hello" and isinstance(secret, str):
                            if hmac.compare_digest(secret.encode(), self.secret.encode()):
                                authenticated.add(sock)
                                continue
                        logger.warning("prefill reply channel: refused a connection without the secret")
                        drop(sock)
                        continue
                    self._deliver(record)
        finally:
            for sock in list(channels):
                drop(sock)

    def _accept(self, channels: dict[socket.socket, Channel]) -> None:
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
        uid = peer_uid(sock)
        if uid is not None and uid != os.getuid():
            logger.warning("prefill reply channel: refused a connection from uid %d", uid)
            sock.close()
            return
        channels[sock] = Channel(sock)

    def _deliver(self, record: dict[str, Any]) -> None:
        try:
            handoff_id, result = result_from_record(record)
        except ValueError as e:
            logger.warning("prefill reply channel: dropped a malformed %r record: %s", record.get("k"), e)
            return
        try:
            self._on_result(handoff_id, result)
        except Exception:  # noqa: BLE001 - one result's delivery never stops the listener
            logger.exception("prefill reply channel: delivering %s failed", handoff_id)


class ReplyPusher:
    """A prefill rank's end: `push` never blocks and never raises (the Ray reply carries the result anyway).

    Raises (constructor only): OSError when the driver's socket cannot be reached."""

    def __init__(self, address: str, secret: str) -> None:
        self._channel = connect(address)
        self._channel.send({"k": "hello", "secret": secret})
        self._channel.sock.setblocking(False)  # a stalled driver costs a dropped push, not the engine thread
        self._lock = threading.Lock()
        self._broken = False

    def push(self, handoff_id: str, result: PrefillResult) -> None:
        with self._lock:
            if self._broken:
                return
            try:
                self._channel.send(result_to_record(handoff_id, result))
            except BlockingIOError:  # the driver's socket buffer is full: this one goes by Ray only
                pass
            except OSError as e:
                logger.warning("prefill reply channel to the driver failed (Ray replies only now): %r", e)
                self._broken = True
                with contextlib.suppress(OSError):
                    self._channel.close()

    def close(self) -> None:
        with self._lock:
            self._broken = True
            with contextlib.suppress(OSError):
                self._channel.close()
