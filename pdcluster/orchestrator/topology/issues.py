"""What a topology problem is: an `Issue` at a key path, and a `TopologyIssue` at a file's line.

Rules (`orchestrator.topology.rules`, `orchestrator.preflight`) report `Issue`s at key paths; the YAML
loader turns each path into the line of its key and raises every problem of a file at once, in file order,
as one `TopologyError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

KeyPath = tuple[str, ...]  # a key path in the YAML file, e.g. ("decode", "expert_parallel_size")


class Issue(NamedTuple):
    """One problem: where (a YAML key path; the loader turns it into a line) and why."""

    path: KeyPath
    reason: str


class TopologyIssue(NamedTuple):
    """One problem of a topology file: `FILE:LINE: reason`, or `FILE: reason` without a line."""

    file: str
    line: int | None  # 1-based; None when the problem has no line (file unreadable)
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}" if self.line else f"{self.file}: {self.reason}"


def line_of(lines: Mapping[KeyPath, int], path: KeyPath) -> int:
    """The line of `path`'s key in `lines`, else of its nearest enclosing key that is written, else 1."""
    while path:
        if path in lines:
            return lines[path]
        path = path[:-1]
    return 1


class TopologyError(ValueError):
    """A topology file with problems; the message has one `FILE:LINE: reason` per line, in file order."""

    def __init__(self, issues: list[TopologyIssue]) -> None:
        self.issues = sorted(issues, key=lambda i: i.line or 0)
        super().__init__("\n".join(str(i) for i in self.issues))
