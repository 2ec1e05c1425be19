"""FLOP and byte counts of each op against values computed by hand (in the comments) for the bundled tiny
config (pdcluster/models/tiny/config.json) and DeepSeek-V3's public config
(clusters/models/deepseek-v3.config.json).

Counts are sums of products of integers held in floats below 2**53, so they compare exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pdcluster.models import bundled_checkpoint_dir
from pdcluster.models.config import DeepseekV3Config
from pdcluster.planner import op_costs as oc
from pdcluster.planner.op_costs import Dtypes, RankWork

ROOT = Path(__file__).resolve().parents[2]
BF16 = Dtypes("bfloat16", "bfloat16", "bfloat16")


@pytest.fixture(scope="module")
def tiny() -> DeepseekV3Config:
    # h 256, H 4, q_lora 96, r 64, dr 16, dn 32, dv 32, inter 640, moe_inter 128, E 8, k 2, V 4096, 4 layers
    return DeepseekV3Config.from_json_file(bundled_checkpoint_dir() / "config.json")


@pytest.fixture(scope="module")
def v3() -> DeepseekV3Config:
    return DeepseekV3Config.from_json_file(ROOT / "clusters" / "models" / "deepseek-v3.config.json")


def by_name(ops):
    return {op.name: op for op in ops}


def test_tiny_attention_projections(tiny):
    ops = by_name(oc.attention_projections(tiny, 10, BF16))
    q_a = ops["attn.q_a_proj"]  # [10, 256] x [256, 96]
    assert (q_a.flops, q_a.weight_bytes, q_a.activation_bytes) == (
        2 * 10 * 256 * 96,
        256 * 96 * 2,
        10 * 352 * 2,
    )
    assert ops["attn.q_b_proj"].flops == 368_640  # 2 * 10 * 96 * (4 heads * 48)
    assert ops["attn.kv_a_proj_with_mqa"].flops == 409_600  # 2 * 10 * 256 * (64 + 16)
    assert ops["attn.o_proj"].flops == 655_360  # 2 * 10 * (4 * 32) * 256
    assert ops["attn.o_proj"].weight_bytes == 65_536  # 128 * 256 * 2 B


def test_tiny_mla_absorbed_decode_row(tiny):
    # one decode row: 100 cached tokens + 1 query -> 101 keys, 101 query-key pairs
    work = RankWork(num_tokens=1, absorbed_queries=1, absorbed_keys=101, absorbed_pairs=101)
    (op,) = oc.attention_core(tiny, work, BF16)
    # W_UK 2*4*32*64 + W_UV 2*4*64*32 + scores 2*4*101*(64+16) + P.c_kv 2*4*101*64
    assert op.flops == 16_384 + 16_384 + 64_640 + 51_712
    assert op.kv_bytes == 101 * 80 * 2 + 1 * 80 * 2  # latent read + the new token's write, bf16
    assert op.weight_bytes == 64 * 4 * (32 + 32) * 2  # kv_b_proj
    assert op.kind == "attention"


def test_tiny_mla_expanded_prefill_chunk(tiny):
    # a 200-token prompt from scratch: 200 keys, 200 * 201 / 2 = 20,100 causal pairs (expanded: >= 13 queries)
    work = RankWork(num_tokens=200, expanded_queries=200, expanded_keys=200, expanded_pairs=20_100)
    (op,) = oc.attention_core(tiny, work, BF16)
    up = 2 * 200 * 64 * 4 * 64  # kv_b_proj over every key: 6,553,600
    attn = 2 * 4 * 20_100 * (32 + 16) + 2 * 4 * 20_100 * 32  # 7,718,400 + 5,145,600
    assert op.flops == up + attn == 19_417_600
    assert op.kv_bytes == 200 * 160 + 200 * 160  # read the 200 latents, write the 200 new ones
    assert op.activation_bytes == 2 * 200 * 4 * 64 * 2 + 200 * 4 * (32 + 16 + 32) * 2


def test_tiny_mlp_moe_and_head(tiny):
    dense = oc.mlp("dense_mlp", 10, 256, 640, 2, 2)
    assert (dense.flops, dense.weight_bytes) == (6 * 10 * 256 * 640, 3 * 256 * 640 * 2)
    assert dense.activation_bytes == 10 * (2 * 256 + 3 * 640) * 2
    moe = by_name(oc.moe_ops(tiny, 10, routed_pairs_rank=20, active_experts_rank=5, d=BF16))
    assert moe["moe.gate"].flops == 2 * 10 * 256 * 8
    assert moe["moe.routed_experts"].flops == 6 * 20 * 256 * 128  # 20 (token, expert) pairs
    assert moe["moe.routed_experts"].weight_bytes == 5 * 3 * 256 * 128 * 2  # only the 5 experts hit
    assert moe["moe.shared_expert"].flops == 6 * 10 * 256 * 128
    head = oc.lm_head(tiny, 3, BF16)
    assert (head.flops, head.weight_bytes) == (2 * 3 * 256 * 4096, 256 * 4096 * 2)


def test_v3_per_op_counts(v3):
    int8 = Dtypes("int8", "bfloat16", "int8")
    assert oc.kv_bytes_per_token_per_layer(v3, "bfloat16") == 1152  # 576 values x 2 B
    assert oc.kv_bytes_per_token_per_layer(v3, "int8") == 580  # 576 B + a float32 scale
    # decode row over 4,095 cached tokens: 4,096 keys and pairs, 128 heads
    work = RankWork(num_tokens=1, absorbed_queries=1, absorbed_keys=4096, absorbed_pairs=4096)
    (op,) = oc.attention_core(v3, work, int8)
    w_uk = w_uv = 2 * 128 * 128 * 512  # 16,777,216 each
    scores, pv = 2 * 128 * 4096 * 576, 2 * 128 * 4096 * 512  # 603,979,776 and 536,870,912
    assert op.flops == w_uk + w_uv + scores + pv == 1_174_405_120
    assert op.kv_bytes == 4096 * 580 + 580
    expert = oc.mlp("e", 1, 7168, 2048, 1, 2)
    assert (expert.flops, expert.weight_bytes) == (88_080_384, 44_040_192)  # one expert: 44.0M params, int8
    assert oc.lm_head(v3, 1, int8).flops == 2 * 7168 * 129_280
    proj = by_name(oc.attention_projections(v3, 1, int8))
    assert (
        sum(op.weight_bytes for op in proj.values())
        == 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 128 * 128 * 7168
    )


def test_v3_each_op_by_hand(v3):
    """Every op kind of a DeepSeek-V3 layer, FLOPs and bytes from the config's numbers (h 7168, 128 heads,
    q_lora 1536, kv_lora 512, rope 64, nope 128, v 128, inter 18432, moe_inter 2048, 256 routed experts,
    1 shared, V 129,280), INT8 weights and KV, bf16 activations."""
    int8 = Dtypes("int8", "bfloat16", "int8")
    t = 10
    proj = by_name(oc.attention_projections(v3, t, int8))
    # [10, 7168] x [7168, 1536]; [10, 1536] x [1536, 128 * 192]; [10, 7168] x [7168, 576];
    # [10, 128 * 128] x [16384, 7168]
    expected = {
        "attn.q_a_proj": (2 * 10 * 7168 * 1536, 7168 * 1536, 10 * (7168 + 1536) * 2),
        "attn.q_b_proj": (2 * 10 * 1536 * 24576, 1536 * 24576, 10 * (1536 + 24576) * 2),
        "attn.kv_a_proj_with_mqa": (2 * 10 * 7168 * 576, 7168 * 576, 10 * (7168 + 576) * 2),
        "attn.o_proj": (2 * 10 * 16384 * 7168, 16384 * 7168, 10 * (16384 + 7168) * 2),
    }
    assert {n: (op.flops, op.weight_bytes, op.activation_bytes) for n, op in proj.items()} == expected
    tp8 = by_name(oc.attention_projections(v3, t, int8, tp=8))  # 16 heads per rank; q_a, kv_a whole
    assert tp8["attn.q_b_proj"].weight_bytes == 1536 * 16 * 192
    assert tp8["attn.o_proj"].flops == 2 * 10 * (16 * 128) * 7168
    assert tp8["attn.q_a_proj"].weight_bytes == 7168 * 1536

    # a 4,096-token prompt from scratch, expanded: 4,096 keys, 4,096 * 4,097 / 2 causal pairs
    pairs = 4096 * 4097 // 2  # 8,390,656
    work = RankWork(num_tokens=4096, expanded_queries=4096, expanded_keys=4096, expanded_pairs=pairs)
    (mla,) = oc.attention_core(v3, work, int8)
    up = 2 * 4096 * 512 * 128 * (128 + 128)  # kv_b_proj over every key
    scores, pv = 2 * 128 * pairs * (128 + 64), 2 * 128 * pairs * 128
    assert mla.flops == up + scores + pv
    assert mla.weight_bytes == 512 * 128 * 256  # kv_b_proj, int8
    assert mla.kv_bytes == 4096 * 580 + 4096 * 580  # read every latent + write the prompt's, int8 + scale
    assert mla.activation_bytes == 2 * 4096 * 128 * 256 * 2 + 4096 * 128 * (128 + 64 + 128) * 2

    dense = oc.mlp("dense_mlp", t, v3.hidden_size, v3.intermediate_size, 1, 2)  # the first 3 layers
    assert (dense.flops, dense.weight_bytes) == (6 * 10 * 7168 * 18432, 3 * 7168 * 18432)
    # one EP288 decode rank: 64 tokens, 512 (token, expert) pairs through its 1 expert
    moe = by_name(oc.moe_ops(v3, 64, routed_pairs_rank=512, active_experts_rank=1, d=int8))
    assert (moe["moe.gate"].flops, moe["moe.gate"].weight_bytes) == (2 * 64 * 7168 * 256, 7168 * 256 * 2)
    assert (moe["moe.routed_experts"].flops, moe["moe.routed_experts"].weight_bytes) == (
        6 * 512 * 7168 * 2048,
        3 * 7168 * 2048,
    )
    assert (moe["moe.shared_expert"].flops, moe["moe.shared_expert"].weight_bytes) == (
        6 * 64 * 7168 * 2048,
        3 * 7168 * 2048,
    )
    split = by_name(oc.moe_ops(v3, 64, 512, 1, int8, moe_tp=2))  # each expert's FFN over 2 ranks
    assert split["moe.routed_experts"].weight_bytes == 3 * 7168 * 1024
    head = oc.lm_head(v3, 4, int8)
    assert (head.flops, head.weight_bytes) == (2 * 4 * 7168 * 129_280, 7168 * 129_280)


def test_v3_active_parameters_per_token(v3):
    """One token's GEMM FLOPs / 2 are the active parameters without the embedding: the report's 37B
    (DeepSeek-V3 technical report, arXiv:2412.19437, section 1) less the 0.93B embedding table."""
    from pdcluster.config.hardware import get_accelerator
    from pdcluster.planner.perf_model import PerfModel
    from pdcluster.planner.step_model import DecodeRow, StepShape

    model = PerfModel(v3, get_accelerator("h800"), ep_imbalance=1.0)
    ops = model.ops(StepShape(decode=(DecodeRow(1),)))
    gemm_flops = sum(op.flops * op.count for op in ops if op.kind == "gemm")
    # one token meets all 256 experts' layer at EP1 with 8 active: the routed GEMMs count 8 pairs per layer
    embedding = 129_280 * 7168
    assert gemm_flops / 2 + embedding == pytest.approx(37e9, rel=0.02)


def test_expected_active_experts():
    assert oc.expected_active_experts(8, 8, 2, 0) == 0
    assert oc.expected_active_experts(8, 8, 2, 1) == pytest.approx(2.0)  # one token hits exactly k experts
    assert oc.expected_active_experts(1, 288, 8, 10_000) == pytest.approx(1.0)  # big batch: all hit
    assert oc.expected_active_experts(9, 288, 8, 1) == pytest.approx(9 * 8 / 288)


def test_bad_dtype_names_the_field():
    with pytest.raises(ValueError, match="weight dtype: unknown dtype 'int4'"):
        Dtypes(weight="int4")


def test_tiny_decode_step_op_list(tiny):
    """Every op of one tiny decode step with MTP k=1 (1 row, 2 verified tokens), with its layer count:
    1 dense + 3 MoE layers (first_k_dense_replace 1), then the MTP module (an MoE layer) over the 2
    verified positions and one draft's lm_head."""
    from pdcluster.config.hardware import get_accelerator
    from pdcluster.planner.perf_model import PerfModel
    from pdcluster.planner.step_model import DecodeRow, StepShape

    f32 = Dtypes("float32", "float32", "float32")
    model = PerfModel(tiny, get_accelerator("cpu"), dtypes=f32, ep_imbalance=1.0)
    ops = model.ops(StepShape(decode=(DecodeRow(100, 2),), num_speculative_tokens=1))
    counts = {}
    for op in ops:
        counts[op.name] = counts.get(op.name, 0) + op.count
    assert counts["attn.q_a_proj"] == 4 and counts["dense_mlp"] == 1 and counts["moe.routed_experts"] == 3
    assert counts["mtp.attn.q_a_proj"] == 1 and counts["mtp.moe.routed_experts"] == 1
    named = {op.name: op for op in ops}
    assert named["embedding"].activation_bytes == 2 * 256 * 4
    assert named["lm_head"].flops == 2 * 2 * 256 * 4096  # both verified positions get logits
    assert named["mtp.lm_head"].flops == 2 * 1 * 256 * 4096  # one draft
    assert named["mtp.eh_proj"].flops == 2 * 2 * 512 * 256  # [2, 2h] x [2h, h]
    assert named["norms_residuals"].activation_bytes == 10 * 2 * 256 * 4
    # one routed pair per (token, chosen expert): 2 tokens x top-2 = 4 pairs over 8 experts at EP1
    assert named["moe.routed_experts"].flops == 6 * 4 * 256 * 128
    assert named["moe.routed_experts"].weight_bytes == pytest.approx(
        oc.expected_active_experts(8, 8, 2, 2) * 3 * 256 * 128 * 4
    )
    # absorbed attention: 2 queries over 100 cached + 2 new keys, causal pairs 2 * 100 + 3 = 203
    attn = named["attn.mla_absorbed"]
    assert attn.flops == 2 * 2 * 4 * 32 * 64 * 2 + 2 * 4 * 203 * (64 + 16) + 2 * 4 * 203 * 64
