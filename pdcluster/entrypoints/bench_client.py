"""Replay a scaled trace against an OpenAI-compatible endpoint and report latency, throughput and goodput.

Each request is a streaming `POST /v1/completions` of token ids at its arrival time, `ignore_eos`, greedy.
TTFT: send -> first text chunk; TPOT: (last chunk - first chunk) / (completion tokens - 1), tokens from
`usage`; e2e: send -> `[DONE]`. Goodput counts requests meeting both the TTFT and TPOT SLOs.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from pdcluster.config.slo import (
    DEFAULT_TPOT_SLO_MS,
    DEFAULT_TTFT_SLO_MS,
    meets_slo,
    time_per_output_token_s,
)
from pdcluster.planner.trace import Workload


@dataclass
class RequestResult:
    """One replayed request (seconds; None where not measured)."""

    index: int
    num_input_tokens: int
    num_output_tokens_requested: int
    scheduled_s: float
    ok: bool = False
    error: str | None = None
    num_output_tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    acceptance_rate: float | None = None
    kv_transfer_s: float | None = None
    phases: dict[str, float] = field(default_factory=dict)


async def _one(
    client: httpx.AsyncClient,
    index: int,
    prompt: list[int],
    num_output_tokens: int,
    scheduled_s: float,
    model: str | None,
) -> RequestResult:
    result = RequestResult(index, len(prompt), num_output_tokens, scheduled_s)
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": num_output_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        # vLLM and SGLang send `usage` only when asked, in a last chunk with an empty `choices` list
        "stream_options": {"include_usage": True},
    }
    if model is not None:
        body["model"] = model
    sent_s = time.perf_counter()
    first_s = last_s = None
    finished = False
    usage: dict[str, Any] | None = None
    extension: dict[str, Any] = {}
    num_text_chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("error"):
                    error = event["error"]
                    result.error = error.get("message", str(error)) if isinstance(error, dict) else str(error)
                    return result
                usage = event.get("usage") or usage
                extension = event.get("pdcluster") or extension
                choices = event.get("choices") or []
                if not choices:
                    continue
                now = time.perf_counter()
                choice = choices[0]
                if choice.get("text"):
                    num_text_chunks += 1
                if choice.get("text") or choice.get("finish_reason") is not None:
                    if first_s is None:
                        first_s = now
                    last_s = now
                if choice.get("finish_reason") is not None:
                    finished = True
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    done_s = time.perf_counter()
    if not finished or first_s is None:
        result.error = "the stream ended without a finish_reason"
        return result
    result.ok = True
    # Without `usage` (a server that ignores stream_options), one token per text chunk.
    result.num_output_tokens = int(usage["completion_tokens"]) if usage else num_text_chunks
    result.ttft_s = first_s - sent_s
    result.tpot_s = time_per_output_token_s(first_s, last_s, result.num_output_tokens)
    result.e2e_s = done_s - sent_s
    result.acceptance_rate = extension.get("acceptance_rate")
    result.phases = extension.get("phases") or {}
    result.kv_transfer_s = result.phases.get("kv_transfer_s")
    return result


def _auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def replay(
    endpoint: str,
    workload: Workload,
    prompts: list[list[int]],
    model: str | None = None,
    api_key: str | None = None,
    show_progress: bool = True,
    timeout_s: float = 600.0,
) -> tuple[list[RequestResult], float]:
    """Send every request at its arrival time; the results in trace order and the duration in seconds."""
    from tqdm import tqdm

    headers = _auth_headers(api_key)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    progress = tqdm(total=len(prompts), desc="requests", unit="req", disable=not show_progress)
    async with httpx.AsyncClient(
        base_url=endpoint.rstrip("/"), headers=headers, timeout=timeout_s, limits=limits
    ) as client:
        start_s = time.perf_counter()

        async def scheduled(index: int) -> RequestResult:
            request = workload.requests[index]
            delay_s = start_s + request.arrival_s - time.perf_counter()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            result = await _one(
                client, index, prompts[index], request.num_output_tokens, request.arrival_s, model
            )
            progress.update(1)
            return result

        results = await asyncio.gather(*(scheduled(i) for i in range(len(prompts))))
        duration_s = time.perf_counter() - start_s
    progress.close()
    return list(results), duration_s


async def send_in_turn(
    endpoint: str, workload: Workload, prompts: list[list[int]], model: str | None = None,
    timeout_s: float = 600.0,
) -> AsyncIterator[RequestResult]:  # fmt: skip
    """Send the requests one at a time, each when the previous has ended, over one client as `replay`'s;
    yields each result as it ends."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=endpoint.rstrip("/"), timeout=timeout_s, limits=limits) as client:
        for index, request in enumerate(workload.requests):
            yield await _one(client, index, prompts[index], request.num_output_tokens, 0.0, model)


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def pct(q: float) -> float:
        pos = q * (len(ordered) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return {"mean": statistics.fmean(ordered), "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99)}


def summarize(
    results: list[RequestResult], duration_s: float, ttft_slo_ms: float, tpot_slo_ms: float
) -> dict[str, Any]:
    """Aggregate figures, times in ms (named `_ms`)."""
    ok = [r for r in results if r.ok]
    meets = [r for r in ok if meets_slo(r.ttft_s, r.tpot_s, ttft_slo_ms, tpot_slo_ms)]
    num_output = sum(r.num_output_tokens for r in ok)
    acceptance = [r.acceptance_rate for r in ok if r.acceptance_rate is not None]
    kv_transfer = [r.kv_transfer_s for r in ok if r.kv_transfer_s is not None]

    def ms(values: list[float]) -> dict[str, float | None]:
        return {k: None if v is None else v * 1000 for k, v in _percentiles(values).items()}

    return {
        "num_requests": len(results),
        "num_ok": len(ok),
        "num_failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration_s,
        "ttft_ms": ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "e2e_ms": ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        "num_input_tokens": sum(r.num_input_tokens for r in ok),
        "num_output_tokens": num_output,
        "output_tokens_per_s": num_output / duration_s if duration_s > 0 else 0.0,
        "requests_per_s": len(ok) / duration_s if duration_s > 0 else 0.0,
        "slo": {"ttft_ms": ttft_slo_ms, "tpot_ms": tpot_slo_ms},
        "goodput_fraction": len(meets) / len(results) if results else 0.0,
        "goodput_requests_per_s": len(meets) / duration_s if duration_s > 0 else 0.0,
        "mean_acceptance_rate": statistics.fmean(acceptance) if acceptance else None,
        "mean_kv_transfer_ms": statistics.fmean(kv_transfer) * 1000 if kv_transfer else None,
        "phases_p50_ms": _phase_medians_ms(ok),
    }


def _phase_medians_ms(results: list[RequestResult]) -> dict[str, float]:
    """Median in ms of each phase the server reported (`pdcluster.phases`), in the server's order."""
    names = dict.fromkeys(name for r in results for name in r.phases if name.endswith("_s"))
    medians: dict[str, float] = {}
    for name in names:
        values = [r.phases[name] for r in results if isinstance(r.phases.get(name), int | float)]
        if values:
            medians[name.removesuffix("_s") + "_ms"] = statistics.median(values) * 1000
    return medians


def format_table(summary: dict[str, Any], description: str = "", *, simulated: bool = False) -> str:
    """A human-readable report of `summarize`'s output."""

    def f(value: float | None, digits: int = 1) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    lines = []
    if description:
        lines += [description, ""]
    lines.append(
        f"requests: {summary['num_ok']} ok / {summary['num_requests']} "
        f"({summary['num_failed']} failed) in {summary['duration_s']:.2f} s"
        + (" of simulated time" if simulated else "")
    )
    for error in summary["errors"]:
        lines.append(f"  error: {error}")
    lines.append(f"{'':<10}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for key, label in (("ttft_ms", "TTFT ms"), ("tpot_ms", "TPOT ms"), ("e2e_ms", "e2e ms")):
        row = summary[key]
        lines.append(f"{label:<10}" + "".join(f"{f(row[k]):>10}" for k in ("mean", "p50", "p90", "p99")))
    slo = summary["slo"]
    lines += [
        f"throughput: {summary['output_tokens_per_s']:.1f} output tokens/s, "
        f"{summary['requests_per_s']:.2f} requests/s "
        f"({summary['num_input_tokens']} input, {summary['num_output_tokens']} output tokens)",
        f"goodput (TTFT <= {slo['ttft_ms']:g} ms and TPOT <= {slo['tpot_ms']:g} ms): "
        f"{summary['goodput_fraction'] * 100:.1f}% of requests, "
        f"{summary['goodput_requests_per_s']:.2f} req/s",
        f"mean acceptance rate: {f(summary['mean_acceptance_rate'], 3)}; "
        f"mean KV transfer: {f(summary['mean_kv_transfer_ms'], 2)} ms",
    ]
    phases = summary.get("phases_p50_ms") or {}
    if phases:
        lines.append(
            "server phases, p50 ms: "
            + ", ".join(f"{k.removesuffix('_ms')} {v:.1f}" for k, v in phases.items())
        )
    return "\n".join(lines)


def results_as_dicts(results: list[RequestResult]) -> list[dict[str, Any]]:
    return [asdict(r) for r in results]


@dataclass
class BenchReport:
    description: str
    prompt_note: str
    summary: dict[str, Any]
    results: list[RequestResult]

    def as_json(self) -> dict[str, Any]:
        return {"workload": self.description, "prompts": self.prompt_note, **self.summary}

    def as_table(self) -> str:
        return format_table(self.summary, f"{self.description}\n{self.prompt_note}")


def served_model(endpoint: str, api_key: str | None = None) -> tuple[str, int]:
    """(model id, max_model_len) from `GET /v1/models`; httpx.HTTPError or ValueError."""
    headers = _auth_headers(api_key)
    response = httpx.get(endpoint.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    model = response.json()["data"][0]
    if "max_model_len" not in model:
        raise ValueError(f"{endpoint}/v1/models does not say max_model_len")
    return model["id"], int(model["max_model_len"])


def run_bench(
    endpoint: str,
    trace_path: str,
    tokenizer_dir: str,
    num_requests: int | None = None,
    time_scale: float = 1.0,
    max_tokens_cap: int = 128,
    ttft_slo_ms: float = DEFAULT_TTFT_SLO_MS,
    tpot_slo_ms: float = DEFAULT_TPOT_SLO_MS,
    api_key: str | None = None,
    show_progress: bool = True,
) -> BenchReport:
    """Load, scale and replay a trace against `endpoint`.

    Raises FileNotFoundError or ValueError (trace, options), httpx.HTTPError (endpoint unreachable).
    """
    from pdcluster.models.tokenizer import Tokenizer
    from pdcluster.planner.trace import build_prompts, load_trace, scale_trace

    trace = load_trace(trace_path, num_requests)
    model, max_model_len = served_model(endpoint, api_key)
    workload = scale_trace(trace, max_model_len, max_tokens_cap=max_tokens_cap, time_scale=time_scale)
    prompts = build_prompts(workload, Tokenizer.from_dir(tokenizer_dir))
    note = (
        f"prompts: held-out Python source (pdcluster.models.prompts.heldout_token_prompts), sent as token "
        f"ids (prompt: [ids]) of exactly the scaled lengths; ignore_eos, greedy; model {model!r} at "
        f"{endpoint}"
    )
    results, duration_s = asyncio.run(
        replay(endpoint, workload, prompts, model=model, api_key=api_key, show_progress=show_progress)
    )
    summary = summarize(results, duration_s, ttft_slo_ms, tpot_slo_ms)
    return BenchReport(workload.description, note, summary, results)
