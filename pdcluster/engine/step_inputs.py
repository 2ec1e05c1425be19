"""A step's packed inputs, and its placeholder inputs (async scheduling) resolved from the last step."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from pdcluster.engine.input_batch import SamplingArrays
from pdcluster.engine.model_runner import ModelInput
from pdcluster.engine.outputs import ScheduledRequest


class PreparedStep(NamedTuple):
    """A step's packed inputs before placeholders are resolved; query_start_loc `[num_reqs + 1]` on host."""

    batch: ModelInput | None
    query_start_loc: list[int]
    placeholder_items: list[int]
    sampling: SamplingArrays | None = None
    plain: bool = False  # no request asks for logprobs, prompt logprobs or structured output
    num_queries: int | None = None  # inputs per request when known to be equal (a decode step: 1)
    processed: bool = True  # a request's logits a penalty, a logit bias or min_tokens changes


class StepResult(NamedTuple):
    """One request's result of the last step, what its next step's placeholders resolve to."""

    token_ids: list[int]
    draft_token_ids: list[int]
    num_rejected: int


def last_step_results(
    scheduled: list[ScheduledRequest],
    sampling: list[int],
    sampled: dict[str, list[int]],
    spec: dict[str, list[int]],
    failed: dict[str, str],
) -> dict[str, StepResult]:
    """Request id -> `StepResult` of each sampling item `scheduled[i]`, i in `sampling`: its sampled tokens,
    next drafts and rejected drafts (a failed request: one token 0, nothing rejected).
    """
    results: dict[str, StepResult] = {}
    for i in sampling:
        item = scheduled[i]
        request_id = item.request.request_id
        if request_id in failed:
            results[request_id] = StepResult([0], [], 0)
            continue
        tokens = sampled[request_id]
        results[request_id] = StepResult(
            tokens, spec.get(request_id, []), len(item.spec_token_ids) + 1 - len(tokens)
        )
    return results


def logit_rows(
    hidden: torch.Tensor, items: list[ScheduledRequest], sampling: list[int], starts: list[int]
) -> torch.Tensor:
    """The rows of `hidden` that yield tokens: each sampling request's last `k_i + 1`, in batch order."""
    if len(sampling) == len(starts) - 1 and all(
        item.num_scheduled_tokens == len(item.spec_token_ids) + 1 for item in items
    ):
        return hidden  # every request samples from all its inputs
    counts = np.fromiter((len(item.spec_token_ids) + 1 for item in items), np.int64, len(items))
    ends = np.asarray(starts, dtype=np.int64)[1:][sampling]
    offsets = np.cumsum(counts) - counts
    rows = np.repeat(ends - counts - offsets, counts) + np.arange(int(counts.sum()), dtype=np.int64)
    return hidden[torch.from_numpy(rows).to(hidden.device)]


def resolve_placeholders(
    scheduled: list[ScheduledRequest],
    prepared: PreparedStep,
    last_step: dict[str, StepResult],
    block_size: int,
) -> list[ScheduledRequest]:
    """Fill in placeholder inputs and move their requests back by the previous step's rejected drafts."""
    items = prepared.placeholder_items
    if not items:
        return scheduled
    batch, bs = prepared.batch, block_size
    assert batch is not None
    scheduled = list(scheduled)
    values: list[int] = []
    counts: list[int] = []
    shifts: list[int] = []
    for i in items:
        item = scheduled[i]
        previous = last_step.get(item.request_id)
        if previous is None:
            raise RuntimeError(f"placeholders of {item.request_id!r}, but the last step sampled nothing")
        n, shift = item.num_scheduled_tokens, previous.num_rejected
        bonus = previous.token_ids[-1]
        if n == 1 and not shift and item.num_placeholders == 1 and not item.spec_token_ids:
            values.append(bonus)  # a decode input: the item stays as it is
            counts.append(1)
            shifts.append(0)
            continue
        inputs = ([bonus] + previous.draft_token_ids)[:n]
        inputs += [bonus] * (n - len(inputs))
        values.extend(inputs)
        counts.append(n)
        shifts.append(shift)
        # The bonus token stays a placeholder in the item (its `token_ids`): known to this step only.
        scheduled[i] = item._replace(
            spec_token_ids=inputs[1:], start_position=item.start_position - shift, num_placeholders=1
        )
    device = batch.input_ids.device
    item_index = np.asarray(items, dtype=np.int64)
    num_inputs = np.asarray(counts, dtype=np.int64)
    # flat row of each of their inputs in the batch: query start + offset within the request
    flat = np.asarray(prepared.query_start_loc, dtype=np.int64)[item_index]
    if len(values) > len(items):
        flat = np.repeat(flat - (np.cumsum(num_inputs) - num_inputs), num_inputs)
        flat += np.arange(len(values), dtype=np.int64)
    if device.type == "cpu" and not any(shifts):  # host buffers: one numpy write
        batch.input_ids.numpy()[flat] = values
        return scheduled
    flat_rows = torch.from_numpy(flat).to(device)
    batch.input_ids[flat_rows] = torch.tensor(values, dtype=torch.long, device=device)
    if any(shifts):
        shift = np.asarray(shifts, dtype=np.int64)
        positions = batch.positions[flat_rows] - torch.from_numpy(np.repeat(shift, num_inputs)).to(device)
        batch.positions[flat_rows] = positions
        request_rows = torch.from_numpy(np.repeat(item_index, num_inputs)).to(device)
        batch.slot_mapping[flat_rows] = (
            batch.block_tables[request_rows, positions // bs] * bs + positions % bs
        )
        batch.seq_lens[torch.from_numpy(item_index).to(device)] -= torch.from_numpy(shift).to(device)
    return scheduled
