"""Model runner: one forward step of DeepSeek-V3 over a ragged batch, with a paged latent KV cache.

KV cache per layer: `[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]` in the model dtype, or
int8 with a float32 scale per token (`kv_scales[layer]: [num_blocks, block_size]`) when
`kv_cache_dtype="int8"`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdcluster.engine.compiled_forward import CompiledDecodeForward
from pdcluster.engine.compiled_prefill import CompiledPrefillForward
from pdcluster.engine.config import KV_CACHE_DTYPES
from pdcluster.engine.input_buffers import InputBuffers, ModelInput, build_model_input
from pdcluster.engine.kv_pool_attention import KVPoolCaches
from pdcluster.kernels.kv_quant import kv_cache_bytes_per_token
from pdcluster.kernels.paged_mla import paged_mla_attention, write_kv
from pdcluster.kvtransfer.shm_transport.inplace import SharedKVCache
from pdcluster.models.deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3ForCausalLM

LayerKVCallback = Callable[[int, torch.Tensor, ModelInput], None]

__all__ = ["InputBuffers", "LayerKVCallback", "ModelInput", "ModelRunner", "build_model_input"]


class ModelRunner:
    """Runs main and MTP layers of a `DeepseekV3ForCausalLM` over a paged latent KV cache.

    this host can write a handoff's layers straight into the reserved blocks; elsewhere, or with an int8
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
        # The compiled ragged-batch forward (`engine.compiled_prefill`), set by the engine with `compile`.
        self.compiled_prefill: CompiledPrefillForward | None = None
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
        self.kv_pools: KVPoolCaches | None = None
        self.num_mtp_forwards = 0
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
        block table) of one layer: with KV pools, its pool's tensors and local ids.
        """
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
        """One decoder layer over the flattened batch with paged attention; writes the layer's latent KV."""
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
        """Main layers over `batch`; returns final (post-norm) hidden states `[num_tokens, hidden_size]`."""
        compiled = self.compiled
        if self.kv_pools is not None:
            self.kv_pools.begin_step(
                batch.slot_mapping, batch.block_tables, batch.seq_lens, batch.query_start_loc
            )
        if on_layer_kv is None and compiled and compiled.accepts(len(batch.seq_lens), num_queries):
            hidden = compiled(batch, num_queries)
            if hidden is not None:
                return hidden
        prefill = self.compiled_prefill
        if prefill is not None and prefill.accepts(batch.num_tokens):
            hidden = prefill(batch, on_layer_kv)
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

        prev_hidden: `[num_tokens, hidden_size]`, hidden state at each position i.
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
