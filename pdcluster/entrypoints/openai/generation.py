"""Edge bookkeeping of one request: admission checks (`prepare`), then one generation (`Generation`)."""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pdcluster.config import SLOConfig
from pdcluster.config.slo import time_per_output_token_s
from pdcluster.driver.backend import PHASE_NAMES, BackendUnavailable, ServingBackend, StreamDelta
from pdcluster.engine.outputs import TokenLogprobs
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.entrypoints.openai.logprobs import (
    chat_logprobs,
    completion_logprobs,
    prompt_completion_logprobs,
)
from pdcluster.entrypoints.openai.metrics import ApiMetrics
from pdcluster.entrypoints.openai.protocol import MAX_STOP_STRINGS, ApiError, CommonRequest


@dataclass
class PreparedRequest:
    """A request that passed the edge's checks, ready for `ServingBackend.generate`."""

    request_id: str  # "cmpl-<hex>" or "chatcmpl-<hex>"
    prompt_token_ids: list[int]
    params: SamplingParams
    model: str  # the served model's id
    created_s: int  # Unix time (whole seconds): the responses' `created`
    num_top_logprobs: int | None = None  # alternatives per token in the response; None: no logprobs
    echo_text: str = ""  # completions' `echo`: the prompt's text, sent before the output's
    echo_only: bool = False  # completions' `echo` with max_tokens 0: the prompt only, output dropped


_SAMPLING_FIELDS = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "ignore_eos",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_tokens",
        "logit_bias",
        "stop_token_ids",
    }
)


def prepare(
    backend: ServingBackend,
    body: CommonRequest,
    prompt_ids: list[int],
    max_tokens: int | None,
    default_max_tokens: int | None,
    prefix: str,
    max_tokens_param: str = "max_tokens",
    num_top_logprobs: int | None = None,
    logit_bias: dict[int, float] | None = None,
    echo_text: str = "",
) -> PreparedRequest:
    """Check `body` and its tokenized prompt against the served model; build the sampling params.

    Raises ApiError: 404 for an unknown model; 400 naming the field for an invalid or over-long request.
    """
    if body.model is not None and body.model != backend.model_name:
        raise ApiError(
            404, f"unknown model {body.model!r}; this server serves {backend.model_name!r}", param="model"
        )
    num_prompt = len(prompt_ids)
    max_len = backend.max_model_len
    if num_prompt == 0:
        raise ApiError(400, "the prompt is empty (0 tokens)", param="prompt")
    vocab_size = getattr(backend, "vocab_size", None) or backend.tokenizer.vocab_size
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ApiError(400, f"prompt token ids must be in [0, {vocab_size}), got {bad[0]}", param="prompt")
    if num_prompt >= max_len:
        raise ApiError(
            400,
            f"the prompt has {num_prompt} tokens, but the model's context (max_model_len) is {max_len} "
            "tokens "
            "and at least one must be left for the output",
            param="prompt",
        )
    if max_tokens is None:
        max_tokens = (
            max_len - num_prompt
            if default_max_tokens is None
            else min(default_max_tokens, max_len - num_prompt)
        )
    if max_tokens < 1:
        raise ApiError(400, f"{max_tokens_param} must be >= 1, got {max_tokens}", param=max_tokens_param)
    if num_prompt + max_tokens > max_len:
        raise ApiError(
            400,
            f"the prompt ({num_prompt} tokens) plus {max_tokens_param} ({max_tokens}) is "
            f"{num_prompt + max_tokens} tokens, over the model's context (max_model_len) of {max_len} tokens",
            param=max_tokens_param,
        )
    for param, ids in (("stop_token_ids", body.stop_token_ids or []), ("logit_bias", logit_bias or {})):
        if any(not 0 <= t < vocab_size for t in ids):
            raise ApiError(400, f"{param} token ids must be in [0, {vocab_size})", param=param)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise ApiError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", param="stop")
    try:
        params = SamplingParams(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            max_tokens=max_tokens,
            stop=tuple(stop),
            ignore_eos=body.ignore_eos,
            logprobs=num_top_logprobs,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            min_tokens=body.min_tokens,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            logit_bias=logit_bias or {},
        )
    except ValueError as exc:  # SamplingParams names the field first: "temperature must be ..."
        field = str(exc).split(" ", 1)[0]
        raise ApiError(400, str(exc), param=field if field in _SAMPLING_FIELDS else None) from exc
    return PreparedRequest(
        request_id=f"{prefix}-{uuid.uuid4().hex}",
        prompt_token_ids=prompt_ids,
        params=params,
        model=backend.model_name,
        created_s=int(time.time()),
        num_top_logprobs=num_top_logprobs,
        echo_text=echo_text,
    )


