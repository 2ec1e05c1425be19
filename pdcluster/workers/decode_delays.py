"""`DelayPoints`: test-only delays a decode rank injects at named points of a handoff."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

DELAY_POINTS = ("before_reserve", "after_reserve", "before_admit")


class DelayPoints:
    """Armed delays per point; `locked`: the decode rank's engine lock (`DecodeWorker._locked`)."""

    def __init__(self, locked: Callable[[], AbstractContextManager[Any]]) -> None:
        self._locked = locked
        self._delays: dict[str, list[float]] = {}
        self._released = threading.Event()

    def inject(self, where: str, seconds: float, count: int = 1) -> None:
        """The next `count` passes through `where` wait `seconds` (holding no lock), or until `release`:
        "before_reserve" (a reply late because the reservation is: an abort sent meanwhile overtakes it),
        "after_reserve" (reserved, its reply late), "before_admit" (received, admitted late). Raises
        ValueError for another point."""
        if where not in DELAY_POINTS:
            raise ValueError(f"unknown delay point {where!r}")
        with self._locked():
            self._released.clear()
            self._delays.setdefault(where, []).extend([seconds] * count)

    def release(self) -> None:
        """End the injected delays now (those in progress and those armed)."""
        self._released.set()

    def maybe_delay(self, where: str) -> None:
        if not self._delays.get(where):
            return
        with self._locked():
            delays = self._delays.get(where)
            seconds = delays.pop(0) if delays else 0.0
        if seconds and not self._released.is_set():
            self._released.wait(seconds)
