"""DeepSeek-V3 architecture in torch, read top to bottom: MLA -> MLP / MoE -> decoder layer -> MTP -> model.

Sources: DeepSeek-V3 technical report (arXiv 2412.19437) sections 2.1 (MLA, DeepSeekMoE) and 2.2 (MTP);
DeepSeek-V2 paper (arXiv 2405.04434) section 2.1 (MLA, decoupled RoPE). Parameter names equal the public
checkpoint's tensor names (`model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight`, ...), so a state dict
loads without renaming; the MTP module is `model.layers.{num_hidden_layers}` as in the public release.

The model is single-device; expert parallelism replaces the `ExpertDispatcher` of each MoE layer, and the
engine drives layers through `DeepseekV3Attention.project` / `attend` with its own paged KV cache.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pdcluster.kernels.mla import mla_attention_absorbed, mla_attention_expanded
from pdcluster.kernels.moe import grouped_topk
from pdcluster.kernels.norm import rms_norm
from pdcluster.kernels.rope import apply_rope, rope_cos_sin, rope_inv_freq
from pdcluster.models.config import DeepseekV3Config
from pdcluster.models.moe_dispatch import ExpertDispatcher, LocalDispatcher

# The attention of one decoder block over its KV: (q_nope [T, H, qk_nope_head_dim], q_pe [T, H,
# qk_rope_head_dim], latent_kv [T, kv_lora_rank + qk_rope_head_dim]) -> [T, hidden_size] after o_proj.
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class DeepseekV3Attention(nn.Module):
    """Multi-head Latent Attention with decoupled RoPE.

    Per token: `q = W_UQ RMSNorm(W_DQ h)` (or `W_Q h` when `q_lora_rank` is None), split into
    `q_nope [H, qk_nope_head_dim]` and `q_pe [H, qk_rope_head_dim]`; `[c_kv; k_pe] = W_DKV h`,
    `c_kv <- RMSNorm(c_kv)`, `k_pe <- RoPE(k_pe)`. Only `latent_kv = [c_kv; k_pe]` is cached.
    """

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        h, d = config.num_attention_heads, config.hidden_size
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * config.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, config.q_lora_rank, bias=config.attention_bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, h * config.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, config.kv_cache_dim, bias=config.attention_bias)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(
            config.kv_lora_rank, h * (config.qk_nope_head_dim + config.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(h * config.v_head_dim, d, bias=config.attention_bias)

    def project(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries and this step's latent KV.

        Args:
            hidden: `[num_tokens, hidden_size]` (already input-normalized).
            cos, sin: `[num_tokens, qk_rope_head_dim // 2]` float32 for the tokens' positions.

        Returns:
            `q_nope [num_tokens, H, qk_nope_head_dim]`, `q_pe [num_tokens, H, qk_rope_head_dim]` (rotated),
            `latent_kv [num_tokens, kv_lora_rank + qk_rope_head_dim]` (normalized c_kv; rotated k_pe).
        """
        cfg = self.config
        num_tokens = hidden.shape[0]
        if cfg.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(num_tokens, self.num_heads, cfg.qk_head_dim)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        q_pe = apply_rope(q_pe, cos, sin, cfg.rope_interleave)
        kv = self.kv_a_proj_with_mqa(hidden)
        kv_c, k_pe = kv.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        latent_kv = torch.cat(
            (self.kv_a_layernorm(kv_c), apply_rope(k_pe, cos, sin, cfg.rope_interleave)), -1
        )
        return q_nope, q_pe, latent_kv

    def attend(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent_kv: torch.Tensor,
        *,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        absorbed: bool = False,
    ) -> torch.Tensor:
        """Attention of batched queries over latent KV, then the output projection.

        Args:
            q_nope: `[B, Sq, H, qk_nope_head_dim]`; q_pe: `[B, Sq, H, qk_rope_head_dim]`.
            latent_kv: `[B, Sk, kv_lora_rank + qk_rope_head_dim]`.
            attn_mask: bool `[B, Sq, Sk]` (True = may attend), or `is_causal` for a square causal mask.
            absorbed: use the weight-absorbed computation (decode) instead of the expanded one (prefill).

        Returns:
            `[B, Sq, hidden_size]`.
        """
        cfg = self.config
        kv_c, k_pe = latent_kv.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        fn = mla_attention_absorbed if absorbed else mla_attention_expanded
        out = fn(q_nope, q_pe, kv_c, k_pe, self.kv_b_proj.weight, cfg.softmax_scale, attn_mask, is_causal)
        batch, num_q = out.shape[:2]
        return self.o_proj(out.reshape(batch, num_q, -1))


