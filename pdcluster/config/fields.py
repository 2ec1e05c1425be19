"""Field metadata (`choices`, `min`/`gt`/`max`, `check`) and the checks of one field's value."""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import re
import types
import typing
from typing import Any

MIB = 1024**2


def choices(*values: str) -> dict[str, Any]:
    return {"choices": values}


def at_least(bound: float) -> dict[str, Any]:
    return {"min": bound}


def above(bound: float) -> dict[str, Any]:
    return {"gt": bound}


def between(low: float, high: float) -> dict[str, Any]:
    return {"min": low, "max": high}


def above_at_most(low: float, high: float) -> dict[str, Any]:
    return {"gt": low, "max": high}


# Upper bounds of the integer fields, so a typo (`1e29`) is an error at its line.
MAX_NODES = 65_536
MAX_DEVICES_PER_NODE = 1_024
MAX_DEVICES = MAX_NODES * MAX_DEVICES_PER_NODE
MAX_INSTANCES = 65_536
MAX_TOKENS = 2**26
MAX_SEQS = 2**20
MAX_BLOCK_SIZE = 65_536
MAX_KV_CACHE_BYTES = 2**50  # 1 PiB per device; the rule against the device's memory is tighter
MAX_SPECULATIVE_TOKENS = 64
MAX_CPUS_PER_DEVICE = 1_024
MAX_TIMEOUT_S = 86_400.0


def _shown(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**15:
        return f"{value:.3g}"
    return repr(value)


def unwrap_optional(hint: Any) -> tuple[Any, bool]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(hint)) == 2:
            return args[0], True
    return hint, False


TYPE_NAMES = {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string"}


def value_problem(f: dataclasses.Field, hint: Any, value: Any) -> str | None:
    """Why `value` is not acceptable for field `f` (type, choices, bounds), or None."""
    base, optional = unwrap_optional(hint)
    if value is None:
        return None if optional else "must not be null"
    if dataclasses.is_dataclass(base):
        return None if isinstance(value, base) else f"expected a {base.__name__}"
    if base is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    elif base is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, base)
    if not ok:
        return f"expected {TYPE_NAMES.get(base, base.__name__)}, got {value!r}"
    meta = f.metadata
    if "choices" in meta and value not in meta["choices"]:
        return f"{value!r} is not one of: {', '.join(meta['choices'])}"
    if "min" in meta and value < meta["min"]:
        return f"must be >= {meta['min']}, got {_shown(value)}"
    if "gt" in meta and not value > meta["gt"]:
        return f"must be > {meta['gt']}, got {_shown(value)}"
    if "max" in meta and value > meta["max"]:
        return f"must be <= {meta['max']}, got {_shown(value)}"
    if "check" in meta:
        return meta["check"](value)
    return None


def check_fields(obj: Any) -> None:
    """Raise ValueError naming the first field of dataclass `obj` with an unacceptable value."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        problem = value_problem(f, hints[f.name], getattr(obj, f.name))
        if problem is not None:
            raise ValueError(f"{type(obj).__name__} field {f.name!r}: {problem}")


_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def host_problem(host: str) -> str | None:
    """Why `host` cannot be bound by the HTTP server (syntax only), or None; IPv6 is refused."""
    if not host:
        return "must not be empty (127.0.0.1: this machine only; 0.0.0.0: every interface)"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        if address.version == 6:
            return f"{host!r}: IPv6 addresses are not supported (the HTTP server binds an IPv4 socket)"
        return None
    labels = host.removesuffix(".").split(".")
    if len(host) > 253 or not all(_DNS_LABEL.fullmatch(label) for label in labels):
        return (
            f"{host!r} is neither an IPv4 address nor a host name (dot-separated labels of letters, digits "
            "and inner hyphens, 1-63 characters each)"
        )
    if labels[-1].isdigit():
        return f"{host!r} is not a valid IPv4 address (each of its 4 numbers is 0-255)"
    return None


def api_key_problem(key: str) -> str | None:
    """Why `key` cannot be sent as `Authorization: Bearer KEY`, or None."""
    if not key:
        return "must not be empty (null: no authentication)"
    if not all("!" <= c <= "~" for c in key):
        return "must be printable ASCII without spaces (it is sent as `Authorization: Bearer KEY`)"
    return None
