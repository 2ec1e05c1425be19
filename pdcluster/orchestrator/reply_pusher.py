"""A rank's end of the driver's reply socket (`orchestrator.reply_channel`, whose docstring says what goes
over it and who may connect): `ReplyPusher` pushes a prefill rank's results and a decode rank's events,
takes the driver's binds and calls on a reader thread of its own, and answers the calls."""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from pdcluster.kvtransfer.base import ProtocolError
from pdcluster.kvtransfer.shm_transport.channel import (
    MAX_PACKET_BYTES,
    connect,
    record_from_single_packet,
    single_packet,
    wait_readable,
)
from pdcluster.orchestrator.messages import (
    DecodeNodeLoad,
    PolledEvent,
    PrefillBind,
    PrefillResult,
    ReserveResult,
)
from pdcluster.orchestrator.reply_records import (
    CALL_KINDS,
    RankCall,
    answer_to_record,
    bind_from_record,
    call_from_record,
    error_answer_record,
    events_to_record,
    handoff_tag,
    result_to_record,
)

logger = logging.getLogger(__name__)

POLL_S = 0.2  # how often the reader looks at close() while the driver is quiet


class ReplyPusher:
    """A rank's end: `push` (a prefill rank) and `push_events` (a decode rank, which connects with its tag
    `who`) never block and never raise (the call's answer or Ray reply, and the poll, carry everything
    anyway); `push_answer` may wait a bounded time for room (a call's answer has no other way to the
    driver).

    A prefill rank (`on_bind` given; `who` its tag) also takes the binds the driver sends on this connection
    (`ReplyListener.send_bind`), and a rank given `on_call` the calls (`send_call`: a prefill rank's
    `PrefillRequest`s, a decode rank's `ReserveRequest`s), which it answers with `push_answer`: a thread of
    its own reads them and calls `on_bind(PrefillBind)` or `on_call(RankCall, this pusher)` (which must not
    block: the rank runs the call on a thread of its own, which answers on this pusher); a malformed record
    is dropped with a warning (a call whose id can be read is answered with the error at once). The thread
    ends when the driver closes the connection or at `close`.

    Raises (constructor only): OSError when the driver's socket cannot be reached."""

    def __init__(
        self,
        address: str,
        secret: str,
        who: str | None = None,
        on_bind: Callable[[PrefillBind], None] | None = None,
        on_call: Callable[[RankCall, ReplyPusher], None] | None = None,
    ) -> None:
        self._sock = connect(address).sock
        try:
            hello = {"k": "hello", "secret": secret, "who": who}
            if on_bind is not None:
                hello["prefill"] = True
            if on_call is not None:
                hello["calls"] = True
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
        self.num_calls_received = 0
        self._reader: threading.Thread | None = None
        handlers: dict[str, tuple[Callable[[dict[str, Any]], Any], Callable[[Any], None]]] = {}
        if on_bind is not None:
            handlers["bind"] = (bind_from_record, on_bind)
        if on_call is not None:
            for kind in CALL_KINDS:
                handlers[kind] = (call_from_record, lambda request: on_call(request, self))
        if handlers:
            self._reader = threading.Thread(
                target=self._read_driver, args=(handlers,), name="driver-records", daemon=True
            )
            self._reader.start()

    def _read_driver(
        self, handlers: dict[str, tuple[Callable[[dict[str, Any]], Any], Callable[[Any], None]]]
    ) -> None:
        """The reader thread: each record whose kind `handlers` names, parsed by its parser, to its handler,
        until the connection ends. However it ends, the connection is shut down on the way out, so the
        driver drops it and sends nothing more there that nobody would read (binds and calls go by Ray)."""
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
                record = None
                try:
                    record = record_from_single_packet(packet)
                    kind = record.get("k")
                    if kind not in handlers:
                        raise ValueError(f"a {kind!r} record, which this rank does not take")
                    parse, handler = handlers[kind]
                    item = parse(record)
                except (ProtocolError, ValueError) as e:
                    logger.warning("reply channel: dropped a malformed record from the driver: %s", e)
                    if isinstance(record, dict) and record.get("k") in CALL_KINDS:
                        self._answer_unreadable(record, e)
                    continue
                if kind == "bind":
                    self.num_binds_received += 1
                else:
                    self.num_calls_received += 1
                try:
                    handler(item)
                except Exception:  # noqa: BLE001 - one record never stops the reader
                    handoff_id = item.request.handoff_id if isinstance(item, RankCall) else item.handoff_id
                    logger.exception("reply channel: taking the %s record of %s failed", kind, handoff_id)
        except Exception as e:  # noqa: BLE001 - the socket failed, or a bug: logged, then shut down below
            if not self._closed.is_set():
                logger.warning("reply channel: reading the driver's records failed (Ray calls now): %r", e)
        finally:
            self._shut_down()

    def _shut_down(self) -> None:
        """Mark the connection broken and shut it down (both ways; the descriptor stays open until `close`,
        so no other thread's call on it can reach a socket that reused its number)."""
        with self._lock:
            self._mark_broken()

    def _mark_broken(self) -> None:
        """(Lock held.) No more pushes; the socket shut down both ways (closed at `close`)."""
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

    def push_answer(
        self, call: RankCall, outcome: ReserveResult | PrefillResult | BaseException, wait_s: float
    ) -> bool:
        """Answer the driver's `call` with its result or the error it raised, waiting up to `wait_s` seconds
        for room in the driver's socket buffer (without holding the lock the engine thread's pushes take).
        True: sent; False: not (the channel broke, or no room in time): the driver's wait for it times out,
        so the caller undoes what the call set up (a reservation)."""
        return self._send(answer_to_record(call, outcome), wait_s)

    def _answer_unreadable(self, record: dict[str, Any], error: Exception) -> None:
        """Answer a call record that could not be read, when its id and handoff id can be (a driver bug):
        the driver fails that request at once instead of waiting out its bound."""
        call_id, handoff_id = record.get("id"), record.get("rid")
        if isinstance(call_id, int) and isinstance(handoff_id, str):
            raised = RuntimeError(f"the rank could not read the call: {error}")
            self._send(error_answer_record(call_id, record["k"], handoff_id, raised))

    def _break(self, e: BaseException) -> None:
        """(Lock held.) The channel failed: no more pushes; shut down (closed at `close`: the reader may be
        in it)."""
        logger.warning("reply channel to the driver failed (Ray calls only now): %r", e)
        self._mark_broken()

    def _send(self, record: dict[str, Any], wait_s: float = 0.0) -> bool:
        """Send `record` without blocking; while the driver's socket buffer is full, wait for room up to
        `wait_s` seconds (outside the lock). True: sent; False: not (no room in time, over one packet, or
        the channel broke: after that nothing more is sent)."""
        packet = single_packet(record)  # encoded once, outside the lock
        if packet is None:  # over one packet (a result: never; a pass's events: very long texts)
            return False
        deadline_s = time.monotonic() + wait_s
        while True:
            with self._lock:
                if self._broken:
                    return False
                try:
                    self._sock.send(packet)  # a sequenced packet goes whole or not at all
                    return True
                except BlockingIOError:  # the driver's socket buffer is full
                    pass
                except Exception as e:  # noqa: BLE001 - the Ray reply and the poll still carry everything
                    self._break(e)
                    return False
            remaining_s = deadline_s - time.monotonic()
            if remaining_s <= 0:
                return False
            with contextlib.suppress(OSError, ValueError):
                select.select([], [self._sock], [], min(remaining_s, POLL_S))

    def close(self, join_timeout_s: float = 2.0) -> None:
        self._closed.set()
        self._shut_down()  # the reader's poll returns at once
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(join_timeout_s)
        with self._lock:
            with contextlib.suppress(OSError):
                self._sock.close()
