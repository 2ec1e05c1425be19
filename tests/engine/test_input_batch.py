"""Persistent batch rows (`engine.input_batch`: block tables, sampling parameters, token ids) and
`InputBuffers.pack_rows` over them, against the per-request reference packing."""

from __future__ import annotations

import numpy as np
import pytest

from pdcluster.engine.input_batch import BlockTableRows, RequestRows, SamplingArrays, ScheduledRows
from pdcluster.engine.model_runner import InputBuffers, build_model_input
from pdcluster.engine.outputs import PLACEHOLDER_TOKEN_ID as P
from pdcluster.engine.outputs import ScheduledRequest
from pdcluster.engine.request import Request
from pdcluster.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def test_rows_grow_by_deltas_are_rewritten_when_replaced_and_given_back() -> None:
    rows = BlockTableRows(num_rows=2, num_columns=4)
    a = rows.update("a", [7])
    b = rows.update("b", [3, 4])
    assert a != b and rows.num_requests == 2
    assert rows.update("a", [7, 9]) == a  # grew: the same row, one id appended
    np.testing.assert_array_equal(rows.table[a], [7, 9, 0, 0])
    np.testing.assert_array_equal(rows.lens[[a, b]], [2, 2])
    assert rows.update("b", [5]) == b  # not a growth (other blocks): rewritten, the tail zeroed
    np.testing.assert_array_equal(rows.table[b], [5, 0, 0, 0])
    c = rows.update("c", [1, 2, 6])  # a third request: the rows double
    assert len(rows.lens) == 4 and rows.num_requests == 3
    np.testing.assert_array_equal(rows.table[c], [1, 2, 6, 0])
    rows.remove(["a", "unknown"])
    assert rows.num_requests == 2 and rows.lens[a] == 0 and not rows.table[a].any()
    d = rows.update("d", [8])  # reuses a freed row, with no stale ids
    np.testing.assert_array_equal(rows.table[d], [8, 0, 0, 0])
    with pytest.raises(ValueError, match="holds 5 blocks, the table has 4"):
        rows.update("d", [8, 1, 2, 3, 4])


def test_pack_over_rows_equals_pack_over_lists() -> None:
    tables = [[4, 1, 6], [2], [5, 3]]
    token_ids, starts = [[11, 12], [13], [14, 15, 16]], [33, 3, 17]
    expected = InputBuffers(16, 4, 4, 16).pack(token_ids, starts, tables)
    rows = RequestRows(num_rows=4, num_columns=4, max_num_tokens=64)
    rows.join("x", [9] * 40, GREEDY)
    rows.update("x", [9, 9, 9, 9])
    rows.remove(["x"])  # a freed row that held more blocks and tokens than any of the batch
    index = []
    for r, (table, tokens, start) in enumerate(zip(tables, token_ids, starts, strict=True)):
        index.append(rows.join(str(r), [0] * start + tokens, GREEDY))
        rows.update(str(r), table)
    step = ScheduledRows(rows, np.array(index), np.array(starts), np.array([len(t) for t in token_ids]))
    got = InputBuffers(16, 4, 4, 16).pack_rows(step)
    for name, want, have in zip(expected._fields, expected, got, strict=True):
        assert want.tolist() == have.tolist(), name
    with pytest.raises(ValueError, match="need 3 blocks, table has 2"):
        last = ScheduledRows(rows, step.row_index[2:], np.array([32]), np.array([1]))
        InputBuffers(16, 4, 4, 16).pack_rows(last)
    # Position 35 of request "0" (in x's former row 0) was never written: refused, not read stale.
    with pytest.raises(ValueError, match="up to 36 of row 0, which holds 35 valid tokens"):
        InputBuffers(16, 4, 4, 16).pack_rows(step._replace(num_scheduled_tokens=np.array([3, 1, 3])))


def test_pack_rows_one_input_each_and_a_request_with_none() -> None:
    """The path for one input per request, and a batch with as many inputs as requests that is not
    one each (a request with no input): both equal the reference packing."""
    rows = RequestRows(num_rows=4, num_columns=4, max_num_tokens=32)
    for name, first, blocks in (("a", 10, [1, 2, 3]), ("b", 30, [4, 5, 6])):
        rows.join(name, list(range(first, first + 10)), GREEDY)
        rows.update(name, blocks)
    tables = [[1, 2, 3], [4, 5, 6]]
    for token_ids, starts in (([[19], [37]], [9, 7]), ([[], [35, 36]], [3, 5])):
        counts = [len(t) for t in token_ids]
        step = ScheduledRows(rows, np.array([0, 1]), np.array(starts), np.array(counts))
        got = InputBuffers(8, 4, 4, 4).pack_rows(step)
        want = InputBuffers(8, 4, 4, 4).pack(token_ids, starts, tables)
        for name, expected, packed in zip(want._fields, want, got, strict=True):
            assert packed.tolist() == expected.tolist(), (counts, name)


