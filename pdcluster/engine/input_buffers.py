"""The step's packed inputs: `ModelInput` (a ragged batch, vLLM-style flattening) and `InputBuffers`, the
persistent tensors it views, filled in place each step without per-request Python.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np
import torch

from pdcluster.engine.input_batch import ScheduledRows


class ModelInput(NamedTuple):
    """One step's flattened batch (vLLM-style ragged packing).
    input_ids: `[num_tokens]` int64, the tokens of all requests back to back.
    positions: `[num_tokens]` int64, each token's position in its request.
    slot_mapping: `[num_tokens]` int64, cache slot (`block_id * block_size + offset`) for each token.
    block_tables: `[num_reqs, max_num_blocks]` int64, padded with 0.
    seq_lens: `[num_reqs]` int64, tokens in the cache for each request after this step's writes.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


class InputBuffers:
    """Preallocated tensors that `pack` fills in place and a packed `ModelInput` views: no tensor is allocated
    per step (vLLM's persistent input batch).

    Host buffers are int64 CPU tensors, filled through numpy views; on a non-CPU device each has a device
    """

    def __init__(
        self,
        max_num_tokens: int,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        block_size: int,
        device: str | torch.device = "cpu",
    ) -> None:
        self.block_size = block_size
        self.device = torch.device(device)
        max_num_blocks_per_req = max(1, max_num_blocks_per_req)
        shapes = (
            (max_num_tokens,),
            (max_num_tokens,),
            (max_num_tokens,),
            (max_num_reqs, max_num_blocks_per_req),
            (max_num_reqs,),
            (max_num_reqs + 1,),
        )
        self._host = [torch.zeros(shape, dtype=torch.long) for shape in shapes]
        self._np = [t.numpy() for t in self._host]
        on_host = self.device.type == "cpu"
        self._device = [t if on_host else torch.zeros_like(t, device=self.device) for t in self._host]
        self._arange = np.arange(max(max_num_tokens, max_num_reqs + 1), dtype=np.int64)
        self._last_views: tuple[tuple[int, int, int], ModelInput] | None = None
        # `_pack_decode`'s last (row index, table version, max blocks): the tables it copied
        self._tables_key: tuple | None = None

    @property
    def host_input_ids(self) -> np.ndarray:
        """`[max_num_tokens]` int64 host copy of the packed input ids (valid up to the last pack's tokens)."""
        return self._np[0]

    @property
    def host_query_start_loc(self) -> np.ndarray:
        """`[max_num_reqs + 1]` int64 host copy of the last pack's query starts."""
        return self._np[5]

    def pack(
        self,
        token_ids: list[list[int]],
        start_positions: list[int],
        block_tables: list[list[int]],
        slot_mapping: list[int] | None = None,
    ) -> ModelInput:
        """Fill the buffers with one ragged batch given as per-request lists and return the `ModelInput`
        viewing them (the reference packing; the engine's steps use `pack_rows`).

        slot_mapping: `[sum n]` cache slot of every token when the caller has them; None computes them.
        Raises ValueError: a request runs a position its block table does not cover, or the batch exceeds
        the buffers' capacity."""
        self._tables_key = None
        num_reqs = len(token_ids)
        num_scheduled = np.fromiter(map(len, token_ids), dtype=np.int64, count=num_reqs)
        table_lens = np.fromiter(map(len, block_tables), dtype=np.int64, count=num_reqs)
        starts = np.asarray(start_positions, dtype=np.int64).reshape(num_reqs)
        num_tokens, max_blocks = self._layout(num_scheduled, starts, table_lens)
        ids_np, pos_np, slots_np, tables_np = self._np[:4]
        ids_np[:num_tokens] = np.fromiter(itertools.chain.from_iterable(token_ids), np.int64, num_tokens)
        tables = tables_np[:num_reqs, :max_blocks]
        tables.fill(0)
        for r, table in enumerate(block_tables):
            tables[r, : len(table)] = table
        if slot_mapping is None:
            self._fill_slots(num_scheduled, tables, num_tokens)
        else:
            slots_np[:num_tokens] = slot_mapping
        return self._views(num_tokens, num_reqs, max_blocks)

    def pack_rows(self, step: ScheduledRows) -> ModelInput:
        """Fill the buffers with one step given as rows of the persistent batch and return the `ModelInput`
        viewing them, with whole-batch numpy ops only (no per-request Python).
        Raises ValueError: a request runs a position its block table does not cover or its row does not
        hold (`RequestRows.num_valid_tokens`), or the batch exceeds the buffers' capacity."""
        if step.decode is not None:
            return self._pack_decode(step)
        self._tables_key = None
        rows, row_index, starts, num_scheduled = step[:4]
        ids_np, pos_np, slots_np, tables_np, seq_lens_np, qsl_np = self._np
        num_reqs = len(row_index)
        num_tokens = int(num_scheduled.sum())
        table_lens = rows.lens[row_index]
        max_blocks = max(1, int(table_lens.max(initial=0)))
        self._check_capacity(num_tokens, num_reqs, max_blocks)
        ends = seq_lens_np[:num_reqs]
        np.add(starts, num_scheduled, out=ends)
        bs = self.block_size
        if (ends > np.minimum(table_lens * bs, rows.num_valid_tokens[row_index])).any():
            self._check_ends(ends, table_lens)
            num_valid = rows.num_valid_tokens[row_index]
            r = int(np.flatnonzero(ends > num_valid)[0])
            raise ValueError(
                f"positions up to {ends[r]} of row {row_index[r]}, which holds {num_valid[r]} valid tokens"
            )
        qsl_np[0] = 0
        np.cumsum(num_scheduled, out=qsl_np[1 : num_reqs + 1])
        positions = pos_np[:num_tokens]
        row_width = rows.token_ids.shape[1]
        if num_tokens == num_reqs and num_scheduled.min(initial=1) == 1:
            request_of_token = self._arange[:num_reqs]
            positions[:] = starts
            flat = row_index * row_width
        else:
            # position of flat token j of request r: starts[r] + (j - query_start_loc[r])
            request_of_token = np.repeat(self._arange[:num_reqs], num_scheduled)
            np.add((starts - qsl_np[:num_reqs])[request_of_token], self._arange[:num_tokens], out=positions)
            flat = (row_index * row_width)[request_of_token]
        flat += positions
        np.take(rows.token_ids, flat, out=ids_np[:num_tokens])
        # rows hold 0 past their blocks: the gather pads with 0
        tables = tables_np[:num_reqs, :max_blocks]
        np.take(rows.table[:, :max_blocks], row_index, axis=0, out=tables)
        slots = slots_np[:num_tokens]
        np.multiply(tables[request_of_token, positions // bs], bs, out=slots)
        slots += positions % bs
        return self._views(num_tokens, num_reqs, max_blocks)

    def _pack_decode(self, step: ScheduledRows) -> ModelInput:
        """`pack_rows` of a decode step (one input per request) from its per-request lists (`step.decode`,
        whose slots `request_step.schedule_decode` computed); the block tables are copied only when they or
        the rows changed since this buffer set's last decode pack."""
        decode = step.decode
        assert decode is not None
        ids_np, pos_np, slots_np, tables_np, seq_lens_np, qsl_np = self._np
        num_reqs = len(decode.start_positions)
        max_blocks = max(decode.table_lens)
        self._check_capacity(num_reqs, num_reqs, max_blocks)
        ids_np[:num_reqs] = decode.last_token_ids
        positions = pos_np[:num_reqs]
        positions[:] = decode.start_positions
        slots_np[:num_reqs] = decode.slot_mapping
        np.add(positions, 1, out=seq_lens_np[:num_reqs])
        key = (step.row_index, step.table_version, max_blocks)
        last = self._tables_key
        if last is None or last[0] is not key[0] or last[1:] != key[1:] or key[1] is None:
            tables = tables_np[:num_reqs, :max_blocks]
            np.take(step.rows.table[:, :max_blocks], step.row_index, axis=0, out=tables)
            qsl_np[: num_reqs + 1] = self._arange[: num_reqs + 1]
            self._tables_key = key
        return self._views(num_reqs, num_reqs, max_blocks)

    def _check_capacity(self, num_tokens: int, num_reqs: int, max_blocks: int) -> None:
        _, pos_np, _, tables_np, seq_lens_np, _ = self._np
        if num_tokens > len(pos_np) or num_reqs > len(seq_lens_np) or max_blocks > tables_np.shape[1]:
            raise ValueError(
                f"batch of {num_reqs} requests, {num_tokens} tokens, {max_blocks} blocks per request "
                f"exceeds the input buffers ({len(seq_lens_np)}, {len(pos_np)}, {tables_np.shape[1]})"
            )

    def _check_ends(self, ends: np.ndarray, table_lens: np.ndarray) -> None:
        too_long = np.flatnonzero(ends > table_lens * self.block_size)
        if too_long.size:
            r = int(too_long[0])
            raise ValueError(
                f"positions up to {ends[r]} need {-(-int(ends[r]) // self.block_size)} blocks, "
                f"table has {table_lens[r]}"
            )

    def _layout(
        self, num_scheduled: np.ndarray, starts: np.ndarray, table_lens: np.ndarray
    ) -> tuple[int, int]:
        """Check the batch against buffers and block tables; fill query starts, seq lengths and positions."""
        _, pos_np, _, _, seq_lens_np, qsl_np = self._np
        num_reqs = len(num_scheduled)
        num_tokens = int(num_scheduled.sum())
        max_blocks = max(1, int(table_lens.max(initial=0)))
        self._check_capacity(num_tokens, num_reqs, max_blocks)
        ends = seq_lens_np[:num_reqs]
        np.add(starts, num_scheduled, out=ends)
        self._check_ends(ends, table_lens)
        qsl_np[0] = 0
        np.cumsum(num_scheduled, out=qsl_np[1 : num_reqs + 1])
        # position of flat token j of request r: starts[r] + (j - query_start_loc[r])
        positions = pos_np[:num_tokens]
        np.add(np.repeat(starts - qsl_np[:num_reqs], num_scheduled), self._arange[:num_tokens], out=positions)
        return num_tokens, max_blocks

    def _fill_slots(self, num_scheduled: np.ndarray, tables: np.ndarray, num_tokens: int) -> None:
        """Slots of the packed positions from the packed block tables `tables` `[num_reqs, max_blocks]`."""
        positions, bs = self._np[1][:num_tokens], self.block_size
        request_of_token = np.repeat(self._arange[: len(num_scheduled)], num_scheduled)
        slots = self._np[2][:num_tokens]
        np.multiply(tables[request_of_token, positions // bs], bs, out=slots)
        slots += positions % bs

    def _views(self, num_tokens: int, num_reqs: int, max_blocks: int) -> ModelInput:
        """The `ModelInput` viewing the packed prefix of each buffer (copied to the device ones first)."""
        sizes = (
            (num_tokens,),
            (num_tokens,),
            (num_tokens,),
            (num_reqs, max_blocks),
            (num_reqs,),
            (num_reqs + 1,),
        )
        if self._device[0] is not self._host[0]:
            for host, dev, size in zip(self._host, self._device, sizes, strict=True):
                index = tuple(slice(n) for n in size)
                dev[index].copy_(host[index])
        key = (num_tokens, num_reqs, max_blocks)
        if self._last_views is not None and self._last_views[0] == key:
            return self._last_views[1]
        batch = ModelInput(
            *(dev[tuple(slice(n) for n in size)] for dev, size in zip(self._device, sizes, strict=True))
        )
        self._last_views = (key, batch)
        return batch


def build_model_input(
    token_ids: list[list[int]],
    start_positions: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: str | torch.device = "cpu",
) -> ModelInput:
    """Pack per-request token lists into a freshly allocated `ModelInput` (see `InputBuffers.pack`)."""
    buffers = InputBuffers(
        sum(map(len, token_ids)),
        len(token_ids),
        max(map(len, block_tables), default=1),
        block_size,
        device,
    )
    return buffers.pack(token_ids, start_positions, block_tables)
