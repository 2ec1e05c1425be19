"""Shared test factories: tiny DeepSeek-V3 configs and deterministically randomized models; eager copies
of topology files.

Tiny means every dimension is a few dozen at most, so a forward pass takes milliseconds on one CPU core,
while every architectural switch (q_lora_rank, n_group, YaRN, first_k_dense_replace, rope_interleave,
MTP) can still be flipped.

Compiling: a decode pool compiles its forward at load by default (`compile`, tens of seconds on this
2-core machine). Every test that deploys a decode pool opts out explicitly, `compile=False` in its
`DecodePoolConfig` or a file from `eager_topology_file`, except tests/cluster/test_cluster_compiled.py,
the one end-to-end test of the default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from pdcluster.models.config import DeepseekV3Config, RopeScaling
from pdcluster.models.deepseek_v3 import DeepseekV3ForCausalLM

TINY_CONFIG: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    routed_scaling_factor=2.5,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    v_head_dim=12,
    qk_nope_head_dim=8,
    n_group=2,
    topk_group=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    max_position_embeddings=256,
    rope_theta=10000.0,
    num_nextn_predict_layers=1,
    torch_dtype="float32",
)

# YaRN as the public DeepSeek-V3 config sets it (mscale 0.707 is not mscale_all_dim, so both the softmax
# scale and the cos/sin attention factor differ from 1). With qk_rope_head_dim=8 and an original context
# of 64, the ramp spans rope dims 0..2: some frequencies are kept, some divided by `factor`.
# max_position_embeddings = factor * original, as in the public config (transformers derives `factor`
# from that ratio when `factor` is absent).
TINY_YARN = RopeScaling(
    factor=4.0,
    original_max_position_embeddings=64,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=0.707,
    mscale_all_dim=1.0,
)


def tiny_config(**overrides: Any) -> DeepseekV3Config:
    """A tiny `DeepseekV3Config`; `yarn=True` is shorthand for `rope_scaling=TINY_YARN`."""
    if overrides.pop("yarn", False):
        overrides["rope_scaling"] = TINY_YARN
    return DeepseekV3Config(**{**TINY_CONFIG, **overrides})


def randomize_(module: nn.Module, seed: int = 0, bias_std: float = 0.1) -> nn.Module:
    """Overwrite every parameter (and `e_score_correction_bias`) with seeded random values, in place.

    Matrices get `N(0, 1 / fan_in)` (fan_in = last dim; also for transformers' fused `[E, out, in]`
    expert tensors) so activations and logits stay O(1); norm weights `1 + N(0, 0.1)`; linear biases
    `N(0, 0.1)`; the router's selection-only bias `N(0, bias_std)`, large enough to change which experts
    are picked. Parameters are visited in name order, so the result depends only on the seed and names.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(module.named_parameters(), key=lambda item: item[0]):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if param.dim() >= 2:
                value = noise / param.shape[-1] ** 0.5
            elif "norm" in name:
                value = 1.0 + 0.1 * noise
            else:
                value = 0.1 * noise
            param.copy_(value.to(param.dtype))
        for name, buf in sorted(module.named_buffers(), key=lambda item: item[0]):
            if name.endswith("e_score_correction_bias"):
                buf.copy_(bias_std * torch.randn(buf.shape, generator=gen, dtype=torch.float32))
    return module


def tiny_model(
    config: DeepseekV3Config | None = None, seed: int = 0, **overrides: Any
) -> DeepseekV3ForCausalLM:
    """A randomized float32 model in eval mode (`tiny_config(**overrides)` unless `config` is given)."""
    config = config if config is not None else tiny_config(**overrides)
    torch.manual_seed(seed)
    return randomize_(DeepseekV3ForCausalLM(config), seed).eval()


def random_ids(config: DeepseekV3Config, batch: int = 2, seq_len: int = 12, seed: int = 0) -> torch.Tensor:
    """`[batch, seq_len]` int64 token ids."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, seq_len), generator=gen)


def hf_config_for(config: DeepseekV3Config) -> Any:
    """The `transformers.DeepseekV3Config` with the same architecture as `config` (MTP aside)."""
    from transformers import DeepseekV3Config as HFDeepseekV3Config

    shared = [
        *("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers"),
        *("num_attention_heads", "n_shared_experts", "n_routed_experts", "routed_scaling_factor"),
        *("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim"),
        *("n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace", "norm_topk_prob"),
        *("hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_interleave", "attention_bias"),
        *("tie_word_embeddings", "bos_token_id", "eos_token_id"),
    ]
    kwargs = {name: getattr(config, name) for name in shared}
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    rs = config.rope_scaling
    if rs is not None:
        rope = {
            "rope_type": "yarn",
            "rope_theta": config.rope_theta,
            "factor": rs.factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings,
            "beta_fast": rs.beta_fast,
            "beta_slow": rs.beta_slow,
            "mscale": rs.mscale,
            "mscale_all_dim": rs.mscale_all_dim,
        }
    # num_key_value_heads must equal num_attention_heads, or transformers' MLA forward breaks.
    return HFDeepseekV3Config(**kwargs, num_key_value_heads=config.num_attention_heads, rope_parameters=rope)


def eager_topology_file(source: Path, directory: Path) -> Path:
    """A copy of topology file `source` in `directory`, same name, with `decode.compile: false` (a
    deployment that loads in seconds; see the module docstring). Comments are dropped; a relative
    `model.path` / `model.config_path` is made absolute, as the copy lives elsewhere."""
    import yaml

    data = yaml.safe_load(source.read_text())
    model = data.get("model") or {}
    for key in ("path", "config_path"):
        if model.get(key) and not Path(model[key]).is_absolute():
            model[key] = str((source.resolve().parent / model[key]).resolve())
    data["decode"] = {**(data.get("decode") or {}), "compile": False}
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / source.name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path
