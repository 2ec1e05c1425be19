"""A topology file as a tree of YAML nodes, read within bounds: `compose_topology_file`.

Bounds (`MAX_YAML_BYTES`, `MAX_YAML_DEPTH`, `MAX_YAML_NODES` with aliases expanded) are far above any real
file and keep a hostile one from exhausting memory or the stack; anything out of bounds is one issue.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import yaml

from pdcluster.config.fields import MIB
from pdcluster.config.issues import TopologyError, TopologyIssue

MAX_YAML_BYTES = 1 * MIB
MAX_YAML_DEPTH = 32  # nesting levels of mappings and lists, aliases and merge keys expanded
MAX_YAML_NODES = 100_000  # YAML nodes with every alias expanded (a "billion laughs" file is refused)


def _read_yaml_text(path: Path) -> str:
    """The text of `path`; TopologyError if missing, not a regular file (never opened), too big, not UTF-8."""
    file = str(path)

    def fail(reason: str, line: int | None = None) -> TopologyError:
        return TopologyError([TopologyIssue(file, line, reason)])

    too_large = f"larger than {MAX_YAML_BYTES // MIB} MiB; a topology file is a few KB"
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise fail("not a regular file")
        # O_NONBLOCK: should the path be replaced by a FIFO after the stat, opening it still returns.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise fail("not a regular file")
            data = f.read(MAX_YAML_BYTES + 1)
    except OSError as exc:
        raise fail(f"cannot read: {exc.strerror or exc}") from None
    if len(data) > MAX_YAML_BYTES:
        raise fail(too_large)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise fail(f"not valid UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start})", line) from None


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, raising `ComposerError` at nodes nested deeper than `MAX_YAML_DEPTH`."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        nested = self.check_event(yaml.MappingStartEvent, yaml.SequenceStartEvent)
        if nested and self._depth >= MAX_YAML_DEPTH:
            raise yaml.composer.ComposerError(
                None, None, f"nested deeper than {MAX_YAML_DEPTH} levels", self.peek_event().start_mark
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _expansion_problem(root: yaml.Node) -> tuple[yaml.Node, str] | None:
    """The first node where `root` with aliases and merge keys expanded breaks the bounds, and why."""
    sizes: dict[int, tuple[int, int]] = {}
    in_progress: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        else:
            children = []
        if not children_done:
            if id(node) in sizes:
                continue
            in_progress.add(id(node))
            stack.append((node, True))
            for child in children:
                if id(child) in in_progress:
                    return child, "an alias refers to a node that contains it (a recursive structure)"
                if id(child) not in sizes:
                    stack.append((child, False))
            continue
        in_progress.discard(id(node))
        size = 1 + sum(sizes[id(c)][0] for c in children)
        depth = 1 + max((sizes[id(c)][1] for c in children), default=0)
        if depth > MAX_YAML_DEPTH:
            return node, f"nested deeper than {MAX_YAML_DEPTH} levels with its aliases expanded"
        if size > MAX_YAML_NODES:
            return node, f"more than {MAX_YAML_NODES:,} YAML nodes with its aliases expanded"
        sizes[id(node)] = (size, depth)
    return None


def compose_topology_file(path: Path) -> tuple[yaml.SafeLoader, yaml.Node]:
    """Read `path` and compose its single YAML document: (the disposed loader, the root node).

    Raises TopologyError with one issue when the file cannot be read as a bounded YAML document.
    """
    file = str(path)
    text = _read_yaml_text(path)
    try:
        loader = _BoundedLoader(text)
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        reason = f"invalid YAML: character #x{exc.character:04x} at offset {exc.position}: {exc.reason}"
        raise TopologyError([TopologyIssue(file, line, reason)]) from None
    try:
        root = loader.get_single_node()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        raise TopologyError([TopologyIssue(file, line, f"invalid YAML: {exc.problem or exc}")]) from None
    except yaml.YAMLError as exc:
        raise TopologyError([TopologyIssue(file, None, f"invalid YAML: {exc}")]) from None
    finally:
        loader.dispose()
    if root is None:
        raise TopologyError([TopologyIssue(file, 1, "empty file; a topology needs at least `name:`")])
    too_big = _expansion_problem(root)
    if too_big is not None:
        node, reason = too_big
        raise TopologyError([TopologyIssue(file, node.start_mark.line + 1, f"invalid YAML: {reason}")])
    return loader, root
