"""Calibration files: efficiency factors fitted by `pdcluster profile`, read back by the planner.

A JSON object `{"format", "accelerator", "factors": {Efficiency field: number}, "kv_transfer":
{"transport"}, ...}`; only `factors` and the KV transport are read here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any

from pdcluster.planner.efficiency import Efficiency

logger = logging.getLogger(__name__)

# fitted from KV handoffs over one transport
KV_LINK_FACTORS = ("kv_link", "handoff_overhead_s")


def measured_kv_transport(transport: str) -> str:
    """The transport `pdcluster profile` measures for handoffs over `transport`: shm, else grpc."""
    return "shm" if transport == "shm" else "grpc"


FORMAT = "pdcluster-calibration/2"
# /1 priced the KV handoff inside first_token_extra_s
OLD_FORMATS = ("pdcluster-calibration/1",)


def factor_names() -> tuple[str, ...]:
    """The `Efficiency` fields a calibration may set."""
    return tuple(f.name for f in dataclasses.fields(Efficiency))


def read_calibration(path: str | Path) -> dict[str, Any]:
    """The calibration JSON object at `path`. Raises ValueError naming the file and key: missing, not JSON,
    wrong `format`, or a factor unknown or not a finite number >= 0."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: no such calibration file (write one with `pdcluster profile`)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable JSON calibration ({exc})") from None
    if isinstance(raw, dict) and raw.get("format") in OLD_FORMATS:
        raise ValueError(
            f'{path}: "format": "{raw["format"]}" was written by an earlier pdcluster, whose control plane '
            f"priced the first token after the KV handoff; run `pdcluster profile` again"
        )
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ValueError(f'{path}: not a calibration file (expected "format": "{FORMAT}")')
    factors = raw.get("factors")
    if not isinstance(factors, dict):
        raise ValueError(f'{path}: "factors" must be an object')
    known = factor_names()
    for key, value in factors.items():
        if key not in known:
            raise ValueError(f"{path}: unknown factor {key!r}; known: {', '.join(known)}")
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value < 0
        ):
            raise ValueError(f"{path}: factor {key!r} must be a finite number >= 0, got {value!r}")
    return raw


def load_calibration(
    path: str | Path, base: Efficiency, *, accelerator: str | None = None, kv_transport: str | None = None
) -> Efficiency:
    """`base` with the calibration's factors (KV link ones only if measured over `kv_transport`'s transport).
    Raises ValueError as `read_calibration`, or for a calibration of another accelerator kind."""
    raw = read_calibration(path)
    if accelerator is not None and raw.get("accelerator") != accelerator:
        raise ValueError(
            f"{path}: calibration of accelerator {raw.get('accelerator')!r}, not {accelerator!r}"
        )
    factors = dict(raw["factors"])
    kv = raw.get("kv_transfer")
    measured = kv.get("transport") if isinstance(kv, dict) else None
    if kv_transport is not None and measured is not None:
        wanted = measured_kv_transport(kv_transport)
        dropped = [name for name in KV_LINK_FACTORS if name in factors]
        if measured != wanted and dropped:
            for name in dropped:
                del factors[name]
            logger.warning(
                "%s: its KV link factors (%s) were measured over %s, this topology's handoffs go over %s "
                "(%s): the catalog's are used instead",
                path,
                ", ".join(dropped),
                measured,
                kv_transport,
                wanted,
            )
    return base.replace(**factors)
