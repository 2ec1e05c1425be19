"""`DeepseekV3Config`: validation names the bad field; both RoPE spellings parse; derived values."""

from __future__ import annotations

import json
import math

import pytest

from pdcluster.models.config import DeepseekV3Config, RopeScaling
from tests.conftest import TINY_CONFIG, TINY_YARN, tiny_config


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("n_group", 3, "must divide n_routed_experts=8"),
        ("topk_group", 3, r"must be in \[1, n_group=2\]"),
        ("num_experts_per_tok", 5, r"must be in \[1, topk_group \* experts per group = 4\]"),
        ("qk_rope_head_dim", 7, "must be even"),
        ("q_lora_rank", 0, "must be a positive integer or null"),
        ("hidden_size", 0, "must be a positive integer"),
        ("scoring_func", "softmax", "only 'sigmoid'"),
        ("hidden_act", "gelu", "only 'silu'"),
        ("first_k_dense_replace", -1, "must be >= 0"),
        ("num_nextn_predict_layers", -1, "must be >= 0"),
    ],
)
def test_invalid_field_is_named(field, value, why) -> None:
    with pytest.raises(ValueError, match=rf"config field '{field}': {why}.*\(got {value!r}\)"):
        tiny_config(**{field: value})


def test_groups_of_one_expert_are_rejected() -> None:
    with pytest.raises(ValueError, match="config field 'n_group': group-limited routing needs at least 2"):
        tiny_config(n_routed_experts=4, n_group=4, topk_group=2)


def test_from_json_file_names_the_file(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY_CONFIG, "n_group": 3}))
    with pytest.raises(ValueError, match=rf"^{path}: config field 'n_group'"):
        DeepseekV3Config.from_json_file(path)
    path.write_text('{"vocab_size": 64,\n "hidden_size": }')
    with pytest.raises(ValueError, match=rf"^{path}: invalid JSON at line 2"):
        DeepseekV3Config.from_json_file(path)


def test_unsupported_model_type_and_rope_type() -> None:
    with pytest.raises(ValueError, match="unsupported model_type 'llama'; supported: deepseek_v3"):
        DeepseekV3Config.from_dict({**TINY_CONFIG, "model_type": "llama"})
    linear = {"type": "linear", "factor": 2.0}
    with pytest.raises(ValueError, match="rope_scaling type 'linear' is not supported"):
        DeepseekV3Config.from_dict({**TINY_CONFIG, "rope_scaling": linear})


def test_public_and_transformers_rope_spellings_agree() -> None:
    """Public release: `rope_theta` + `rope_scaling` with `type`; transformers >= 5: `rope_parameters`."""
    scaling = {
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
    }
    raw = {k: v for k, v in TINY_CONFIG.items() if k != "rope_theta"}
    public = DeepseekV3Config.from_dict(
        {**raw, "rope_theta": 10000.0, "rope_scaling": {"type": "yarn", **scaling}}
    )
    hf = DeepseekV3Config.from_dict(
        {**raw, "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, **scaling}}
    )
    assert public == hf == tiny_config(yarn=True)
    plain = DeepseekV3Config.from_dict(
        {**raw, "rope_parameters": {"rope_type": "default", "rope_theta": 50.0}}
    )
    assert plain.rope_scaling is None and plain.rope_theta == 50.0


def test_to_dict_round_trip() -> None:
    for config in (tiny_config(), tiny_config(yarn=True, q_lora_rank=None, tie_word_embeddings=True)):
        raw = json.loads(json.dumps(config.to_dict()))
        assert raw["model_type"] == "deepseek_v3"
        assert DeepseekV3Config.from_dict(raw) == config
    assert DeepseekV3Config.from_dict({**TINY_CONFIG, "eos_token_id": [7, 8]}).eos_token_id == 7


def test_public_deepseek_v3_derived_values() -> None:
    """Defaults are the public DeepSeek-V3 config; YaRN as it ships (factor 40, mscale = mscale_all_dim)."""
    config = DeepseekV3Config(
        rope_scaling=RopeScaling(
            factor=40, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0
        )
    )
    assert config.qk_head_dim == 192
    assert config.kv_cache_dim == 576
    mscale = 0.1 * 1.0 * math.log(40) + 1.0
    assert config.softmax_scale == pytest.approx(192**-0.5 * mscale**2, rel=1e-12)
    assert config.rope_attention_factor == 1.0
    assert [config.is_moe_layer(i) for i in (0, 2, 3, 60, 61)] == [False, False, True, True, True]


def test_yarn_attention_factor() -> None:
    config = tiny_config(yarn=True)
    expected = (0.1 * 0.707 * math.log(4) + 1) / (0.1 * 1.0 * math.log(4) + 1)
    assert config.rope_attention_factor == pytest.approx(expected, rel=1e-12)
    assert config.softmax_scale == pytest.approx(16**-0.5 * (0.1 * math.log(4) + 1) ** 2, rel=1e-12)
    explicit = tiny_config(rope_scaling=RopeScaling(**{**TINY_YARN.__dict__, "attention_factor": 0.5}))
    assert explicit.rope_attention_factor == 0.5
