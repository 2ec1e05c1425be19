"""DeepSeek-V3 in torch, top to bottom: MLA -> MLP / MoE -> decoder layer -> MTP -> model.

Sources: DeepSeek-V3 report (arXiv 2412.19437) sections 2.1-2.2; DeepSeek-V2 (arXiv 2405.04434) section 2.1.
Parameter names equal the public checkpoint's, the MTP module at `model.layers.{num_hidden_layers}`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pdcluster.kernels.mla import mla_attention
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
    """Multi-head Latent Attention with decoupled RoPE; only `latent_kv = [c_kv; k_pe]` is cached."""

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

        hidden: [num_tokens, hidden_size], input-normalized
        cos, sin: [num_tokens, qk_rope_head_dim // 2] float32
        returns q_nope: [num_tokens, H, qk_nope_head_dim], q_pe: [num_tokens, H, qk_rope_head_dim] (rotated),
            latent_kv: [num_tokens, kv_lora_rank + qk_rope_head_dim]
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
        """Attention over latent KV, then `o_proj`; `absorbed` selects the weight-absorbed (decode) path.

        q_nope: [B, Sq, H, qk_nope_head_dim]; q_pe: [B, Sq, H, qk_rope_head_dim]
        latent_kv: [B, Sk, kv_lora_rank + qk_rope_head_dim]; attn_mask: [B, Sq, Sk] bool, True = may attend
        returns [B, Sq, hidden_size]
        """
        cfg = self.config
        kv_c, k_pe = latent_kv.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        w_kv_b, scale = self.kv_b_proj.weight, cfg.softmax_scale
        out = mla_attention(q_nope, q_pe, kv_c, k_pe, w_kv_b, scale, attn_mask, is_causal, absorbed)
        batch, num_q = out.shape[:2]
        return self.o_proj(out.reshape(batch, num_q, -1))


class DeepseekV3MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEGate(nn.Module):
    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        nn.init.normal_(self.weight, std=0.02)
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts))

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: [num_tokens, hidden_size] -> (topk_weights [T, k] float32, topk_ids [T, k] int64)."""
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
    """DeepSeekMoE: shared experts plus top-k routed experts (report eq. 12).

    num_local_experts: routed-expert slots on this EP rank, fed by an `EPDispatcher`; None: all, local.
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
        self._dense_weights: tuple[torch.Tensor, torch.Tensor] | None = None
        self.last_expert_load: torch.Tensor | None = None

    def run_experts(self, rows: torch.Tensor, rows_per_expert: list[int]) -> torch.Tensor:
        """rows: [num_rows, hidden_size] sorted by local expert -> the same shape and order."""
        self.last_expert_load = torch.tensor(rows_per_expert)
        outputs, start = [], 0
        for expert, num_rows in zip(self.experts, rows_per_expert, strict=True):
            if num_rows:
                outputs.append(expert(rows[start : start + num_rows]))
            start += num_rows
        return torch.cat(outputs) if outputs else rows[:0]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(hidden)
        out = self.dispatcher.forward(hidden, topk_ids, topk_weights, self.run_experts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return out

    def dense_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(w_gate_up [2 * U, hidden_size], w_down [hidden_size, U])`, U = (experts + shared) * I, built on
        first use; the experts' parameters become views of them (one copy; in-place updates reach both)."""
        if self._dense_weights is None:
            mlps = [*self.experts, *([self.shared_experts] if self.shared_experts is not None else [])]
            with torch.no_grad():
                gate = torch.cat([m.gate_proj.weight for m in mlps])
                w_gate_up = torch.cat((gate, torch.cat([m.up_proj.weight for m in mlps])))
                w_down = torch.cat([m.down_proj.weight for m in mlps], dim=1)
                start, num_units = 0, gate.shape[0]
                for m in mlps:
                    end = start + m.gate_proj.weight.shape[0]
                    m.gate_proj.weight.data = w_gate_up[start:end]
                    m.up_proj.weight.data = w_gate_up[num_units + start : num_units + end]
                    m.down_proj.weight.data = w_down[:, start:end]
                    start = end
            self._dense_weights = (w_gate_up, w_down)
        return self._dense_weights

    def forward_dense(self, hidden: torch.Tensor) -> torch.Tensor:
        """`forward` with fixed shapes for graph capture: every expert runs every token (two matmuls over
        `dense_weights`, units scaled by their expert's gate weight). Only for the local dispatcher and few,
        small experts; equal to `forward` up to summation order."""
        w_gate_up, w_down = self.dense_weights()
        num_tokens, num_experts = hidden.shape[0], len(self.experts)
        topk_weights, topk_ids = self.gate(hidden)
        weights = torch.zeros(num_tokens, num_experts, dtype=torch.float32, device=hidden.device).scatter_(
            1, topk_ids, topk_weights.float()
        )
        size = self.experts[0].gate_proj.weight.shape[0] if num_experts else 0
        unit_weights = weights.to(hidden.dtype)[:, :, None].expand(-1, -1, size).reshape(num_tokens, -1)
        num_shared = w_down.shape[1] - num_experts * size
        if num_shared:
            unit_weights = torch.cat((unit_weights, unit_weights.new_ones(num_tokens, num_shared)), dim=1)
        gate, up = F.linear(hidden, w_gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up * unit_weights, w_down)


