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
