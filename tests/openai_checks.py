"""Checks of OpenAI responses shared by the edge's tests (one engine in-process, and the cluster)."""

from __future__ import annotations

from typing import Any

import pytest


def chat_logprobs_whole_and_streamed(
    client: Any, messages: list[dict], tolerance: float, **params: Any
) -> Any:
    """A greedy chat completion with `logprobs` (`params`: e.g. max_tokens, top_logprobs) whole and streamed
    through the `openai` client `client`: the stream carries the same tokens, and their logprobs within
    `tolerance`, one entry per completion token. Returns the whole response."""
    common = {"model": "tiny", "messages": messages, "temperature": 0, "logprobs": True, **params}
    whole = client.chat.completions.create(**common)
    chunks = list(client.chat.completions.create(**common, stream=True))
    content = whole.choices[0].logprobs.content
    streamed = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert len(content) == whole.usage.completion_tokens
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=tolerance)
    k = params.get("top_logprobs") or 0
    for whole_entry, streamed_entry in zip(content, streamed, strict=True):
        top = whole_entry.top_logprobs
        assert len(top) == k and len(streamed_entry.top_logprobs) == k
        assert [t.token for t in streamed_entry.top_logprobs] == [t.token for t in top]
        values = [t.logprob for t in top]
        assert [t.logprob for t in streamed_entry.top_logprobs] == pytest.approx(values, abs=tolerance)
        assert values == sorted(values, reverse=True)
        if k:  # greedy: the chosen token is the most likely one
            assert top[0].token == whole_entry.token
            assert top[0].logprob == pytest.approx(whole_entry.logprob, abs=tolerance)
    return whole
