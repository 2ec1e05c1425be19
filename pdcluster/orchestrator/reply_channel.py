"""Results and token events pushed to the driver over a Unix socket on its host, beside the Ray calls.

Prefill results. The first token of a request comes back in the prefill call's reply (`orchestrator.
dispatch.EmitFirstToken`). Measured on this 2-core host (per-process timestamps, p50), that Ray reply took
2.3-2.6 ms from the actor method's return to the driver's event loop; from a push on this socket to the
first token streamed took 0.98 ms, while the Ray reply reached the driver 2.73 ms after the push (20
sequential requests at idle; 0.71 ms of it to the event loop). So each prefill rank on the driver's host
pushes the `PrefillResult` it is about to return (`ReplyPusher.push`, from the prefill engine thread once
the handoff is finished on its side) and the driver takes whichever comes first as the attempt's
`PrefillDone` (`RequestDispatch._on_prefill_reply`); the other is dropped. The call itself (its answer on
this socket, below, or where the rank has no connection the Ray reply) stays the authority for everything
else: failures, timeouts, the prefill load accounting.

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
(`who`; a prefill rank's says `prefill`: it pushes results and takes binds; either says `calls` when it
takes calls): events are taken only under the current tag of a decode rank, so a restarted rank's
predecessor, whose sequence numbers started over, is never mistaken for it; binds and calls go only to the
first connection under a tag (while it is open), and answers are taken only from it, for a call sent on it
(by call id). A malformed record from an authenticated peer is dropped with a warning. Each
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

Calls, likewise. The driver sends a decode rank's reserve (`ReserveRequest`) and a prefill rank's request
(`PrefillRequest`) on the rank's connection when its hello said it takes calls (`ReplyListener.send_call`),
instead of a `DecodeNode.reserve` / `PrefillNode.prefill` Ray call (about 1 ms of CPU on each side here);
the rank runs the method on a thread of its own (`RankActor._take_call`) and answers on the same
connection (`ReplyPusher.push_answer`: the method's result or the error it raised), which the listener hands
to `on_answer` only from the connection the call went to. The driver waits for the answer as it did for the
Ray call, with the same bound; when the connection closes first, every call waiting on it fails as a call
to a dead actor does (`routing.RankConnectionLost`). A prefill rank still pushes its result from the engine
thread as soon as the handoff is finished (the first of it and the answer is the attempt's `PrefillDone`);
the answer, like the Ray reply it replaces, settles the call. A reserve whose answer the rank cannot send
is released there. No connection, a full buffer or a prompt over one packet: the Ray call.

Where. Only on a single-node cpu topology (every rank on the driver's host); elsewhere the Ray reply and the
poll alone carry results and events, and binds and calls go by Ray.

The records (`done`, `ev`, `bind`, `rsv`, `pf`, `ans`) and their checks are `orchestrator.reply_records`';
this module is the driver's end of the socket (`ReplyListener`), `orchestrator.reply_pusher` a rank's.
"""

from __future__ import annotations

import asyncio
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
from collections.abc import Callable
from typing import Any

