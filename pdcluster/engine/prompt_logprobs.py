"""Prompt logprobs (completions' `echo` with `logprobs`), as vLLM's `prompt_logprobs`: each prompt token's
raw `log_softmax` under the target model given the tokens before it (no temperature or penalties), and top-k.

Computed on the engine that prefills the prompt: its forward holds every prompt position's hidden state, so
they cost one more lm_head over them; a prefill instance returns them in its `PrefillResult` (the KV handoff
is unchanged). A prefix-cache hit has no hidden states, so such requests skip the prefix cache, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from pdcluster.engine.model_runner import ModelRunner
from pdcluster.engine.outputs import ScheduledRequest, TokenLogprobs
from pdcluster.kernels.sampling import compute_logprobs

if TYPE_CHECKING:
    from pdcluster.engine.request_record import RequestRecord

MAX_ROWS = 256
"""Prompt positions per lm_head call: bounds the `[rows, vocab_size]` float32 logits held at once."""

# request id -> (index in the prompt of the first token scored, the entries of the tokens from there on)
PromptLogprobs = dict[str, tuple[int, list[TokenLogprobs]]]


def wants_prompt_logprobs(scheduled: list[ScheduledRequest]) -> list[int]:
    """Indices of the items of `scheduled` asking for prompt logprobs whose inputs hold prompt positions."""
    return [
        i
        for i, item in enumerate(scheduled)
        if item.request.sampling_params.prompt_logprobs is not None
        and item.start_position < item.request.num_prompt_tokens - 1
    ]


def prompt_logprobs(
    runner: ModelRunner,
    scheduled: list[ScheduledRequest],
    items: list[int],
    hidden: torch.Tensor,
    starts: list[int],
) -> PromptLogprobs:
    """The prompt logprobs this step yields for `scheduled[i]`, i in `items` (`wants_prompt_logprobs`).

    hidden: `[num_tokens, hidden_size]` the step's final hidden states; starts: `[num_reqs + 1]` the
    batch's query_start_loc. Prompt token j (j >= 1) is scored by the hidden state at position j - 1, so a
    chunk over positions [s, e) scores tokens s + 1 .. min(e, num_prompt_tokens - 1).
    """
    result: PromptLogprobs = {}
    for i in items:
        item = scheduled[i]
        request = item.request
        start = item.start_position
        end = min(start + item.num_scheduled_tokens, request.num_prompt_tokens - 1)
        num_top = request.sampling_params.prompt_logprobs
        targets = torch.tensor(request.prompt_token_ids[start + 1 : end + 1], dtype=torch.long)
        rows = hidden[starts[i] : starts[i] + end - start]
        entries: list[TokenLogprobs] = []
        for s in range(0, end - start, MAX_ROWS):
            logits = runner.compute_logits(rows[s : s + MAX_ROWS])
            chunk_targets = targets[s : s + MAX_ROWS]
            lp = compute_logprobs(logits, chunk_targets.to(logits.device), num_top)
            values, ranks = lp.token_logprobs.tolist(), lp.token_ranks.tolist()
            top_ids, top_values = lp.top_token_ids.tolist(), lp.top_logprobs.tolist()
            entries += [
                TokenLogprobs(t, values[r], ranks[r], top_ids[r], top_values[r])
                for r, t in enumerate(chunk_targets.tolist())
            ]
        result[request.request_id] = (start + 1, entries)
    return result


def record_prompt_logprobs(records: Mapping[str, RequestRecord], step: PromptLogprobs) -> None:
    """Add a step's prompt logprobs (`ModelRunnerOutput.prompt_logprobs`) to the requests' records."""
    for request_id, (first, entries) in step.items():
        record = records.get(request_id)
        if record is not None and record.prompt_logprobs is not None:
            merge(record.prompt_logprobs, first, entries)


def merge(have: list[TokenLogprobs | None], first: int, entries: list[TokenLogprobs]) -> None:
    """Append to `have` (a request's prompt logprobs so far: index j for prompt token j, None at 0) the
    `entries` from prompt index `first` on that it does not hold yet (a preempted request recomputes its
    prompt: those are scored again).

    Raises ValueError: `entries` start past the end of `have` (a chunk was missed).
    """
    if first > len(have):
        raise ValueError(f"prompt logprobs from token {first}, but only {len(have)} are known")
    have += entries[len(have) - first :]
