"""The one-host rank channel's records: msgspec tagged structs around `driver.messages`' dataclasses.

A frame is a 4-byte big-endian length, then one record in msgpack. Records to a rank (`ToRank`) and from it
(`ToDriver`) are decoded against their union, so a malformed or unknown record raises `ProtocolError`.
A reply's value is typed by the call it answers (`Reply.value`, decoded by the caller with `decode_as`).
"""

from __future__ import annotations

import builtins
import importlib
import struct
from dataclasses import dataclass, field

import msgspec

from pdcluster.driver.command_order import CommandSeq
from pdcluster.driver.messages import (
    DecodeNodeLoad,
    PolledEvent,
    PrefillBind,
    PrefillRequest,
    RequestError,
    ReserveRequest,
    TokenDelta,
)
from pdcluster.kvtransfer.base import ProtocolError

MAX_FRAME_BYTES = 64 << 20
LENGTH = struct.Struct("!I")


@dataclass(frozen=True)
class ChannelAddress:
    """Where a rank serves its driver channel: a socket `path` in a 0700 directory, and the `secret` a
    connection's first record must present."""

    path: str
    secret: str = field(repr=False)


class RankConnectionLost(ConnectionError):
    """The channel to a rank closed (the rank died or restarted, or the connection broke): a call in flight
    on it has no answer."""


class _Record(msgspec.Struct, tag=True, array_like=True, frozen=True):
    pass


# ---- to a rank --------------------------------------------------------------------------------------------
class Hello(_Record):
    secret: str


class Reserve(_Record):
    call: int
    request: ReserveRequest


class Prefill(_Record):
    call: int
    request: PrefillRequest
    order: CommandSeq | None


class Bind(_Record):
    bind: PrefillBind
    order: CommandSeq | None


class Abort(_Record):
    handoff_id: str
    order: CommandSeq | None


class Load(_Record):
    call: int


class Subscribe(_Record):
    """Push every event after `acked_seq`, then each as the rank emits it, with its load."""

    acked_seq: int


class Ack(_Record):
    seq: int


ToRank = Hello | Reserve | Prefill | Bind | Abort | Load | Subscribe | Ack


# ---- to the driver ----------------------------------------------------------------------------------------
class Welcome(_Record):
    pid: int
    incarnation: str  # fresh per rank process: its events number from 1 again under a new one


class Reply(_Record):
    call: int
    value: msgspec.Raw


class Failed(_Record):
    call: int
    error: str  # the exception's `module.qualname`
    message: str


class Token(_Record):
    seq: int
    event: TokenDelta


class Dropped(_Record):
    seq: int
    event: RequestError


class Events(_Record):
    events: list[Token | Dropped]
    load: DecodeNodeLoad


ToDriver = Welcome | Reply | Failed | Events

_encoder = msgspec.msgpack.Encoder()
_to_rank = msgspec.msgpack.Decoder(ToRank)
_to_driver = msgspec.msgpack.Decoder(ToDriver)


def frame(record: _Record) -> bytes:
    """`record` as one frame (length, then msgpack)."""
    body = _encoder.encode(record)
    return LENGTH.pack(len(body)) + body


def frame_length(header: bytes) -> int:
    """The body length a frame header announces; ProtocolError past MAX_FRAME_BYTES."""
    (length,) = LENGTH.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"rank channel: a frame of {length} B (at most {MAX_FRAME_BYTES})")
    return length


def decode_to_rank(body: bytes) -> ToRank:
    return _decode(_to_rank, body)


def decode_to_driver(body: bytes) -> ToDriver:
    return _decode(_to_driver, body)


def _decode(decoder: msgspec.msgpack.Decoder, body: bytes):
    try:
        return decoder.decode(body)
    except (msgspec.DecodeError, ValueError, TypeError) as e:
        raise ProtocolError(f"rank channel: malformed record: {e}") from None


def reply(call: int, value: object) -> Reply:
    return Reply(call, msgspec.Raw(_encoder.encode(value)))


def decode_as(value: msgspec.Raw, kind: type):
    """A `Reply.value` as `kind` (a `driver.messages` dataclass). ProtocolError when it is not one."""
    try:
        return msgspec.msgpack.decode(value, type=kind)
    except (msgspec.DecodeError, ValueError, TypeError) as e:
        raise ProtocolError(f"rank channel: a reply that is no {kind.__name__}: {e}") from None


def pushed(events: list[PolledEvent], load: DecodeNodeLoad) -> Events:
    return Events(
        [
            Token(p.seq, p.event) if isinstance(p.event, TokenDelta) else Dropped(p.seq, p.event)
            for p in events
        ],
        load,
    )


def polled(record: Events) -> list[PolledEvent]:
    return [PolledEvent(e.seq, e.event) for e in record.events]


def failed(call: int, error: BaseException) -> Failed:
    cls = type(error)
    return Failed(call, f"{cls.__module__}.{cls.__qualname__}", str(error))


def remote_error(record: Failed) -> Exception:
    """The exception a rank method raised, rebuilt: its own class when builtin or pdcluster's (and
    constructible from its message), else RuntimeError("Type: message")."""
    module, _, name = record.error.rpartition(".")
    cls = None
    if module == "builtins":
        cls = getattr(builtins, name, None)
    elif module.split(".")[0] == "pdcluster":
        try:
            cls = getattr(importlib.import_module(module), name, None)
        except ImportError:
            cls = None
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(record.message)
        except Exception:  # noqa: BLE001 - a constructor that wants more: the generic form below
            pass
    return RuntimeError(f"{name}: {record.message}")
