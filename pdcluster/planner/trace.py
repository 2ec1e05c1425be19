"""Public request traces as workloads: arrival times and token counts, scaled to a model's context.

Azure LLM inference CSV (`TIMESTAMP`, `ContextTokens`, `GeneratedTokens`) and Mooncake FAST'25 JSONL
(`timestamp` ms, `input_length`, `output_length`, `hash_ids` of 512-token prefix blocks). The traces carry
no text: `build_prompts` cuts held-out source to the scaled lengths, shared hash ids giving shared prefixes.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from pdcluster.models.tokenizer import Tokenizer

MOONCAKE_BLOCK_TOKENS = 512

# Reference contexts: Azure's service ran 8k-context models; Kimi (Mooncake) serves 128k.
REFERENCE_CONTEXT_TOKENS = {"azure": 8192, "mooncake": 131072}
MIN_INPUT_TOKENS = 16


def default_trace_dir() -> Path:
    return Path(__file__).resolve().parents[3] / "shared" / "traces"


@dataclass(frozen=True)
class TraceRequest:
    """One request as recorded: `arrival_s` since the first; `hash_ids` empty for Azure."""

    arrival_s: float
    num_input_tokens: int
    num_output_tokens: int
    hash_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Trace:
    kind: str
    path: Path
    requests: list[TraceRequest]


def _parse_azure_timestamp(text: str) -> tuple[datetime, float]:
    """Whole seconds as a UTC datetime, and the fraction (7 digits, beyond datetime's microseconds)."""
    whole, _, frac = text.strip().partition(".")
    stamp = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)
    return stamp, (int(frac) / 10 ** len(frac)) if frac else 0.0


def load_azure_csv(path: str | Path, num_requests: int | None = None) -> Trace:
    """Load an Azure trace CSV; ValueError naming the file and line of a bad row."""
    path = Path(path)
    requests: list[TraceRequest] = []
    first: tuple[datetime, float] | None = None
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        for line_no, row in enumerate(reader, start=2):
            if num_requests is not None and len(requests) >= num_requests:
                break
            try:
                stamp, frac = _parse_azure_timestamp(row["TIMESTAMP"])
                num_in, num_out = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{line_no}: not an Azure trace row ({exc})") from exc
            if first is None:
                first = (stamp, frac)
            arrival_s = (stamp - first[0]).total_seconds() + (frac - first[1])
            requests.append(TraceRequest(arrival_s, num_in, num_out))
    return Trace("azure", path, requests)


def load_mooncake_jsonl(path: str | Path, num_requests: int | None = None) -> Trace:
    """Load a Mooncake trace JSONL; ValueError naming the file and line of a bad row."""
    path = Path(path)
    requests: list[TraceRequest] = []
    first_ms: float | None = None
    with path.open() as f:
        for line_no, line in enumerate(f, start=1):
            if num_requests is not None and len(requests) >= num_requests:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                timestamp_ms = float(row["timestamp"])
                num_in, num_out = int(row["input_length"]), int(row["output_length"])
                hash_ids = tuple(int(h) for h in row.get("hash_ids", ()))
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{line_no}: not a Mooncake trace row ({exc})") from exc
            if first_ms is None:
                first_ms = timestamp_ms
            requests.append(TraceRequest((timestamp_ms - first_ms) / 1000.0, num_in, num_out, hash_ids))
    return Trace("mooncake", path, requests)


def load_trace(path: str | Path, num_requests: int | None = None) -> Trace:
    """Load a trace by suffix (`.csv`, `.jsonl`), a bare name from `default_trace_dir()`.

    Raises FileNotFoundError / ValueError naming the file.
    """
    path = Path(path)
    if not path.exists() and not path.is_absolute() and (default_trace_dir() / path).exists():
        path = default_trace_dir() / path
    if not path.exists():
        raise FileNotFoundError(f"trace file not found: {path}")
    if path.suffix == ".csv":
        return load_azure_csv(path, num_requests)
    if path.suffix == ".jsonl":
        return load_mooncake_jsonl(path, num_requests)
    raise ValueError(f"{path}: unknown trace format (expected .csv (Azure) or .jsonl (Mooncake))")