class DeepseekV3MLP(nn.Module):
    """SwiGLU feed-forward: `down(silu(gate(x)) * up(x))`."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEGate(nn.Module):
    """Router: `weight [n_routed_experts, hidden_size]` and the selection-only `e_score_correction_bias`."""

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        nn.init.normal_(self.weight, std=0.02)
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts))

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: `[num_tokens, hidden_size]` -> `(topk_weights [T, k] float32, topk_ids [T, k] int64)`."""
        cfg = self.config
        logits = F.linear(hidden.float(), self.weight.float())
        return grouped_topk(
            logits,
            self.e_score_correction_bias,
            top_k=cfg.num_experts_per_tok,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            norm_topk_prob=cfg.norm_topk_prob,
            routed_scaling_factor=cfg.routed_scaling_factor,
        )


class DeepseekV3MoE(nn.Module):
    """DeepSeekMoE: `n_shared_experts` always-on experts plus top-k of `n_routed_experts` (report eq. 12).

    `num_local_experts` (expert parallelism): hold only that many routed-expert slots, the physical experts
    of this EP rank (`models.expert_placement`), which an `models.ep_dispatch.EPDispatcher` feeds; None
    holds all `n_routed_experts`, fed by a `LocalDispatcher`. The router and shared expert are replicated.
    """

    def __init__(self, config: DeepseekV3Config, num_local_experts: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.gate = MoEGate(config)
        num_slots = config.n_routed_experts if num_local_experts is None else num_local_experts
        self.experts = nn.ModuleList(
            DeepseekV3MLP(config.hidden_size, config.moe_intermediate_size) for _ in range(num_slots)
        )
        self.shared_experts = (
            DeepseekV3MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
            if config.n_shared_experts
            else None
        )
        self.dispatcher: ExpertDispatcher = LocalDispatcher(config.n_routed_experts)
        # Rows each local expert processed in the last forward (for load balancing statistics).
        self.last_expert_load: torch.Tensor | None = None

    def run_experts(self, rows: torch.Tensor, rows_per_expert: list[int]) -> torch.Tensor:
        """Each local expert over its contiguous slice of `rows [num_rows, hidden_size]` (sorted by local
        expert, `rows_per_expert` each); returns `[num_rows, hidden_size]` in the same order."""
        self.last_expert_load = torch.tensor(rows_per_expert)
        outputs, start = [], 0
        for expert, num_rows in zip(self.experts, rows_per_expert, strict=True):
            if num_rows:
                outputs.append(expert(rows[start : start + num_rows]))
            start += num_rows
        return torch.cat(outputs) if outputs else rows[:0]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: `[num_tokens, hidden_size]` -> `[num_tokens, hidden_size]`."""
        topk_weights, topk_ids = self.gate(hidden)
        out = self.dispatcher.forward(hidden, topk_ids, topk_weights, self.run_experts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return out

    def forward_dense(self, hidden: torch.Tensor) -> torch.Tensor:
        """The same function as `forward` with fixed shapes: every local expert runs every token and its
        output is weighted by the token's gate weight for it (0 when not routed there). No host sync and
        no data-dependent shape, so it traces into one graph (`engine.compiled_forward`); worth it only
        where experts are few and small (the work grows with `n_routed_experts`), and only with the
        local dispatcher (expert parallelism moves tokens). Equal to `forward` up to float rounding of
        the sum order. hidden: `[num_tokens, hidden_size]` -> `[num_tokens, hidden_size]`."""
        topk_weights, topk_ids = self.gate(hidden)
        weights = torch.zeros(
            hidden.shape[0], len(self.experts), dtype=torch.float32, device=hidden.device
        ).scatter_(1, topk_ids, topk_weights.float())
        weights = weights.to(hidden.dtype)
        out = hidden.new_zeros(hidden.shape)
        for e, expert in enumerate(self.experts):
            out = out + expert(hidden) * weights[:, e : e + 1]
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return out


class DeepseekV3DecoderLayer(nn.Module):
    """Pre-norm block: `h += MLA(RMSNorm(h)); h += FFN(RMSNorm(h))`; FFN dense below first_k_dense_replace."""

    def __init__(
        self, config: DeepseekV3Config, layer_idx: int, num_local_experts: int | None = None
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = DeepseekV3Attention(config)
        self.mlp: nn.Module = (
            DeepseekV3MoE(config, num_local_experts)
            if config.is_moe_layer(layer_idx)
            else DeepseekV3MLP(config.hidden_size, config.intermediate_size)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def block(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionFn,
        mlp: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder block over flattened tokens, with the attention over the KV left to the caller:
        `h += attention(project(RMSNorm(h))); h += FFN(RMSNorm(h))`. The cache-less `forward` and the
        engine's paged runner (`engine.model_runner`) both run it.

        Args:
            hidden: `[num_tokens, hidden_size]` in the model dtype.
            cos, sin: `[num_tokens, qk_rope_head_dim // 2]` float32 for the tokens' positions.
            attention: `(q_nope, q_pe, latent_kv) -> [num_tokens, hidden_size]`, the attention output after
                `o_proj`; gets `DeepseekV3Attention.project`'s outputs for these tokens (and may cache
                `latent_kv`).
            mlp: the FFN to run instead of `self.mlp` (the same function, e.g. `DeepseekV3MoE.forward_dense`).

        Returns:
            `(hidden [num_tokens, hidden_size], latent_kv [num_tokens, kv_lora_rank + qk_rope_head_dim])`.
        """
        q_nope, q_pe, latent_kv = self.self_attn.project(self.input_layernorm(hidden), cos, sin)
        hidden = hidden + attention(q_nope, q_pe, latent_kv)
        hidden = hidden + (mlp or self.mlp)(self.post_attention_layernorm(hidden))
        return hidden, latent_kv

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, absorbed: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache-less causal forward over whole sequences (`block` with causal attention per sequence).

        Args:
            hidden: `[B, S, hidden_size]`; cos, sin: `[S, qk_rope_head_dim // 2]` for positions 0..S-1.

        Returns:
            `(hidden [B, S, hidden_size], latent_kv [B, S, kv_lora_rank + qk_rope_head_dim])`.
        """
        batch, seq_len, hidden_size = hidden.shape

        def causal_attention(
            q_nope: torch.Tensor, q_pe: torch.Tensor, latent_kv: torch.Tensor
        ) -> torch.Tensor:
            out = self.self_attn.attend(
                q_nope.view(batch, seq_len, *q_nope.shape[1:]),  # [B, S, H, qk_nope_head_dim]
                q_pe.view(batch, seq_len, *q_pe.shape[1:]),  # [B, S, H, qk_rope_head_dim]
                latent_kv.view(batch, seq_len, -1),  # [B, S, kv_dim]
                is_causal=True,
                absorbed=absorbed,
            )
            return out.reshape(batch * seq_len, hidden_size)

        hidden, latent_kv = self.block(
            hidden.reshape(batch * seq_len, hidden_size),
            cos.repeat(batch, 1),
            sin.repeat(batch, 1),
            causal_attention,
        )
        return hidden.view(batch, seq_len, hidden_size), latent_kv.view(batch, seq_len, -1)


class DeepseekV3MTPLayer(DeepseekV3DecoderLayer):
    """Multi-Token Prediction module (report section 2.2), stored as layer `num_hidden_layers + k`.

    `h' = eh_proj([enorm(Emb(t_{i+1})); hnorm(h_i)])`, one transformer block over `h'`, then the shared
    output head after `shared_head.norm`. The embedding and output head are the main model's.
    The concatenation order (embedding first) follows the public checkpoints' `eh_proj` layout, which is
    the reverse of the order written in the report's eq. 21.
    """

    def __init__(
        self, config: DeepseekV3Config, layer_idx: int, num_local_experts: int | None = None
    ) -> None:
        super().__init__(config, layer_idx, num_local_experts)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def combine_inputs(self, next_embeds: torch.Tensor, prev_hidden: torch.Tensor) -> torch.Tensor:
        """`eh_proj([enorm(next_embeds); hnorm(prev_hidden)])`; both `[..., hidden_size]`."""
        return self.eh_proj(torch.cat((self.enorm(next_embeds), self.hnorm(prev_hidden)), dim=-1))


class DeepseekV3Model(nn.Module):
    def __init__(self, config: DeepseekV3Config, num_local_experts: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        layers: list[nn.Module] = [
            DeepseekV3DecoderLayer(config, i, num_local_experts) for i in range(config.num_hidden_layers)
        ]
        layers += [
            DeepseekV3MTPLayer(config, config.num_hidden_layers + k, num_local_experts)
            for k in range(config.num_nextn_predict_layers)
        ]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.register_buffer("rope_inv_freq", rope_inv_freq(config), persistent=False)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin `[num_tokens, qk_rope_head_dim // 2]` float32 for int64 `positions [num_tokens]`."""
        return rope_cos_sin(positions, self.rope_inv_freq, self.config.rope_attention_factor)


class DeepseekV3ForCausalLM(nn.Module):
    """DeepSeek-V3 with its MTP module(s).

    `forward(input_ids [B, S]) -> logits [B, S, vocab_size]` float32 is cache-less and causal; the engine
    uses the layers directly with a paged cache. `num_local_experts`: routed-expert slots per MoE layer on an
    EP rank (see `DeepseekV3MoE`); None for all experts on this device.
    """

    def __init__(self, config: DeepseekV3Config, num_local_experts: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = DeepseekV3Model(config, num_local_experts)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def main_layers(self) -> list[DeepseekV3DecoderLayer]:
        return list(self.model.layers[: self.config.num_hidden_layers])

    @property
    def mtp_layers(self) -> list[DeepseekV3MTPLayer]:
        return list(self.model.layers[self.config.num_hidden_layers :])

    @classmethod
    def from_pretrained(
        cls, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> DeepseekV3ForCausalLM:
        """Load a Hugging Face-format checkpoint directory; see `models.loader.load_checkpoint`."""
        from pdcluster.models.loader import load_checkpoint

        return load_checkpoint(path, device=device, dtype=dtype)

    def hidden_states(self, input_ids: torch.Tensor, absorbed: bool = False) -> torch.Tensor:
        """Final (post-norm) hidden states `[B, S, hidden_size]` for `input_ids [B, S]` int64."""
        batch, seq_len = input_ids.shape
        cos, sin = self.model.rope(torch.arange(seq_len, device=input_ids.device))
        hidden = self.model.embed_tokens(input_ids)
        for layer in self.main_layers:
            hidden, _ = layer(hidden, cos, sin, absorbed=absorbed)
        return self.model.norm(hidden)

    def forward(self, input_ids: torch.Tensor, absorbed: bool = False) -> torch.Tensor:
        """Logits `[B, S, vocab_size]` float32 for `input_ids [B, S]` int64 (positions 0..S-1)."""
        return self.lm_head(self.hidden_states(input_ids, absorbed)).float()

    def mtp_forward(
        self, prev_hidden: torch.Tensor, next_ids: torch.Tensor, depth: int = 0, absorbed: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run MTP module `depth` on its own.

        Args:
            prev_hidden: `[B, S, hidden_size]`, hidden state at position i (the main model's final,
                post-norm hidden states for depth 0, or the previous MTP output when chaining).
            next_ids: `[B, S]` int64, token i+1 (the token that follows each position).

        Returns:
            `(hidden [B, S, hidden_size], logits [B, S, vocab_size] float32)`: the post-norm hidden state
            that feeds the head, and logits for token i+2. Positions are 0..S-1.
        """
        if not self.mtp_layers:
            raise ValueError("this checkpoint has no MTP module (num_nextn_predict_layers = 0)")
        layer = self.mtp_layers[depth]
        seq_len = next_ids.shape[1]
        cos, sin = self.model.rope(torch.arange(seq_len, device=next_ids.device))
        hidden = layer.combine_inputs(self.model.embed_tokens(next_ids), prev_hidden)
        hidden, _ = layer(hidden, cos, sin, absorbed=absorbed)
        hidden = layer.shared_head.norm(hidden)
        return hidden, self.lm_head(hidden).float()