def test_request_rows_keep_sampling_parameters_from_join_to_finish() -> None:
    a_params, b_params = SamplingParams(temperature=0.7, top_k=5), SamplingParams(top_p=0.25)
    rows = RequestRows(num_rows=1, num_columns=4, max_num_tokens=8)
    a = rows.join("a", [1], a_params)
    b = rows.join("b", [2], b_params)  # the rows double: the sampling and token arrays too
    assert rows.token_ids.shape == (2, 8) and rows.num_valid_tokens.tolist() == [1, 1]
    with pytest.raises(ValueError, match="already holds row"):
        rows.join("a", [1, 3], SamplingParams(temperature=0.0))  # params written once, at join
    got = rows.sampling.take(np.array([b, a]))
    want = SamplingArrays.of([b_params, a_params])
    for have, expected in zip(got, want, strict=True):
        np.testing.assert_array_equal(have, expected)
    rows.remove(["a"])
    c = rows.join("c", [4], SamplingParams(temperature=0.0))  # reuses a's row: no stale parameters
    assert c == a and rows.sampling.temperature[c] == 0 and rows.sampling.top_k[c] == 0


def test_sampling_arrays_batch_flags() -> None:
    """The batch-wide flags the sampler reads instead of per-step reductions, on a mixed batch and a part."""
    params = [
        SamplingParams(temperature=0.0, logprobs=3, presence_penalty=0.5),
        SamplingParams(temperature=0.5, repetition_penalty=1.2, min_tokens=2),
        SamplingParams(temperature=1.0, logit_bias={3: 1.0}),
    ]
    arrays = SamplingArrays.of(params)
    assert not arrays.all_greedy and arrays.any_processed and arrays.any_logprobs
    assert arrays.penalized.tolist() == [True, True, False] and not arrays.only_penalties
    assert arrays.penalties_on == (True, False, True)
    assert arrays.logprob_temperature.tolist() == [1.0, 0.5, 1.0]  # greedy rows: divided by 1
    first = arrays.take(np.array([0]))
    assert first.all_greedy and first.only_penalties and first.penalties_on == (True, False, False)
    assert first.logprob_temperature is None  # nothing to divide
    last = arrays.take(np.array([2]))
    assert not last.any_logprobs and last.any_processed and not last.penalized.any()


def make_item(
    request: Request, start: int, count: int, spec: list[int], blocks: list[int], **kw
) -> ScheduledRequest:
    return ScheduledRequest(request, start, count, list(spec), list(blocks), True, **kw)