@dataclass(frozen=True)
class Workload:
    """A trace fitted to one model; `description` says how it was scaled."""

    requests: list[TraceRequest]
    description: str
    kind: str
    input_scale: float


def scale_trace(
    trace: Trace,
    max_model_len: int,
    max_tokens_cap: int = 128,
    time_scale: float = 1.0,
    reference_context_tokens: int | None = None,
) -> Workload:
    """Fit `trace` to a context of `max_model_len` tokens.

    Inputs scale by `max_model_len / reference_context_tokens`, outputs are capped at `max_tokens_cap`,
    arrivals divide by `time_scale`. Raises ValueError for max_tokens_cap or time_scale out of range.
    """
    if not 1 <= max_tokens_cap < max_model_len - MIN_INPUT_TOKENS + 1:
        raise ValueError(
            f"max_tokens_cap must be in [1, max_model_len - {MIN_INPUT_TOKENS}] = "
            f"[1, {max_model_len - MIN_INPUT_TOKENS}], got {max_tokens_cap}"
        )
    if not time_scale > 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    reference = reference_context_tokens or REFERENCE_CONTEXT_TOKENS[trace.kind]
    scale = max_model_len / reference
    max_input = max_model_len - max_tokens_cap
    scaled = [
        replace(
            r,
            arrival_s=r.arrival_s / time_scale,
            num_input_tokens=min(max_input, max(MIN_INPUT_TOKENS, round(r.num_input_tokens * scale))),
            num_output_tokens=min(max_tokens_cap, max(1, r.num_output_tokens)),
        )
        for r in trace.requests
    ]
    description = (
        f"{trace.kind} trace {trace.path.name}, {len(scaled)} requests: input lengths scaled by "
        f"{max_model_len}/{reference} and clamped to [{MIN_INPUT_TOKENS}, {max_input}] "
        f"(max_model_len {max_model_len} - max_tokens_cap {max_tokens_cap}); output lengths unscaled, "
        f"clamped to [1, {max_tokens_cap}]; arrival times / {time_scale:g}"
    )
    if trace.kind == "mooncake":
        description += f"; a {MOONCAKE_BLOCK_TOKENS}-token hash block = {mooncake_block_tokens(scale)} tokens"
    return Workload(scaled, description, trace.kind, scale)


def mooncake_block_tokens(input_scale: float) -> int:
    return max(1, round(MOONCAKE_BLOCK_TOKENS * input_scale))


def build_prompts(workload: Workload, tokenizer: Tokenizer) -> list[list[int]]:
    """Token-id prompts of each request's scaled input length, cut from held-out source."""
    from pdcluster.models.prompts import heldout_token_prompts

    lengths = [r.num_input_tokens for r in workload.requests]
    if workload.kind != "mooncake":
        return heldout_token_prompts(tokenizer, lengths)
    block_tokens = mooncake_block_tokens(workload.input_scale)
    hash_ids = sorted({h for r in workload.requests for h in r.hash_ids})
    chunks = heldout_token_prompts(tokenizer, [block_tokens] * len(hash_ids) + lengths)
    hash_to_chunk = dict(zip(hash_ids, chunks[: len(hash_ids)], strict=True))
    fillers = chunks[len(hash_ids) :]
    prompts = []
    for request, filler in zip(workload.requests, fillers, strict=True):
        ids = [t for h in request.hash_ids for t in hash_to_chunk[h]]
        prompts.append((ids + filler)[: request.num_input_tokens])
    return prompts


def arrival_rate_per_s(requests: Sequence[TraceRequest]) -> float:
    if len(requests) < 2 or requests[-1].arrival_s <= requests[0].arrival_s:
        return 0.0
    return (len(requests) - 1) / (requests[-1].arrival_s - requests[0].arrival_s)
