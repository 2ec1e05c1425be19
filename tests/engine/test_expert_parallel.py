"""Expert-parallel engines (EP2, EP4) over real gloo groups of spawned ranks: lockstep, outputs, EPLB, faults.

What they prove: each rank's `LLMEngine` (its own requests and KV cache, only its experts) gives greedy
tokens identical to one single-device engine on held-out prompts, with and without redundant experts and
with MTP k=1; a rank without requests joins every step with an empty batch (no deadlock); a live EPLB
rebalance lowers the measured imbalance and changes no output; a killed rank fails the others' steps with
a clear error within the collective timeout. Every wait derives from `TIMEOUT_S`.
"""

from __future__ import annotations

import os
import time

import pytest

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.llm_engine import EngineStepError, LLMEngine
from pdcluster.engine.local_ranks import run_ranks
from pdcluster.engine.parallel import ParallelConfig, make_instance_group
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.models import bundled_checkpoint_dir
from pdcluster.models.prompts import heldout_def_prompts

CKPT = str(bundled_checkpoint_dir())
# Collective timeout of the instance group. Generous: the first step's agreement also waits for the slowest
# rank's engine load, seconds apart on a loaded machine; a dead peer fails collectives at once anyway.
TIMEOUT_S = 60.0
# A whole multi-process run at most (spawn, import, load, steps: the 200-step run took 572 s on this 2-core
# machine at load average 20, about 30 s when quiet); pytest-timeout for these tests is raised above it so
# that a stuck run fails with the ranks' own report.
JOIN_S = 15 * TIMEOUT_S
multi_process = pytest.mark.timeout(JOIN_S + 2 * TIMEOUT_S)


def engine_config(k: int, **parallel) -> EngineConfig:
    return EngineConfig(
        CKPT,
        num_kv_blocks=256,
        num_speculative_tokens=k,
        parallel=ParallelConfig(collective_timeout_s=TIMEOUT_S, **parallel),
    )


def run_until_idle(engine: LLMEngine, min_steps: int = 0) -> tuple[dict[str, list[int]], list, int]:
    """Step until no rank of the instance has work (every rank leaves at the same step). Returns
    `(token ids by request, final outputs, steps called)`."""
    tokens: dict[str, list[int]] = {}
    finals = []
    num_calls = 0
    while True:
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
                finals.append(out)
        num_calls += 1
        if not engine.has_unfinished_requests() and not engine.ep.last_stepped and num_calls >= min_steps:
            return tokens, finals, num_calls


def ep_worker(rank: int, world_size: int, port: int, case: dict) -> dict:
    group = make_instance_group("127.0.0.1", port, rank, world_size, timeout_s=TIMEOUT_S)
    cfg = engine_config(
        case["k"],
        expert_parallel_size=world_size,
        rank=rank,
        num_redundant_experts=case.get("redundant", 0),
        eplb_interval_steps=case.get("eplb_interval"),
    )
    engine = LLMEngine(cfg, group=group)
    result: dict = {"num_local": len(engine.model.model.layers[1].mlp.experts), "rounds": [], "stats": []}
    for i, round_prompts in enumerate(case["rounds"]):
        engine.ep.set_micro_batch_overlap(i in case.get("overlap_rounds", ()))
        for request_id, prompt, max_tokens in round_prompts[rank]:
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens), request_id)
        tokens, finals, num_calls = run_until_idle(engine, case.get("min_steps", 0))
        accepted = sum(o.drafts.num_accepted_tokens for o in finals)
        drafted = sum(o.drafts.num_draft_tokens for o in finals)
        result["rounds"].append(
            {"tokens": tokens, "calls": num_calls, "accepted": accepted, "drafted": drafted}
        )
        result["stats"].append(engine.ep_stats())
    return result


def reference(prompts: list[tuple[str, str, int]], k: int) -> tuple[dict[str, list[int]], float]:
    engine = LLMEngine(engine_config(k))
    for request_id, prompt, max_tokens in prompts:
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens), request_id)
    tokens, accepted, drafted = {}, 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
                accepted += out.drafts.num_accepted_tokens
                drafted += out.drafts.num_draft_tokens
    return tokens, accepted / max(drafted, 1)


def split(prompts: list[tuple[str, str, int]], world_size: int) -> list[list[tuple[str, str, int]]]:
    return [prompts[r::world_size] for r in range(world_size)]


