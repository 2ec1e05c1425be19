"""Prefill results pushed to the driver over a Unix socket on its host, beside the prefill call's Ray reply.

Why. The first token of a request comes back in the prefill call's reply (`orchestrator.dispatch.
EmitFirstToken`). Measured on this 2-core host (per-process timestamps, p50), that Ray reply took 2.3-2.6
ms from the actor method's return to the driver's event loop; from a push on this socket to the first token
streamed took 0.98 ms, while the Ray reply reached the driver 2.73 ms after the push (20 sequential
requests at idle; 0.71 ms of it to the event loop). So each prefill rank on the driver's host pushes the
`PrefillResult` it is about to return (`ReplyPusher.push`, from the prefill engine thread once the handoff is
finished on its side) and the driver takes whichever comes first as the attempt's `PrefillDone`
(`RequestDispatch._on_prefill_reply`); the other is dropped. The Ray call stays the authority for
everything else: failures, timeouts, the prefill load accounting.

Who may connect. The socket is `kvtransfer.shm_transport.channel`'s (a fresh 0700 directory, the peer's uid
checked, msgpack records on SOCK_SEQPACKET, each one packet here), and a connection's first record must
present the secret the driver handed the prefill rank over Ray (`ReplyListener.secret`) within
`HELLO_TIMEOUT_S`; anything else closes it. A malformed record from an authenticated peer is dropped with a
warning. Each result names its attempt by `handoff_tag` (a hash of the handoff's secret), checked by the
driver against the attempt's reservation.

Where. Only when every prefill rank runs on the driver's host (a single-node cpu topology); elsewhere
the Ray reply alone carries the result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import logging
import os
import secrets
import selectors
import shutil
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from kvtransfer.base import ProtocolError
from kvtransfer.shm_transport.channel import (
    MAX_PACKET_BYTES,
    SOCKET_NAME,
    connect,
    listen,
    peer_uid,
    record_from_single_packet,
    single_packet,
    sweep_stale_socket_dirs,
)
from orchestrator.messages import PrefillResult

logger = logging.getLogger(__name__)

POLL_S = 0.2  # how often the listener thread looks at close() and at connections without a hello
HELLO_TIMEOUT_S = 2.0  # a connection must present the secret this soon after it is accepted
REFUSAL_LOG_INTERVAL_S = 10.0  # refused connections are logged at most once per this, with their count
MAX_CONNECTIONS = 1024  # open at once (prefill ranks on this host, and their reconnections)
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "first_token_id": (int,),
    "num_drafts": (int,),
    "queue_s": (int, float),
    "prefill_s": (int, float),
    "last_layer_sent_s": (int, float, type(None)),
    "first_token_text": (str, type(None)),
    "cpu_wait_s": (int, float, type(None)),
}


def handoff_tag(secret: bytes) -> str:
    """Names one attempt's handoff in a pushed record without its secret: 16 hex digits of SHA-256 over
    the per-handoff secret decode's reservation bound (`HandoffMeta.secret`). The driver takes a pushed
    result only for the attempt whose bound meta gives the same tag, so a result for an earlier attempt
    of a reused request id is never taken for the current one."""
    return hashlib.sha256(secret).hexdigest()[:16]


def result_to_record(handoff_id: str, tag: str, result: PrefillResult) -> dict[str, Any]:
    """The `done` record a prefill rank pushes: handoff id, `handoff_tag`, the result's fields."""
    return {"k": "done", "rid": handoff_id, "tag": tag, "r": dataclasses.asdict(result)}


def result_from_record(record: dict[str, Any]) -> tuple[str, str, PrefillResult]:
    """(handoff id, tag, result) of a `done` record. ValueError naming the field when it is malformed."""
    handoff_id, tag, fields = record.get("rid"), record.get("tag"), record.get("r")
    if not isinstance(handoff_id, str) or not isinstance(tag, str) or not isinstance(fields, dict):
        raise ValueError("a done record needs a string rid, a string tag and a mapping r")
    if set(fields) != set(_FIELD_TYPES):
        raise ValueError(f"fields {sorted(fields)} are not {sorted(_FIELD_TYPES)}")
    for name, types in _FIELD_TYPES.items():
        if not isinstance(fields[name], types) or isinstance(fields[name], bool):
            raise ValueError(f"{name} is {type(fields[name]).__name__}")
    return handoff_id, tag, PrefillResult(**fields)


@dataclasses.dataclass
class _Peer:
    sock: socket.socket
    accepted_at_s: float
    authenticated: bool = False


