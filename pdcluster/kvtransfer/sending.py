"""Sender-side bookkeeping shared by the transports: a sender's begun handoffs, their close and flush.

A sender keeps `{request_id: handoff}` under its own lock; call these with that lock held, except
`flush_closed`, which takes it. The receiver-side counterpart is `reservations.Reservations`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from pdcluster.kvtransfer.base import FailureLog, HandoffMeta, KVTransferError, TransferTimeout


@dataclass
class SenderHandoff:
    """One begun handoff: `closed` once finished or aborted (`abort_reason`); `stalled` by a fault hook."""

    meta: HandoffMeta
    begun_at_s: float
    closed: bool = False
    abort_reason: str | None = None
    stalled: bool = False

    @property
    def deadline_s(self) -> float:
        """When the sender's lease runs out (monotonic clock)."""
        return self.begun_at_s + self.meta.lease_s


@dataclass
class TrackedHandoff(SenderHandoff):
    """A handoff whose outcome is recorded on its own: `done` (delivered or failed), then `ended` set."""

    done: bool = False
    ended: threading.Event = field(default_factory=threading.Event)


H = TypeVar("H", bound=SenderHandoff)


def check_begin(handoff: HandoffMeta, sender: str, closed: bool, begun: Container[str]) -> None:
    """What `KVSender.begin` refuses.

    Raises ValueError (no secret, request already begun) or RuntimeError (sender closed).
    """
    if not handoff.secret:
        raise ValueError(f"{handoff.request_id}: the handoff has no secret; begin with what expect returned")
    if closed:
        raise RuntimeError(f"{sender} is closed")
    if handoff.request_id in begun:
        raise ValueError(f"{handoff.request_id}: handoff already begun")


def open_handoff(handoffs: Mapping[str, H], request_id: str) -> H:
    """The begun handoff `request_id`; ValueError if never begun or already finished/aborted."""
    handoff = handoffs.get(request_id)
    if handoff is None or handoff.closed:
        raise ValueError(f"{request_id}: no open handoff (never begun, or already finished/aborted)")
    return handoff


def close_handoff(handoffs: Mapping[str, H], request_id: str, abort_reason: str | None = None) -> H:
    """Mark `request_id` finished, or aborted when `abort_reason` is given; ValueError as `open_handoff`."""
    handoff = open_handoff(handoffs, request_id)
    handoff.closed = True
    if abort_reason is not None:
        handoff.abort_reason = abort_reason
    return handoff


def forget_handoff(handoffs: dict[str, H], handoff: H) -> None:
    if handoffs.get(handoff.meta.request_id) is handoff:
        del handoffs[handoff.meta.request_id]


def flush_closed(
    lock: threading.Lock, handoffs: Mapping[str, TrackedHandoff], failures: FailureLog, timeout_s: float
) -> dict[str, KVTransferError]:
    """`KVSender.flush`: wait up to `timeout_s` for the closed handoffs to end, then pop the failures.

    Raises TransferTimeout naming the closed handoffs still in flight.
    """
    deadline_s = time.monotonic() + timeout_s
    with lock:
        closed = [h for h in handoffs.values() if h.closed]
    for handoff in closed:
        handoff.ended.wait(max(0.0, deadline_s - time.monotonic()))
    with lock:
        in_flight = sorted(rid for rid, h in handoffs.items() if h.closed and not h.done)
        if in_flight:
            raise TransferTimeout(
                f"flush: {len(in_flight)} finished handoffs in flight after {timeout_s:g} s: {in_flight}"
            )
        return failures.pop_all()
