"""Several choices for one request (`n`, completions' `best_of`): the edge fans out one backend request per
choice, sharing the prompt's KV through the prefix cache.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pdcluster.engine.sampling_params import MAX_SEED
from pdcluster.entrypoints.openai.generation import Generation, PreparedRequest
from pdcluster.entrypoints.openai.logprobs import cumulative_logprob
from pdcluster.entrypoints.openai.protocol import ApiError, Endpoint, response_body
from pdcluster.entrypoints.openai.sse import DISCONNECTED, SSEResponse, sse_event, until_disconnect
from pdcluster.entrypoints.openai.tool_calls import ToolCallMarkers, ToolCallStream, parse_tool_calls

StartGeneration = Callable[[PreparedRequest], Generation]


def choice_request(prepared: PreparedRequest, index: int, rank_by_logprob: bool) -> PreparedRequest:
    """The backend request of choice `index` (0: `prepared` itself, its id and seed; the others derive
    theirs); `rank_by_logprob`: the engine computes the sampled tokens' logprobs (best_of)."""
    params = prepared.params
    if index and params.seed is not None:
        params = dataclasses.replace(params, seed=(params.seed + index) % (MAX_SEED + 1))
    if rank_by_logprob and params.logprobs is None:
        params = dataclasses.replace(params, logprobs=0)
    if index and params.prompt_logprobs is not None:  # choice 0 scores the prompt (`share_prompt_logprobs`)
        params = dataclasses.replace(params, prompt_logprobs=None)
    request_id = f"{prepared.request_id}-{index}" if index else prepared.request_id
    return dataclasses.replace(prepared, request_id=request_id, params=params)


async def serve_choices(
    request: Request,
    prepared: PreparedRequest,
    start: StartGeneration,
    endpoint: Endpoint,
    num_choices: int,
    best_of: int,
    stream: bool,
    include_usage: bool,
    tool_markers: ToolCallMarkers | None = None,
) -> Response:
    """Answer with `num_choices` choices out of `best_of` generated ones, streamed (interleaved by `index`)
    or whole; `tool_markers`: each choice's tool calls parsed (chat with tools)."""
    rank = best_of > num_choices
    gens = [start(choice_request(prepared, 0, rank))]
    try:
        first = await until_disconnect(request, gens[0].next())
        if first is not DISCONNECTED:
            gens += [start(choice_request(prepared, i, rank)) for i in range(1, best_of)]
            first = await until_disconnect(request, asyncio.gather(*(g.next() for g in gens[1:])))
    except BaseException:
        await _close(gens)
        raise
    if first is DISCONNECTED:
        await _close(gens)
        return Response(status_code=499)
    share_prompt_logprobs(gens)
    if stream:
        events = _events(gens, prepared, endpoint, include_usage, tool_markers)
        return SSEResponse(events, on_close=lambda: _close(gens))
    if not await _drain_all(request, gens):
        return Response(status_code=499)
    order = list(range(len(gens)))
    if rank:
        order.sort(key=lambda i: cumulative_logprob(gens[i].progress.logprobs), reverse=True)
    body = response_body(
        gens[0], endpoint, gens[0].progress.text, gens[0].progress.finish_reason, chunk=False
    )
    body["choices"] = []
    for index, i in enumerate(order[:num_choices]):
        p = gens[i].progress
        content, finish, calls = p.text, p.finish_reason, None
        if tool_markers is not None:
            content, parsed = parse_tool_calls(p.text, tool_markers)
            finish = "tool_calls" if parsed and finish == "stop" else finish
            calls = [c.to_openai() for c in parsed]
        body["choices"] += response_body(
            gens[i], endpoint, content, finish, chunk=False, index=index, tool_calls=calls
        )["choices"]
    body["usage"] = usage(gens)
    return JSONResponse(body)


def share_prompt_logprobs(gens: list[Generation]) -> None:
    """Give the choices of one prompt the prompt logprobs its first choice's backend request computed
    (`choice_request` asks only that one); each first delta was folded already."""
    params = gens[0].prepared.params
    for gen in gens[1:]:
        gen.prepared = dataclasses.replace(
            gen.prepared,
            params=dataclasses.replace(gen.prepared.params, prompt_logprobs=params.prompt_logprobs),
        )
        gen.progress.prompt_logprobs = gens[0].progress.prompt_logprobs


