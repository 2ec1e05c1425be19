"""Results and token events pushed to the driver over a Unix socket on its host, beside the Ray calls.

Prefill results. The first token of a request comes back in the prefill call's reply (`orchestrator.
dispatch.EmitFirstToken`). Measured on this 2-core host (per-process timestamps, p50), that Ray reply took
2.3-2.6 ms from the actor method's return to the driver's event loop; from a push on this socket to the
first token streamed took 0.98 ms, while the Ray reply reached the driver 2.73 ms after the push (20
sequential requests at idle; 0.71 ms of it to the event loop). So each prefill rank on the driver's host
pushes the `PrefillResult` it is about to return (`ReplyPusher.push`, from the prefill engine thread once
the handoff is finished on its side) and the driver takes whichever comes first as the attempt's
`PrefillDone` (`RequestDispatch._on_prefill_reply`); the other is dropped. The Ray call stays the authority
for everything else: failures, timeouts, the prefill load accounting.

Decode token events. Each decode rank on the driver's host pushes the events of each engine pass with its
load snapshot (`ReplyPusher.push_events`: `TokenDelta` / `RequestError` with their sequence numbers) as it
emits them, instead of a `DecodeNode.poll_with_load` Ray call returning them once per step. The poll stays,
as the authority: every event is kept until a poll acknowledges it, and a poll returns early only for an
event that was not pushed (the socket buffer was full, the push failed, or an earlier one was not pushed:
pushes are contiguous in sequence), else after `POLL_WAIT_S` with the load, so a push lost or refused costs
that event's delay, never the event. The driver hands an event over once, in sequence, whichever way it came
(`RequestDispatch._on_decode_events`).

Who may connect. The socket is `kvtransfer.shm_transport.channel`'s (a fresh 0700 directory, the peer's uid
checked, msgpack records on SOCK_SEQPACKET, each one packet here), and a connection's first record must
present the secret the driver handed the rank over Ray (`ReplyListener.secret`) within `HELLO_TIMEOUT_S`;
anything else closes it. A rank's hello also names it by the fresh tag the driver gave that incarnation
(`who`; a prefill rank's says `prefill`: it pushes results and takes binds): events are taken only under the
current tag of a decode rank, so a restarted rank's predecessor, whose sequence numbers started over, is
never mistaken for it. A malformed record from an authenticated peer is dropped with a warning. Each
prefill result names its attempt by `handoff_tag` (a hash of the handoff's secret), checked by the driver
against the attempt's reservation.

Binds, the other way. A prefill call sent before decode reserved (`PrefillRequest.awaiting_bind`) learns
its reservation from a bind (`PrefillBind`: the bound meta, with the handoff's secret). The driver writes it
on the prefill rank's own connection (`ReplyListener.send_bind`), found by the tag that rank's hello named,
instead of a `PrefillNode.bind` Ray call, which cost about 1 ms of CPU on each side per request on this
host; the rank's `ReplyPusher` reads it on a thread of its own and hands it to `on_bind`. When the rank has
no connection (not on this host, not connected yet, or restarted and not yet reconnected) or its socket
buffer is full, the driver makes the Ray call instead. A bind goes over one path only, so it is never taken
twice; one that is lost with its connection shows as the prefill call failing or timing out, as a lost Ray
call does.

Where. Only on a single-node cpu topology (every rank on the driver's host); elsewhere the Ray reply and the
poll alone carry results and events, and binds go by Ray.

The records (`done`, `ev`, `bind`) and their checks are `orchestrator.reply_records`'; this module is the
socket: `ReplyListener` (the driver's end) and `ReplyPusher` (a rank's end).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import logging
import os
import secrets
import selectors
import shutil
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvtransfer.base import ProtocolError
from kvtransfer.shm_transport.channel import (
    MAX_PACKET_BYTES,
    SOCKET_NAME,
    LogThrottle,
    connect,
    listen,
    peer_uid,
    record_from_single_packet,
    single_packet,
    sweep_stale_socket_dirs,
    wait_readable,
)
from orchestrator.messages import DecodeNodeLoad, PolledEvent, PrefillBind, PrefillResult
from orchestrator.reply_records import (
    bind_from_record,
    bind_to_record,
    events_from_record,
    events_to_record,
    handoff_tag,
    result_from_record,
    result_to_record,
)

logger = logging.getLogger(__name__)

POLL_S = 0.2  # how often the listener thread looks at close() and at connections without a hello
HELLO_TIMEOUT_S = 2.0  # a connection must present the secret this soon after it is accepted
REFUSAL_LOG_INTERVAL_S = 10.0  # refused connections are logged at most once per this, with their count
MAX_CONNECTIONS = 1024  # open at once (prefill ranks on this host, and their reconnections)


@dataclasses.dataclass
class _Peer:
    sock: socket.socket
    accepted_at_s: float
    authenticated: bool = False
    who: str | None = None  # the rank's tag (its hello's `who`); None: a prefill rank that named none
    prefill: bool = True  # a prefill rank (pushes results, takes binds); else a decode rank (pushes events)


EventsCallback = Callable[[str, list[PolledEvent], DecodeNodeLoad], None]


class ReplyListener:
    """The driver's end: accepts the ranks' connections and calls, on its own thread (the callbacks must
    hand what they get to the event loop), `on_result(handoff_id, tag, result)` for every result an
    authenticated prefill rank pushes and `on_events(who, events, load)` for every batch of events an
    authenticated decode rank pushes (`who`: the tag its hello named; without `on_events` such records are
    dropped). `address` (a socket path) and `secret` go to the ranks (`PrefillNode.connect_reply_channel`,
    `DecodeNode.connect_reply_channel`). `send_bind(who, bind)` (any thread) writes a bind on the connection
    of the prefill rank whose hello named tag `who` (the first one under that tag, while it is open).

    One thread, non-blocking sockets, one packet read per readiness: no peer can hold it. A connection that
    has not presented the secret within `HELLO_TIMEOUT_S`, or sends anything but one-packet records, is
    closed; at most `MAX_CONNECTIONS` are open at once (newer ones are refused).
    """

    def __init__(
        self, on_result: Callable[[str, str, PrefillResult], None], on_events: EventsCallback | None = None
    ) -> None:
        sweep_stale_socket_dirs()
        self._on_result = on_result
        self._on_events = on_events
        self._listener, self._dir = listen()
        self._listener.setblocking(False)
        self.address = str(self._dir / SOCKET_NAME)
        self.secret = secrets.token_hex(16)
        self._closed = threading.Event()
        self._refusals = LogThrottle(REFUSAL_LOG_INTERVAL_S)
        self._prefill_socks: dict[str, socket.socket] = {}  # tag -> its authenticated prefill connection
        self._socks_lock = threading.Lock()  # guards _prefill_socks (the listener thread and send_bind)
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

    def send_bind(self, who: str, bind: PrefillBind) -> bool:
        """Send `bind` on the connection of the prefill rank whose hello named `who`; never blocks or
        raises. True: it is in that connection's socket buffer (the rank reads it); False: not sent (no such
        connection now, its buffer full, or it broke): make the Ray call instead."""
        with self._socks_lock:
            sock = self._prefill_socks.get(who)
            if sock is None:
                return False
            try:
                packet = single_packet(bind_to_record(bind))
                if packet is None:
                    return False
                sock.send(packet)  # non-blocking: a sequenced packet goes whole or not at all
            except Exception:  # noqa: BLE001 - BlockingIOError (full), the rank gone (the listener drops it)
                return False
        return True

    def is_registered(self, who: str) -> bool:
        """Whether a prefill connection under tag `who` has presented the secret (binds can go to it)."""
        with self._socks_lock:
            return who in self._prefill_socks

    def _run(self) -> None:
        peers: dict[socket.socket, _Peer] = {}
        with selectors.DefaultSelector() as selector:
            selector.register(self._listener, selectors.EVENT_READ)

            def drop(peer: _Peer) -> None:
                selector.unregister(peer.sock)
                peers.pop(peer.sock, None)
                with self._socks_lock:  # no bind goes to it any more
                    if peer.who is not None and self._prefill_socks.get(peer.who) is peer.sock:
                        del self._prefill_socks[peer.who]
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
                        logger.exception("reply channel: the listener's loop failed; going on")
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
        self._refusals.warning(
            logger,
            "reply channel: refused or closed %d connection(s) of processes that are not ranks of this "
            "deployment (latest: %s)",
            why,
        )

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
            secret, who, prefill = record.get("secret"), record.get("who"), record.get("prefill", None)
            if prefill is None:  # a hello without it: a decode rank names itself, a prefill rank does not
                prefill = who is None
            if (
                record.get("k") == "hello"
                and isinstance(secret, str)
                and isinstance(who, str | None)
                and isinstance(prefill, bool)
                and (prefill or who is not None)  # a decode rank names itself
            ):
                if hmac.compare_digest(secret.encode(), self.secret.encode()):
                    peer.authenticated, peer.who, peer.prefill = True, who, prefill
                    if prefill and who is not None:
                        with self._socks_lock:  # the first connection under a tag keeps it while open
                            self._prefill_socks.setdefault(who, peer.sock)
                    return
            self._refused("no secret")
            drop(peer)
            return
        try:
            if peer.prefill:
                handoff_id, tag, result = result_from_record(record)
            else:
                events, load = events_from_record(record)
        except ValueError as e:
            logger.warning("reply channel: dropped a malformed %r record: %s", record.get("k"), e)
            return
        try:
            if peer.prefill:
                self._on_result(handoff_id, tag, result)
            elif self._on_events is not None:
                self._on_events(peer.who, events, load)
        except Exception:  # noqa: BLE001 - one delivery never stops the listener
            logger.exception("reply channel: delivering a record of %s failed", peer.who or "a prefill rank")


class ReplyPusher:
    """A rank's end: `push` (a prefill rank) and `push_events` (a decode rank, which connects with its tag
    `who`) never block and never raise (the Ray reply and the poll carry everything anyway).

    A prefill rank (`on_bind` given; `who` its tag) also takes the binds the driver sends on this connection
    (`ReplyListener.send_bind`): a thread of its own reads them and calls `on_bind(PrefillBind)`; a malformed
    record is dropped with a warning. The thread ends when the driver closes the connection or at `close`.

    Raises (constructor only): OSError when the driver's socket cannot be reached."""

    def __init__(
        self,
        address: str,
        secret: str,
        who: str | None = None,
        on_bind: Callable[[PrefillBind], None] | None = None,
    ) -> None:
        self._sock = connect(address).sock
        try:
            hello = {"k": "hello", "secret": secret, "who": who}
            if on_bind is not None:
                hello["prefill"] = True
            packet = single_packet(hello)
            assert packet is not None  # a few dozen bytes
            self._sock.sendall(packet)
        except OSError:
            self._sock.close()
            raise
        self._sock.setblocking(False)  # a stalled driver costs a dropped push, not the engine thread
        self._lock = threading.Lock()
        self._broken = False
        self._closed = threading.Event()
        self.num_binds_received = 0
        self._reader: threading.Thread | None = None
        if on_bind is not None:
            self._reader = threading.Thread(
                target=self._read_binds, args=(on_bind,), name="driver-binds", daemon=True
            )
            self._reader.start()

    def _read_binds(self, on_bind: Callable[[PrefillBind], None]) -> None:
        """The reader thread of a prefill rank: each `bind` record to `on_bind`, until the connection ends.
        However it ends, the connection is shut down on the way out, so the driver drops it and sends no
        bind there that nobody would read (they go by Ray)."""
        sock = self._sock
        try:
            while not self._closed.is_set():
                try:
                    if not wait_readable(sock, POLL_S):
                        continue
                    packet = sock.recv(MAX_PACKET_BYTES + 1)
                except BlockingIOError:
                    continue
                if not packet:  # the driver closed it
                    return
                try:
                    record = record_from_single_packet(packet)
                    if record.get("k") != "bind":
                        raise ValueError(f"a {record.get('k')!r} record, not a bind")
                    bind = bind_from_record(record)
                except (ProtocolError, ValueError) as e:
                    logger.warning("reply channel: dropped a malformed record from the driver: %s", e)
                    continue
                self.num_binds_received += 1
                try:
                    on_bind(bind)
                except Exception:  # noqa: BLE001 - one bind never stops the reader
                    logger.exception("reply channel: taking the bind of %s failed", bind.handoff_id)
        except Exception as e:  # noqa: BLE001 - the socket failed, or a bug: logged, then shut down below
            if not self._closed.is_set():
                logger.warning("reply channel: reading the driver's binds failed (Ray binds only now): %r", e)
        finally:
            self._shut_down()

    def _shut_down(self) -> None:
        """Mark the connection broken and shut it down (both ways; the descriptor stays open until `close`,
        so no other thread's call on it can reach a socket that reused its number)."""
        with self._lock:
            self._broken = True
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)

    def push(self, handoff_id: str, secret: bytes, result: PrefillResult) -> None:
        """Push `result` of handoff `handoff_id` (whose bound meta carries `secret`: `handoff_tag`)."""
        self._send(result_to_record(handoff_id, handoff_tag(secret), result))

    def push_events(self, events: Sequence[PolledEvent], load: DecodeNodeLoad) -> bool:
        """Push `events` (consecutive sequence numbers) with `load`. True: they are in the driver's socket
        buffer; False: not sent (buffer full, over one packet, or the channel broke): the poll brings them."""
        return self._send(events_to_record(events, load))

    def _send(self, record: dict[str, Any]) -> bool:
        with self._lock:
            if self._broken:
                return False
            try:
                packet = single_packet(record)
                if packet is None:  # over one packet (a result: never; a pass's events: very long texts)
                    return False
                self._sock.send(packet)  # a sequenced packet goes whole or not at all
                return True
            except BlockingIOError:  # the driver's socket buffer is full: the Ray reply or the poll brings it
                return False
            except Exception as e:  # noqa: BLE001 - the Ray reply and the poll still carry everything
                logger.warning("reply channel to the driver failed (Ray calls only now): %r", e)
                self._broken = True
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)  # closed at `close`: the reader may be in it
                return False

    def close(self, join_timeout_s: float = 2.0) -> None:
        self._closed.set()
        self._shut_down()  # the reader's poll returns at once
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(join_timeout_s)
        with self._lock:
            with contextlib.suppress(OSError):
                self._sock.close()
