"""DeepSeek-V3 model configuration: `config.json` keys map 1:1 onto `DeepseekV3Config`.

Both RoPE spellings are accepted: `rope_theta` + `rope_scaling`, and newer `transformers`' `rope_parameters`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("deepseek_v3",)


@dataclass(frozen=True)
class RopeScaling:
    """YaRN RoPE scaling (Peng et al. 2023, "YaRN: Efficient Context Window Extension of LLMs")."""

    rope_type: str = "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN attention temperature `0.1 * mscale * ln(scale) + 1` (YaRN section 3.4); 1 for scale <= 1."""
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class DeepseekV3Config:
    """Architecture hyper-parameters; field names equal the public `config.json` keys.

    `q_lora_rank=None`: a plain query projection (DeepSeek-V2-Lite); `num_nextn_predict_layers` MTP modules
    follow the main layers (the first at index `num_hidden_layers`).
    """

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int = 8
    topk_group: int = 4
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 3
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    hidden_act: str = "silu"
    max_position_embeddings: int = 163840
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 1
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    torch_dtype: str = "bfloat16"
    quantization_config: dict[str, Any] | None = field(default=None, compare=False)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """One token's latent KV width per layer: `kv_lora_rank + qk_rope_head_dim`."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """`qk_head_dim ** -0.5`, times `yarn_get_mscale(factor, mscale_all_dim) ** 2` under YaRN.

        Source: DeepSeek-V2 paper appendix (YaRN for MLA) and the public DeepSeek-V3 inference code.
        """
        scale = self.qk_head_dim**-0.5
        rs = self.rope_scaling
        if rs is not None and rs.mscale_all_dim:
            m = yarn_get_mscale(rs.factor, rs.mscale_all_dim)
            scale = scale * m * m
        return scale

    @property
    def rope_attention_factor(self) -> float:
        """Multiplier on cos/sin under YaRN: `mscale(factor, mscale) / mscale(factor, mscale_all_dim)`.

        An explicit `attention_factor` wins; as vLLM's DeepseekScalingRotaryEmbedding.
        """
        rs = self.rope_scaling
        if rs is None:
            return 1.0
        if rs.attention_factor is not None:
            return rs.attention_factor
        if rs.mscale and rs.mscale_all_dim:
            return yarn_get_mscale(rs.factor, rs.mscale) / yarn_get_mscale(rs.factor, rs.mscale_all_dim)
        return yarn_get_mscale(rs.factor)

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.n_routed_experts > 0 and layer_idx >= self.first_k_dense_replace

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"config field {name!r}: {why} (got {getattr(self, name)!r})")

        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "kv_lora_rank",
            "qk_rope_head_dim",
            "v_head_dim",
            "qk_nope_head_dim",
        ):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise bad(name, "must be a positive integer")
        if self.qk_rope_head_dim % 2:
            raise bad("qk_rope_head_dim", "must be even (RoPE rotates pairs)")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise bad("q_lora_rank", "must be a positive integer or null")
        if self.n_routed_experts:
            if self.n_group <= 0 or self.n_routed_experts % self.n_group:
                raise bad("n_group", f"must divide n_routed_experts={self.n_routed_experts}")
            if not 0 < self.topk_group <= self.n_group:
                raise bad("topk_group", f"must be in [1, n_group={self.n_group}]")
            per_group = self.n_routed_experts // self.n_group
            if per_group < 2 and self.n_group > 1:
                raise bad("n_group", "group-limited routing needs at least 2 experts per group")
            if not 0 < self.num_experts_per_tok <= self.topk_group * per_group:
                raise bad(
                    "num_experts_per_tok",
                    f"must be in [1, topk_group * experts per group = {self.topk_group * per_group}]",
                )
        if self.scoring_func != "sigmoid":
            raise bad("scoring_func", "only 'sigmoid' (DeepSeek-V3 routing) is supported")
        if self.hidden_act != "silu":
            raise bad("hidden_act", "only 'silu' is supported")
        if self.first_k_dense_replace < 0:
            raise bad("first_k_dense_replace", "must be >= 0")
        if self.num_nextn_predict_layers < 0:
            raise bad("num_nextn_predict_layers", "must be >= 0")

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "config") -> DeepseekV3Config:
        """Build from a `config.json` dict, ignoring unknown keys.

        Raises ValueError for an unsupported `model_type` or an invalid field (named).
        """
        model_type = raw.get("model_type", "deepseek_v3")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"{source}: unsupported model_type {model_type!r}; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in names}
        rope = dict(raw.get("rope_parameters") or {})
        if "rope_theta" in rope:
            kwargs["rope_theta"] = rope.pop("rope_theta")
        scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling and scaling.get("factor") is None and "original_max_position_embeddings" in scaling:
            # No explicit factor: the stretch is max_position_embeddings / original (transformers' rule).
            max_len = raw.get("max_position_embeddings", cls.max_position_embeddings)
            scaling = {**scaling, "factor": max_len / scaling["original_max_position_embeddings"]}
        kwargs["rope_scaling"] = _parse_rope_scaling(scaling, source) if scaling else None
        if isinstance(kwargs.get("eos_token_id"), list):
            kwargs["eos_token_id"] = kwargs["eos_token_id"][0]
        try:
            return cls(**kwargs)
        except TypeError as exc:  # pragma: no cover
            raise ValueError(f"{source}: {exc}") from exc

    @classmethod
    def from_json_file(cls, path: str | Path) -> DeepseekV3Config:
        """Read `config.json`; FileNotFoundError, or ValueError naming the file for anything unreadable."""
        path = Path(path)
        if path.exists() and not path.is_file():
            raise ValueError(f"{path}: not a regular file")
        try:
            raw = json.loads(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: not valid UTF-8 (byte at offset {exc.start})") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from exc
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
        try:
            return cls.from_dict(raw, source=str(path))
        except ValueError as exc:
            msg = str(exc)
            raise ValueError(msg if msg.startswith(str(path)) else f"{path}: {msg}") from exc
        except (TypeError, AttributeError, KeyError) as exc:
            raise ValueError(f"{path}: a field has a value of the wrong type ({exc})") from exc

    def to_dict(self) -> dict[str, Any]:
        """The `config.json` form (public-release spelling: `rope_theta` + `rope_scaling`)."""
        out = dataclasses.asdict(self)
        out["model_type"] = "deepseek_v3"
        out["architectures"] = ["DeepseekV3ForCausalLM"]
        if self.rope_scaling is None:
            out["rope_scaling"] = None
        else:
            rs = dataclasses.asdict(self.rope_scaling)
            rs["type"] = rs["rope_type"]
            out["rope_scaling"] = rs
        if out["quantization_config"] is None:
            del out["quantization_config"]
        return out


def _parse_rope_scaling(raw: dict[str, Any], source: str) -> RopeScaling:
    kind = raw.get("rope_type", raw.get("type"))
    if kind != "yarn":
        raise ValueError(f"{source}: rope_scaling type {kind!r} is not supported (only 'yarn')")
    names = {f.name for f in dataclasses.fields(RopeScaling)}
    kwargs = {k: v for k, v in raw.items() if k in names and v is not None}
    kwargs["rope_type"] = "yarn"
    return RopeScaling(**kwargs)
