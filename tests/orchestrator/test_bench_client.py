"""`pdcluster bench`'s client against other OpenAI-compatible servers: the chunk shapes vLLM and SGLang
stream (a usage-only last chunk with an empty `choices` list, `usage: null` on the others, extra fields),
served by a real HTTP server (uvicorn) from recorded chunks."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from pdcluster.entrypoints.bench_client import _one
from pdcluster.entrypoints.openai.server import ServerThread


def _chunk(text: str, finish_reason: str | None = None, **extra: Any) -> dict[str, Any]:
    """A /v1/completions stream chunk as vLLM's OpenAI server writes it (0.x, `stream_options` set)."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "tiny", "choices": [choice],
            "usage": None, **extra}  # fmt: skip


VLLM_STREAM = [
    _chunk(" return"),
    _chunk(" a"),
    _chunk(" +"),
    _chunk(" b", finish_reason="length"),
    {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "tiny",
        "choices": [],
        "usage": {"prompt_tokens": 7, "total_tokens": 11, "completion_tokens": 4},
    },  # fmt: skip
]
NO_USAGE_STREAM = [_chunk(" return"), _chunk(""), _chunk(" a"), _chunk("", finish_reason="stop")]
NO_FINISH_STREAM = [_chunk(" return"), _chunk(" a")]


def _serve(chunks: list[dict[str, Any]], bodies: list[dict[str, Any]]) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        bodies.append(await request.json())

        async def lines():
            for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(lines(), media_type="text/event-stream")

    return app


def _replay_one(chunks: list[dict[str, Any]]):
    bodies: list[dict[str, Any]] = []
    with ServerThread(_serve(chunks, bodies)) as server:

        async def run():
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                return await _one(client, 0, [1, 2, 3], 4, 0.0, None)

        return asyncio.run(run()), bodies


def test_vllm_stream_with_a_usage_only_last_chunk() -> None:
    result, bodies = _replay_one(VLLM_STREAM)
    assert result.ok, result.error
    assert result.num_output_tokens == 4  # from the usage-only chunk
    assert result.ttft_s is not None and result.tpot_s is not None and result.e2e_s is not None
    assert result.acceptance_rate is None and result.phases == {}  # no pdcluster extension there
    assert bodies[0]["stream_options"] == {"include_usage": True}
    assert bodies[0]["prompt"] == [1, 2, 3] and bodies[0]["max_tokens"] == 4


def test_a_server_without_usage_counts_one_token_per_text_chunk() -> None:
    result, _ = _replay_one(NO_USAGE_STREAM)
    assert result.ok, result.error
    assert result.num_output_tokens == 2


def test_a_stream_without_a_finish_reason_is_a_failed_request() -> None:
    result, _ = _replay_one(NO_FINISH_STREAM)
    assert not result.ok
    assert result.error == "the stream ended without a finish_reason"


def test_summary_gives_the_median_of_each_reported_phase_in_server_order() -> None:
    """`phases_p50_ms`: per phase, the median over the requests that report it (a failed request and one
    without a phase do not count), in the order the server lists them; none for a server without them."""
    from pdcluster.entrypoints.bench_client import RequestResult, summarize

    def ok(**phases: float) -> RequestResult:
        return RequestResult(0, 8, 4, 0.0, ok=True, ttft_s=0.05, tpot_s=0.01, e2e_s=0.2, num_output_tokens=4,
                             phases=phases)  # fmt: skip

    results = [
        ok(route_s=0.001, prefill_s=0.030, kv_transfer_s=0.040),
        ok(route_s=0.003, prefill_s=0.010, kv_transfer_s=0.020),
        ok(route_s=0.002, prefill_s=0.020),
        RequestResult(3, 8, 4, 0.0, ok=False, error="boom", phases={"route_s": 9.0}),
    ]
    phases = summarize(results, 1.0, 1000.0, 100.0)["phases_p50_ms"]
    assert list(phases) == ["route_ms", "prefill_ms", "kv_transfer_ms"]
    assert phases["route_ms"] == pytest.approx(2.0)
    assert phases["prefill_ms"] == pytest.approx(20.0)
    assert phases["kv_transfer_ms"] == pytest.approx(30.0)  # the two that report it
    assert summarize([ok()], 1.0, 1000.0, 100.0)["phases_p50_ms"] == {}
