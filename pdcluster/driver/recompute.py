"""Resuming a request whose decode instance lost its KV (a dead instance, or one that shrank: elastic EP).

It goes again through prefill with the original prompt plus every streamed token but the last; the last is
forced as prefill's first token (never streamed again) and `max_tokens` drops to match, so the client sees
one stream and greedy output is unchanged. Pure functions over plain data.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdcluster.engine.sampling_params import SamplingParams

MAX_RECOMPUTES = 1  # re-dispatches of one request after its decode instance lost its KV


@dataclass(frozen=True)
class Recompute:
    """Dispatch the request again with its streamed tokens kept (`resumed`); `error` says what was lost."""

    error: str


@dataclass(frozen=True)
class Resumed:
    """What the re-dispatch sends: `prompt_token_ids` (original + streamed[:-1]), `params` (max_tokens
    lowered by the same count), `first_token_id` (streamed[-1]; None when nothing was streamed) and
    `num_recomputed_tokens` (the streamed tokens whose KV is computed again)."""

    prompt_token_ids: list[int]
    params: SamplingParams
    first_token_id: int | None
    num_recomputed_tokens: int


def recompute_refusal(
    params: SamplingParams,
    num_recomputes: int,
    aborted: bool = False,
    finished: bool = False,
    max_recomputes: int = MAX_RECOMPUTES,
) -> str | None:
    """Why a request whose decode instance lost its KV cannot be re-dispatched; None when it can.

    Unseeded sampling continues (each token is drawn afresh anyway); state that would not carry over to a
    new prompt refuses: a seed's random stream, a structured-output grammar's state, stop strings (matched
    on decode's text, which would restart at the boundary), logprobs (the forced token has none), and the
    penalties / min_tokens that count output tokens.
    """
    if finished:
        return "it had finished"
    if aborted:
        return "the client aborted it"
    if num_recomputes >= max_recomputes:
        return f"it was re-dispatched after a lost decode {num_recomputes} time(s), the most allowed"
    if params.seed is not None and not params.is_greedy:
        return "its seeded sampling stream cannot be continued on another instance"
    if params.structured_output is not None:
        return "its structured-output grammar state cannot be carried over"
    if params.stop:
        return "its stop strings are matched on decode's text, which a re-dispatch would restart"
    if params.logprobs is not None:
        return "it asks for logprobs, which the carried-over token has none of"
    if (
        params.presence_penalty
        or params.frequency_penalty
        or params.repetition_penalty != 1
        or params.min_tokens
    ):
        return "its penalties / min_tokens count output tokens, which a re-dispatch moves into the prompt"
    return None


def resume(prompt_token_ids: list[int], params: SamplingParams, streamed: list[int]) -> Resumed:
    """The re-dispatch of a request (`prompt_token_ids`, `params`) after the client got `streamed`.

    Raises ValueError: `streamed` already holds `params.max_tokens` tokens (nothing left to generate).
    """
    if len(streamed) >= params.max_tokens:
        raise ValueError(f"{len(streamed)} tokens streamed of max_tokens={params.max_tokens}: nothing left")
    if not streamed:
        return Resumed(list(prompt_token_ids), params, None, 0)
    carried = len(streamed) - 1
    return Resumed(
        [*prompt_token_ids, *streamed[:-1]],
        dataclasses.replace(params, max_tokens=params.max_tokens - carried),
        streamed[-1],
        len(streamed),
    )
