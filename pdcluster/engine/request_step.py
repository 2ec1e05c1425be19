"""One request's share of a step, at both ends: what the scheduler gives it to run, and committing what it
sampled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from pdcluster.engine.block_manager import BlockManager
from pdcluster.engine.outputs import PLACEHOLDER_TOKEN_ID, RequestUpdate, ScheduledRequest
from pdcluster.engine.request import Request, RequestStatus
from pdcluster.engine.stopping import check_stop_token


def schedule_request(
    request: Request, num_new_tokens: int, bm: BlockManager, num_draft_placeholders: int
) -> ScheduledRequest:
    """Allocate slots for the request's next `num_new_tokens` positions and describe its step inputs:
    committed tokens, the placeholder of a token still being sampled, then its drafts (drafts beyond the
    budget are dropped); the token ids go to the scheduler's rows (`RequestRows.add_step`).
    Raises RuntimeError: the slots cannot be allocated (the plan did not fit the free blocks)."""
    if not bm.allocate_slots(request, num_new_tokens):
        raise RuntimeError(
            f"scheduler plan not applicable: {num_new_tokens} slots for {request.request_id!r}"
        )
    start, end = request.num_computed_tokens, request.num_computed_tokens + num_new_tokens
    num_tokens = request.num_tokens
    num_known = num_tokens + request.num_output_placeholders
    if request.spec_token_ids:
        request.spec_token_ids = request.spec_token_ids[: max(0, end - num_known)]
    samples = end >= num_known
    item = ScheduledRequest(
        request,
        start,
        num_new_tokens,
        list(request.spec_token_ids),
        bm.block_ids(request),
        samples,
        request.num_preemptions,
        # the tokens still being sampled among the inputs (positions num_tokens .. num_known - 1)
        max(0, min(end, num_known) - max(start, num_tokens)),
    )
    request.num_computed_tokens = end
    if samples:
        request.num_output_placeholders += len(request.spec_token_ids) + 1
        if num_draft_placeholders:
            # The drafts this step proposes, verified by the next; none past the last allowed token.
            num_outputs = request.num_output_tokens + request.num_output_placeholders
            num_allowed = request.sampling_params.max_tokens - num_outputs - 1
            num_drafts = max(0, min(num_draft_placeholders, num_allowed))
            request.spec_token_ids = [PLACEHOLDER_TOKEN_ID] * num_drafts
    return item


def samples_last_token(request: Request) -> bool:
    """The step in flight (asynchronous scheduling) may sample the request's `max_tokens`-th token."""
    num_outputs = request.num_output_tokens + request.num_output_placeholders
    return request.num_output_placeholders > 0 and num_outputs >= request.sampling_params.max_tokens


class DecodeStep(NamedTuple):
    """`schedule_decode`'s step: items, and per item its newest token, its position, blocks held, last
    block (-1: none) and the cache slot its input writes.
    """

    scheduled: list[ScheduledRequest]
    last_token_ids: list[int]
    start_positions: list[int]
    table_lens: list[int]
    last_block_ids: list[int]
    slot_mapping: list[int]


# A NamedTuple built by `tuple.__new__` skips its Python-level constructor (every field must be given).
_new_tuple = tuple.__new__