class DeepseekV3DecoderLayer(nn.Module):
    """Pre-norm block: `h += MLA(RMSNorm(h)); h += FFN(RMSNorm(h))`."""

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
        """The block over flattened tokens, the attention over the KV left to the caller.

        hidden: [num_tokens, hidden_size] model dtype; cos, sin: [num_tokens, qk_rope_head_dim // 2] float32
        attention: (q_nope, q_pe, latent_kv) -> [num_tokens, hidden_size] after `o_proj`
        mlp: runs instead of `self.mlp` (the same function)
        returns (hidden [num_tokens, hidden_size], latent_kv [num_tokens, kv_lora_rank + qk_rope_head_dim])
        """
        q_nope, q_pe, latent_kv = self.self_attn.project(self.input_layernorm(hidden), cos, sin)
        hidden = hidden + attention(q_nope, q_pe, latent_kv)
        hidden = hidden + (mlp or self.mlp)(self.post_attention_layernorm(hidden))
        return hidden, latent_kv

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, absorbed: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache-less causal forward: hidden [B, S, hidden_size] -> (hidden, latent_kv [B, S, kv_dim])."""
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

    `h' = eh_proj([enorm(Emb(t_{i+1})); hnorm(h_i)])`: embedding first, as the checkpoints' `eh_proj` is laid
    out (the reverse of the report's eq. 21).
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
        """cos/sin [num_tokens, qk_rope_head_dim // 2] float32 for positions [num_tokens] int64."""
        return rope_cos_sin(positions, self.rope_inv_freq, self.config.rope_attention_factor)


class DeepseekV3ForCausalLM(nn.Module):
    """DeepSeek-V3 with its MTP module(s); `num_local_experts` as in `DeepseekV3MoE`."""

    def __init__(self, config: DeepseekV3Config, num_local_experts: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = DeepseekV3Model(config, num_local_experts)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def main_layers(self) -> list[DeepseekV3DecoderLayer]:
        return list(self.model.layers)[: self.config.num_hidden_layers]

    @property
    def mtp_layers(self) -> list[DeepseekV3MTPLayer]:
        return list(self.model.layers)[self.config.num_hidden_layers :]

    @classmethod
    def from_pretrained(
        cls, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> DeepseekV3ForCausalLM:
        from pdcluster.models.loader import load_checkpoint

        return load_checkpoint(path, device=device, dtype=dtype)

    def hidden_states(self, input_ids: torch.Tensor, absorbed: bool = False) -> torch.Tensor:
        """Post-norm hidden states [B, S, hidden_size] for input_ids [B, S] int64."""
        batch, seq_len = input_ids.shape
        cos, sin = self.model.rope(torch.arange(seq_len, device=input_ids.device))
        hidden = self.model.embed_tokens(input_ids)
        for layer in self.main_layers:
            hidden, _ = layer(hidden, cos, sin, absorbed=absorbed)
        return self.model.norm(hidden)

    def forward(self, input_ids: torch.Tensor, absorbed: bool = False) -> torch.Tensor:
        """Logits [B, S, vocab_size] float32 for input_ids [B, S] int64 (cache-less, causal)."""
        return self.lm_head(self.hidden_states(input_ids, absorbed)).float()

    def mtp_forward(
        self, prev_hidden: torch.Tensor, next_ids: torch.Tensor, depth: int = 0, absorbed: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run MTP module `depth` on its own.

        prev_hidden: [B, S, hidden_size], hidden state at position i; next_ids: [B, S] int64, token i+1
        returns (hidden [B, S, hidden_size], logits [B, S, vocab_size] float32 for token i+2)
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
