"""Persistent block-table rows (`engine.input_batch.BlockTableRows`) and `InputBuffers.pack` over them."""

from __future__ import annotations

import numpy as np
import pytest

from engine.input_batch import BlockTableRows
from engine.model_runner import InputBuffers


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
    rows = BlockTableRows(num_rows=4, num_columns=4)
    rows.update("x", [9, 9, 9, 9])
    rows.remove(["x"])  # a freed row that held more blocks than any of the batch
    index = np.array([rows.update(str(r), t) for r, t in enumerate(tables)], dtype=np.int64)
    got = InputBuffers(16, 4, 4, 16).pack(token_ids, starts, None, block_table_rows=(rows, index))
    for name, want, have in zip(expected._fields, expected, got, strict=True):
        assert want.tolist() == have.tolist(), name
    with pytest.raises(ValueError, match="need 3 blocks, table has 2"):
        InputBuffers(16, 4, 4, 16).pack([[1]], [32], None, block_table_rows=(rows, index[2:]))


def test_request_rows_keep_sampling_parameters_from_join_to_finish() -> None:
    from engine.input_batch import RequestRows, SamplingArrays
    from engine.sampling_params import SamplingParams

    a_params, b_params = SamplingParams(temperature=0.7, top_k=5), SamplingParams(top_p=0.25)
    rows = RequestRows(num_rows=1, num_columns=4)
    a = rows.join("a", [1], a_params)
    b = rows.join("b", [2], b_params)  # the rows double: the sampling arrays too
    assert rows.join("a", [1, 3], SamplingParams(temperature=0.0)) == a  # params written once, at join
    got = rows.sampling.take(np.array([b, a]))
    want = SamplingArrays.of([b_params, a_params])
    for have, expected in zip(got, want, strict=True):
        np.testing.assert_array_equal(have, expected)
    rows.remove(["a"])
    c = rows.join("c", [4], SamplingParams(temperature=0.0))  # reuses a's row: no stale parameters
    assert c == a and rows.sampling.temperature[c] == 0 and rows.sampling.top_k[c] == 0


def test_prepare_over_persistent_rows_equals_the_reference_pack() -> None:
    """A real engine whose requests join, grow (block size 4) and finish at different steps, two seats:
    every step `Executor.prepare` builds from its rows exactly what packing the scheduled requests'
    lists gives (`build_model_input`), and the sampling parameters gathered from the rows equal theirs."""
    from engine.input_batch import SamplingArrays
    from engine.llm import LLM
    from engine.model_runner import build_model_input
    from engine.sampling_params import SamplingParams
    from models import bundled_checkpoint_dir

    engine = LLM(bundled_checkpoint_dir(), num_kv_blocks=64, block_size=4, max_num_seqs=2).engine
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
        return prepared

    engine.executor.prepare = checking_prepare
    while engine.has_unfinished_requests():
        engine.step()
    assert len(checked) > 8 and max(checked) == 2