def test_token_rows_join_grow_commit_roll_back_and_reuse() -> None:
    """The token-id deltas of requests' lives, with the exact rows after each step: join (the prompt),
    a prefill chunk (nothing more written), a decode step with drafts (written past the committed
    tokens), the next step after one accepted draft and a bonus token were committed (only the new
    committed tokens are written; the rejected drafts are no longer valid), a step with a placeholder
    and draft placeholders (asynchronous scheduling), removal, reuse of the row by another request, and
    a request resumed after preemption, which joins again with its prompt and outputs."""
    rows = RequestRows(num_rows=2, num_columns=4, max_num_tokens=12)
    a = Request("a", [11, 12, 13, 14, 15], GREEDY, arrival_time_s=0.0)
    b = Request("b", [21, 22], GREEDY, arrival_time_s=0.0)

    def valid(row: int) -> list[int]:
        return rows.token_ids[row, : rows.num_valid_tokens[row]].tolist()

    step = rows.add_step([make_item(a, 0, 3, [], [7])._replace(samples=False), make_item(b, 0, 2, [], [8])])
    ra, rb = step.row_index.tolist()
    assert (step.start_positions.tolist(), step.num_scheduled_tokens.tolist()) == ([0, 0], [3, 2])
    assert step.num_uncommitted_inputs == 0
    assert valid(ra) == [11, 12, 13, 14, 15] and valid(rb) == [21, 22]
    assert rows.table[ra].tolist() == [7, 0, 0, 0] and rows.lens[[ra, rb]].tolist() == [1, 1]

    b.append_output_token_ids([23])  # b's first token, committed
    step = rows.add_step([make_item(a, 3, 2, [], [7, 9]), make_item(b, 2, 4, [31, 32, 33], [8])])
    assert step.row_index.tolist() == [ra, rb] and step.start_positions.tolist() == [3, 2]
    assert step.num_uncommitted_inputs == 3
    assert valid(ra) == [11, 12, 13, 14, 15] and rows.table[ra].tolist() == [7, 9, 0, 0]  # grew by one block
    assert valid(rb) == [21, 22, 23, 31, 32, 33]  # the committed tokens, then the drafts to verify

    a.append_output_token_ids([16])
    b.append_output_token_ids([31, 40])  # b accepted 31, rejected 32 and 33, sampled 40
    step = rows.add_step([make_item(a, 5, 1, [], [7, 9]), make_item(b, 4, 1, [], [8, 3])])
    assert valid(ra) == [11, 12, 13, 14, 15, 16]
    assert valid(rb) == [21, 22, 23, 31, 40]  # the bonus token over the first rejected draft
    assert rows.token_ids[rb, 5].tolist() == 33  # a rejected draft, past the valid tokens

    step = rows.add_step([make_item(b, 5, 3, [P, P], [8, 3], num_placeholders=1)])  # async: 41 in flight
    assert valid(rb) == [21, 22, 23, 31, 40, P, P, P]
    b.append_output_token_ids([41])  # committed after the step above was scheduled (and packed)
    step = rows.add_step([make_item(b, 5, 1, [], [8, 3])])  # no draft accepted: 41 runs next
    assert valid(rb) == [21, 22, 23, 31, 40, 41]

    rows.remove(["b", "unknown"])
    assert rows.num_valid_tokens[rb] == 0 and rows.lens[rb] == 0 and rows.num_requests == 1
    c = Request("c", [51], GREEDY, arrival_time_s=0.0)
    step = rows.add_step([make_item(c, 0, 1, [], [5])])
    assert step.row_index.tolist() == [rb] and valid(rb) == [51] and rows.table[rb].tolist() == [5, 0, 0, 0]

    rows.remove(["a"])  # preempted: resumed later from token 0 with its prompt and outputs
    a.append_output_token_ids([17])
    step = rows.add_step([make_item(a, 0, 4, [], [2, 6])._replace(samples=False)])
    assert step.row_index.tolist() == [ra] and valid(ra) == [11, 12, 13, 14, 15, 16, 17]
    assert rows.table[ra].tolist() == [2, 6, 0, 0]
    with pytest.raises(ValueError, match="inputs 8 .. 12 are not past its 7 committed tokens or not within"):
        rows.add_step([make_item(a, 7, 6, [1, 2, 3, 4, 5], [2, 6, 1, 3])])  # past the row's 12 positions
    with pytest.raises(ValueError, match="inputs 6 .. 7 are not past its 7 committed tokens"):
        rows.add_step([make_item(a, 5, 3, [1, 2], [2, 6])])  # drafts over committed tokens: refused
    assert valid(ra) == [11, 12, 13, 14, 15, 16, 17]


def test_rows_double_inside_a_step() -> None:
    """More requests than rows: a join in the middle of `add_step` doubles the arrays, and the writes of
    the requests before and after it (committed tokens, drafts) land in the new arrays."""
    rows = RequestRows(num_rows=1, num_columns=2, max_num_tokens=8)
    a = Request("a", [1, 2], GREEDY, arrival_time_s=0.0)
    rows.add_step([make_item(a, 0, 2, [], [4])])
    a.append_output_token_ids([3])
    b = Request("b", [5], GREEDY, arrival_time_s=0.0)
    step = rows.add_step([make_item(a, 2, 3, [6, 7], [4]), make_item(b, 0, 1, [], [9])])
    assert rows.token_ids.shape == (2, 8) and step.row_index.tolist() == [0, 1]
    assert rows.token_ids[0, :5].tolist() == [1, 2, 3, 6, 7] and rows.token_ids[1, :1].tolist() == [5]
    assert rows.num_valid_tokens.tolist() == [5, 1] and rows.table.tolist() == [[4, 0], [9, 0]]
    a.append_output_token_ids([6, 8])
    c = Request("c", [10, 11], GREEDY, arrival_time_s=0.0)
    rows.add_step([make_item(c, 0, 2, [], [3]), make_item(a, 4, 2, [12], [4, 5])])  # doubles first
    assert rows.token_ids.shape == (4, 8) and rows.token_ids[2, :2].tolist() == [10, 11]
    assert rows.token_ids[0, :6].tolist() == [1, 2, 3, 6, 8, 12] and rows.num_valid_tokens[0] == 6


