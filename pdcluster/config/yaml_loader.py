"""Reading a topology file: YAML nodes into the schema's dataclasses, every problem at its line."""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pdcluster.config.fields import TYPE_NAMES, unwrap_optional, value_problem
from pdcluster.config.issues import Issue, KeyPath, TopologyError, TopologyIssue, line_of
from pdcluster.config.rules import cross_section_issues, read_model_architecture
from pdcluster.config.schema import TLS_FILE_KEYS, ModelConfig, Topology
from pdcluster.config.yaml_file import compose_topology_file
from pdcluster.models.config import DeepseekV3Config


class _Reader:
    def __init__(self, loader: yaml.SafeLoader, base_dir: Path) -> None:
        self.loader = loader
        self.base_dir = base_dir
        self.lines: dict[KeyPath, int] = {}
        self.problems: list[tuple[int, str]] = []
        self.broken: set[KeyPath] = set()

    def error(self, node: yaml.Node, reason: str) -> None:
        self.problems.append((node.start_mark.line + 1, reason))

    def line_of(self, path: KeyPath) -> int:
        return line_of(self.lines, path)

    def keys(
        self, node: yaml.MappingNode, fields: dict[str, dataclasses.Field], path: KeyPath
    ) -> Iterator[tuple[str, yaml.Node]]:
        """(key, value node) for each known key of `node`; reports unknown and duplicate keys."""
        where = ".".join(path) or "top level"
        self.loader.flatten_mapping(node)  # YAML merge keys (`<<: *anchor`)
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if not isinstance(key, str) or key_node.tag != "tag:yaml.org,2002:str":
                self.error(key_node, f"{where}: keys must be plain names, got {_describe(key_node)}")
                self.broken.add(path)
                continue
            if key in seen:
                self.error(key_node, f"{'.'.join((*path, key))}: duplicate key")
                self.broken.add(path)
                continue
            seen.add(key)
            if key not in fields:
                close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
                hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(fields)}"
                self.error(key_node, f"{where}: unknown key {key!r} ({hint})")
                self.broken.add(path)
                continue
            self.lines[(*path, key)] = key_node.start_mark.line + 1
            yield key, value_node
        for f in fields.values():
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if required and f.name not in seen:
                self.error(node, f"{where}: missing required key {f.name!r}")
                self.broken.add(path)

    def section(self, cls: type, node: yaml.Node, path: KeyPath) -> Any | None:
        """Build dataclass `cls` from mapping `node`; None if any of its keys has a problem."""
        where = ".".join(path) or "top level"
        if not isinstance(node, yaml.MappingNode):
            self.error(node, f"{where}: expected a mapping of keys, got {_describe(node)}")
            return None
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        ok = True
        for key, value_node in self.keys(node, fields, path):
            good, value = self.value(fields[key], hints[key], value_node, (*path, key))
            if good:
                kwargs[key] = value
            else:
                ok = False
        if not ok or path in self.broken:
            return None
        try:
            return cls(**kwargs)
        except ValueError as exc:
            self.error(node, f"{where}: {exc}")
            return None

    def value(self, f: dataclasses.Field, hint: Any, node: yaml.Node, path: KeyPath) -> tuple[bool, Any]:
        name = ".".join(path)
        base, optional = unwrap_optional(hint)
        if isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:null":
            if optional:
                return True, None
            if dataclasses.is_dataclass(base):
                self.error(node, f"{name}: expected a mapping of keys, got null (omit the key for defaults)")
            else:
                self.error(node, f"{name}: must not be null")
            return False, None
        if dataclasses.is_dataclass(base):
            result = self.section(base, node, path)
            return result is not None, result
        if not isinstance(node, yaml.ScalarNode):
            expected = TYPE_NAMES.get(base, base.__name__)
            self.error(node, f"{name}: expected {expected}, got {_describe(node)}")
            return False, None
        try:
            raw = self.loader.construct_object(node, deep=True)
        except (yaml.YAMLError, ValueError, KeyError, TypeError) as exc:
            problem = exc.problem if isinstance(exc, yaml.MarkedYAMLError) else str(exc)
            self.error(node, f"{name}: {node.value!r} cannot be read as {node.tag}: {problem}")
            return False, None
        value = _coerce(base, raw, plain=node.style is None)
        problem = value_problem(f, hint, value)
        if problem is not None:
            self.error(node, f"{name}: {problem}")
            return False, None
        relative_to_file = [("model", "path"), ("model", "config_path"), ("autoscale", "calibration")]
        relative_to_file += [("kv_transfer", "tls", key) for key in TLS_FILE_KEYS]
        if path in relative_to_file and not Path(value).is_absolute():
            value = str((self.base_dir / value).resolve())
        return True, value