def schedule_decode(order: list[Request], bm: BlockManager, block_size: int) -> DecodeStep | None:
    """`schedule_request(r, 1, ...)` of each request of `order` when every one decodes one token without
    drafts, none exports its KV, and the free blocks cover the new ones (else None, nothing changed).
    Raises RuntimeError: a block cannot be allocated although the free blocks covered it."""
    table_of = bm.block_table
    step = DecodeStep([], [], [], [], [], [])
    scheduled, last_token_ids, starts, table_lens, last_block_ids, slots = step
    grow: list[int] = []  # items whose input starts a new block
    for r in order:
        num_computed, tokens = r.num_computed_tokens, r.all_token_ids
        if r.spec_token_ids or r.num_output_placeholders or len(tokens) != num_computed + 1 or r.export_kv:
            return None
        table = table_of(r.request_id)
        index = num_computed // block_size
        if index < len(table):
            slots.append(table[index] * block_size + num_computed - index * block_size)
            last_block_ids.append(table[-1])
        else:
            grow.append(len(starts))
            slots.append(-1)
            last_block_ids.append(-1)
        starts.append(num_computed)
        last_token_ids.append(tokens[num_computed])
        table_lens.append(len(table))
        item = (r, num_computed, 1, [], table[:], True, r.num_preemptions, 0)
        scheduled.append(_new_tuple(ScheduledRequest, item))
    if grow:
        if len(grow) > bm.num_free_blocks:
            return None
        for i in grow:
            r, num_computed = order[i], starts[i]
            if not bm.allocate_slots(r, 1):
                raise RuntimeError(f"scheduler plan not applicable: 1 slot for {r.request_id!r}")
            table = table_of(r.request_id)
            scheduled[i] = scheduled[i]._replace(block_ids=table[:])
            table_lens[i], last_block_ids[i] = len(table), table[-1]
            slots[i] = table[num_computed // block_size] * block_size + num_computed % block_size
    for r in order:
        r.num_computed_tokens += 1
        r.num_output_placeholders = 1
    return step


def commit_decode_token(
    request: Request, sampled: list[int], bm: BlockManager, now: float, block_size: int = 0
) -> RequestStatus:
    """`commit_sampled` of one token (`sampled`) with no drafts verified, proposed or pending. `block_size`:
    the step ran this one input (a decode step), so a block filled only if its position ends one."""
    request.num_output_placeholders -= 1
    status = check_stop_token(request, sampled[0], len(request.output_token_ids) + 1)
    request.append_output_token_ids(sampled)
    if request.first_token_time_s is None:
        request.first_token_time_s = now
    request.last_token_time_s = now
    if not block_size or request.num_computed_tokens % block_size == 0:
        bm.cache_full_blocks(request)
    if request.spec_token_ids:
        request.spec_token_ids = []
    return status


def commit_decode_step(
    scheduled: list[ScheduledRequest],
    sampled: dict[str, list[int]],
    requests: dict[str, Request],
    bm: BlockManager,
    now: float,
    block_size: int,
    remove: Callable[[Request, RequestStatus], None],
) -> list[RequestUpdate]:
    """`commit_decode_token` of each item of a `schedule_decode` step still current in `requests`, `remove`
    of each it finished (one without exactly one token: `commit_sampled`). Returns the updates, in order."""
    running, updates = RequestStatus.RUNNING, []
    for item in scheduled:
        request = item[0]
        request_id = request.request_id
        if (
            requests.get(request_id) is not request
            or request.status is not running
            or request.num_preemptions != item[6]
        ):
            continue
        new_token_ids = sampled.get(request_id, ())
        if len(new_token_ids) == 1:
            status = commit_decode_token(request, new_token_ids, bm, now, block_size)
        else:
            new_token_ids, status = commit_sampled(item, list(new_token_ids), [], bm, 0, now)
        if status is not running:
            remove(request, status)
        updates.append(_new_tuple(RequestUpdate, (request_id, new_token_ids, status)))
    return updates


def commit_sampled(
    item: ScheduledRequest,
    sampled: list[int],
    next_draft_token_ids: list[int],
    bm: BlockManager,
    num_draft_placeholders: int,
    now: float,
) -> tuple[list[int], RequestStatus]:
    """Commit what a sampling step yielded for `item.request`: count and roll back rejected drafts, commit
    tokens up to a stop (`commit_tokens`), cache full blocks, and, unless it finished, take the drafts
    proposed for its next step (`next_draft_token_ids`; with `num_draft_placeholders` only for a request
    left out of the step in flight). Raises ValueError: no token, more tokens than drafts + 1, or
    "accepted" tokens that differ from the drafts."""
    request = item.request
    if len(sampled) == 1 and not item.spec_token_ids and not num_draft_placeholders:
        # a decode step without drafts: nothing to verify or roll back
        request.num_output_placeholders -= 1
        committed, status = commit_tokens(request, [sampled[0]], now)
        bm.cache_full_blocks(request)
        if request.spec_token_ids or next_draft_token_ids:
            num_allowed = request.sampling_params.max_tokens - request.num_output_tokens - 1
            request.spec_token_ids = [] if status.is_finished else list(next_draft_token_ids)[:num_allowed]
        return committed, status
    sampled = list(sampled)
    num_drafts, num_accepted = len(item.spec_token_ids), len(sampled) - 1
    request.num_output_placeholders -= num_drafts + 1
    if (
        not 0 <= num_accepted <= num_drafts
        or num_accepted
        and any(
            token != draft and draft != PLACEHOLDER_TOKEN_ID
            for token, draft in zip(sampled[:num_accepted], item.spec_token_ids, strict=False)
        )
    ):
        raise ValueError(
            f"request {item.request_id!r}: sampled {sampled} does not fit drafts "
            f"{item.spec_token_ids} (expected the accepted drafts then one sampled token)"
        )
    if num_drafts:
        request.drafts = request.drafts.plus(num_drafts, num_accepted)
        request.num_computed_tokens -= num_drafts - num_accepted
        bm.trim(request, request.num_computed_tokens)
    if not num_draft_placeholders:
        request.spec_token_ids = []
    new_token_ids, status = commit_tokens(request, sampled, now)
    bm.cache_full_blocks(request)
    # No draft beyond the last allowed output token (keeps slots within check_request_fits).
    num_allowed = request.sampling_params.max_tokens - request.num_output_tokens - 1
    if status.is_finished:
        return new_token_ids, status
    if not num_draft_placeholders:
        request.spec_token_ids = list(next_draft_token_ids)[:num_allowed]
    elif request.num_output_placeholders == 0 and request.spec_token_ids:
        num_drafts = min(len(request.spec_token_ids), num_allowed)
        request.spec_token_ids = list(next_draft_token_ids)[:num_drafts]
    return new_token_ids, status


def commit_tokens(request: Request, sampled: list[int], now: float) -> tuple[list[int], RequestStatus]:
    """Append sampled tokens up to and including the first that stops the request
    (`engine.stopping.check_stop_token`: EOS, a stop token id, the max_tokens-th token); sets the first and
    last token times to `now` (seconds, the scheduler's clock).
    """
    if len(sampled) == 1:  # a decode step without drafts
        committed = sampled
        status = check_stop_token(request, sampled[0], request.num_output_tokens + 1)
        request.append_output_token_ids(committed)
        if request.first_token_time_s is None:
            request.first_token_time_s = now
        request.last_token_time_s = now
        return committed, status
    committed = []
    status = RequestStatus.RUNNING
    for token_id in sampled:
        committed.append(token_id)
        status = check_stop_token(request, token_id, request.num_output_tokens + len(committed))
        if status.is_finished:
            break
    request.append_output_token_ids(committed)
    if request.first_token_time_s is None:
        request.first_token_time_s = now
    request.last_token_time_s = now
    return committed, status
