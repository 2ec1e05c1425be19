"""The discrete-event simulator: live policies, event order and exact TTFT/TPOT arithmetic.

The step models here are explicit (constant or linear step times defined in the test) so every expected
time is hand-computable; `pdcluster plan` and the fidelity bench use `planner.perf_model`. Times are sums
of a few binary floats, so they are compared with a 1e-9 s tolerance (rounding of the sums, not modelling).
"""

from __future__ import annotations

import pytest

import pdcluster.driver.dispatch
import pdcluster.driver.router
import pdcluster.engine.scheduler_policy
from pdcluster.config import (
    DecodePoolConfig,
    KVTransferConfig,
    PrefillPoolConfig,
    RouterConfig,
    Topology,
)
from pdcluster.engine.scheduler_policy import SchedulerConfig
from pdcluster.planner import sim_engine, simulator
from pdcluster.planner.simulator import LengthOnlyPrompt, PoolSizing, SimOptions, simulate
from pdcluster.planner.step_model import DecodeRow, PrefillChunk, StepShape
from pdcluster.planner.trace import TraceRequest

TOL_S = 1e-9


class LinearModel:
    """step = base_s + per_token_s x tokens; the handoff a constant. Records every step it prices."""

    def __init__(self, base_s: float, per_token_s: float = 0.0, handoff_s: float = 0.0) -> None:
        self.base_s, self.per_token_s, self.handoff_s = base_s, per_token_s, handoff_s
        self.steps: list[StepShape] = []

    def step_time_s(self, step: StepShape) -> float:
        self.steps.append(step)
        return self.base_s + self.per_token_s * step.num_tokens if step.num_tokens else 0.0

    def kv_handoff_s(self, num_prompt_tokens: int, prefill_compute_s: float) -> float:
        return self.handoff_s


def topology(
    k: int = 0, num_decodes: int = 1, timeout_s: float = 30.0, policy: str = "least_loaded"
) -> Topology:
    return Topology(
        name="sim-test",
        prefill=PrefillPoolConfig(num_instances=1),
        decode=DecodePoolConfig(num_instances=num_decodes, num_speculative_tokens=k),
        kv_transfer=KVTransferConfig(timeout_s=timeout_s),
        router=RouterConfig(policy=policy),
    )


def sizing(num_blocks: int = 1000, budget: int = 2048, max_num_seqs: int = 64) -> PoolSizing:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=8192)
    return PoolSizing(config, num_blocks)


def run(requests, prefill, decode, k=0, acceptance=(), decode_blocks=1000, **kw):
    topo = kw.pop("topo", None) or topology(k=k, **kw)
    return simulate(
        topo,
        requests,
        SimOptions(prefill, decode, acceptance),
        prefill_sizing=sizing(),
        decode_sizing=sizing(num_blocks=decode_blocks),
    )


def test_the_simulator_calls_the_live_policy_functions():
    assert simulator.POLICIES is pdcluster.driver.router.POLICIES
    assert simulator.after_reserve is pdcluster.driver.dispatch.after_reserve
    assert sim_engine.schedule_step is pdcluster.engine.scheduler_policy.schedule_step
    assert simulator.check_request_fits is pdcluster.engine.scheduler_policy.check_request_fits
    for (
        name,
        live,
    ) in pdcluster.driver.router.POLICIES.items():  # the instance routes with the live object
        sim = simulator.ClusterSimulator(
            topology(policy=name), SimOptions(LinearModel(0.1), LinearModel(0.01)), sizing(), sizing()
        )
        assert sim.policy is live


