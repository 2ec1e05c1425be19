"""A topology problem: an `Issue` at a key path, and a `TopologyIssue` at a file's line."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

KeyPath = tuple[str, ...]  # a key path in the YAML file, e.g. ("decode", "expert_parallel_size")


class Issue(NamedTuple):
    path: KeyPath
    reason: str


class TopologyIssue(NamedTuple):
    file: str
    line: int | None  # 1-based; None when the problem has no line (file unreadable)
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}" if self.line else f"{self.file}: {self.reason}"


def line_of(lines: Mapping[KeyPath, int], path: KeyPath) -> int:
    """The line of `path`'s key in `lines`, else of its nearest written parent, else 1."""
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
