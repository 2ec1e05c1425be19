"""Instances sharing a node's CPU cores slow each other (`cpu`, where a device is a worker slot).

Processor sharing: while busy engines demand more than the node's cores, each runs at `cores / demand` of
full speed, and step ends move whenever the busy set changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class NodeCores:
    """A node's cores (> 0) shared by busy engines (`busy[key] = [work seconds left, demand]`) and a steady
    `background` demand of other processes, in cores."""

    cores: float
    background: float = 0.0
    busy: dict = field(default_factory=dict)
    rate: float = 1.0
    updated_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.cores > 0 or not (self.background >= 0 and math.isfinite(self.background)):
            raise ValueError(f"cores must be > 0 and background >= 0, got {self.cores}, {self.background}")

    def _advance(self, now_s: float) -> None:
        elapsed = (now_s - self.updated_s) * self.rate
        for entry in self.busy.values():
            entry[0] = max(entry[0] - elapsed, 0.0)
        self.updated_s = now_s

    def _ends(self, now_s: float) -> list[tuple[object, float]]:
        demand = sum(d for _, d in self.busy.values())
        self.rate = min(1.0, self.cores / (demand + self.background)) if demand > 0 else 1.0
        return [(key, now_s + left / self.rate) for key, (left, _) in self.busy.items()]

    def start(self, key: object, work_s: float, demand: float, now_s: float) -> list[tuple[object, float]]:
        """`key` starts `work_s` of full-speed work demanding `demand` cores; returns busy ends."""
        if key in self.busy:
            raise ValueError(f"{key!r} is already busy on this node")
        if not (work_s >= 0 and math.isfinite(work_s)) or not demand > 0:
            raise ValueError(f"work_s must be finite and >= 0 and demand > 0, got {work_s}, {demand}")
        self._advance(now_s)
        self.busy[key] = [work_s, demand]
        return self._ends(now_s)

    def finish(self, key: object, now_s: float) -> list[tuple[object, float]]:
        """`key`'s step ended at `now_s`; returns the new `(key, end_s)` of the others still busy."""
        self._advance(now_s)
        del self.busy[key]
        return self._ends(now_s)