async def _drain_all(request: Request, gens: list) -> bool:
    """Run every generation to its end (then close them); False when the client went away first."""
    try:
        result = await until_disconnect(request, asyncio.gather(*(g.drain() for g in gens)))
    finally:
        await _close(gens)
    return result is not DISCONNECTED


async def serve_prompts(
    request: Request, prepared: list[PreparedRequest], start: StartGeneration, num_choices: int
) -> Response:
    """Answer a completions request with several prompts, whole: `num_choices` choices per prompt, choice
    `index` = prompt index * num_choices + choice, `usage` summed over the prompts."""
    gens = [start(choice_request(p, i, False)) for p in prepared for i in range(num_choices)]
    if not await _drain_all(request, gens):
        return Response(status_code=499)
    for k in range(0, len(gens), num_choices):
        share_prompt_logprobs(gens[k : k + num_choices])
    body = response_body(
        gens[0], "completion", gens[0].progress.text, gens[0].progress.finish_reason, chunk=False
    )
    body["choices"] = []
    for index, gen in enumerate(gens):
        p = gen.progress
        body["choices"] += response_body(
            gen, "completion", p.text, p.finish_reason, chunk=False, index=index
        )["choices"]
    num_prompt = sum(len(p.prompt_token_ids) for p in prepared)  # once per prompt, not per choice
    num_completion = sum(len(g.progress.token_ids) for g in gens)
    body["usage"] = {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
    }
    return JSONResponse(body)


def usage(gens: list[Generation]) -> dict[str, int]:
    """OpenAI `usage` of a request with several choices: the prompt once, the choices' tokens summed."""
    num_prompt = len(gens[0].prepared.prompt_token_ids)
    num_completion = sum(len(g.progress.token_ids) for g in gens)
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
    }


async def _close(gens: list[Generation]) -> None:
    await asyncio.gather(*(g.close() for g in gens), return_exceptions=True)


async def _events(
    gens: list[Generation],
    prepared: PreparedRequest,
    endpoint: Endpoint,
    include_usage: bool,
    tool_markers: ToolCallMarkers | None,
) -> AsyncIterator[bytes]:
    num_sent_chars = [0] * len(gens)
    first = [True] * len(gens)
    parsers = None if tool_markers is None else [ToolCallStream(tool_markers) for _ in gens]

    def chunk(i: int) -> dict[str, Any] | None:
        gen = gens[i]
        text = gen.stream_text(num_sent_chars[i])
        num_sent_chars[i] += len(text)
        finish = gen.progress.finish_reason
        calls = None
        if parsers is not None:
            text, calls = parsers[i].feed(text, final=finish is not None)
            finish = "tool_calls" if finish == "stop" and parsers[i].num_calls else finish
        if not (text or calls or first[i] or finish is not None):
            return None
        body = response_body(
            gen, endpoint, text, finish, chunk=True, first=first[i], index=i, tool_calls=calls or None
        )
        body["id"] = prepared.request_id
        first[i] = False
        return body

    pending: dict[asyncio.Future, int] = {}
    try:
        for i, gen in enumerate(gens):
            if (body := chunk(i)) is not None:
                yield sse_event(body)
            if not gen.progress.finished:
                pending[asyncio.ensure_future(gen.next())] = i
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                i = pending.pop(future)
                future.result()  # an ApiError ends the stream with an error event
                if (body := chunk(i)) is not None:
                    yield sse_event(body)
                if not gens[i].progress.finished:
                    pending[asyncio.ensure_future(gens[i].next())] = i
        if include_usage:
            yield sse_event(
                {
                    "id": prepared.request_id,
                    "object": "text_completion" if endpoint == "completion" else "chat.completion.chunk",
                    "created": prepared.created_s,
                    "model": prepared.model,
                    "choices": [],
                    "usage": usage(gens),
                }
            )
    except ApiError as exc:
        gens[0].metrics.errors.labels(str(exc.status_code)).inc()
        yield sse_event(exc.body())
    finally:
        for future in pending:
            future.cancel()
    yield sse_event("[DONE]")