@multi_process
@pytest.mark.parametrize("world_size, redundant", [(2, 2), (4, 0)])
def test_ep_matches_single_device_with_mtp(world_size: int, redundant: int) -> None:
    """Greedy tokens identical to one device; acceptance rate equal within 0.05 (the MTP drafts' argmax may
    flip on float noise from expert GEMMs over other row sets; the verified output cannot). EP2 runs the
    same prompts twice: the second round with two-micro-batch overlap on."""
    prompts = [(f"p{i}", p, 16) for i, p in enumerate(heldout_def_prompts(2 * world_size + 1))]
    want, want_rate = reference(prompts, k=1)
    rounds = [split(prompts, world_size)] * (2 if world_size == 2 else 1)  # overlap: EP2 (time)
    case = {"k": 1, "redundant": redundant, "rounds": rounds, "overlap_rounds": (1,)}
    results = run_ranks(ep_worker, world_size, case, timeout_s=JOIN_S)
    for i in range(len(rounds)):
        got, accepted, drafted = {}, 0, 0
        for result in results.values():
            assert result["num_local"] == (8 + redundant) // world_size  # only this rank's experts
            round_ = result["rounds"][i]
            got.update(round_["tokens"])
            accepted += round_["accepted"]
            drafted += round_["drafted"]
        assert got == want, f"round {i}"
        assert abs(accepted / drafted - want_rate) <= 0.05, f"round {i}"


@multi_process
def test_eplb_live_rebalance_lowers_imbalance_and_keeps_outputs() -> None:
    """Skewed load (the same prompt, 4 copies per rank), 3 identical rounds of 8 steps (k=0: one step per
    token); `eplb_interval_steps=12` rebalances mid round 2. Imbalance (max/mean rows per rank over all
    MoE layers) with the default placement (after round 1) vs since the rebalance (after round 3): lower
    after. Every round's tokens equal the single-device ones."""
    (prompt,) = heldout_def_prompts(1)
    skewed = [[(f"r{r}-{i}", prompt, 8) for i in range(4)] for r in range(2)]
    want, _ = reference([("x", prompt, 8)], k=0)
    case = {"k": 0, "redundant": 2, "eplb_interval": 12, "rounds": [skewed] * 3}
    results = run_ranks(ep_worker, 2, case, timeout_s=JOIN_S)
    for result in results.values():
        for round_ in result["rounds"]:
            assert set(map(tuple, round_["tokens"].values())) == {tuple(want["x"])}
        before, mid, after = result["stats"]
        assert (before.num_steps, mid.num_steps, after.num_steps) == (8, 16, 24)
        assert (before.num_rebalances, mid.num_rebalances, after.num_rebalances) == (0, 1, 1)
        assert after.total_imbalance < before.total_imbalance, (before.total_imbalance, after.total_imbalance)
        assert after.last_rebalance_s > 0


@multi_process
def test_idle_rank_joins_100_steps_without_deadlock() -> None:
    """Rank 0 runs one 100-token request (k=0: 100 steps, rebalancing every 25 steps meanwhile); rank 1
    has none and joins every step with an empty batch."""
    (prompt,) = heldout_def_prompts(1)
    busy = [("busy", prompt, 100)]
    want, _ = reference(busy, k=0)
    case = {"k": 0, "redundant": 2, "eplb_interval": 25, "rounds": [[busy, []]]}
    results = run_ranks(ep_worker, 2, case, timeout_s=JOIN_S)
    assert results[0]["rounds"][0]["tokens"] == want
    assert results[1]["rounds"][0]["tokens"] == {}
    for rank in (0, 1):
        assert results[rank]["rounds"][0]["calls"] >= 100
        (stats,) = results[rank]["stats"]
        assert stats.num_steps == 100  # the instance stepped once per token
        assert stats.num_idle_steps == (100 if rank == 1 else 0)
        assert stats.num_rebalances == 3  # before steps 26, 51, 76


def killing_worker(rank: int, world_size: int, port: int) -> dict:
    group = make_instance_group("127.0.0.1", port, rank, world_size, timeout_s=TIMEOUT_S)
    engine = LLMEngine(engine_config(0, expert_parallel_size=world_size, rank=rank), group=group)
    for i, prompt in enumerate(heldout_def_prompts(2)):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=64), f"r{rank}-{i}")
    for _ in range(3):
        engine.step()
    if rank == 1:
        os._exit(3)  # the rank dies mid-generation
    start_s = time.monotonic()
    try:
        while True:
            engine.step()
    except EngineStepError as e:
        elapsed_s = time.monotonic() - start_s
        finals = [(o.request_id, o.finish_reason, o.error) for o in e.outputs]
        message = str(e)
    try:  # the instance stays failed: a new request fails at the next step, at once
        engine.add_request("def f():", SamplingParams(max_tokens=4), "late")
        engine.step()
        late = None
    except EngineStepError as e:
        late = [(o.request_id, o.finish_reason) for o in e.outputs]
    return {"elapsed_s": elapsed_s, "finals": finals, "message": message, "late": late}


@multi_process
def test_killed_rank_fails_the_instance_within_the_timeout() -> None:
    results = run_ranks(killing_worker, 2, timeout_s=JOIN_S, allow_failed=(1,))
    result = results[0]
    assert result["elapsed_s"] < TIMEOUT_S * 1.5
    assert sorted(r for r, _, _ in result["finals"]) == ["r0-0", "r0-1"]
    assert all(
        reason == "error" and "expert-parallel instance failed" in err for _, reason, err in result["finals"]
    )
    assert "EP rank 0" in result["message"]
    assert result["late"] == [("late", "error")]