# ---- one generation ----------------------------------------------------------------------------------
@dataclass
class Progress:
    """What the edge has seen of one request so far (times from `time.perf_counter()`, seconds)."""

    arrival_s: float
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    first_token_s: float | None = None
    second_delta_s: float | None = None
    last_token_s: float | None = None
    last: StreamDelta | None = None
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # `SamplingParams.prompt_logprobs`

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Generation:
    """Drives one backend request: the text the backend released, timings, metrics, abort."""

    def __init__(
        self,
        backend: ServingBackend,
        prepared: PreparedRequest,
        metrics: ApiMetrics,
        slo: SLOConfig | None,
    ) -> None:
        self.backend = backend
        self.prepared = prepared
        self.metrics = metrics
        self.slo = slo
        self.progress = Progress(arrival_s=time.perf_counter())
        self._deltas = backend.generate(prepared.request_id, prepared.prompt_token_ids, prepared.params)
        self._closed = False
        self._num_logprobs_sent = 0  # of progress.logprobs, in chunks sent
        self._logprobs_text_offset = len(prepared.echo_text)  # completions' text_offset of the next
        self._prompt_logprobs_sent = False  # (streamed) the first chunk carried the prompt's

    async def next(self) -> StreamDelta | None:
        """The next delta (already folded into `progress`), or None after the last one.

        Raises ApiError: 400 for a request the backend refuses (ValueError), 503 for `BackendUnavailable`.
        """
        if self.progress.finished:
            return None
        try:
            delta = await anext(self._deltas)
        except StopAsyncIteration:
            # a backend that ends its stream without a finished delta: treat as aborted
            self.progress.finish_reason = "abort"
            return None
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc
        except BackendUnavailable as exc:
            raise ApiError(503, str(exc), "service_unavailable") from exc
        self._fold(delta)
        return delta

    def _fold(self, delta: StreamDelta) -> None:
        p, now = self.progress, time.perf_counter()
        if delta.prompt_logprobs is not None:
            p.prompt_logprobs = delta.prompt_logprobs
        if self.prepared.echo_only:  # the engine generates one token: the client sees none of it
            delta = dataclasses.replace(delta, new_token_ids=[], new_text="", logprobs=None)
            p.first_token_s = p.first_token_s or now
        if delta.new_token_ids:
            if p.first_token_s is None:
                p.first_token_s = now
            else:
                if p.second_delta_s is None:
                    p.second_delta_s = now
                self.metrics.itl_s.observe(now - p.last_token_s)
            p.last_token_s = now
            p.token_ids.extend(delta.new_token_ids)
            if delta.logprobs is not None:
                p.logprobs.extend(delta.logprobs)
        p.last = delta
        p.text += delta.new_text
        if delta.finished:
            p.finish_reason = delta.finish_reason or "stop"

    def stream_text(self, num_sent_chars: int) -> str:
        """Text received since the first `num_sent_chars` characters (the engine already held back what
        could still change: an incomplete character, a possible start of a stop string)."""
        return self.progress.text[num_sent_chars:]

    async def drain(self) -> None:
        """Fold every delta until the request is finished (a non-streaming response)."""
        while await self.next() is not None:
            pass

    async def close(self) -> None:
        """Finish the bookkeeping; abort the backend request if it did not finish. Idempotent."""
        if self._closed:
            return
        self._closed = True
        p = self.progress
        with contextlib.suppress(Exception):
            await self._deltas.aclose()
        if p.last is None or not p.last.finished:
            # the client went away, an error, or a stop string found here: the backend must let go
            with contextlib.suppress(Exception):
                await self.backend.abort(self.prepared.request_id)
        self.metrics.record_request(
            p.finish_reason or "abort",
            len(self.prepared.prompt_token_ids),
            len(p.token_ids),
            self.extension(),
            p.last,
            self.slo,
        )

    # ---- response pieces -----------------------------------------------------------------------------
    def logprobs_body(self, endpoint: str, chunk: bool) -> dict[str, Any] | None:
        """The choice's `logprobs` (`api.logprobs`): of every token (`chunk` False), or of the tokens since
        the previous chunk (advancing past them); None when the client asked for none."""
        num_top = self.prepared.num_top_logprobs
        if num_top is None:
            return None
        entries = self.progress.logprobs
        if chunk:
            entries = entries[self._num_logprobs_sent :]
            self._num_logprobs_sent += len(entries)
        tokenizer = self.backend.tokenizer
        if endpoint == "chat":
            return chat_logprobs(tokenizer, entries, num_top)
        start = self._logprobs_text_offset if chunk else len(self.prepared.echo_text)
        body = completion_logprobs(tokenizer, entries, start, num_top)
        if chunk and entries:
            self._logprobs_text_offset = body["text_offset"][-1] + len(body["tokens"][-1])
        if self.prepared.params.prompt_logprobs is None or (chunk and self._prompt_logprobs_sent):
            return body
        self._prompt_logprobs_sent = True
        prompt = self._prompt_logprobs_body(num_top)
        return {key: prompt[key] + body[key] for key in body}

    def _prompt_logprobs_body(self, num_top: int) -> dict[str, Any]:
        """The prompt's part of the completions `logprobs` (`echo`). Raises ApiError 500: the backend
        finished the request without them (never answered as a success without them)."""
        p = self.progress
        try:
            if p.prompt_logprobs is None:
                raise ValueError("the backend returned no prompt logprobs")
            tokenizer = self.backend.tokenizer
            return prompt_completion_logprobs(
                tokenizer, self.prepared.prompt_token_ids, p.prompt_logprobs, num_top
            )
        except ValueError as exc:
            raise ApiError(500, f"prompt logprobs: {exc}", "internal_server_error") from exc

    def usage(self) -> dict[str, int]:
        """OpenAI `usage`: prompt, completion and total tokens."""
        num_prompt = len(self.prepared.prompt_token_ids)
        num_completion = len(self.progress.token_ids)
        return {
            "prompt_tokens": num_prompt,
            "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion,
        }

    def extension(self) -> dict[str, Any]:
        """The `pdcluster` field: request id, phases, TTFT/TPOT/e2e in seconds at the edge, MTP counts and
        rates, and the ranks that served it."""
        p = self.progress
        end_s = p.last_token_s if p.last_token_s is not None else time.perf_counter()
        ttft_s = None if p.first_token_s is None else p.first_token_s - p.arrival_s
        tpot_s = time_per_output_token_s(p.first_token_s, p.last_token_s, len(p.token_ids))
        e2e_s = end_s - p.arrival_s
        last = p.last or StreamDelta([])
        phases = last.reported_phases()
        if "first_decode_step_s" not in phases and p.second_delta_s is not None:
            phases["first_decode_step_s"] = p.second_delta_s - p.first_token_s
        phases.setdefault("total_s", e2e_s)
        return {
            "request_id": self.prepared.request_id,
            "phases": {
                k: phases[k] for k in (*PHASE_NAMES, *sorted(set(phases) - set(PHASE_NAMES))) if k in phases
            },
            "ttft_s": ttft_s,
            "tpot_s": tpot_s,
            "e2e_s": e2e_s,
            **last.drafts.summary(),
            **({"ranks": last.ranks} if last.ranks else {}),
        }
