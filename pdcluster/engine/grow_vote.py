"""The survivors' agreement to switch to a grown group: carried in each step's agreement over the old group
(`ExpertParallelRuntime.begin_step`), so every survivor switches after the same step, or none does."""

from __future__ import annotations

import threading


class GrowVote:
    """One survivor's vote: `ready()` once the new group is formed and loaded; the step agreement then
    `contribute()`s it and `resolve()`s with the group's minimum; `agreed` from the first step where every
    survivor voted. `abort()` (any thread, at once) and `withdraw()` take it back unless already agreed."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._ready = self.agreed = self._withdrawn = False
        self._in_flight = False

    def ready(self) -> None:
        with self._cond:
            self._ready = not self._withdrawn

    def abort(self) -> None:
        """From the next step on this rank votes against switching."""
        with self._cond:
            self._withdrawn = True

    @property
    def aborted(self) -> bool:
        return self._withdrawn

    def contribute(self) -> int:
        """This rank's vote for the step starting now (1 ready, else 0)."""
        with self._cond:
            self._in_flight = True
            return int(self._ready and not self._withdrawn)

    def resolve(self, all_ready: bool) -> None:
        """The step's agreement: `all_ready` when every rank contributed 1 (False when it failed)."""
        with self._cond:
            self.agreed = self.agreed or all_ready
            self._in_flight = False
            self._cond.notify_all()

    def withdraw(self, timeout_s: float) -> bool:
        """Take the vote back: True when no step agreed (none will), False when one had agreed (or did in
        the step in flight). Waits up to `timeout_s` for that step's agreement.

        Raises RuntimeError: the step in flight did not resolve within `timeout_s`.
        """
        with self._cond:
            self._withdrawn = True
            if not self._cond.wait_for(lambda: not self._in_flight, timeout_s):
                raise RuntimeError(f"the step agreement did not end within {timeout_s:g} s")
            return not self.agreed
