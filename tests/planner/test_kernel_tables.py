"""Shape-aware pricing: the tables interpolate to their published points, prefill throughput falls with
prompt length, decode step time grows with context, the overlap timeline hides only what the other half's
compute covers, and the imbalance terms behave."""

from __future__ import annotations

import math
import random

import pytest

from pdcluster.planner import kernel_tables as kt
from pdcluster.planner.imbalance import dp_max_rank_kv_factor, eplb_imbalance
from pdcluster.planner.op_costs import gemm
from pdcluster.planner.overlap import layer_timeline, overlapped_s
from pdcluster.planner.published import load_config, load_table, model_for
from pdcluster.planner.step_model import DecodeRow, PrefillChunk, StepShape
from pdcluster.planner.step_pricing import gemm_time_s


@pytest.mark.parametrize("tables", [kt.HOPPER_TABLES, kt.ASCEND_TABLES], ids=["hopper", "ascend"])
def test_each_table_interpolates_to_its_published_points(tables):
    for layout, table in tables.gemm.items():
        for p in table.points:
            compute, memory = table.fractions(p.m, p.n, p.k)
            assert compute * table.peak_flops_per_s == pytest.approx(p.flops_per_s, rel=1e-12), (layout, p)
            # priced as a GEMM op: the published time; our byte count (bf16 activations) differs from the
            # benchmark's (fp8 inputs), so a memory-bound point may come out a few percent slower
            op = gemm("g", p.m, p.k, p.n, 1, 2)
            seconds, _ = gemm_time_s(tables, "dense", op, table.peak_flops_per_s, table.peak_bytes_per_s)
            if layout == "dense":
                assert seconds == pytest.approx(2 * p.m * p.n * p.k / p.flops_per_s, rel=0.05), p
    att = tables.attention
    for seq_len, fraction in zip(att.seq_lens, att.compute_fractions, strict=True):
        assert att.prefill_compute_fraction(seq_len) == pytest.approx(fraction, rel=1e-12)
    mid = att.prefill_compute_fraction(math.sqrt(att.seq_lens[0] * att.seq_lens[1]))
    assert att.compute_fractions[0] < mid < att.compute_fractions[1]
    for ep_table in (tables.ep_decode, tables.ep_prefill):
        if ep_table is None:
            continue
        for i, ep in enumerate(ep_table.ep_sizes):
            assert ep_table.bandwidth(ep) == (
                ep_table.dispatch_bytes_per_s[i],
                ep_table.combine_bytes_per_s[i],
            )
        if ep_table.floor is not None:
            for ep, dispatch, combine in zip(*ep_table.floor, strict=True):
                assert ep_table.latency_floor_s(ep) == (dispatch, combine)
                # the ~1-token floor stays below the table's own 128-token call (fp8 out, bf16 back, top-8)
                out, back = ep_table.bandwidth(ep)
                assert dispatch < 128 * 8 * 7168 / out and combine < 128 * 8 * 7168 * 2 / back


def test_grouped_layouts_below_their_smallest_m_use_the_dense_rows():
    tables = kt.HOPPER_TABLES
    assert tables.gemm_fractions("contiguous", 128, 4096, 7168) == tables.gemm["dense"].fractions(
        128, 4096, 7168
    )
    assert tables.gemm_fractions("masked", 512, 4096, 7168)[0] == pytest.approx(1040 / 1979)


@pytest.fixture(scope="module")
def deployments():
    return load_table()[0], load_config()


def test_prefill_throughput_per_device_falls_with_prompt_length_at_a_fixed_token_budget(deployments):
    deps, config = deployments
    for key in ("h800-prefill", "cm-prefill"):
        model = model_for(deps[key], config)
        n = model.parallel.devices
        per_device = []
        for prompt_len in (1024, 2048, 4096, 8192):
            prompts = 16384 // prompt_len  # 16,384 tokens per device in every step
            step = StepShape(prefill=(PrefillChunk(prompt_len),) * (prompts * n))
            per_device.append(16384 / model.step_time_s(step))
        assert all(a > b for a, b in zip(per_device, per_device[1:], strict=False)), (key, per_device)