def test_the_simulator_runs_the_policy_functions_it_imports(monkeypatch):
    """Not only the same names: each live function is what decides (a copy inlined next to the import
    would leave these counters at 0). Two requests: each is routed, reserved (after_reserve), admitted
    (check_request_fits) and scheduled by the live functions."""
    calls: dict[str, int] = {}

    def counting(owner, name, live):
        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return live(*args, **kwargs)

        if isinstance(owner, dict):
            monkeypatch.setitem(owner, name, wrapper)
        else:
            monkeypatch.setattr(owner, name, wrapper)
        return wrapper

    counting(sim_engine, "schedule_step", pdcluster.engine.scheduler_policy.schedule_step)
    counting(simulator, "after_reserve", pdcluster.driver.dispatch.after_reserve)
    counting(simulator, "check_request_fits", pdcluster.engine.scheduler_policy.check_request_fits)
    policy = counting(
        pdcluster.driver.router.POLICIES,
        "least_loaded",
        pdcluster.driver.router.POLICIES["least_loaded"],
    )
    assert simulator.POLICIES["least_loaded"] is policy  # the simulator's table is the live one
    run([TraceRequest(0.0, 8, 4), TraceRequest(0.5, 8, 4)], LinearModel(0.1), LinearModel(0.01))
    assert calls["least_loaded"] >= 2 and calls["after_reserve"] >= 2 and calls["check_request_fits"] >= 2
    assert calls["schedule_step"] >= 2  # every simulated step is planned by the live function


def test_one_request_ttft_tpot_e2e_exact():
    prefill, decode = LinearModel(0.1, handoff_s=0.05), LinearModel(0.01)
    result = run([TraceRequest(0.0, 100, 4)], prefill, decode)
    (r,) = result.results
    assert r.ok and r.num_output_tokens == 4
    # prefill step [0, 0.1]: the first token (the prefill reply streams it); handoff until 0.15:
    # admitted; 3 decode steps of 0.01 s
    assert r.ttft_s == pytest.approx(0.1, abs=TOL_S)
    assert r.tpot_s == pytest.approx(0.08 / 3, abs=TOL_S)
    assert r.e2e_s == pytest.approx(0.18, abs=TOL_S)
    assert r.phases == pytest.approx(
        {"queue_s": 0.0, "prefill_s": 0.1, "kv_transfer_s": 0.05, "decode_s": 0.03}, abs=TOL_S
    )
    assert prefill.steps == [StepShape((PrefillChunk(100, 0),), (), 0)]
    assert decode.steps == [StepShape((), (DecodeRow(100 + i, 1),), 0) for i in range(3)]
    assert result.summary["num_ok"] == 1 and result.summary["ttft_ms"]["p50"] == pytest.approx(100.0)


def test_chunked_prefill_under_the_token_budget():
    prefill, decode = LinearModel(0.0, per_token_s=1e-4), LinearModel(0.01)
    result = run([TraceRequest(0.0, 5000, 2)], prefill, decode)
    assert [s.prefill for s in prefill.steps] == [
        (PrefillChunk(2048, 0),),
        (PrefillChunk(2048, 2048),),
        (PrefillChunk(904, 4096),),
    ]
    (r,) = result.results
    assert r.phases["prefill_s"] == pytest.approx(0.5, abs=TOL_S)  # 5000 tokens x 1e-4 s
    assert r.ttft_s == pytest.approx(0.5, abs=TOL_S)
    assert r.tpot_s == pytest.approx(0.01, abs=TOL_S)


@pytest.mark.parametrize(("acceptance", "num_decode_steps"), [(1.0, 2), (0.0, 4)])
def test_mtp_drafts_verified_at_the_given_acceptance(acceptance, num_decode_steps):
    decode = LinearModel(0.01)
    result = run([TraceRequest(0.0, 32, 5)], LinearModel(0.1), decode, k=1, acceptance=(acceptance,))
    (r,) = result.results
    assert r.ok and r.num_output_tokens == 5
    assert len(decode.steps) == num_decode_steps
    # 1 + a draft per step, but no draft that would pass max_tokens (the last step of acceptance 0)
    expected = [2] * num_decode_steps if acceptance else [2, 2, 2, 1]
    assert [s.decode[0].num_query_tokens for s in decode.steps] == expected
    assert all(s.num_speculative_tokens == 1 for s in decode.steps)
    assert r.acceptance_rate == acceptance
    assert r.tpot_s == pytest.approx(0.01 * num_decode_steps / 4, abs=TOL_S)


