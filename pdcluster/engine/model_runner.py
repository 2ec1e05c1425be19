"""Model runner: one forward step of DeepSeek-V3 over a ragged batch, with a paged latent KV cache.

The runner owns the KV cache (one tensor per layer, MTP layers included) and knows nothing about
scheduling: the engine hands it a `ModelInput` (flattened tokens of all scheduled requests plus their block
tables) and gets hidden states back. Every layer, main or MTP, shares the same block tables: a token at
position p of a request lives at the same slot in every layer's cache.

KV cache per layer: `[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]` in the model dtype, or
int8 with a float32 scale per token (`kv_scales[layer]: [num_blocks, block_size]`) when
`kv_cache_dtype="int8"`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from pdcluster.engine.compiled_forward import CompiledDecodeForward
from pdcluster.engine.config import KV_CACHE_DTYPES
from pdcluster.engine.input_batch import ScheduledRows
from pdcluster.engine.kv_pool_attention import KVPoolCaches
from pdcluster.kernels.kv_quant import kv_cache_bytes_per_token
from pdcluster.kernels.paged_mla import paged_mla_attention, write_kv
from pdcluster.kvtransfer.shm_transport.inplace import SharedKVCache
from pdcluster.models.deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3ForCausalLM

# Called after each layer's KV is written: (layer_idx, latent_kv [num_tokens, kv_dim], model_input).
# The model_input's tensors view persistent buffers (`InputBuffers`) that a later step refills: a callback
# that keeps them past its return must copy them.
LayerKVCallback = Callable[[int, torch.Tensor, "ModelInput"], None]


class ModelInput(NamedTuple):
    """One step's flattened batch (vLLM-style ragged packing).

    input_ids: `[num_tokens]` int64, the tokens of all requests back to back.
    positions: `[num_tokens]` int64, each token's position in its request.
    slot_mapping: `[num_tokens]` int64, cache slot (`block_id * block_size + offset`) for each token.
    block_tables: `[num_reqs, max_num_blocks]` int64, padded with 0.
    seq_lens: `[num_reqs]` int64, tokens in the cache for each request after this step's writes.
    query_start_loc: `[num_reqs + 1]` int64, request r owns tokens `query_start_loc[r]:query_start_loc[r+1]`.
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
    """Preallocated tensors that `pack` fills in place and a packed `ModelInput` views: no tensor is
    allocated per step (vLLM's persistent input batch).

    Host buffers are int64 CPU tensors, filled through numpy views; on a non-CPU device each has a device
    twin, updated with one copy per tensor. A packed `ModelInput` is valid until the next `pack` on the
    same buffers, so a pipelined engine (`engine.async_loop`) keeps two sets and alternates.

    Args:
        max_num_tokens: tokens of one batch at most (the step's token budget).
        max_num_reqs: requests of one batch at most.
        max_num_blocks_per_req: block-table columns (a request's blocks at most).
        block_size: token slots per block.
        device: where the model runs.
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
            (max_num_tokens,),  # input_ids
            (max_num_tokens,),  # positions
            (max_num_tokens,),  # slot_mapping
            (max_num_reqs, max_num_blocks_per_req),  # block_tables
            (max_num_reqs,),  # seq_lens
            (max_num_reqs + 1,),  # query_start_loc
        )
        self._host = [torch.zeros(shape, dtype=torch.long) for shape in shapes]
        self._np = [t.numpy() for t in self._host]
        on_host = self.device.type == "cpu"
        self._device = [t if on_host else torch.zeros_like(t, device=self.device) for t in self._host]
        self._arange = np.arange(max(max_num_tokens, max_num_reqs), dtype=np.int64)
        self._last_views: tuple[tuple[int, int, int], ModelInput] | None = None

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

        Args:
            token_ids: per request, the tokens to run this step (positions `start .. start + n - 1`).
            start_positions: per request, the position of its first token this step.
            block_tables: per request, its block ids (enough to cover every position it runs).
            slot_mapping: `[sum n]` cache slot of every token when the caller has them; None computes
                them from the block tables.

        Raises:
            ValueError: a request runs a position its block table does not cover, or the batch exceeds
                the buffers' capacity.
        """
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
        """Fill the buffers with one step given as rows of the persistent batch and return the
        `ModelInput` viewing them, with whole-batch numpy ops only (no per-request Python): token ids
        are one `np.take` of the rows' `token_ids` at `row * row_width + position`, block tables one
        gather of the rows, positions `start + arange`, slots from the gathered tables.

        Each numpy call costs microseconds right after a forward (cold caches), so the step is built
        with few of them; a step of one input per request (decode without drafts) skips the repeats.

        Args:
            step: the rows (`engine.input_batch.RequestRows`) and, per request, its row, first position
                and number of inputs (`engine.input_batch.ScheduledRows`).

        Raises:
            ValueError: a request runs a position its block table does not cover or its row does not
                hold (`RequestRows.num_valid_tokens`), or the batch exceeds the buffers' capacity.
        """
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
        if num_tokens == num_reqs and num_scheduled.min(initial=1) == 1:  # one input each: position = start
            request_of_token = self._arange[:num_reqs]
            positions[:] = starts
            flat = row_index * row_width
        else:
            # position of flat token j of request r: starts[r] + (j - query_start_loc[r])
            request_of_token = np.repeat(self._arange[:num_reqs], num_scheduled)
            np.add((starts - qsl_np[:num_reqs])[request_of_token], self._arange[:num_tokens], out=positions)
            flat = (row_index * row_width)[request_of_token]
        flat += positions  # flat index into the rows' token ids: row * row_width + position
        np.take(rows.token_ids, flat, out=ids_np[:num_tokens])
        # rows hold 0 past their blocks: the gather pads with 0
        tables = tables_np[:num_reqs, :max_blocks]
        np.take(rows.table[:, :max_blocks], row_index, axis=0, out=tables)
        slots = slots_np[:num_tokens]
        np.multiply(tables[request_of_token, positions // bs], bs, out=slots)
        slots += positions % bs
        return self._views(num_tokens, num_reqs, max_blocks)

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
        """Check the batch against the buffers and block tables, fill query starts, sequence lengths and
        positions. `num_scheduled`, `starts`, `table_lens`: `[num_reqs]` int64. Returns (num_tokens,
        block-table columns used)."""
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
        """The `ModelInput` viewing the packed prefix of each buffer (copied to the device ones first).
        The views of the last shape are kept for the next pack of the same shape (a decode step usually
        packs the shape of the one before): they stay valid, what they view is refilled in place."""
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


class ModelRunner:
    """Runs main and MTP layers of a `DeepseekV3ForCausalLM` over a paged latent KV cache.

    shared_kv_cache: on the host with a float cache, keep the cache in one anonymous shared-memory file
    (`kvtransfer.shm_transport.inplace.SharedKVCache`, `self.shared_kv_cache`), so that a prefill sender on
    this host can write a handoff's layers straight into the reserved blocks; elsewhere, or with an int8
    cache, ignored (`self.shared_kv_cache` None).
    """

    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        num_blocks: int,
        block_size: int,
        kv_cache_dtype: str = "auto",
        shared_kv_cache: bool = False,
    ) -> None:
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
        self.model = model
        self.config = model.config
        # The compiled uniform-decode forward (`engine.compiled_forward`), set by the engine with `compile`.
        self.compiled: CompiledDecodeForward | None = None
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        num_layers = len(model.model.layers)
        cache_dtype = torch.int8 if kv_cache_dtype == "int8" else self.dtype
        shape = (num_blocks, block_size, self.config.kv_cache_dim)
        self.shared_kv_cache: SharedKVCache | None = None
        if shared_kv_cache and self.device.type == "cpu" and kv_cache_dtype != "int8":
            self.shared_kv_cache = SharedKVCache.for_tensors(num_layers, shape, cache_dtype)
            self.kv_caches = list(self.shared_kv_cache.layers)
        else:
            self.kv_caches = [
                torch.zeros(shape, dtype=cache_dtype, device=self.device) for _ in range(num_layers)
            ]
        # Blocks in several dtypes (`engine.kv_pool_attention`), set by the engine with kv_precision; then
        # every layer's KV goes there and `kv_caches` is unused.
        self.kv_pools: KVPoolCaches | None = None
        self.num_mtp_forwards = 0  # MTP layer passes so far (the EP lockstep pads a step's passes to k)
        self.kv_scales: list[torch.Tensor | None] = [
            torch.zeros(shape[:2], dtype=torch.float32, device=self.device)
            if kv_cache_dtype == "int8"
            else None
            for _ in range(num_layers)
        ]

    def layer_cache(
        self, layer_idx: int, block_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """`(cache, scale or None, block ids in that cache)` holding a request's blocks (`block_ids`, its
        block table) of one layer: with KV pools, its pool's tensors and local ids."""
        if self.kv_pools is not None:
            return self.kv_pools.layer_cache(layer_idx, block_ids)
        return self.kv_caches[layer_idx], self.kv_scales[layer_idx], block_ids

    @property
    def kv_cache_bytes_per_token(self) -> int:
        """Bytes one token occupies across all layers' caches (scales included for int8)."""
        dtype = torch.int8 if self.kv_cache_dtype == "int8" else self.dtype
        return kv_cache_bytes_per_token(self.config.kv_cache_dim, dtype, len(self.kv_caches))

    def _layer(
        self,
        layer: DeepseekV3DecoderLayer,
        hidden: torch.Tensor,
        batch: ModelInput,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer over the flattened batch (`DeepseekV3DecoderLayer.block` with paged attention);
        writes the layer's latent KV. hidden: `[num_tokens, hidden_size]`."""
        idx = layer.layer_idx
        attn = layer.self_attn

        def paged_attention(
            q_nope: torch.Tensor, q_pe: torch.Tensor, latent_kv: torch.Tensor
        ) -> torch.Tensor:
            if self.kv_pools is not None:
                out = self.kv_pools.write_and_attend(
                    idx, q_nope, q_pe, latent_kv, attn.kv_b_proj.weight, self.config.softmax_scale
                )
                return attn.o_proj(out.flatten(1))
            write_kv(self.kv_caches[idx], latent_kv, batch.slot_mapping, self.kv_scales[idx])
            out = paged_mla_attention(
                q_nope,
                q_pe,
                self.kv_caches[idx],
                batch.block_tables,
                batch.seq_lens,
                batch.query_start_loc,
                attn.kv_b_proj.weight,
                self.config.softmax_scale,
                kv_scale=self.kv_scales[idx],
            )
            return attn.o_proj(out.flatten(1))  # [num_tokens, H * v_head_dim] -> hidden (0 tokens too)

        return layer.block(hidden, cos, sin, paged_attention)

    @torch.inference_mode()
    def forward(
        self,
        batch: ModelInput,
        on_layer_kv: LayerKVCallback | None = None,
        num_queries: int | None = None,
    ) -> torch.Tensor:
        """Main layers over `batch`; returns final (post-norm) hidden states `[num_tokens, hidden_size]`.

        `on_layer_kv(layer_idx, latent_kv, batch)` runs right after each layer's KV is computed and
        written (the prefill side streams it to decode from there). `num_queries`: the query tokens of
        every request when they are all equal (None otherwise); such a step runs the compiled forward
        when there is one that takes it (`engine.compiled_forward`), else the eager layers below.
        """
        compiled = self.compiled
        if self.kv_pools is not None:
            self.kv_pools.begin_step(
                batch.slot_mapping, batch.block_tables, batch.seq_lens, batch.query_start_loc
            )
        if on_layer_kv is None and compiled and compiled.accepts(len(batch.seq_lens), num_queries):
            hidden = compiled(batch, num_queries)
            if hidden is not None:
                return hidden
        cos, sin = self.model.model.rope(batch.positions)
        hidden = self.model.model.embed_tokens(batch.input_ids)
        for layer in self.model.main_layers:
            hidden, latent_kv = self._layer(layer, hidden, batch, cos, sin)
            if on_layer_kv is not None:
                on_layer_kv(layer.layer_idx, latent_kv, batch)
        return self.model.model.norm(hidden)

    @torch.inference_mode()
    def mtp_forward(
        self,
        batch: ModelInput,
        prev_hidden: torch.Tensor,
        depth: int = 0,
        on_layer_kv: LayerKVCallback | None = None,
        num_queries: int | None = None,
    ) -> torch.Tensor:
        """MTP module `depth` over `batch` (whose `input_ids` are the *next* tokens t_{i+1}).

        Args:
            prev_hidden: `[num_tokens, hidden_size]`, hidden state at each position i.
            num_queries: the query tokens of every request when they are all equal (None otherwise): a
                depth-0 pass over such a batch runs the compiled MTP graph when there is one that takes
                it (`engine.compiled_forward`, no `on_layer_kv`), else the eager layer below.

        Returns:
            `[num_tokens, hidden_size]` post-norm hidden states (feed `compute_logits`, or the next depth).
        """
        compiled = self.compiled
        if self.kv_pools is not None:
            self.kv_pools.begin_step(
                batch.slot_mapping, batch.block_tables, batch.seq_lens, batch.query_start_loc
            )
        if (
            depth == 0
            and on_layer_kv is None
            and compiled
            and compiled.accepts_mtp(len(batch.seq_lens), num_queries)
        ):
            hidden = compiled.mtp(batch, prev_hidden, num_queries)
            if hidden is not None:
                self.num_mtp_forwards += 1
                return hidden
        layer = self.model.mtp_layers[depth]
        self.num_mtp_forwards += 1
        cos, sin = self.model.model.rope(batch.positions)
        hidden = layer.combine_inputs(self.model.model.embed_tokens(batch.input_ids), prev_hidden)
        hidden, latent_kv = self._layer(layer, hidden, batch, cos, sin)
        if on_layer_kv is not None:
            on_layer_kv(layer.layer_idx, latent_kv, batch)
        return layer.shared_head.norm(hidden)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[N, hidden_size]` -> logits `[N, vocab_size]` float32."""
        return self.model.lm_head(hidden).float()
