"""Turn one step's target logits into tokens: sample, or verify drafts, per request; and log-probabilities.

    logits [sum(k_i + 1), vocab_size] --sample_isolated--> request id -> accepted drafts + one token

Request i owns `k_i + 1` rows (its `k_i` drafts `ScheduledRequest.spec_token_ids`, then the bonus
position), after request i-1's. The accept rule itself lives in `kernels.rejection_sampling`:
`greedy_verify_batch` when every request is greedy (no probabilities computed), else
`rejection_sample_batch` (greedy rows by argmax, the others by Leviathan et al.'s rule). Without drafts,
sampled requests draw from `kernels.sampling.sample`.

Isolation: `sample_isolated` retries request by request when the batch raises, so one request's error
fails that request alone (see `engine.executor`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping

import torch

from pdcluster.engine.input_batch import SamplingArrays
from pdcluster.engine.outputs import ScheduledRequest, TokenLogprobs
from pdcluster.kernels.rejection_sampling import greedy_verify_batch, rejection_sample_batch
from pdcluster.kernels.sampling import argmax, compute_logprobs, probs_from_logits, sample

# The request's own torch.Generator (None: torch's global one); the executor creates them lazily.
GeneratorOf = Callable[[ScheduledRequest], "torch.Generator | None"]


def sample_isolated(
    items: list[ScheduledRequest],
    logits: torch.Tensor,
    generator_of: GeneratorOf,
    draft_probs: Mapping[str, torch.Tensor | None],
    params: SamplingArrays | None = None,
) -> tuple[dict[str, list[int]], dict[str, str]]:
    """`sample_or_verify` over the batch; if it raises, over each request alone (its own rows of
    `logits`), so an error one request causes fails only that request.

    Args:
        items: the sampling requests, in batch order.
        logits: `[sum(k_i + 1), vocab_size]` float32, as `sample_or_verify`.
        generator_of, draft_probs, params: as `sample_or_verify`.

    Returns:
        (request id -> tokens, for the requests that sampled; request id -> error message, for those
        that raised even alone).
    """
    if params is None:
        params = SamplingArrays.of([item.request.sampling_params for item in items])
    try:
        return sample_or_verify(items, logits, generator_of, draft_probs, params), {}
    except Exception:  # noqa: BLE001 - find the request(s) it came from, below
        pass
    sampled: dict[str, list[int]] = {}
    failed: dict[str, str] = {}
    row = 0
    for i, item in enumerate(items):
        num_rows = len(item.spec_token_ids) + 1
        try:
            rows = logits[row : row + num_rows]
            alone = params.take(slice(i, i + 1))
            sampled.update(sample_or_verify([item], rows, generator_of, draft_probs, alone))
        except Exception as e:  # noqa: BLE001 - this request's error, this request's failure
            failed[item.request_id] = f"sampling failed: {e!r}"
        row += num_rows
    return sampled, failed


def sample_or_verify(
    items: list[ScheduledRequest],
    logits: torch.Tensor,
    generator_of: GeneratorOf,
    draft_probs: Mapping[str, torch.Tensor | None],
    params: SamplingArrays | None = None,
) -> dict[str, list[int]]:
    """Tokens of each request: its accepted drafts then one sampled (bonus or recovered) token, for the
    whole batch at once: greedy rows by one argmax over all rows (accept lengths from one compare and a
    cumulative product, `kernels.rejection_sampling`), the other rows' top-k/top-p masks in one batch,
    and one host transfer of the result. Seeded requests draw from their own generators (alone, so their
    tokens do not depend on the batch); unseeded ones share a generator and draw together.

    Args:
        items: the sampling requests, in batch order.
        logits: `[sum(k_i + 1), vocab_size]` float32, request i's `k_i + 1` rows after request i-1's.
        generator_of: the request's generator (drawn from for sampled requests only).
        draft_probs: request id -> `[num_drafts, vocab_size]` float32 distributions its drafts were
            sampled from (None or absent: deterministic drafts, one-hot). Rows past a stored tensor's
            length are filler drafts (one-hot).
        params: the items' sampling parameters (`engine.input_batch.SamplingArrays`, gathered from the
            persistent rows); None: built from the items' `SamplingParams`.

    Raises:
        ValueError: from the kernels, for inconsistent shapes or draft ids outside the vocabulary.
    """
    if params is None:
        params = SamplingArrays.of([item.request.sampling_params for item in items])
    request_ids = [item.request_id for item in items]
    num_drafts = [len(item.spec_token_ids) for item in items]
    all_greedy = params.all_greedy
    if not any(num_drafts) and all_greedy:  # plain greedy decode
        return {rid: [tok] for rid, tok in zip(request_ids, argmax(logits).tolist(), strict=True)}
    draft_ids = torch.tensor(
        list(itertools.chain.from_iterable(item.spec_token_ids for item in items)),
        dtype=torch.long,
        device=logits.device,
    )
    if all_greedy:  # no randomness: no generator is made or drawn from
        result = greedy_verify_batch(draft_ids, num_drafts, logits)
        return dict(zip(request_ids, result.token_ids(), strict=True))
    generators = [generator_of(item) for item in items]
    temperature = torch.from_numpy(params.temperature)
    top_k, top_p = torch.from_numpy(params.top_k), torch.from_numpy(params.top_p)
    if not any(num_drafts):
        tokens = sample(logits, temperature, top_k, top_p, generators).tolist()
        return {rid: [tok] for rid, tok in zip(request_ids, tokens, strict=True)}
    counts = torch.tensor(num_drafts) + 1
    target_probs = probs_from_logits(
        logits,
        temperature.repeat_interleave(counts),
        top_k.repeat_interleave(counts),
        top_p.repeat_interleave(counts),
    )
    is_greedy = (params.temperature == 0).tolist()
    batch_draft_probs = None
    if any(not greedy for greedy, k in zip(is_greedy, num_drafts, strict=True) if k):
        # Rows of greedy drafts are one-hot: a deterministic drafter puts all its mass on its draft.
        batch_draft_probs = torch.nn.functional.one_hot(draft_ids, logits.shape[1]).float()
        offset = 0
        for item, k in zip(items, num_drafts, strict=True):
            stored = draft_probs.get(item.request_id)
            if k and stored is not None:
                m = min(k, stored.shape[0])  # rows past m: filler drafts (one-hot)
                batch_draft_probs[offset : offset + m] = stored[:m]
            offset += k
    result = rejection_sample_batch(
        draft_ids, num_drafts, batch_draft_probs, target_probs.to(logits.device), is_greedy, generators
    )
    return dict(zip(request_ids, result.token_ids(), strict=True))


def token_logprobs(
    items: list[ScheduledRequest], logits: torch.Tensor, sampled: dict[str, list[int]]
) -> dict[str, list[TokenLogprobs]]:
    """Raw log-probabilities of each output token, for the requests that asked for them.

    logits: `[sum(k_i + 1), vocab_size]` target logits, request i's `k_i + 1` rows after request i-1's;
    row j of a request predicts its output token j (accepted draft j+1, or the bonus/recovered token).
    """
    rows: list[int] = []
    token_ids: list[int] = []
    wanting: list[ScheduledRequest] = []
    offset = 0
    for item in items:
        tokens = sampled.get(item.request_id)  # None: its sampling failed
        if tokens is not None and item.request.sampling_params.logprobs is not None:
            wanting.append(item)
            rows.extend(range(offset, offset + len(tokens)))
            token_ids.extend(tokens)
        offset += len(item.spec_token_ids) + 1
    if not wanting:
        return {}
    num_top = max(item.request.sampling_params.logprobs for item in wanting)
    result = compute_logprobs(
        logits[rows], torch.tensor(token_ids, dtype=torch.long, device=logits.device), num_top
    )
    token_logprobs = result.token_logprobs.tolist()
    ranks = result.token_ranks.tolist()
    top_ids, top_logprobs = result.top_token_ids.tolist(), result.top_logprobs.tolist()
    out: dict[str, list[TokenLogprobs]] = {}
    row = 0
    for item in wanting:
        n = item.request.sampling_params.logprobs
        per_token = []
        for token_id in sampled[item.request_id]:
            per_token.append(
                TokenLogprobs(
                    token_id, token_logprobs[row], ranks[row], top_ids[row][:n], top_logprobs[row][:n]
                )
            )
            row += 1
        out[item.request_id] = per_token
    return out
