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

from collections.abc import Callable
from typing import NamedTuple

import torch

from engine.config import KV_CACHE_DTYPES
from kernels.kv_quant import kv_cache_bytes_per_token
from kernels.paged_mla import paged_mla_attention, write_kv
from models.deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3ForCausalLM

# Called after each layer's KV is written: (layer_idx, latent_kv [num_tokens, kv_dim], model_input).
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


def build_model_input(
    token_ids: list[list[int]],
    start_positions: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: str | torch.device = "cpu",
) -> ModelInput:
    """Pack per-request token lists into a `ModelInput`.

    Args:
        token_ids: per request, the tokens to run this step (positions `start .. start + n - 1`).
        start_positions: per request, the position of its first token this step.
        block_tables: per request, its block ids (enough to cover every position it runs).
        block_size: token slots per block.

    Raises:
        ValueError: a request runs a position its block table does not cover.
    """
    flat_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    query_start_loc = [0]
    for ids, start, table in zip(token_ids, start_positions, block_tables, strict=True):
        end = start + len(ids)
        if end > len(table) * block_size:
            raise ValueError(
                f"positions up to {end} need {-(-end // block_size)} blocks, table has {len(table)}"
            )
        flat_ids.extend(ids)
        positions.extend(range(start, end))
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        seq_lens.append(end)
        query_start_loc.append(query_start_loc[-1] + len(ids))
    max_blocks = max((len(t) for t in block_tables), default=0)
    tables = torch.zeros(len(block_tables), max(max_blocks, 1), dtype=torch.long)
    for r, table in enumerate(block_tables):
        tables[r, : len(table)] = torch.tensor(table, dtype=torch.long)

    def t(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return ModelInput(t(flat_ids), t(positions), t(slots), tables.to(device), t(seq_lens), t(query_start_loc))


class ModelRunner:
    """Runs main and MTP layers of a `DeepseekV3ForCausalLM` over a paged latent KV cache."""

    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        num_blocks: int,
        block_size: int,
        kv_cache_dtype: str = "auto",
    ) -> None:
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
        self.model = model
        self.config = model.config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        num_layers = len(model.model.layers)
        cache_dtype = torch.int8 if kv_cache_dtype == "int8" else self.dtype
        shape = (num_blocks, block_size, self.config.kv_cache_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=cache_dtype, device=self.device) for _ in range(num_layers)
        ]
        self.kv_scales: list[torch.Tensor | None] = [
            torch.zeros(shape[:2], dtype=torch.float32, device=self.device)
            if kv_cache_dtype == "int8"
            else None
            for _ in range(num_layers)
        ]

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
        """One decoder layer over the flattened batch; writes the layer's latent KV. hidden: `[T, D]`."""
        idx = layer.layer_idx
        attn = layer.self_attn
        q_nope, q_pe, latent_kv = attn.project(layer.input_layernorm(hidden), cos, sin)
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
        hidden = hidden + attn.o_proj(out.reshape(out.shape[0], -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return hidden, latent_kv

    @torch.inference_mode()
    def forward(self, batch: ModelInput, on_layer_kv: LayerKVCallback | None = None) -> torch.Tensor:
        """Main layers over `batch`; returns final (post-norm) hidden states `[num_tokens, hidden_size]`.

        `on_layer_kv(layer_idx, latent_kv, batch)` runs right after each layer's KV is computed and
        written (the prefill side streams it to decode from there).
        """
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
    ) -> torch.Tensor:
        """MTP module `depth` over `batch` (whose `input_ids` are the *next* tokens t_{i+1}).

        Args:
            prev_hidden: `[num_tokens, hidden_size]`, hidden state at each position i.

        Returns:
            `[num_tokens, hidden_size]` post-norm hidden states (feed `compute_logits`, or the next depth).
        """
        layer = self.model.mtp_layers[depth]
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
