"""Turn one step's target logits into tokens (sample, or verify drafts: `kernels.rejection_sampling`, after
Leviathan et al.), and log-probabilities."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping

import numpy as np
import torch

from pdcluster.engine.input_batch import SamplingArrays
from pdcluster.engine.outputs import ScheduledRequest, TokenLogprobs
from pdcluster.engine.penalties import OutputHistory, PenaltyCounts
from pdcluster.kernels.rejection_sampling import greedy_verify_lists, rejection_sample_batch
from pdcluster.kernels.sampling import (
    argmax_list,
    compute_logprobs,
    probs_from_logits,
    sample,
)

# The request's own torch.Generator (None: torch's global one); the executor creates them lazily.
GeneratorOf = Callable[[ScheduledRequest], "torch.Generator | None"]


def sample_isolated(
    items: list[ScheduledRequest],
    logits: torch.Tensor,
    generator_of: GeneratorOf,
    draft_probs: Mapping[str, torch.Tensor | None],
    params: SamplingArrays | None = None,
) -> tuple[dict[str, list[int]], dict[str, str]]:
    """`sample_or_verify` over the batch; if it raises, over each request alone, so an error one request
    causes fails only that request. logits: `[sum(k_i + 1), vocab_size]` float32, as `sample_or_verify`."""
    if params is None:
        params = SamplingArrays.of([item.request.sampling_params for item in items])
    try:
        return sample_or_verify(items, logits, generator_of, draft_probs, params), {}
    except Exception:  # noqa: BLE001 - find the request(s) it came from, below
        pass
    return _one_at_a_time(
        items,
        "sampling",
        lambda i, item, rows: sample_or_verify(
            [item], logits[rows], generator_of, draft_probs, params.take(slice(i, i + 1))
        ),
    )


def _one_at_a_time(
    items: list[ScheduledRequest], what: str, run_one: Callable[[int, ScheduledRequest, slice], dict]
) -> tuple[dict, dict[str, str]]:
    """`run_one(i, item, its logits rows)` per request; one that raises fails alone ("<what> failed: ...")."""
    out: dict = {}
    failed: dict[str, str] = {}
    row = 0
    for i, item in enumerate(items):
        num_rows = len(item.spec_token_ids) + 1
        try:
            out.update(run_one(i, item, slice(row, row + num_rows)))
        except Exception as e:  # noqa: BLE001 - this request's error, this request's failure
            failed[item.request_id] = f"{what} failed: {e!r}"
        row += num_rows
    return out, failed


def sample_or_verify(
    items: list[ScheduledRequest],
    logits: torch.Tensor,
    generator_of: GeneratorOf,
    draft_probs: Mapping[str, torch.Tensor | None],
    params: SamplingArrays,
) -> dict[str, list[int]]:
    """Tokens of each request: its accepted drafts then one sampled (bonus or recovered) token, batched.

    logits: `[sum(k_i + 1), vocab_size]` float32, request i's `k_i + 1` rows after request i-1's.
    draft_probs: request id -> `[num_drafts, vocab_size]` float32 distributions its drafts were sampled
    from (None or absent: deterministic drafts, one-hot).
    Raises ValueError: from the kernels, for inconsistent shapes or draft ids outside the vocabulary."""
    request_ids = [item.request_id for item in items]
    num_drafts = [len(item.spec_token_ids) for item in items]
    all_greedy = params.all_greedy
    if not any(num_drafts) and all_greedy:
        return {rid: [tok] for rid, tok in zip(request_ids, argmax_list(logits), strict=True)}
    if all_greedy:
        tokens = greedy_verify_lists([item.spec_token_ids for item in items], logits)
        return dict(zip(request_ids, tokens, strict=True))
    draft_ids = torch.tensor(
        list(itertools.chain.from_iterable(item.spec_token_ids for item in items)),
        dtype=torch.long,
        device=logits.device,
    )
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
                m = min(k, stored.shape[0])
                batch_draft_probs[offset : offset + m] = stored[:m]
            offset += k
    result = rejection_sample_batch(
        draft_ids, num_drafts, batch_draft_probs, target_probs.to(logits.device), is_greedy, generators
    )
    return dict(zip(request_ids, result.token_ids(), strict=True))


def process_logits_isolated(
    items: list[ScheduledRequest],
    logits: torch.Tensor,
    params: SamplingArrays,
    output_history: OutputHistory,
    counts: PenaltyCounts,
    fresh_logits: Callable[[], torch.Tensor],
) -> tuple[torch.Tensor, dict[str, str]]:
    """`process_logits` over the batch; if it raises, over `fresh_logits()` (the step's logits rebuilt as they
    were before any processor ran) one request at a time, its penalty counts recounted, so a request whose
    processors raise fails alone. Returns the processed logits and request id -> error of the failures."""
    try:
        return process_logits(items, logits, params, output_history, counts), {}
    except Exception:  # noqa: BLE001 - find the request(s) it came from, below
        pass
    counts.drop([item.request_id for item in items])  # a batched update may have stopped half-way
    logits = fresh_logits()
    failed: dict[str, str] = {}
    row = 0
    for i, item in enumerate(items):
        num_rows = len(item.spec_token_ids) + 1
        if params.processed[i]:
            alone = params.take(slice(i, i + 1))
            try:
                process_logits([item], logits[row : row + num_rows], alone, output_history, counts)
            except Exception as e:  # noqa: BLE001 - this request's error, this request's failure
                failed[item.request_id] = f"logits processing failed: {e!r}"
        row += num_rows
    return logits, failed


@torch.inference_mode()  # logits come from the model's inference-mode forward: changed in place
def process_logits(
    items: list[ScheduledRequest],
    logits: torch.Tensor,
    params: SamplingArrays,
    output_history: OutputHistory,
    counts: PenaltyCounts,
) -> torch.Tensor:
    """The logit processors of `params` (penalties, logit bias, min_tokens' stop-token ban) applied to
    `logits` `[sum(k_i + 1), vocab_size]` float32 in place; returns `logits`.
    output_history: `(item, start)` -> the item's output tokens before its inputs end, from index `start`;
    counts: the penalised requests' token counts, brought up to their histories here.
    """
    processed = params.processed
    if not params.any_processed:
        return logits
    penalized = params.penalized
    if params.only_penalties and not any(i.spec_token_ids for i in items):
        # penalties alone, one row per request: the rows are the penalised requests' indices
        index = np.flatnonzero(penalized)
        whole = len(index) == len(items)
        slots, _ = counts.update(items if whole else [items[i] for i in index.tolist()], output_history)
        per_row = params if whole else params.take(index)
        counts.penalize_(
            logits,
            index.tolist(),
            slots,
            None,
            per_row.presence_penalty,
            per_row.frequency_penalty,
            per_row.repetition_penalty,
            per_row.penalties_on,
        )
        return logits
    penalized_items = [item for item, p in zip(items, penalized.tolist(), strict=True) if p]
    slots, lengths = counts.update(penalized_items, output_history) if penalized_items else ([], [])
    length_of = dict(zip((item.request_id for item in penalized_items), lengths, strict=True))
    rows: list[int] = []
    penalized_rows: list[int] = []  # of `rows`
    penalized_request_of_row: list[int] = []
    slot_of_row: list[int] = []
    drafts: list[list[int]] = []
    bias: list[tuple[int, int, float]] = []
    banned: list[tuple[int, int]] = []
    offset = 0
    next_slot = iter(slots)
    for i, item in enumerate(items):
        num_rows = len(item.spec_token_ids) + 1
        if processed[i]:
            request = item.request
            sp = request.sampling_params
            slot = next(next_slot) if penalized[i] else -1
            num_history = length_of.get(item.request_id)
            if num_history is None and sp.min_tokens:
                num_history = len(output_history(item, 0))
            stops: list[int] = []
            if sp.min_tokens and num_history < sp.min_tokens:
                stops.extend(sp.stop_token_ids)
                if request.eos_token_id is not None and not sp.ignore_eos:
                    stops.append(request.eos_token_id)
            for j in range(num_rows):
                row = len(rows)
                rows.append(offset + j)
                if slot >= 0:
                    penalized_rows.append(row)
                    penalized_request_of_row.append(i)
                    slot_of_row.append(slot)
                    drafts.append(item.spec_token_ids[:j])
                if sp.logit_bias:
                    bias.extend((row, token_id, value) for token_id, value in sp.logit_bias)
                if stops and num_history + j < sp.min_tokens:
                    banned.extend((row, token_id) for token_id in stops)
        offset += num_rows
    device = logits.device
    whole = len(rows) == logits.shape[0]
    row_index = None if whole else torch.tensor(rows, dtype=torch.long, device=device)
    sub = logits if whole else logits[row_index]  # [R, V]
    if banned:
        banned_rows, banned_ids = torch.tensor(banned, dtype=torch.long, device=device).T
        saved = sub[banned_rows, banned_ids]
        sub[banned_rows, banned_ids] = float("-inf")
        # A row left without a token (a grammar that allows only stop tokens) keeps them: the grammar wins.
        rows_hit = banned_rows.unique()
        dead = rows_hit[(sub[rows_hit] == float("-inf")).all(dim=-1)]
        if dead.numel():
            keep = torch.isin(banned_rows, dead)
            sub[banned_rows[keep], banned_ids[keep]] = saved[keep]
    if bias:
        bias_rows, bias_ids, bias_values = zip(*bias, strict=True)
        sub.index_put_(
            (torch.tensor(bias_rows, device=device), torch.tensor(bias_ids, device=device)),
            torch.tensor(bias_values, dtype=sub.dtype, device=device),
            accumulate=True,
        )
    if slot_of_row:
        per_row = params.take(np.asarray(penalized_request_of_row, dtype=np.int64))
        counts.penalize_(
            sub,
            penalized_rows,
            slot_of_row,
            drafts,
            per_row.presence_penalty,
            per_row.frequency_penalty,
            per_row.repetition_penalty,
        )
    if not whole:
        logits.index_copy_(0, row_index, sub)
    return logits


def token_logprobs_isolated(
    items: list[ScheduledRequest],
    logits: torch.Tensor,
    sampled: dict[str, list[int]],
    params: SamplingArrays | None = None,
) -> tuple[dict[str, list[TokenLogprobs]], dict[str, str]]:
    """`token_logprobs` over the batch; if it raises, one request at a time, so a request whose logprobs
    raise fails alone. Returns the logprobs and request id -> error of the failures."""
    if params is None:
        params = SamplingArrays.of([item.request.sampling_params for item in items])
    try:
        return token_logprobs(items, logits, sampled, params), {}
    except Exception:  # noqa: BLE001 - find the request(s) it came from, below
        pass
    return _one_at_a_time(
        items,
        "logprobs",
        lambda i, item, rows: token_logprobs([item], logits[rows], sampled, params.take(slice(i, i + 1))),
    )


def token_logprobs(
    items: list[ScheduledRequest],
    logits: torch.Tensor,
    sampled: dict[str, list[int]],
    params: SamplingArrays | None = None,
) -> dict[str, list[TokenLogprobs]]:
    """Log-probabilities of each output token, for the requests that asked for them: `log_softmax` of the
    (processed) logits divided by the request's temperature (1 when greedy), one batched pass.
    logits: `[sum(k_i + 1), vocab_size]` target logits, request i's `k_i + 1` rows after request i-1's;
    params: the batch's `SamplingArrays` (None: from `items`)."""
    if params is None:
        params = SamplingArrays.of([item.request.sampling_params for item in items])
    if not params.any_logprobs:
        return {}
    asked = params.logprobs
    rows: list[int] = []
    token_ids: list[int] = []
    wanting: list[tuple[str, int, int]] = []  # request id, logprobs asked, tokens
    index: list[int] = []  # of `items`, per entry of `wanting`
    offset = 0
    for i, (item, num_top) in enumerate(zip(items, asked.tolist(), strict=True)):
        request_id = item.request.request_id
        tokens = sampled.get(request_id) if num_top >= 0 else None
        if tokens is not None:
            n = len(tokens)
            wanting.append((request_id, num_top, n))
            index.append(i)
            if n == 1:
                rows.append(offset)
                token_ids.append(tokens[0])
            else:
                rows.extend(range(offset, offset + n))
                token_ids.extend(tokens)
        offset += len(item.spec_token_ids) + 1
    if not wanting:
        return {}
    num_tokens = [n for _, _, n in wanting]
    scaled = logits if len(rows) == logits.shape[0] else logits[rows]  # rows ascend: all rows is identity
    temperature = params.logprob_temperature
    if temperature is not None:
        temperature = temperature[index]
        if len(rows) != len(index):
            temperature = np.repeat(temperature, num_tokens)
        scaled = scaled / torch.from_numpy(temperature).to(logits.device)[:, None]
    num_top = max(n for _, n, _ in wanting)
    result = compute_logprobs(
        scaled, torch.tensor(token_ids, dtype=torch.long, device=logits.device), num_top
    )
    top_ids, top_logprobs = result.top_token_ids.tolist(), result.top_logprobs.tolist()
    if any(n < num_top for _, n, _ in wanting):  # fewer asked than the batch's most: cut their rows
        row = 0
        for _, n, count in wanting:
            if n < num_top:
                for r in range(row, row + count):
                    top_ids[r], top_logprobs[r] = top_ids[r][:n], top_logprobs[r][:n]
            row += count
    per_row = list(
        map(
            TokenLogprobs,
            token_ids,
            result.token_logprobs.tolist(),
            result.token_ranks.tolist(),
            top_ids,
            top_logprobs,
        )
    )
    if len(per_row) == len(wanting):  # one token each: no drafts accepted
        return {request_id: [lp] for (request_id, _, _), lp in zip(wanting, per_row, strict=True)}
    out: dict[str, list[TokenLogprobs]] = {}
    row = 0
    for (request_id, _, _), count in zip(wanting, num_tokens, strict=True):
        out[request_id] = per_row[row : row + count]
        row += count
    return out
