"""Parameters per device (`planner.memory`) against published and hand-computed counts, and the real
checkpoint's own count."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pdcluster.models import bundled_checkpoint_dir
from pdcluster.models.config import DeepseekV3Config
from pdcluster.models.deepseek_v3 import DeepseekV3ForCausalLM
from pdcluster.planner.memory import resident_params

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def v3() -> DeepseekV3Config:
    return DeepseekV3Config.from_json_file(ROOT / "clusters" / "models" / "deepseek-v3.config.json")


@pytest.fixture(scope="module")
def tiny_model() -> DeepseekV3ForCausalLM:
    return DeepseekV3ForCausalLM.from_pretrained(bundled_checkpoint_dir())


def test_deepseek_v3_on_one_device_is_the_published_685b(v3):
    # Source: the Hugging Face model card of deepseek-ai/DeepSeek-V3: "The total size of DeepSeek-V3 models
    # on Hugging Face is 685B, which includes 671B of the Main Model weights and 14B of the Multi-Token
    # Prediction (MTP) Module weights" (the report, arXiv 2412.19437, section 1: 671B total, 37B activated).
    # The MTP's 14B include its own copies of the embedding and output head (2 x 129280 x 7168 = 1.85B),
    # which the engine shares with the main model, so the count here is 682.6B: 0.35% under 685B.
    params = resident_params(v3)
    assert params.experts_per_layer == 256
    assert abs(params.total - 685e9) / 685e9 < 0.01
    main = resident_params(dataclasses.replace(v3, num_nextn_predict_layers=0))
    assert abs(main.total - 671e9) / 671e9 < 0.01
    mtp_with_head_copies = params.total - main.total + 2 * 129_280 * 7168
    assert abs(mtp_with_head_copies - 14e9) / 14e9 < 0.05  # "14B", rounded: 13.46B


def test_deepseek_v3_counts_by_hand(v3):
    h, mi = 7168, 2048
    # MLA per layer: q_a 7168x1536 + norm 1536 + q_b 1536x(128x192) + kv_a 7168x576 + norm 512
    # + kv_b 512x(128x256) + o (128x128)x7168
    attention = 11_010_048 + 1536 + 37_748_736 + 4_128_768 + 512 + 16_777_216 + 117_440_512
    assert attention == 187_107_328
    params = resident_params(v3)
    assert params.attention == 62 * attention  # 61 layers + the MTP layer
    assert params.dense_mlp == 3 * 3 * h * 18_432
    assert params.routed_experts == 59 * 256 * 3 * h * mi  # 58 MoE layers + the MTP layer's MoE
    assert params.mtp_extra == 2 * h * h + 3 * h


def test_tiny_on_one_device_is_the_checkpoints_parameter_count(tiny_model):
    cfg = tiny_model.config
    assert cfg.num_nextn_predict_layers == 1  # the MTP module is loaded, so it is in both counts
    assert resident_params(cfg).total == sum(p.numel() for p in tiny_model.parameters()) == 6_834_464


def test_tiny_ep2_with_2_redundant_experts_holds_5_experts_per_layer(tiny_model):
    cfg = tiny_model.config
    full = resident_params(cfg)
    ep2 = resident_params(cfg, devices=2, expert_parallel_size=2, num_redundant_experts=2)
    expert = 3 * 256 * 128  # gate/up/down of hidden 256 x moe_intermediate 128
    num_moe_layers = 4  # 4 layers, the first dense, + the MTP layer
    assert ep2.experts_per_layer == 5  # ceil((8 + 2) / 2)
    assert ep2.routed_experts == num_moe_layers * 5 * expert
    assert ep2.replicated == full.replicated
    assert ep2.total == full.total - num_moe_layers * (8 - 5) * expert
    # what an EP rank's engine builds: the same model with 5 expert slots per MoE layer
    rank_model = DeepseekV3ForCausalLM(cfg, num_local_experts=5)
    assert ep2.total == sum(p.numel() for p in rank_model.parameters())


def test_moe_tensor_parallel_splits_each_expert_and_tp_splits_the_heads():
    cfg = DeepseekV3Config.from_json_file(bundled_checkpoint_dir() / "config.json")
    # EP 2 over 4 devices: each expert's FFN over moe_tp = 2 devices
    split = resident_params(cfg, devices=4, expert_parallel_size=2)
    assert split.experts_per_layer == 4 and split.routed_experts == 4 * 4 * (3 * 256 * 128 // 2)
    # TP 2: q_b, kv_b, o and the dense/shared MLPs halve; q_a and kv_a stay whole
    one, two = resident_params(cfg, devices=2), resident_params(cfg, devices=2, tensor_parallel_size=2)
    q_b, kv_b, o = 96 * 4 * 48, 64 * 4 * 64, 4 * 32 * 256
    assert one.attention - two.attention == 5 * (q_b + kv_b + o) // 2  # 4 layers + MTP
    assert two.dense_mlp == 3 * 256 * 320 and two.shared_experts == 4 * 3 * 256 * 64
    with pytest.raises(ValueError, match="divide devices 3"):
        resident_params(cfg, devices=3, expert_parallel_size=2)


def test_bytes_are_parameters_times_the_weight_dtype(v3):
    params = resident_params(v3, devices=32, expert_parallel_size=32, num_redundant_experts=32)
    assert params.bytes("bfloat16") == 2 * params.total and params.bytes("int8") == params.total
    with pytest.raises(ValueError, match="weight dtype"):
        params.bytes("int4")
