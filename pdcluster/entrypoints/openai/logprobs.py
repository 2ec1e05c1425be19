"""Per-token log-probabilities in OpenAI's response shapes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdcluster.engine.outputs import TokenLogprobs
from pdcluster.models.tokenizer import Tokenizer

MAX_TOP_LOGPROBS = 20
"""`logprobs` (completions) and `top_logprobs` (chat) at most (vLLM's default limit)."""
MIN_LOGPROB = -9999.0


def _value(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(
    tokenizer: Tokenizer, entries: Sequence[TokenLogprobs], text_offset: int, num_top: int
) -> dict[str, Any]:
    """The completions `logprobs` object of `entries` (consecutive output tokens), offsets counted from
    `text_offset` characters; `num_top` alternatives per token plus the sampled one (as vLLM)."""
    tokens: list[str] = []
    offsets: list[int] = []
    top: list[dict[str, float]] = []
    for entry in entries:
        text = _text(tokenizer, entry.token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        alternatives = {
            _text(tokenizer, t): _value(v)
            for t, v in zip(entry.top_token_ids[:num_top], entry.top_logprobs[:num_top], strict=True)
        }
        alternatives.setdefault(text, _value(entry.logprob))
        top.append(alternatives)
    return {
        "tokens": tokens,
        "token_logprobs": [_value(e.logprob) for e in entries],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def prompt_completion_logprobs(
    tokenizer: Tokenizer,
    prompt_token_ids: Sequence[int],
    entries: Sequence[TokenLogprobs | None],
    num_top: int,
) -> dict[str, Any]:
    """The completions `logprobs` object of the prompt (`echo`), offsets from 0: `entries` one per prompt
    token (`engine.prompt_logprobs`), the first None: nothing scores it, so its logprob and alternatives are
    null (as OpenAI and vLLM answer).

    Raises ValueError: `entries` do not match the prompt.
    """
    if len(entries) != len(prompt_token_ids) or entries[0] is not None or None in entries[1:]:
        raise ValueError(f"{len(entries)} prompt logprobs for {len(prompt_token_ids)} prompt tokens")
    first = _text(tokenizer, prompt_token_ids[0])
    rest = completion_logprobs(tokenizer, entries[1:], len(first), num_top)  # type: ignore[arg-type]
    return {
        "tokens": [first, *rest["tokens"]],
        "token_logprobs": [None, *rest["token_logprobs"]],
        "top_logprobs": [None, *rest["top_logprobs"]],
        "text_offset": [0, *rest["text_offset"]],
    }


def chat_logprobs(tokenizer: Tokenizer, entries: Sequence[TokenLogprobs], num_top: int) -> dict[str, Any]:
    """The chat `logprobs` object of `entries`, `num_top` alternatives per token."""
    content = []
    for entry in entries:
        text = _text(tokenizer, entry.token_id)
        content.append(
            {
                "token": text,
                "logprob": _value(entry.logprob),
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": (alt := _text(tokenizer, t)), "logprob": _value(v), "bytes": list(alt.encode())}
                    for t, v in zip(entry.top_token_ids[:num_top], entry.top_logprobs[:num_top], strict=True)
                ],
            }
        )
    return {"content": content}


def cumulative_logprob(entries: Sequence[TokenLogprobs]) -> float:
    """The sum of the sampled tokens' logprobs (what best_of ranks choices by)."""
    return sum(entry.logprob for entry in entries)