def _coerce(base: Any, raw: Any, plain: bool) -> Any:
    """Take plain numeric strings PyYAML 1.1 leaves as text (`196e9`) as numbers, integral floats as ints."""
    if base in (int, float) and isinstance(raw, str) and plain:
        try:
            raw = float(raw.replace("_", ""))
        except ValueError:
            return raw
    if base is int and isinstance(raw, float) and math.isfinite(raw) and raw.is_integer():
        return int(raw)
    if base is float and isinstance(raw, int) and not isinstance(raw, bool):
        return float(raw)
    return raw


def _describe(node: yaml.Node) -> str:
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    return repr(node.value)


@dataclass(frozen=True)
class LoadedTopology:
    """A valid topology and the 1-based line of every key written in its file."""

    file: str
    topology: Topology
    key_lines: Mapping[KeyPath, int]

    def line_of(self, path: KeyPath) -> int | None:
        """The line of `path`'s key or its nearest written parent; None for `()` (a command-line override)."""
        return line_of(self.key_lines, path) if path else None

    def locate(self, issues: Iterable[Issue]) -> list[TopologyIssue]:
        located = [TopologyIssue(self.file, self.line_of(i.path), i.reason) for i in issues]
        return sorted(located, key=lambda i: i.line or 0)


def load_topology(path: str | Path) -> Topology:
    """`read_topology(path).topology`."""
    return read_topology(path).topology


def read_topology(path: str | Path) -> LoadedTopology:
    """Read and validate a topology YAML file, keeping the line of each key.

    Raises TopologyError with every problem, one `FILE:LINE: reason` per line.
    """
    path = Path(path)
    file = str(path)
    loader, root = compose_topology_file(path)
    reader = _Reader(loader, path.resolve().parent)
    # Each section is read on its own, so one broken section does not hide another's problems.
    sections: dict[str, Any] = {}
    topology: Topology | None = None
    if isinstance(root, yaml.MappingNode):
        hints = typing.get_type_hints(Topology)
        fields = {f.name: f for f in dataclasses.fields(Topology)}
        for key, value_node in reader.keys(root, fields, ()):
            good, value = reader.value(fields[key], hints[key], value_node, (key,))
            sections[key] = value if good else None
        for name, f in fields.items():
            if name not in sections and f.default_factory is not dataclasses.MISSING:
                sections[name] = f.default_factory()
        if all(v is not None for v in sections.values()) and "name" in sections:
            try:
                topology = Topology(**sections)
            except ValueError as exc:
                reader.problems.append((reader.line_of(("name",)), str(exc)))
    else:
        reader.error(root, f"top level: expected a mapping of keys, got {_describe(root)}")

    model: ModelConfig | None = sections.get("model")
    arch: DeepseekV3Config | None = None
    arch_src = ""
    if model is not None:
        try:
            arch = read_model_architecture(model)
            arch_src = str(model.config_json)
        except ValueError as exc:
            key = "config_path" if model.config_path is not None else "path"
            reader.problems.append((reader.line_of(("model", key)), f"model.{key}: {exc}"))
    if isinstance(root, yaml.MappingNode):
        for issue in cross_section_issues(sections, arch, arch_src):
            reader.problems.append((reader.line_of(issue.path), issue.reason))

    if reader.problems or topology is None:
        raise TopologyError([TopologyIssue(file, line, reason) for line, reason in reader.problems])
    return LoadedTopology(file, topology, types.MappingProxyType(dict(reader.lines)))
