"""`CallTimer`: wall-clock time spent inside wrapped methods, per label, across threads (benchmarks that
split a step's time between the model and the host).
"""

from __future__ import annotations

import functools
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any


class CallTimer:
    """Accumulates `time.perf_counter` seconds spent inside wrapped methods, per label.

    Only the outermost wrapped call on a thread counts, so nested wrapped calls are not counted twice.
    Safe to use from several threads (an async engine loop). With `record_intervals`, it also keeps each
    call's `(start_s, end_s)` so that `busy_s` can say how much of a time window some call was running,
    even for a call that started in an earlier window or is still running on another thread.
    """

    def __init__(self, record_intervals: bool = False) -> None:
        self.total_s: dict[str, float] = defaultdict(float)
        self.num_calls: dict[str, int] = defaultdict(int)
        self.record_intervals = record_intervals
        self._intervals: dict[str, list[tuple[float, float]]] = defaultdict(list)
        self._running: dict[tuple[str, int], float] = {}  # (label, thread id) -> start_s
        self._lock = threading.Lock()
        self._local = threading.local()

    def busy_s(self, label: str, start_s: float, end_s: float) -> float:
        """Seconds of `[start_s, end_s]` during which at least one `label` call was running."""
        with self._lock:
            spans = [(s, e) for s, e in self._intervals[label] if e > start_s and s < end_s]
            spans += [(s, end_s) for (lbl, _), s in self._running.items() if lbl == label and s < end_s]
            self._intervals[label] = [(s, e) for s, e in self._intervals[label] if e > start_s]
        busy_s, covered_to = 0.0, start_s
        for s, e in sorted(spans):  # union of the clipped spans
            s, e = max(s, covered_to), min(e, end_s)
            if e > s:
                busy_s += e - s
                covered_to = e
        return busy_s

    def wrap(self, owner: object, name: str, label: str) -> bool:
        """Replace `owner.name` by a timed wrapper (an instance attribute); False if there is none."""
        fn = getattr(owner, name, None)
        if not callable(fn):
            return False
        setattr(owner, name, self._timed(fn, label))
        return True

    def _timed(self, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._local, "depth", 0)
            self._local.depth = depth + 1
            key = (label, threading.get_ident())
            start_s = time.perf_counter()
            if depth == 0 and self.record_intervals:
                with self._lock:
                    self._running[key] = start_s
            try:
                return fn(*args, **kwargs)
            finally:
                end_s = time.perf_counter()
                self._local.depth = depth
                if depth == 0:
                    with self._lock:
                        self.total_s[label] += end_s - start_s
                        self.num_calls[label] += 1
                        if self.record_intervals:
                            self._running.pop(key, None)
                            self._intervals[label].append((start_s, end_s))

        return timed

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self.total_s)
