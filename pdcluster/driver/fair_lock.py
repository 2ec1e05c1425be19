"""`FairLock`: a mutual-exclusion lock granted in request order (first come, first served).

A decode rank's engine thread releases and retakes its lock between steps; with `threading.Lock` it often
wins over a queued waiter (a reserve, an abort), which could wait several steps instead of one.
"""

from __future__ import annotations

import threading
from types import TracebackType


class FairLock:
    """A non-reentrant ticket lock over one `threading.Condition`; blocking acquisition only.

    A waiter interrupted while waiting gives its turn up; releasing a lock not held raises RuntimeError.
    """

    def __init__(self) -> None:
        self._condition = threading.Condition(threading.Lock())
        self._next_ticket = 0
        self._serving = 0  # the ticket that holds (or may now take) the lock
        self._abandoned: set[int] = set()  # tickets of waiters interrupted before their turn
        self._owner: int | None = None

    def acquire(self) -> bool:
        with self._condition:
            ticket = self._next_ticket
            self._next_ticket += 1
            try:
                while self._serving != ticket:
                    self._condition.wait()
            except BaseException:
                if self._serving == ticket:
                    self._pass_on()
                else:
                    self._abandoned.add(ticket)
                raise
            self._owner = threading.get_ident()
        return True

    def _pass_on(self) -> None:
        self._serving += 1
        while self._serving in self._abandoned:
            self._abandoned.discard(self._serving)
            self._serving += 1
        self._condition.notify_all()

    def release(self) -> None:
        """Give the lock to the next request; RuntimeError if this thread does not hold it."""
        with self._condition:
            if self._owner != threading.get_ident():
                raise RuntimeError("FairLock released by a thread that does not hold it")
            self._owner = None
            self._pass_on()

    def locked(self) -> bool:
        with self._condition:
            return self._owner is not None

    @property
    def num_waiting(self) -> int:
        with self._condition:
            holder = 1 if self._owner is not None else 0
            return self._next_ticket - self._serving - len(self._abandoned) - holder

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()