from pdcluster.kvtransfer.base import ProtocolError
from pdcluster.kvtransfer.shm_transport.channel import (
    MAX_PACKET_BYTES,
    SOCKET_NAME,
    LogThrottle,
    listen,
    peer_uid,
    record_from_single_packet,
    single_packet,
    sweep_stale_socket_dirs,
)
from pdcluster.orchestrator.messages import (
    DecodeNodeLoad,
    PolledEvent,
    PrefillBind,
    PrefillRequest,
    PrefillResult,
)
from pdcluster.orchestrator.reply_records import (
    CallAnswer,
    RankCall,
    answer_from_record,
    bind_to_record,
    call_to_record,
    events_from_record,
    result_from_record,
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
    calls: bool = False  # it takes calls (`send_call`): a prefill rank's prefills, a decode rank's reserves
    registered: bool = False  # the first connection under its tag: binds and calls go to it


def call_soon_on(loop: asyncio.AbstractEventLoop | None, callback: Callable[..., Any], *args: Any) -> None:
    """From the listener's thread: run `callback(*args)` on `loop` (the requests' event loop, which owns
    every request's state and queues), or drop it when there is no loop or it has closed (what it was for
    went with it)."""
    if loop is None or loop.is_closed():
        return
    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
        loop.call_soon_threadsafe(callback, *args)


EventsCallback = Callable[[str, list[PolledEvent], DecodeNodeLoad], None]
# (who, the answer to a call sent on its connection; None: the connection closed, and the calls it had not
# answered never will be on it)
AnswerCallback = Callable[[str, CallAnswer | None], None]


class ReplyListener:
    """The driver's end: accepts the ranks' connections and calls, on its own thread (the callbacks must
    hand what they get to the event loop), `on_result(handoff_id, tag, result)` for every result an
    authenticated prefill rank pushes and `on_events(who, events, load)` for every batch of events an
    authenticated decode rank pushes (`who`: the tag its hello named; without `on_events` such records are
    dropped). `address` (a socket path) and `secret` go to the ranks (`PrefillNode.connect_reply_channel`,
    `DecodeNode.connect_reply_channel`). `send_bind(who, bind)` (any thread) writes a bind on the connection
    of the prefill rank whose hello named tag `who` (the first one under that tag, while it is open), and
    `send_call(who, call)` a `RankCall` (a reserve or a prefill request) on the connection of the rank under
    tag `who` whose hello said it takes calls; that rank's answers go to `on_answer(who, CallAnswer)`, and
    when its connection closes, `on_answer(who, None)`.

    One thread, non-blocking sockets, one packet read per readiness: no peer can hold it. A connection that
    has not presented the secret within `HELLO_TIMEOUT_S`, or sends anything but one-packet records, is
    closed; at most `MAX_CONNECTIONS` are open at once (newer ones are refused).
    """

    def __init__(
        self,
        on_result: Callable[[str, str, PrefillResult], None],
        on_events: EventsCallback | None = None,
        on_answer: AnswerCallback | None = None,
    ) -> None:
        sweep_stale_socket_dirs()
        self._on_result = on_result
        self._on_events = on_events
        self._on_answer = on_answer
        self._listener, self._dir = listen()
        self._listener.setblocking(False)
        self.address = str(self._dir / SOCKET_NAME)
        self.secret = secrets.token_hex(16)
        self._closed = threading.Event()
        self._refusals = LogThrottle(REFUSAL_LOG_INTERVAL_S)
        self._registered: dict[str, _Peer] = {}  # tag -> the authenticated connection binds/calls go to
        self._ever_registered: set[str] = set()  # every tag that was registered once (`dropped`)
        self._socks_lock = threading.Lock()  # guards _registered (the listener thread and the senders)
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
        return self._send_to(who, True, False, lambda: bind_to_record(bind))

    def send_call(self, who: str, call: RankCall) -> bool:
        """Send `call` (a `ReserveRequest` to a decode rank, a `PrefillRequest` to a prefill rank) on the
        connection of the rank whose hello named `who` and said it takes calls; never blocks or raises.
        True: it is in that connection's socket buffer (the answer comes to `on_answer`, or the connection's
        close does); False: not sent (no such connection now, its buffer full, a prompt too long for one
        packet, or it broke): make the Ray call instead."""
        prefill = isinstance(call.request, PrefillRequest)
        return self._send_to(who, prefill, True, lambda: call_to_record(call))

    def _send_to(self, who: str, prefill: bool, call: bool, record: Callable[[], dict[str, Any]]) -> bool:
        with self._socks_lock:
            peer = self._registered.get(who)
            if peer is None or peer.prefill != prefill or (call and not peer.calls):
                return False
            try:
                packet = single_packet(record())
                if packet is None:
                    return False
                peer.sock.send(packet)  # non-blocking: a sequenced packet goes whole or not at all
            except Exception:  # noqa: BLE001 - BlockingIOError (full), the rank gone (the listener drops it)
                return False
        return True

    def dropped(self, who: str) -> bool:
        """Whether the connection under tag `who` was registered once and is not any more (it closed)."""
        with self._socks_lock:
            return who in self._ever_registered and who not in self._registered

    def is_registered(self, who: str) -> bool:
        """Whether the connection binds (a prefill rank) or calls go to under tag `who` has presented the
        secret."""
        with self._socks_lock:
            return who in self._registered

    def _run(self) -> None:
        peers: dict[socket.socket, _Peer] = {}
        with selectors.DefaultSelector() as selector:
            selector.register(self._listener, selectors.EVENT_READ)

            def drop(peer: _Peer) -> None:
                selector.unregister(peer.sock)
                peers.pop(peer.sock, None)
                with self._socks_lock:  # no bind or call goes to it any more
                    if peer.registered:
                        del self._registered[peer.who]
                    with contextlib.suppress(OSError):
                        peer.sock.close()
                if peer.registered and peer.calls and self._on_answer is not None:
                    self._deliver(peer, self._on_answer, peer.who, None)

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
            self._hello(peer, record, drop)
            return
        kind = record.get("k")
        try:
            if kind == "ans":
                if not (peer.registered and peer.calls):  # no call was sent to it
                    raise ValueError("an answer from a connection that was sent no call")
                answer = answer_from_record(record)
            elif peer.prefill:
                handoff_id, tag, result = result_from_record(record)
            else:
                events, load = events_from_record(record)
        except ValueError as e:
            logger.warning("reply channel: dropped a malformed %r record: %s", kind, e)
            return
        if kind == "ans":
            if self._on_answer is not None:
                self._deliver(peer, self._on_answer, peer.who, answer)
        elif peer.prefill:
            self._deliver(peer, self._on_result, handoff_id, tag, result)
        elif self._on_events is not None:
            self._deliver(peer, self._on_events, peer.who, events, load)

    def _hello(self, peer: _Peer, record: dict[str, Any], drop: Callable[[_Peer], None]) -> None:
        """Authenticate `peer` by its first record, or drop it. A prefill rank's hello says `prefill`
        (binds go to it when it names a tag); a decode rank's names its tag; either says `calls` when it
        takes calls. The first connection under a tag keeps it while open."""
        secret, who, prefill = record.get("secret"), record.get("who"), record.get("prefill", None)
        calls = record.get("calls", False)
        if prefill is None:  # a hello without it: a decode rank names itself, a prefill rank does not
            prefill = who is None
        if (
            record.get("k") == "hello"
            and isinstance(secret, str)
            and isinstance(who, str | None)
            and isinstance(prefill, bool)
            and isinstance(calls, bool)
            and (prefill or who is not None)  # a decode rank names itself
            and hmac.compare_digest(secret.encode(), self.secret.encode())
        ):
            peer.authenticated, peer.who, peer.prefill, peer.calls = True, who, prefill, calls
            if who is not None and (prefill or calls):
                with self._socks_lock:
                    if who not in self._registered:
                        self._registered[who] = peer
                        self._ever_registered.add(who)
                        peer.registered = True
            return
        self._refused("no secret")
        drop(peer)

    @staticmethod
    def _deliver(peer: _Peer, callback: Callable[..., None], *args: Any) -> None:
        try:
            callback(*args)
        except Exception:  # noqa: BLE001 - one delivery never stops the listener
            logger.exception("reply channel: delivering a record of %s failed", peer.who or "a prefill rank")
