"""Persistent batch rows: one preallocated row per running request, updated by deltas (as vLLM v1's)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from pdcluster.engine.outputs import PLACEHOLDER_TOKEN_ID

if TYPE_CHECKING:
    from pdcluster.engine.outputs import ScheduledRequest
    from pdcluster.engine.request_step import DecodeStep
    from pdcluster.engine.sampling_params import SamplingParams


_FIELDS = (
    ("temperature", np.float32),
    ("top_k", np.int64),
    ("top_p", np.float32),
    ("presence_penalty", np.float32),
    ("frequency_penalty", np.float32),
    ("repetition_penalty", np.float32),
    ("min_tokens", np.int64),
    ("has_logit_bias", np.bool_),
    ("processed", np.bool_),
    ("logprobs", np.int64),
)
_SamplingFields = NamedTuple("_SamplingFields", [(name, np.ndarray) for name, _ in _FIELDS])


class SamplingArrays(_SamplingFields):
    """Sampling parameters of a batch, one entry per request (`kernels.sampling`'s terms).

    temperature: `[B]` float32 (0 = greedy); top_k: `[B]` int64 (<= 0 off); top_p: `[B]` float32.
    presence_penalty, frequency_penalty, repetition_penalty: `[B]` float32 (0, 0, 1: off); min_tokens: `[B]`
    int64; has_logit_bias: `[B]` bool (biases stay in `SamplingParams`); processed: `[B]` bool, a penalty,
    logit bias or `min_tokens` changes its logits; logprobs: `[B]` int64, top logprobs asked (-1: none).
    Batch-wide flags below are cached per object (only `set_row` writes, on the persistent batch's)."""

    @classmethod
    def of(cls, params: Sequence[SamplingParams]) -> SamplingArrays:
        """From per-request `SamplingParams` (the reference the persistent rows must equal)."""
        n = len(params)
        return cls(*(np.fromiter((_value(p, name) for p in params), dtype, n) for name, dtype in _FIELDS))

    def take(self, index: np.ndarray | Sequence[int] | slice) -> SamplingArrays:
        """The entries at `index` (a copy for an index array)."""
        return SamplingArrays(*(array[index] for array in self))

    def set_row(self, row: int, params: SamplingParams) -> None:
        """Write `params` into row `row` of every array."""
        for array, (name, _) in zip(self, _FIELDS, strict=True):
            array[row] = _value(params, name)

    @cached_property
    def all_greedy(self) -> bool:
        return not self.temperature.any()

    @cached_property
    def any_processed(self) -> bool:
        return bool(self.processed.any())

    @cached_property
    def penalized(self) -> np.ndarray:
        """`[B]` bool: the requests with a presence, frequency or repetition penalty."""
        return (self.presence_penalty != 0) | (self.frequency_penalty != 0) | (self.repetition_penalty != 1)

    @cached_property
    def only_penalties(self) -> bool:
        """No `min_tokens` nor logit bias in the batch: penalties are its only logit processors."""
        return not (self.min_tokens.any() or self.has_logit_bias.any())

    @cached_property
    def penalties_on(self) -> tuple[bool, bool, bool]:
        """Whether any request has a presence, a frequency, a repetition penalty."""
        return tuple(
            bool(a.any())
            for a in (self.presence_penalty, self.frequency_penalty, self.repetition_penalty - 1)
        )

    @cached_property
    def any_logprobs(self) -> bool:
        return bool((self.logprobs >= 0).any())

    @cached_property
    def logprob_temperature(self) -> np.ndarray | None:
        """`[B]` float32 the logprobs divide by (1 when greedy); None when every entry is 1."""
        t = self.temperature
        return np.where(t == 0, np.float32(1), t) if ((t != 0) & (t != 1)).any() else None


def _value(params: SamplingParams, name: str) -> float | int | bool:
    if name == "processed":
        p = params
        penalized = p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1
        return penalized or p.min_tokens > 0 or bool(p.logit_bias)
    if name == "logprobs":
        return -1 if params.logprobs is None else params.logprobs
    return bool(params.logit_bias) if name == "has_logit_bias" else getattr(params, name)


class BlockTableRows:
    """Block ids of the running requests: table `[num_rows, num_columns]` int64 (0 past `lens[r]`), lens
    `[num_rows]` int64. Raises ValueError (`update`): a request holds more than `num_columns` blocks."""

    def __init__(self, num_rows: int, num_columns: int) -> None:
        num_rows = max(1, num_rows)
        self.table = np.zeros((num_rows, max(1, num_columns)), dtype=np.int64)
        self.lens = np.zeros(num_rows, dtype=np.int64)
        self._row_of: dict[str, int] = {}
        # Per row, as Python ints for the per-step check: (blocks held, first block id, last block id).
        self._known: list[tuple[int, int, int]] = [(0, -1, -1)] * num_rows
        self._free = list(range(num_rows - 1, -1, -1))
        self._num_row_changes = 0  # rows given or taken back so far
        self._num_table_writes = 0  # `_write_blocks` calls that changed the table so far

    @property
    def num_requests(self) -> int:
        """Requests holding a row."""
        return len(self._row_of)

    def remove(self, request_ids: list[str]) -> None:
        """Give back the rows of `request_ids` (finished, aborted or preempted); unknown ids are skipped."""
        for request_id in request_ids:
            row = self._row_of.pop(request_id, None)
            if row is not None:
                self._num_row_changes += 1
                self.table[row, : self._known[row][0]] = 0
                self.lens[row] = 0
                self._known[row] = (0, -1, -1)
                self._free.append(row)

    def update(self, request_id: str, block_ids: list[int]) -> int:
        """The row of `request_id` (new for a new request), brought up to `block_ids` (appended ids only)."""
        row = self._row_of.get(request_id)
        if row is None:
            row = self._allocate(request_id)
        self._write_blocks(row, request_id, block_ids)
        return row

    def _write_blocks(self, row: int, request_id: str, block_ids: list[int]) -> None:
        """`update` of a known row."""
        n = len(block_ids)
        known_len, first, last = self._known[row]
        if n == known_len and (n == 0 or (block_ids[0] == first and block_ids[-1] == last)):
            return
        if n > self.table.shape[1]:
            raise ValueError(f"request {request_id!r} holds {n} blocks, the table has {self.table.shape[1]}")
        grew = known_len and n > known_len and block_ids[0] == first and block_ids[known_len - 1] == last
        start = known_len if grew else 0
        self._num_table_writes += 1
        self.table[row, start:n] = block_ids[start:]
        if n < known_len:
            self.table[row, n:known_len] = 0
        self.lens[row] = n
        self._known[row] = (n, block_ids[0], block_ids[-1]) if n else (0, -1, -1)

    def _allocate(self, request_id: str) -> int:
        if not self._free:
            old = len(self.lens)
            self._grow_rows()
            self._known += [(0, -1, -1)] * old
            self._free = list(range(2 * old - 1, old - 1, -1))
        row = self._free.pop()
        self._num_row_changes += 1
        self._row_of[request_id] = row
        return row

    def _grow_rows(self) -> None:
        """Double the row arrays (a subclass doubles its own arrays too)."""
        self.table = np.concatenate([self.table, np.zeros_like(self.table)])
        self.lens = np.concatenate([self.lens, np.zeros_like(self.lens)])


class RequestRows(BlockTableRows):
    """`BlockTableRows` plus each row's sampling parameters and token ids: the persistent batch.

    token_ids: `[num_rows, max_num_tokens]` int64 (zeroed; int64 to gather into the input buffer).
    num_valid_tokens: `[num_rows]` int64, valid positions of each row; 0 for a free row.
    Raises ValueError: a request's tokens or inputs reach past `max_num_tokens` (`join`, `add_step`).
    """

    def __init__(self, num_rows: int, num_columns: int, max_num_tokens: int) -> None:
        super().__init__(num_rows, num_columns)
        self.sampling = _default_sampling(len(self.lens))
        self._last_taken: tuple[object, bytes, SamplingArrays] | None = None  # `sampling_of`'s last result
        # `[num_rows]` bool: the row's request asks for no logprobs, prompt logprobs nor structured output
        self.plain = np.zeros(len(self.lens), dtype=np.bool_)
        self._last_flags: tuple[np.ndarray, int, tuple[bool, bool]] | None = None  # `row_flags`' cache
        self.token_ids = np.zeros((len(self.lens), max(1, max_num_tokens)), dtype=np.int64)
        self.num_valid_tokens = np.zeros(len(self.lens), dtype=np.int64)
        self._num_committed = [0] * len(self.lens)
        # `add_decode_step`'s cache: (key, row changes, rows, row index, ones)
        self._decode_rows: tuple[object, int, list[int], np.ndarray, np.ndarray] | None = None
        self._make_views()

    def _make_views(self) -> None:
        self._token_ids_flat = memoryview(self.token_ids.reshape(-1))
        self._num_valid_flat = memoryview(self.num_valid_tokens)

    def join(self, request_id: str, token_ids: Sequence[int], params: SamplingParams) -> int:
        """Give a request a row with its sampling parameters and committed `token_ids` (prompt and outputs).
        Raises ValueError: the request already holds a row, or `token_ids` is longer than a row."""
        if request_id in self._row_of:
            raise ValueError(f"request {request_id!r} already holds row {self._row_of[request_id]}")
        num_tokens = len(token_ids)
        self._check_fits(request_id, num_tokens)
        row = self._allocate(request_id)
        self.sampling.set_row(row, params)
        wants = params.logprobs is not None or params.prompt_logprobs is not None or params.structured_output
        self.plain[row] = not wants
        self._last_taken = None
        self.token_ids[row, :num_tokens] = token_ids
        self.num_valid_tokens[row] = num_tokens
        self._num_committed[row] = num_tokens
        return row

    def add_step(self, items: Sequence[ScheduledRequest]) -> ScheduledRows:
        """Bring the rows of a step's requests up to date and return the step as row indices.
        Raises ValueError: a request's tokens or inputs reach past a row's `max_num_tokens` positions, its
        placeholders and drafts would overwrite committed tokens, or it holds more blocks than the table's
        columns; RuntimeError: a request has fewer committed tokens than its row (a request that left
        without `remove`, under a reused id)."""
        width = self.token_ids.shape[1]
        row_of, num_committed, known = self._row_of, self._num_committed, self._known
        tokens, num_valid = self._token_ids_flat, self._num_valid_flat
        rows: list[int] = []
        starts: list[int] = []
        counts: list[int] = []
        num_uncommitted_inputs = 0
        for item in items:
            request = item.request
            request_id = request.request_id
            row = row_of.get(request_id)
            if row is None:
                row = self.join(request_id, request.all_token_ids, request.sampling_params)
                tokens, num_valid = self._token_ids_flat, self._num_valid_flat
            all_token_ids = request.all_token_ids
            num_tokens = len(all_token_ids)
            num_written = num_committed[row]
            if num_tokens > num_written:
                self._check_fits(request_id, num_tokens)
                index = row * width
                if num_tokens == num_written + 1:
                    tokens[index + num_written] = all_token_ids[num_written]
                else:
                    for position in range(num_written, num_tokens):
                        tokens[index + position] = all_token_ids[position]
                num_committed[row] = num_tokens
            elif num_tokens < num_written:
                raise RuntimeError(f"request {request_id!r} has {num_tokens} tokens, its row {num_written}")
            # `update`, inlined check: usually the blocks did not change
            block_ids = item.block_ids
            num_blocks, first, last = known[row]
            if len(block_ids) != num_blocks or (
                num_blocks and (block_ids[-1] != last or block_ids[0] != first)
            ):
                self._write_blocks(row, request_id, block_ids)
            start, count = item.start_position, item.num_scheduled_tokens
            rows.append(row)
            starts.append(start)
            counts.append(count)
            num_placeholders, spec_token_ids = item.num_placeholders, item.spec_token_ids
            if num_placeholders or spec_token_ids:
                end = start + count
                first_uncommitted = end - num_placeholders - len(spec_token_ids)
                if first_uncommitted < num_tokens or end > width:
                    raise ValueError(
                        f"request {request_id!r}: inputs {first_uncommitted} .. {end - 1} are not past its "
                        f"{num_tokens} committed tokens or not within a row of {width}"
                    )
                index = row * width + first_uncommitted
                for _ in range(num_placeholders):
                    tokens[index] = PLACEHOLDER_TOKEN_ID
                    index += 1
                for token_id in spec_token_ids:
                    tokens[index] = token_id
                    index += 1
                num_valid[row] = end
                num_uncommitted_inputs += num_placeholders + len(spec_token_ids)
            else:
                num_valid[row] = num_tokens
        # [3, num_reqs]: one conversion for the three per-step arrays
        row_index, start_positions, num_scheduled_tokens = np.array((rows, starts, counts), dtype=np.int64)
        return ScheduledRows(self, row_index, start_positions, num_scheduled_tokens, num_uncommitted_inputs)

    def add_decode_step(self, key: object, step: DecodeStep) -> ScheduledRows | None:
        """`add_step` of a `request_step.DecodeStep` (every request runs its newest token); None (nothing
        changed) when one holds no row or is not one token behind. `key`: one object per running set (its
        rows are cached). The result carries `step`, for `InputBuffers.pack_rows`'s decode path."""
        items, last_token_ids, starts, table_lens, last_block_ids = step[:5]
        cached = self._decode_rows
        if cached is None or cached[0] is not key or cached[1] != self._num_row_changes:
            rows = [self._row_of.get(item.request_id, -1) for item in items]
            if -1 in rows:
                return None
            row_index, ones = np.array(rows, dtype=np.int64), np.ones(len(rows), dtype=np.int64)
            row_index.flags.writeable = ones.flags.writeable = False
            cached = self._decode_rows = (key, self._num_row_changes, rows, row_index, ones)
        rows, row_index = cached[2], cached[3]
        num_committed, width = self._num_committed, self.token_ids.shape[1]
        for row, start in zip(rows, starts, strict=True):
            if num_committed[row] != start or start >= width:
                return None
        # per-element writes: cheaper than numpy calls at decode batch sizes
        tokens, num_valid, known = self._token_ids_flat, self._num_valid_flat, self._known
        changed = []
        per_row = zip(rows, starts, table_lens, last_block_ids, strict=True)
        for i, (row, start, num_blocks, last) in enumerate(per_row):
            tokens[row * width + start] = last_token_ids[i]
            num_valid[row] = num_committed[row] = start + 1
            held = known[row]
            if held[0] != num_blocks or held[2] != last:
                changed.append(i)
        for i in changed:  # usually the rows that took a new block
            self._write_blocks(rows[i], items[i].request_id, items[i].block_ids)
        version = (self._num_row_changes, self._num_table_writes)
        return ScheduledRows(self, row_index, np.array(starts, dtype=np.int64), cached[4], 0, step, version)

    def sampling_of(self, row_index: np.ndarray) -> SamplingArrays:
        """`sampling.take(row_index)` (read-only; the same arrays while rows and parameters are unchanged)."""
        last = self._last_taken
        if last is not None and last[0] is row_index and not row_index.flags.writeable:
            return last[2]  # the same read-only array (`add_decode_step`'s): the same rows
        key = row_index.tobytes()
        if last is None or last[1] != key:
            last = self._last_taken = (row_index, key, self.sampling.take(row_index))
        return last[2]

    def row_flags(self, row_index: np.ndarray) -> tuple[bool, bool]:
        """(plain: none wants logprobs or structured output, processed: one has a logit processor) of
        `row_index`'s requests; cached for `add_decode_step`'s read-only row index while no row changes."""
        last = self._last_flags
        if last is not None and last[0] is row_index and last[1] == self._num_row_changes:
            return last[2]
        flags = bool(self.plain[row_index].all()), bool(self.sampling.processed[row_index].any())
        if not row_index.flags.writeable:
            self._last_flags = (row_index, self._num_row_changes, flags)
        return flags

    def remove(self, request_ids: list[str]) -> None:
        rows = [self._row_of[r] for r in request_ids if r in self._row_of]
        self._last_taken = None
        super().remove(request_ids)
        defaults = _default_sampling(1)
        for array, default in zip(self.sampling, defaults, strict=True):
            array[rows] = default[0]
        self.num_valid_tokens[rows] = 0
        self.plain[rows] = False
        for row in rows:
            self._num_committed[row] = 0

    def _check_fits(self, request_id: str, num_tokens: int) -> None:
        if num_tokens > self.token_ids.shape[1]:
            raise ValueError(
                f"request {request_id!r} needs {num_tokens} token positions, a row has "
                f"{self.token_ids.shape[1]}"
            )

    def _grow_rows(self) -> None:
        super()._grow_rows()
        self._last_taken = None
        extra = _default_sampling(len(self.lens) - len(self.sampling.temperature))
        self.sampling = SamplingArrays(
            *(np.concatenate(pair) for pair in zip(self.sampling, extra, strict=True))
        )
        self.token_ids = np.concatenate([self.token_ids, np.zeros_like(self.token_ids)])
        self.num_valid_tokens = np.concatenate([self.num_valid_tokens, np.zeros_like(self.num_valid_tokens)])
        self.plain = np.concatenate([self.plain, np.zeros_like(self.plain)])
        self._num_committed += [0] * (len(self.lens) - len(self._num_committed))
        self._make_views()


class ScheduledRows(NamedTuple):
    """A step's requests as rows of `RequestRows` (`add_step`), for `InputBuffers.pack_rows`.

    row_index, start_positions (of the first input), num_scheduled_tokens: `[num_reqs]` int64, batch order.
    decode: a decode step's per-request lists (`add_decode_step`); table_version: the rows' block-table
    changes as of `add_decode_step` (equal versions with the same `row_index` object: equal tables).
    """

    rows: RequestRows
    row_index: np.ndarray
    start_positions: np.ndarray
    num_scheduled_tokens: np.ndarray
    num_uncommitted_inputs: int = 0
    decode: DecodeStep | None = None
    table_version: tuple[int, int] | None = None


def _default_sampling(num_rows: int) -> SamplingArrays:
    """Greedy, no filter, no logit processor, no logprobs."""
    fill = {"top_p": 1, "repetition_penalty": 1, "logprobs": -1}
    return SamplingArrays(*(np.full(num_rows, fill.get(n, 0), dtype) for n, dtype in _FIELDS))