def test_mixed_batch_packs_as_the_per_request_reference() -> None:
    """A prefill chunk, a plain decode, a decode verifying drafts and a placeholder step with draft
    placeholders in one batch: `pack_rows` over the persistent rows gives exactly the `ModelInput` that
    packing the items' own lists gives (token ids, positions, slots, block tables, lengths, starts)."""
    block_size = 4
    rows = RequestRows(num_rows=4, num_columns=8, max_num_tokens=64)
    prefill = Request("prefill", list(range(100, 118)), GREEDY, arrival_time_s=0.0)
    decode = Request("decode", [1, 2, 3, 4, 5], GREEDY, arrival_time_s=0.0)
    drafts = Request("drafts", [6, 7, 8], GREEDY, arrival_time_s=0.0)
    in_flight = Request("in_flight", [9, 10, 11, 12, 13, 14], GREEDY, arrival_time_s=0.0)
    # An earlier step, so that the batch below reads tokens committed since the rows joined too.
    rows.add_step([make_item(r, 0, 1, [], [0]) for r in (decode, drafts, in_flight)])
    for request in (decode, drafts, in_flight):
        request.append_output_token_ids([60, 61])
    items = [
        make_item(prefill, 8, 6, [], [3, 1, 4, 2])._replace(samples=False),  # chunk: positions 8..13
        make_item(decode, 6, 1, [], [5, 9]),
        make_item(drafts, 4, 4, [70, 71, 72], [6, 10]),
        make_item(in_flight, 8, 3, [P, P], [7, 11, 12], num_placeholders=1),
    ]
    step = rows.add_step(items)
    got = InputBuffers(32, 4, 8, block_size).pack_rows(step)
    want = build_model_input(
        [item.token_ids for item in items],
        [item.start_position for item in items],
        [item.block_ids for item in items],
        block_size,
    )
    for name, expected, packed in zip(want._fields, want, got, strict=True):
        assert packed.tolist() == expected.tolist(), name
    assert got.input_ids.tolist() == [108, 109, 110, 111, 112, 113, 61, 61, 70, 71, 72, P, P, P]
    assert got.positions.tolist() == [8, 9, 10, 11, 12, 13, 6, 4, 5, 6, 7, 8, 9, 10]
    assert got.slot_mapping.tolist() == [16, 17, 18, 19, 8, 9, 38, 40, 41, 42, 43, 48, 49, 50]


@pytest.mark.parametrize(
    ("async_scheduling", "k"), [(False, 0), (False, 2), (True, 2)], ids=["sync-k0", "sync-k2", "async-k2"]
)
def test_prepare_over_persistent_rows_equals_the_reference_pack(async_scheduling: bool, k: int) -> None:
    """A real engine whose requests join, grow (block size 4) and finish at different steps, two seats,
    with MTP drafts (k = 2) and placeholders (asynchronous scheduling): every step `Executor.prepare`
    builds from the rows exactly what packing the scheduled requests' lists gives (`build_model_input`;
    placeholders still unresolved), and the sampling parameters gathered from the rows equal theirs."""
    from pdcluster.engine.llm import LLM
    from pdcluster.models import bundled_checkpoint_dir

    engine = LLM(
        bundled_checkpoint_dir(),
        num_kv_blocks=64,
        block_size=4,
        max_num_seqs=2,
        num_speculative_tokens=k,
        async_scheduling=async_scheduling,
    ).engine
    settings = [
        SamplingParams(temperature=0.0, max_tokens=3),
        SamplingParams(temperature=0.9, top_k=7, seed=1, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.5, top_p=0.8, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
    ]
    for i, params in enumerate(settings):
        engine.add_request(list(range(10 + i, 15 + 2 * i)), params)
    prepare = engine.executor.prepare
    checked = []
    checked_items = []

    def checking_prepare(output):
        prepared = prepare(output)
        items = output.scheduled
        if items:
            reference = build_model_input(
                [item.token_ids for item in items],
                [item.start_position for item in items],
                [item.block_ids for item in items],
                engine.runner.block_size,
            )
            for name, want, have in zip(reference._fields, reference, prepared.batch, strict=True):
                if name == "block_tables":  # the rows' table is padded to the widest row of the batch
                    have = have[:, : want.shape[1]]
                assert want.tolist() == have.tolist(), name
            want = SamplingArrays.of([item.request.sampling_params for item in items])
            for have, expected in zip(prepared.sampling, want, strict=True):
                np.testing.assert_array_equal(have, expected)
            assert prepared.query_start_loc == reference.query_start_loc.tolist()
            checked.append(len(items))
            checked_items.extend(items)
        return prepared

    engine.executor.prepare = checking_prepare
    while engine.has_unfinished_requests():
        engine.step()
    assert len(checked) > 5 and max(checked) == 2
    if k:
        assert any(item.spec_token_ids for item in checked_items)
    if async_scheduling:
        assert any(item.num_placeholders for item in checked_items)