def test_decode_step_time_grows_with_context(deployments):
    deps, config = deployments
    for key in ("h800-decode", "cm-decode"):
        model = model_for(deps[key], config)
        n = model.parallel.devices
        times = [
            model.step_time_s(StepShape(decode=(DecodeRow(ctx, 2),) * (32 * n), num_speculative_tokens=1))
            for ctx in (512, 1024, 2048, 4096, 8192)
        ]
        assert all(a < b for a, b in zip(times, times[1:], strict=False)), (key, times)


def test_overlap_timeline_never_hides_more_communication_than_the_other_halfs_compute():
    rng = random.Random(0)
    for _ in range(500):
        layers = rng.randint(1, 61)
        attention, moe, dispatch, combine = (rng.expovariate(1.0) for _ in range(4))
        t = layer_timeline(layers, attention, moe, dispatch, combine)
        compute, comm = 2 * layers * (attention + moe), 2 * layers * (dispatch + combine)
        # a half's communication runs only beside the other half's compute, layer by layer
        bound = layers * 2 * min(dispatch + combine, attention + moe)
        assert -1e-9 <= t.hidden_comm_s <= bound + 1e-9
        assert max(compute, comm) - 1e-9 <= t.makespan_s <= compute + comm + 1e-9
        # the constant-time form repeats the second layer's increment: the same makespan
        assert overlapped_s(layers, attention, moe, dispatch, combine) == pytest.approx(
            t.makespan_s, rel=1e-9
        )
    assert layer_timeline(10, 1.0, 1.0, 0.0, 0.0).hidden_comm_s == 0.0
    with pytest.raises(ValueError):
        layer_timeline(3, -1.0, 1.0, 1.0, 1.0)


def test_dp_max_rank_holds_more_kv_when_lengths_differ():
    assert dp_max_rank_kv_factor(64, 8, 64 * 1000.0, 64 * 1000.0**2) == 1.0  # equal lengths
    lengths = [500.0, 1500.0] * 32
    spread = dp_max_rank_kv_factor(64, 8, sum(lengths), sum(x * x for x in lengths))
    assert spread == pytest.approx(1 + math.sqrt(2 * math.log(8)) * 0.5 / math.sqrt(8))
    assert dp_max_rank_kv_factor(4, 8, 4000.0, 4e6) == 1.0  # fewer rows than ranks


def test_ep_imbalance_after_eplb():
    assert eplb_imbalance(256, 288, 8, 4, 32, 0.0) == 1.0  # flat popularity, no step deviations
    assert eplb_imbalance(256, 288, 8, 4, 1, 1.0, 1.5, 64) == 1.0  # one rank
    # skewed popularity: EPLB's redundant replicas take load off the hot ranks
    assert eplb_imbalance(256, 256, 8, 4, 32, 1.0) > eplb_imbalance(256, 288, 8, 4, 32, 1.0) > 1.0
    # a step's deviations shrink with its number of requests, and weigh more with fewer experts per rank
    few, many = (
        eplb_imbalance(256, 288, 8, 4, 32, 0.0, 1.5, 64),
        eplb_imbalance(256, 288, 8, 4, 32, 0.0, 1.5, 6400),
    )
    assert few > many > 1.0
    assert eplb_imbalance(256, 320, 8, 40, 320, 0.0, 1.5, 64) > few


def test_a_tiny_decode_step_pays_the_ep_latency_floor_and_always_runs_two_micro_batches(deployments):
    deps, config = deployments
    model = model_for(deps["h800-decode"], config, overlap=False)
    one = StepShape(decode=(DecodeRow(4096, 2),) * model.parallel.devices, num_speculative_tokens=1)
    floor = kt.HOPPER_EP_LOW_LATENCY.latency_floor_s(model.parallel.expert_parallel_size)
    assert min(floor) > 0
    # one token per rank moves a few KB: the floor, not the bytes, prices every MoE layer's dispatch/combine
    assert model.comm_time_s(one) >= model.num_moe_layers * sum(floor)
    always = model_for(deps["rtp-h800-decode"], config)
    assert always.microbatch_overlap == "always"
    serial = model_for(deps["rtp-h800-decode"], config, overlap=False)
    # at one request per rank two micro-batches read every weight twice: slower than one batch, yet priced so
    assert always.step_time_s(one) > serial.step_time_s(one)
