"""Persistent batch rows: one preallocated row per running request, updated by deltas (vLLM v1's input
batch keeps its rows the same way; this is our own, smaller version): the block table, and (`RequestRows`)
the sampling parameters as arrays, written once when the request joins, so a step gathers them for the
whole batch (`SamplingArrays`) instead of rebuilding them from each request's `SamplingParams`.

A running request's block list only grows (the scheduler appends blocks as it runs further), so a step
writes only the block ids appended since the request's previous step, usually none; a step's
`[num_reqs, max_num_blocks]` block table is then one gather of the scheduled rows (`InputBuffers.pack`).
A row is given back when its request finishes or is preempted (the step's `SchedulerOutput` lists them);
a request whose blocks changed other than by growing (its first or last known block differs) has its row
rewritten, so a stale row is never read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from engine.sampling_params import SamplingParams


class SamplingArrays(NamedTuple):
    """Sampling parameters of a batch, one entry per request (the sampler's own terms, see
    `kernels.sampling.probs_from_logits`).

    temperature: `[B]` float32 (0 = greedy); top_k: `[B]` int64 (<= 0 off); top_p: `[B]` float32.
    """

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray

    @classmethod
    def of(cls, params: Sequence[SamplingParams]) -> SamplingArrays:
        """From per-request `SamplingParams` (the reference the persistent rows must equal)."""
        n = len(params)
        return cls(
            np.fromiter((p.temperature for p in params), np.float32, n),
            np.fromiter((p.top_k for p in params), np.int64, n),
            np.fromiter((p.top_p for p in params), np.float32, n),
        )

    def take(self, index: np.ndarray | Sequence[int] | slice) -> SamplingArrays:
        """The entries at `index` (a copy for an index array)."""
        return SamplingArrays(self.temperature[index], self.top_k[index], self.top_p[index])

    @property
    def all_greedy(self) -> bool:
        return not self.temperature.any()


class BlockTableRows:
    """Block ids of the running requests, one row each.

    Attributes:
        table: `[num_rows, num_columns]` int64 block ids; row r's columns past `lens[r]` are 0.
        lens: `[num_rows]` int64, blocks held in each row.

    Args:
        num_rows: rows preallocated (the engine's `max_num_seqs`); grows by doubling past it.
        num_columns: blocks one request may hold at most.

    Raises:
        ValueError: (`update`) a request holds more than `num_columns` blocks.
    """

    def __init__(self, num_rows: int, num_columns: int) -> None:
        num_rows = max(1, num_rows)
        self.table = np.zeros((num_rows, max(1, num_columns)), dtype=np.int64)
        self.lens = np.zeros(num_rows, dtype=np.int64)
        self._row_of: dict[str, int] = {}
        # Per row, as Python ints for the per-step check: (blocks held, first block id, last block id).
        self._known: list[tuple[int, int, int]] = [(0, -1, -1)] * num_rows
        self._free = list(range(num_rows - 1, -1, -1))

    @property
    def num_requests(self) -> int:
        """Requests holding a row."""
        return len(self._row_of)

    def remove(self, request_ids: list[str]) -> None:
        """Give back the rows of `request_ids` (finished, aborted or preempted); unknown ids are skipped."""
        for request_id in request_ids:
            row = self._row_of.pop(request_id, None)
            if row is not None:
                self.table[row, : self._known[row][0]] = 0
                self.lens[row] = 0
                self._known[row] = (0, -1, -1)
                self._free.append(row)

    def update(self, request_id: str, block_ids: list[int]) -> int:
        """The row of `request_id` (a new one for a new request), brought up to `block_ids`: writes only
        the ids appended since the last update, or the whole row when the list did not just grow."""
        row = self._row_of.get(request_id)
        if row is None:
            row = self._allocate(request_id)
        n = len(block_ids)
        known_len, first, last = self._known[row]
        if n == known_len and (n == 0 or (block_ids[0] == first and block_ids[-1] == last)):
            return row  # the common decode step: no new block
        if n > self.table.shape[1]:
            raise ValueError(f"request {request_id!r} holds {n} blocks, the table has {self.table.shape[1]}")
        grew = known_len and n > known_len and block_ids[0] == first and block_ids[known_len - 1] == last
        start = known_len if grew else 0
        self.table[row, start:n] = block_ids[start:]
        if n < known_len:
            self.table[row, n:known_len] = 0
        self.lens[row] = n
        self._known[row] = (n, block_ids[0], block_ids[-1]) if n else (0, -1, -1)
        return row

    def _allocate(self, request_id: str) -> int:
        if not self._free:  # more running requests than rows: double the rows
            old = len(self.lens)
            self._grow_rows()
            self._known += [(0, -1, -1)] * old
            self._free = list(range(2 * old - 1, old - 1, -1))
        row = self._free.pop()
        self._row_of[request_id] = row
        return row

    def _grow_rows(self) -> None:
        """Double the row arrays (a subclass doubles its own arrays too)."""
        self.table = np.concatenate([self.table, np.zeros_like(self.table)])
        self.lens = np.concatenate([self.lens, np.zeros_like(self.lens)])


class RequestRows(BlockTableRows):
    """`BlockTableRows` plus each row's sampling parameters, written when the request takes its row
    (`join`) and kept while it runs (a request's `SamplingParams` never change).

    Attributes (besides `table`, `lens`):
        sampling: `SamplingArrays` over all rows; a free row holds greedy defaults.
    """

    def __init__(self, num_rows: int, num_columns: int) -> None:
        super().__init__(num_rows, num_columns)
        self.sampling = _default_sampling(len(self.lens))

    def join(self, request_id: str, block_ids: list[int], params: SamplingParams) -> int:
        """`update`, writing the request's sampling parameters the first time it takes a row."""
        if request_id not in self._row_of:
            row = self._allocate(request_id)
            temperature, top_k, top_p = self.sampling
            temperature[row], top_k[row], top_p[row] = params.temperature, params.top_k, params.top_p
        return self.update(request_id, block_ids)

    def remove(self, request_ids: list[str]) -> None:
        rows = [self._row_of[r] for r in request_ids if r in self._row_of]
        super().remove(request_ids)
        temperature, top_k, top_p = self.sampling
        temperature[rows], top_k[rows], top_p[rows] = 0.0, 0, 1.0

    def _grow_rows(self) -> None:
        super()._grow_rows()
        extra = _default_sampling(len(self.lens) - len(self.sampling.temperature))
        self.sampling = SamplingArrays(
            *(np.concatenate(pair) for pair in zip(self.sampling, extra, strict=True))
        )


def _default_sampling(num_rows: int) -> SamplingArrays:
    return SamplingArrays(
        np.zeros(num_rows, np.float32), np.zeros(num_rows, np.int64), np.ones(num_rows, np.float32)
    )