def test_continuous_batching_joins_requests_at_step_boundaries():
    prefill, decode = LinearModel(0.1), LinearModel(0.03)
    # the second request's prefill ends at 0.2 (queued behind the first's), mid decode step [0.19, 0.22]
    result = run([TraceRequest(0.0, 16, 8), TraceRequest(0.05, 16, 4)], prefill, decode)
    first, second = result.results
    assert first.ttft_s == pytest.approx(0.1, abs=TOL_S)
    assert second.ttft_s == pytest.approx(0.2 - 0.05, abs=TOL_S)  # its prefill's end (the reply streams it)
    assert second.phases["kv_transfer_s"] == pytest.approx(0.02, abs=TOL_S)
    # steps ending 0.13, 0.16, 0.19, 0.22 run the first alone; 0.25, 0.28, 0.31 both (both end at 0.31)
    assert [len(s.decode) for s in decode.steps] == [1, 1, 1, 1, 2, 2, 2]
    assert first.e2e_s == pytest.approx(0.31, abs=TOL_S)
    assert second.e2e_s == pytest.approx(0.31 - 0.05, abs=TOL_S)


def test_back_pressure_retries_the_reserve_then_fails_at_the_deadline():
    from pdcluster.driver.dispatch import RESERVE_RETRY_S

    # 100 + 1 tokens need 7 blocks of 16: the decode cache (10 blocks) holds one request at a time
    prefill, decode = LinearModel(0.01), LinearModel(0.1)
    requests = [TraceRequest(0.0, 100, 3), TraceRequest(0.0, 100, 3)]
    ok = run(requests, prefill, decode, decode_blocks=10)
    first, second = ok.results
    assert first.ok and second.ok
    # the first finishes at 0.01 + 2 x 0.1 = 0.21; the second's reserve is retried every RESERVE_RETRY_S;
    # the retry at 0.20 waits for the decode step in flight (the engine lock), which ends at 0.21 and
    # frees the first's blocks
    assert RESERVE_RETRY_S * 4 < 0.21 < RESERVE_RETRY_S * 5
    assert second.phases["queue_s"] == pytest.approx(0.21, abs=1e-6)
    failed = run(requests, LinearModel(0.01), LinearModel(0.1), decode_blocks=10, timeout_s=0.1)
    assert failed.results[0].ok and not failed.results[1].ok
    assert "no decode instance had KV blocks free in time" in failed.results[1].error
    assert failed.summary["num_failed"] == 1


def test_a_reserve_waits_for_the_decode_step_in_flight():
    prefill, decode = LinearModel(0.1), LinearModel(0.07)
    # decode steps [0.1, 0.17], [0.17, 0.24], [0.24, 0.31] for the first; the second arrives at 0.15
    result = run([TraceRequest(0.0, 16, 4), TraceRequest(0.15, 16, 2)], prefill, decode)
    first, second = result.results
    assert second.phases["queue_s"] == pytest.approx(0.02, abs=TOL_S)  # reserved when the step ends
    assert second.phases["prefill_s"] == pytest.approx(0.1, abs=TOL_S)  # [0.17, 0.27]
    assert second.ttft_s == pytest.approx(0.27 - 0.15, abs=TOL_S)  # its prefill's end (the reply streams it)
    assert second.phases["kv_transfer_s"] == pytest.approx(
        0.31 - 0.27, abs=TOL_S
    )  # admitted after [0.24, 0.31]
    assert first.e2e_s == pytest.approx(0.31, abs=TOL_S)


