"""A driver thread that runs one round of work every few seconds until stopped (health monitor, autoscale)."""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("pdcluster.driver.cluster")


class PeriodicThread:
    """Calls `run_round()` every `interval_s` seconds on a daemon thread from `start()` until `stop()`; a
    round that raises is logged (quietly ends the thread while stopping)."""

    thread_name = "periodic"

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def _closed(self) -> bool:
        return self._stop.is_set()

    def run_round(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def stop(self, join_timeout_s: float) -> None:
        """Stop after the round in progress; waits for the thread up to `join_timeout_s` seconds."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(join_timeout_s)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.run_round()
            except Exception:  # noqa: BLE001 - a bug, or a cluster going away: never die silently
                if self._closed:
                    return
                logger.exception("%s: a round failed; trying again", self.thread_name)