class ReplyListener:
    """The driver's end: accepts prefill ranks' connections and calls `on_result(handoff_id, tag, result)`
    on its own thread for every result an authenticated rank pushes (`on_result` must hand it to the event
    loop). `address` (a socket path) and `secret` go to the prefill ranks
    (`PrefillNode.connect_reply_channel`).

    One thread, non-blocking sockets, one packet read per readiness: no peer can hold it. A connection that
    has not presented the secret within `HELLO_TIMEOUT_S`, or sends anything but one-packet records, is
    closed; at most `MAX_CONNECTIONS` are open at once (newer ones are refused).
    """

    def __init__(self, on_result: Callable[[str, str, PrefillResult], None]) -> None:
        sweep_stale_socket_dirs()
        self._on_result = on_result
        self._listener, self._dir = listen()
        self._listener.setblocking(False)
        self.address = str(self._dir / SOCKET_NAME)
        self.secret = secrets.token_hex(16)
        self._closed = threading.Event()
        self._num_refused = 0  # since the last refusal logged
        self._refusal_logged_at_s = -REFUSAL_LOG_INTERVAL_S
        self._thread = threading.Thread(target=self._run, name="prefill-replies", daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def close(self, join_timeout_s: float = 2.0) -> None:
        self._closed.set()
        self._thread.join(join_timeout_s)
        self._listener.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _run(self) -> None:
        peers: dict[socket.socket, _Peer] = {}
        with selectors.DefaultSelector() as selector:
            selector.register(self._listener, selectors.EVENT_READ)

            def drop(peer: _Peer) -> None:
                selector.unregister(peer.sock)
                peers.pop(peer.sock, None)
                with contextlib.suppress(OSError):
                    peer.sock.close()

            try:
                while not self._closed.is_set():
                    try:
                        for key, _ in selector.select(POLL_S):
                            if key.fileobj is self._listener:
                                self._accept(selector, peers)
                            else:
                                self._read(peers[key.fileobj], drop)
                        now_s = time.monotonic()
                        for peer in [p for p in peers.values() if not p.authenticated]:
                            if now_s - peer.accepted_at_s > HELLO_TIMEOUT_S:
                                self._refused("sent no secret in time")
                                drop(peer)
                    except Exception:  # noqa: BLE001 - the listener never dies of one bad moment
                        logger.exception("prefill reply channel: the listener's loop failed; going on")
                        time.sleep(POLL_S)
            finally:
                for peer in list(peers.values()):
                    drop(peer)

    def _accept(self, selector: selectors.BaseSelector, peers: dict[socket.socket, _Peer]) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        uid = peer_uid(sock)
        if (uid is not None and uid != os.getuid()) or len(peers) >= MAX_CONNECTIONS:
            self._refused(f"uid {uid}" if uid != os.getuid() else f"{len(peers)} open already")
            sock.close()
            return
        sock.setblocking(False)
        peers[sock] = _Peer(sock, time.monotonic())
        selector.register(sock, selectors.EVENT_READ)

    def _refused(self, why: str) -> None:
        """Count a refused or closed connection; log it at most once per `REFUSAL_LOG_INTERVAL_S` (a local
        process looping on connect must not flood the driver's log)."""
        self._num_refused += 1
        now_s = time.monotonic()
        if now_s - self._refusal_logged_at_s >= REFUSAL_LOG_INTERVAL_S:
            logger.warning(
                "prefill reply channel: refused or closed %d connection(s) of processes that are not "
                "prefill ranks of this deployment (latest: %s)",
                self._num_refused,
                why,
            )
            self._num_refused, self._refusal_logged_at_s = 0, now_s

    def _read(self, peer: _Peer, drop: Callable[[_Peer], None]) -> None:
        try:
            packet = peer.sock.recv(MAX_PACKET_BYTES + 1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            drop(peer)
            return
        if not packet:  # the rank closed it
            drop(peer)
            return
        try:
            record = record_from_single_packet(packet)
        except ProtocolError as e:
            self._refused(f"sent {e}")
            drop(peer)
            return
        if not peer.authenticated:
            secret = record.get("secret")
            if record.get("k") == "hello" and isinstance(secret, str):
                if hmac.compare_digest(secret.encode(), self.secret.encode()):
                    peer.authenticated = True
                    return
            self._refused("no secret")
            drop(peer)
            return
        try:
            handoff_id, tag, result = result_from_record(record)
        except ValueError as e:
            logger.warning("prefill reply channel: dropped a malformed %r record: %s", record.get("k"), e)
            return
        try:
            self._on_result(handoff_id, tag, result)
        except Exception:  # noqa: BLE001 - one result's delivery never stops the listener
            logger.exception("prefill reply channel: delivering %s failed", handoff_id)


class ReplyPusher:
    """A prefill rank's end: `push` never blocks and never raises (the Ray reply carries the result anyway).

    Raises (constructor only): OSError when the driver's socket cannot be reached."""

    def __init__(self, address: str, secret: str) -> None:
        self._sock = connect(address).sock
        try:
            hello = single_packet({"k": "hello", "secret": secret})
            assert hello is not None  # a few dozen bytes
            self._sock.sendall(hello)
        except OSError:
            self._sock.close()
            raise
        self._sock.setblocking(False)  # a stalled driver costs a dropped push, not the engine thread
        self._lock = threading.Lock()
        self._broken = False

    def push(self, handoff_id: str, secret: bytes, result: PrefillResult) -> None:
        """Push `result` of handoff `handoff_id` (whose bound meta carries `secret`: `handoff_tag`)."""
        with self._lock:
            if self._broken:
                return
            try:
                packet = single_packet(result_to_record(handoff_id, handoff_tag(secret), result))
                if packet is None:  # over one packet (a token's text: never near 64 KiB)
                    return
                self._sock.send(packet)  # a sequenced packet goes whole or not at all
            except BlockingIOError:  # the driver's socket buffer is full: this one goes by Ray only
                pass
            except Exception as e:  # noqa: BLE001 - the Ray reply still carries every result
                logger.warning("prefill reply channel to the driver failed (Ray replies only now): %r", e)
                self._broken = True
                with contextlib.suppress(OSError):
                    self._sock.close()

    def close(self) -> None:
        with self._lock:
            self._broken = True
            with contextlib.suppress(OSError):
                self._sock.close()