def test_a_request_that_can_never_fit_fails_alone():
    result = run(
        [TraceRequest(0.0, 100, 3), TraceRequest(0.0, 9000, 3)], LinearModel(0.01), LinearModel(0.01)
    )
    assert result.results[0].ok
    assert not result.results[1].ok and "exceeds max_model_len" in result.results[1].error


def test_round_robin_spreads_over_decode_instances():
    decode = LinearModel(0.01)
    requests = [TraceRequest(0.001 * i, 16, 2) for i in range(4)]
    result = run(requests, LinearModel(0.01), decode, num_decodes=2, policy="round_robin")
    assert all(r.ok for r in result.results)
    assert result.num_steps["decode"] >= 2


def test_same_seed_same_result_and_the_bench_table():
    requests = [TraceRequest(0.01 * i, 64, 8) for i in range(20)]

    def once():
        return run(requests, LinearModel(0.02, 1e-5), LinearModel(0.01, 1e-5), k=1, acceptance=(0.6,))

    a, b = once(), once()
    assert [r.e2e_s for r in a.results] == [r.e2e_s for r in b.results]  # one process, same arithmetic
    table = a.as_table("sim")
    assert "TTFT ms" in table and "goodput" in table


def test_length_only_prompt_has_no_prefix_hits():
    prompt = LengthOnlyPrompt(48)
    assert len(prompt) == 48
    assert pdcluster.driver.router.prefix_hit_tokens(prompt, 16, frozenset({b"x"})) == 0


def test_decode_preempts_by_recompute_when_its_blocks_run_out():
    # each reservation takes 1 block of 16 (15 + 1 tokens); growing to 30 outputs needs 3: the 3-block cache
    # cannot hold both, so the most recent request is preempted, recomputed on decode, and finishes later
    decode = LinearModel(0.01, per_token_s=1e-4)
    requests = [TraceRequest(0.0, 15, 30), TraceRequest(0.0, 15, 30)]
    result = run(requests, LinearModel(0.01), decode, decode_blocks=3)
    assert all(r.ok and r.num_output_tokens == 30 for r in result.results)
    assert result.num_preemptions["decode"] >= 1
    recomputes = [c for s in decode.steps for c in s.prefill]
    assert recomputes and all(c.context_len == 0 for c in recomputes[:1])
    first, second = result.results
    assert second.e2e_s > first.e2e_s


@pytest.mark.parametrize(
    ("path", "role", "max_num_seqs", "max_num_batched_tokens", "dp"),
    [
        ("clusters/cm384.yaml", "decode", 27648, 55296, 288),
        ("clusters/cm384.yaml", "prefill", 1024, 524288, 32),
        ("clusters/local-ep.yaml", "decode", 64, 2048, 2),
    ],
)
def test_pool_sizing_keeps_the_instances_limits(path, role, max_num_seqs, max_num_batched_tokens, dp):
    """An instance is simulated as one engine: it keeps the pool's own per-instance `max_num_seqs` and
    `max_num_batched_tokens` (the YAML's figures), not one data-parallel rank's share of them (which the live
    ranks run with, `Topology.engine_config`), and gets the KV blocks of all its ranks. (Simulating one rank's
    share made cm384's decode instance take 96 requests instead of 27,648.)"""
    from pathlib import Path

    from pdcluster.config import load_topology
    from pdcluster.planner.simulator import pool_sizing

    topology = load_topology(Path(__file__).resolve().parents[2] / path)
    pool = topology.pool(role)
    assert pool.attention_data_parallel_size == dp
    sizing = pool_sizing(topology, role, bytes_per_token=1000)
    assert sizing.scheduler.max_num_seqs == max_num_seqs == pool.max_num_seqs
    assert sizing.scheduler.max_num_batched_tokens == max_num_batched_tokens
    rank = topology.engine_config(role)
    assert rank.max_num_seqs == -(-max_num_seqs // dp)  # what each live rank runs with
    assert sizing.num_blocks == dp * (rank.kv_cache_memory_bytes // (1000 * rank.block_size))
