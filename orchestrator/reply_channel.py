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
poll alone carry results and events.
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
from kvtransfer.wire import meta_from_dict, meta_to_dict
from orchestrator.messages import (
    DecodeNodeLoad,
    DraftCounts,
    Phases,
    PolledEvent,
    PrefillBind,
    PrefillResult,
    RequestError,
    TokenDelta,
)

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


def bind_to_record(bind: PrefillBind) -> dict[str, Any]:
    """The `bind` record the driver sends a prefill rank: the handoff id, the bound meta (its secret
    included: the connection is the rank's own, authenticated, on this host) and the decode rank."""
    return {
        "k": "bind",
        "rid": bind.handoff_id,
        "m": meta_to_dict(bind.meta),
        "d": bind.decode_index,
        "r": bind.decode_rank,
    }


def bind_from_record(record: dict[str, Any]) -> PrefillBind:
    """The `PrefillBind` of a `bind` record. ValueError naming what is malformed (the secret is never in
    the message)."""
    handoff_id, meta, decode_index, decode_rank = (record.get(k) for k in ("rid", "m", "d", "r"))
    if not isinstance(handoff_id, str) or not isinstance(meta, dict):
        raise ValueError("a bind record needs a string rid and a mapping m")
    for name, value in (("decode_index", decode_index), ("decode_rank", decode_rank)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} is {value!r}, not an int >= 0")
    try:
        bound = meta_from_dict(meta)
    except ProtocolError as e:
        raise ValueError(str(e)) from None
    if bound.request_id != handoff_id or not isinstance(bound.secret, bytes) or not bound.secret:
        raise ValueError(f"the meta of bind {handoff_id!r} names {bound.request_id!r} or has no secret")
    return PrefillBind(handoff_id, bound, decode_index, decode_rank)


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


_NUMBER = (int, float)
_PHASE_NAMES = frozenset(f.name for f in dataclasses.fields(Phases))
_LOAD_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "name": (str,),
    "pid": (int,),
    "num_free_blocks": (int,),
    "num_total_blocks": (int,),
    "num_running": (int,),
    "num_reserved": (int,),
    "num_waiting_for_seat": (int,),
    "engine_thread_alive": (bool,),
    "num_engine_errors": (int,),
    "last_engine_error": (str, type(None)),
    "instance_group_error": (str, type(None)),
    "ep": (dict, type(None)),
    "taken_s": _NUMBER,
}


def _event_to_record(item: PolledEvent) -> list[Any]:
    event = item.event
    if isinstance(event, RequestError):
        return [item.seq, "error", event.handoff_id, event.message]
    drafts = event.drafts
    return [
        item.seq,
        "delta",
        event.handoff_id,
        list(event.new_token_ids),
        event.finished,
        event.finish_reason,
        event.phases.as_dict(),
        event.kv_transfer_bytes,
        [
            drafts.num_draft_tokens,
            drafts.num_accepted_tokens,
            list(drafts.num_draft_tokens_per_position),
            list(drafts.num_accepted_tokens_per_position),
        ],
        event.new_text,
    ]


def events_to_record(events: Sequence[PolledEvent], load: DecodeNodeLoad) -> dict[str, Any]:
    """The `ev` record a decode rank pushes: its events (`[seq, "delta", fields...]` or `[seq, "error",
    handoff id, message]`) and its load snapshot's fields."""
    return {"k": "ev", "e": [_event_to_record(item) for item in events], "l": dataclasses.asdict(load)}


def _check(name: str, value: Any, types: tuple[type, ...]) -> Any:
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise ValueError(f"{name} is {type(value).__name__}")
    return value


def _ints(name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ValueError(f"{name} is {type(value).__name__}, not a list")
    return tuple(_check(name, v, (int,)) for v in value)


def _event_from_record(fields: Any) -> PolledEvent:
    if not isinstance(fields, list) or len(fields) < 2:
        raise ValueError("an event is a list [seq, kind, ...]")
    seq, kind = _check("seq", fields[0], (int,)), fields[1]
    if kind == "error" and len(fields) == 4:
        _, _, handoff_id, message = fields
        return PolledEvent(
            seq, RequestError(_check("handoff_id", handoff_id, (str,)), _check("message", message, (str,)))
        )
    if kind != "delta" or len(fields) != 10:
        raise ValueError(f"event {seq}: kind {kind!r} with {len(fields)} fields")
    _, _, handoff_id, token_ids, finished, finish_reason, phases, num_bytes, drafts, new_text = fields
    if not isinstance(phases, dict) or not set(phases) <= _PHASE_NAMES:
        raise ValueError(f"event {seq}: phases {phases!r}")
    for name, seconds in phases.items():
        _check(name, seconds, _NUMBER)
    if not isinstance(drafts, list) or len(drafts) != 4:
        raise ValueError(f"event {seq}: drafts {drafts!r}")
    delta = TokenDelta(
        handoff_id=_check("handoff_id", handoff_id, (str,)),
        new_token_ids=_ints("new_token_ids", token_ids),
        finished=_check("finished", finished, (bool,)),
        finish_reason=_check("finish_reason", finish_reason, (str, type(None))),
        phases=Phases(**phases),
        kv_transfer_bytes=_check("kv_transfer_bytes", num_bytes, (int, type(None))),
        drafts=DraftCounts(
            _check("num_draft_tokens", drafts[0], (int,)),
            _check("num_accepted_tokens", drafts[1], (int,)),
            _ints("num_draft_tokens_per_position", drafts[2]),
            _ints("num_accepted_tokens_per_position", drafts[3]),
        ),
        new_text=_check("new_text", new_text, (str,)),
    )
    return PolledEvent(seq, delta)


def events_from_record(record: dict[str, Any]) -> tuple[list[PolledEvent], DecodeNodeLoad]:
    """(events in sequence, load snapshot) of an `ev` record. ValueError naming what is malformed (a field
    of the wrong type, events out of sequence)."""
    events, load = record.get("e"), record.get("l")
    if not isinstance(events, list) or not events or not isinstance(load, dict):
        raise ValueError("an ev record needs a non-empty list e and a mapping l")
    if set(load) != set(_LOAD_FIELD_TYPES):
        raise ValueError(f"load fields {sorted(load)} are not {sorted(_LOAD_FIELD_TYPES)}")
    for name, types in _LOAD_FIELD_TYPES.items():
        _check(name, load[name], types)
    items = [_event_from_record(fields) for fields in events]
    if any(b.seq != a.seq + 1 for a, b in zip(items, items[1:], strict=False)):
        raise ValueError(f"events out of sequence: {[item.seq for item in items]}")
    return items, DecodeNodeLoad(**load)


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
        count = self._refusals.count()
        if count is not None:
            logger.warning(
                "reply channel: refused or closed %d connection(s) of processes that are not "
                "ranks of this deployment (latest: %s)",
                count,
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
