"""The performance model: the work split over ranks, the roofline regime switch, EP communication, the
layer-wise KV handoff, the topology constructor and calibration files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pdcluster.config import load_topology
from pdcluster.config.hardware import get_accelerator
from pdcluster.models.config import DeepseekV3Config
from pdcluster.planner.calibration import FORMAT, load_calibration
from pdcluster.planner.efficiency import get_efficiency
from pdcluster.planner.op_costs import Dtypes
from pdcluster.planner.perf_model import Link, Parallelism, PerfModel, perf_model_for, statistical_imbalance
from pdcluster.planner.rank_split import attention_sums, decode_sums
from pdcluster.planner.step_model import DecodeRow, PrefillChunk, StepShape

ROOT = Path(__file__).resolve().parents[2]
FP8 = Dtypes("fp8", "bfloat16", "bfloat16")
# Relative tolerance for sums of float seconds computed in different orders.
REL = 1e-12


@pytest.fixture(scope="module")
def v3() -> DeepseekV3Config:
    return DeepseekV3Config.from_json_file(ROOT / "clusters" / "models" / "deepseek-v3.config.json")


def decode(batch: int, context_len: int = 1024, k: int = 0) -> StepShape:
    return StepShape(decode=(DecodeRow(context_len, 1 + k),) * batch, num_speculative_tokens=k)


def test_empty_step_is_free(v3):
    model = PerfModel(v3, get_accelerator("h800"), dtypes=FP8)
    assert model.step_time_s(StepShape()) == 0.0


def test_decode_gemms_switch_from_memory_to_compute_bound_as_the_batch_grows(v3):
    """A GEMM's arithmetic intensity is ~batch FLOPs per weight byte (fp8): below the H800's ridge
    (1,979 x 0.68 / (3.35 x 0.7) ~ 574 FLOP/B, i.e. ~287 tokens) it streams weights, above it computes."""
    model = PerfModel(v3, get_accelerator("h800"), dtypes=FP8, ep_imbalance=1.0, kernel_tables=None)
    small, large = model.breakdown(decode(8)), model.breakdown(decode(4096))
    assert "dense_mlp" not in small.compute_bound_ops and "attn.o_proj" not in small.compute_bound_ops
    assert "dense_mlp" in large.compute_bound_ops and "attn.o_proj" in large.compute_bound_ops
    # memory-bound: time per token falls with the batch; compute-bound: it stays flat
    assert small.op_s["dense_mlp"] / 8 > 10 * large.op_s["dense_mlp"] / 4096
    double = model.breakdown(decode(8192)).op_s["dense_mlp"]
    assert double == pytest.approx(2 * large.op_s["dense_mlp"], rel=1e-9)


def test_absorbed_attention_is_compute_bound_with_all_heads_and_memory_bound_with_few(v3):
    """Absorbed MLA reads one 1,152 B bf16 latent per key for all heads of the rank: 128 heads make
    2 x 128 x (576 + 512) = 278,528 FLOPs per key (242 FLOP/B, over the H800's attention ridge of
    989 x 0.667 / (3.35 x 0.9) = 219); TP8 leaves 16 heads (30 FLOP/B), under it."""
    bf16 = Dtypes("fp8", "bfloat16", "bfloat16")
    dp = PerfModel(v3, get_accelerator("h800"), dtypes=bf16, kernel_tables=None)
    tp = PerfModel(
        v3, get_accelerator("h800"), dtypes=bf16, parallel=Parallelism(8, 8, 8), kernel_tables=None
    )
    step = decode(64, 8192)
    attn = next(op for op in dp.ops(step) if op.name == "attn.mla_absorbed")
    assert attn.flops / attn.bytes == pytest.approx(242, rel=0.03)  # + W_UK/W_UV per query, kv_b read
    assert "attn.mla_absorbed" in dp.breakdown(step).compute_bound_ops
    assert "attn.mla_absorbed" not in tp.breakdown(step).compute_bound_ops


def test_dp_split_gives_the_slowest_rank_ceil_rows(v3):
    model = PerfModel(v3, get_accelerator("h800"), dtypes=FP8, parallel=Parallelism(4, 1, 4))
    work = model.rank_work(decode(10, 100))
    assert work.num_tokens == 3  # ceil(10 / 4)
    assert work.absorbed_keys == 3 * 101
    prefill = model.rank_work(StepShape(prefill=(PrefillChunk(4000), PrefillChunk(100))))
    assert prefill.num_tokens == 4000  # a request is never split: the 4,000-token chunk's rank is slowest
    assert prefill.expanded_pairs == 4000 * 4001 / 2
    balanced = model.rank_work(StepShape(prefill=(PrefillChunk(1000),) * 8))
    assert balanced.num_tokens == 2000 and balanced.expanded_pairs == 2 * 1000 * 1001 / 2


def test_ep_communication_and_overlap(v3):
    link = Link(50e9, 5e-6, "inter_node")
    kw = dict(dtypes=FP8, parallel=Parallelism(32, 1, 32), ep_link=link, ep_imbalance=1.0, kernel_tables=None)
    model = PerfModel(v3, get_accelerator("h800"), dispatch_dtype="fp8", **kw)
    step = decode(32 * 64)  # 64 tokens per rank
    # per MoE layer: 64 tokens x 8 experts x 7168 x (1 B fp8 dispatch + 2 B bf16 combine) x 31/32 remote
    per_layer = 64 * 8 * 7168 * 3 * 31 / 32 / (50e9 * get_efficiency("h800").link.value) + 2 * 5e-6
    assert model.comm_time_s(step) == pytest.approx(58 * per_layer, rel=REL)
    b = model.breakdown(step)
    assert b.total_s == pytest.approx(b.compute_s + b.comm_s + b.host_s, rel=REL)
    # two micro-batches: never faster than the larger of compute and communication, never slower than serial
    hidden = PerfModel(v3, get_accelerator("h800"), dispatch_dtype="fp8", microbatch_overlap=True, **kw)
    bh = hidden.breakdown(decode(32 * 1024))
    serial = model.breakdown(decode(32 * 1024))
    assert bh.hidden_comm_s > 0
    assert max(bh.compute_s, bh.comm_s) + bh.host_s <= bh.total_s < serial.total_s


def test_step_time_is_the_breakdown_total_for_mixed_steps(v3):
    model = PerfModel(
        v3, get_accelerator("h800"), dtypes=FP8, parallel=Parallelism(8, 1, 8), mtp_in_prefill=True
    )
    mixed = StepShape(
        prefill=(PrefillChunk(512, 64), PrefillChunk(8)),
        decode=(DecodeRow(300, 2), DecodeRow(40, 1), DecodeRow(900, 2)),  # unequal query counts
        num_speculative_tokens=1,
    )
    for step in (mixed, decode(64, 2048, k=1)):
        assert model.step_time_s(step) == pytest.approx(model.breakdown(step).total_s, rel=REL)
    rows = tuple(DecodeRow(100 + i, 2) for i in range(16))  # the one-pass sums equal the general ones
    general = attention_sums(((r.num_query_tokens, r.context_len) for r in rows), model.crossover_queries)
    assert decode_sums(rows, model.crossover_queries) == (general, 32)


def test_first_tokens_are_sampled_before_the_prefill_mtp_pass(v3):
    def model(mtp: bool) -> PerfModel:
        return PerfModel(v3, get_accelerator("h800"), dtypes=FP8, parallel=Parallelism(8, 1, 8),
                         mtp_in_prefill=mtp)  # fmt: skip

    with_mtp, without = model(True), model(False)
    step = StepShape(prefill=(PrefillChunk(2048), PrefillChunk(512, 64)), num_speculative_tokens=1)
    # the sampling point is the step priced without the MTP layer over the prompts; after it, that pass
    assert with_mtp.first_token_s(step) == pytest.approx(without.step_time_s(step), rel=REL)
    assert 0 < with_mtp.first_token_s(step) < with_mtp.step_time_s(step)
    assert without.first_token_s(step) == without.step_time_s(step)
    assert with_mtp.mtp_in_prefill  # the model asked is left as it was
    assert with_mtp.first_token_s(decode(8, k=1)) == with_mtp.step_time_s(decode(8, k=1))


def test_statistical_imbalance():
    assert statistical_imbalance(100.0, 1) == 1.0
    assert statistical_imbalance(768.0, 288) == pytest.approx(1 + math.sqrt(2 * math.log(288) / 768))


def test_kv_handoff_layerwise_overlap(v3):
    link = Link(25e9, 10e-6, "inter_node")
    model = PerfModel(v3, get_accelerator("h800"), dtypes=FP8, kv_link=link)
    eff = model.efficiency
    layers = 62  # 61 + the MTP layer
    t = 4096 * 1152 / (25e9 * eff.kv_link.value)  # one layer of a 4,096-token bf16 prompt
    fixed = 10e-6 + eff.handoff_overhead_s.value
    # compute much longer than the transfer: only the last layer shows
    assert model.kv_handoff_s(4096, 10.0) == pytest.approx(t + fixed, rel=REL)
    # no compute to hide behind: every layer
    assert model.kv_handoff_s(4096, 0.0) == pytest.approx(layers * t + fixed, rel=REL)
    c = 0.5 * t * layers  # half as fast as the link: L t - (L - 1) c
    assert model.kv_handoff_s(4096, c) == pytest.approx(
        layers * t - (layers - 1) * c / layers + fixed, rel=REL
    )
    whole = PerfModel(v3, get_accelerator("h800"), dtypes=FP8, kv_link=link, layerwise_kv=False)
    assert whole.kv_handoff_s(4096, 10.0) == pytest.approx(layers * t + fixed, rel=REL)
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        model.kv_handoff_s(0, 1.0)


def test_perf_model_for_reads_the_pools_of_a_topology():
    cm = load_topology(ROOT / "clusters" / "cm384.yaml")
    d = perf_model_for(cm, "decode")  # weights: the file's model.weight_dtype, int8
    assert (d.parallel.devices, d.parallel.expert_parallel_size, d.parallel.attention_data_parallel_size) == (
        288,
        288,
        288,
    )
    assert d.dtypes == Dtypes("int8", "bfloat16", "int8") and d.kv_wire_dtype == "int8"
    assert d.ep_link.level == "supernode" and d.kv_link.level == "supernode"
    p = perf_model_for(cm, "prefill", weight_dtype="bfloat16")
    assert p.mtp_in_prefill and p.parallel.expert_parallel_size == 32 and p.dtypes.weight == "bfloat16"
    local = perf_model_for(load_topology(ROOT / "clusters" / "local.yaml"), "decode")
    assert local.dtypes == Dtypes("float32", "float32", "float32") and local.kv_link.level == "intra_node"
    assert local.step_time_s(decode(4, 64, k=1)) > 0
    with pytest.raises(ValueError, match="role must be one of"):
        perf_model_for(cm, "router")


def test_calibration_files(tmp_path):
    base = get_efficiency("cpu")
    good = tmp_path / "c.json"
    good.write_text(json.dumps({"format": FORMAT, "accelerator": "cpu", "factors": {"gemm_compute": 0.25}}))
    eff = load_calibration(good, base, accelerator="cpu")
    assert eff.gemm_compute.value == 0.25 and eff.memory == base.memory
    with pytest.raises(ValueError, match="not 'h800'"):
        load_calibration(good, base, accelerator="h800")
    for text, match in (
        ("{", "not a readable JSON"),
        (json.dumps({"format": "x"}), "not a calibration"),
        (json.dumps({"format": "pdcluster-calibration/1"}), "written by an earlier pdcluster"),
        (json.dumps({"format": FORMAT, "factors": {"speed": 1}}), "unknown factor 'speed'"),
        (json.dumps({"format": FORMAT, "factors": {"memory": -1}}), "finite number >= 0"),
    ):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(ValueError, match=match):
            load_calibration(bad, base)
    with pytest.raises(ValueError, match="no such calibration"):
        load_calibration(tmp_path / "missing.json", base)


@pytest.mark.parametrize(
    ("topology_transport", "applied"),
    [("shm", True), ("grpc", False), ("shm+grpc", False), ("torch_distributed", False), (None, True)],
)
def test_kv_link_factors_apply_only_to_the_transport_they_were_measured_over(
    tmp_path, caplog, topology_transport, applied
):
    """A calibration of a one-node topology measured its handoffs over shared memory: its kv_link and
    handoff overhead are applied to an shm topology (and when the caller names none), not to one whose
    handoffs go over gRPC or torch.distributed (the catalog's stay, with a warning); the compute factors
    apply either way."""
    base = get_efficiency("cpu")
    path = tmp_path / "shm.json"
    factors = {"gemm_compute": 0.25, "kv_link": 0.125, "handoff_overhead_s": 0.002}
    doc = {"format": FORMAT, "accelerator": "cpu", "factors": factors, "kv_transfer": {"transport": "shm"}}
    path.write_text(json.dumps(doc))
    with caplog.at_level("WARNING", logger="pdcluster.planner.calibration"):
        eff = load_calibration(path, base, accelerator="cpu", kv_transport=topology_transport)
    assert eff.gemm_compute.value == 0.25
    if applied:
        assert (eff.kv_link.value, eff.handoff_overhead_s.value) == (0.125, 0.002) and not caplog.records
    else:
        assert eff.kv_link == base.kv_link and eff.handoff_overhead_s == base.handoff_overhead_s
        assert "measured over shm" in caplog.text and "kv_link, handoff_overhead_s" in caplog.text


def test_nnls_solves_and_clips():
    import numpy as np

    from pdcluster.planner.profiling import nnls

    a = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    assert np.allclose(nnls(a, np.array([3.0, 5.0, 7.0])), [1.0, 2.0])  # y = 1 + 2 x exactly
    # unconstrained [2, -1]; with x >= 0 the best is [0, 0] (x2 = 0 -> x1 = mean(y) = 0)
    assert np.allclose(nnls(a, np.array([1.0, 0.0, -1.0])), [0.0, 0.0])


def test_node_forwarding_sends_a_token_once_per_destination_node(v3):
    """EP32 over 4 nodes of 8: a token's 8 experts land on 4 (1 - (3/4)^8) = 3.60 nodes on average, 3/4 of
    them remote: 2.70 hidden states per token over IB instead of 8 x 31/32 = 7.75 point to point."""
    from pdcluster.planner.comm_costs import ep_layer_s

    ib, nvlink = Link(50e9, 0.0, "inter_node"), Link(160e9, 0.0, "intra_node")
    args = (v3, 32, 1000.0, 8000.0, 1.0, 3, ib, 1.0)
    direct = ep_layer_s(*args)
    assert direct == pytest.approx(1000 * 8 * 7168 * 3 * 31 / 32 / 50e9, rel=REL)
    forwarded = ep_layer_s(*args, node_forwarding=(8, nvlink))
    distinct = 4 * (1 - 0.75**8)
    ib_s = 1000 * distinct * 3 / 4 * 7168 * 3 / 50e9
    nvlink_s = 1000 * 8 * 7 / 8 * 7168 * 3 / 160e9
    assert forwarded == pytest.approx(max(ib_s, nvlink_s), rel=REL)
    assert ep_layer_s(v3, 8, 1000.0, 8000.0, 1.0, 3, ib, 1.0, (8, nvlink)) == ep_layer_s(
        v3, 8, 1000.0, 8000.0, 1.0, 3, ib, 1.0
    )
