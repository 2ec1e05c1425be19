"""One ordered command stream per rank: the rank side (`CommandOrder`)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CommandSeq:
    """Where one command sits in the driver's stream to one rank: `stream` (fresh per rank incarnation
    the driver knows of) and `seq` (from 1)."""

    stream: str
    seq: int


class StaleCommand(RuntimeError):
    """The command came after its stream had moved past it (its gap was skipped, or a newer stream began)."""


class CommandOrder:
    """Admits each rank command in its stream's order (`turn`). Commands without a `CommandSeq` (in-process
    callers, tests) go at once."""

    def __init__(self, gap_timeout_s: float) -> None:
        self.gap_timeout_s = gap_timeout_s
        self._cond = threading.Condition()
        self._stream: str | None = None
        self._next_seq = 1
        self._old_streams: set[str] = set()
        self.num_gaps_skipped = 0

    @contextlib.contextmanager
    def turn(self, order: CommandSeq | None) -> Iterator[None]:
        """Wait for `order`'s turn, run the body, then let the next command go. Raises `StaleCommand`."""
        if order is None:
            yield
            return
        with self._cond:
            if order.stream != self._stream:
                if order.stream in self._old_streams:
                    raise StaleCommand(f"command {order.seq} of a superseded stream")
                if self._stream is not None:
                    self._old_streams.add(self._stream)
                self._stream, self._next_seq = order.stream, 1
                self._cond.notify_all()
            deadline_s = time.monotonic() + self.gap_timeout_s
            while order.stream == self._stream and order.seq > self._next_seq:
                remaining_s = deadline_s - time.monotonic()
                if remaining_s <= 0:
                    logger.warning(
                        "commands %d..%d of stream %s did not come in %g s; going on without them",
                        self._next_seq,
                        order.seq - 1,
                        order.stream,
                        self.gap_timeout_s,
                    )
                    self.num_gaps_skipped += order.seq - self._next_seq
                    self._next_seq = order.seq
                    break
                self._cond.wait(remaining_s)
            if order.stream != self._stream or order.seq < self._next_seq:
                raise StaleCommand(f"command {order.seq} came after its stream moved past it")
            try:
                yield
            finally:
                self._next_seq = order.seq + 1
                self._cond.notify_all()
