"""End-to-end engine tests on the bundled tiny checkpoint (real weights trained on real text).

What they prove: every engine feature (speculative decoding with MTP, prefix caching, batching, chunked
prefill, INT8 KV, preemption, async scheduling) leaves greedy output token-for-token unchanged, sampling
with speculation keeps the target distribution, and no KV block outlives its request.
"""

from __future__ import annotations

import math

import pytest
import torch

from pdcluster.engine.llm import LLM
from pdcluster.engine.model_runner import build_model_input
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.scheduler_policy import cdiv
from pdcluster.kernels.kv_quant import kv_cache_bytes_per_token
from pdcluster.models import bundled_checkpoint_dir
from pdcluster.models.deepseek_v3 import DeepseekV3ForCausalLM
from pdcluster.models.prompts import heldout_def_prompts, heldout_token_prompts

CKPT = bundled_checkpoint_dir()
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(CKPT, num_kv_blocks=512, block_size=16)


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return heldout_def_prompts(16)


@pytest.fixture(scope="module")
def reference(llm, prompts) -> list[list[int]]:
    """Greedy tokens of the plain engine (k=0, prefix caching on, chunked prefill, batch of 16)."""
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def assert_no_blocks_held(llm: LLM) -> None:
    bm = llm.engine.scheduler.block_manager
    bm.check_no_leaks()
    assert bm.num_free_blocks == bm.num_blocks


def test_engine_matches_cacheless_model(llm, prompts, reference):
    """The paged, batched engine reproduces a plain full-recompute greedy loop of the model."""
    model: DeepseekV3ForCausalLM = llm.engine.model
    for prompt, expected in list(zip(prompts, reference, strict=True))[:3]:
        ids = llm.tokenizer.encode(prompt)
        out: list[int] = []
        for _ in range(len(expected)):
            out.append(int(model(torch.tensor([ids + out]))[0, -1].argmax()))
        assert out == expected


@pytest.mark.parametrize(
    "changes",
    [
        {"num_speculative_tokens": 1},
        {"num_speculative_tokens": 3},
        {"enable_prefix_caching": False},
        {"max_num_batched_tokens": 40},  # prompts chunked over several steps
        {"enable_chunked_prefill": False, "max_num_batched_tokens": 2048},
        {"num_speculative_tokens": 2, "max_num_batched_tokens": 40, "block_size": 4},
        {"async_scheduling": True},
        {"async_scheduling": True, "max_num_batched_tokens": 40},  # prefill chunks while a step is in flight
        {"async_scheduling": True, "num_speculative_tokens": 2},
        {
            "async_scheduling": True,
            "num_speculative_tokens": 3,
            "max_num_batched_tokens": 40,
            "block_size": 4,
        },
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()),
)
def test_greedy_output_is_identical_across_engine_settings(llm, prompts, reference, changes):
    other = llm.replace_config(**changes)
    outputs = other.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == reference
    assert_no_blocks_held(other)
    if changes.get("num_speculative_tokens"):
        assert sum(o.drafts.num_draft_tokens for o in outputs) > 0


def test_batch_of_one_equals_batch_of_sixteen(llm, prompts, reference):
    for prompt, expected in list(zip(prompts, reference, strict=True))[::5]:
        assert llm.generate([prompt], GREEDY)[0].token_ids == expected


def test_speculative_acceptance_is_counted_per_position(llm, prompts):
    outputs = llm.replace_config(num_speculative_tokens=3).generate(prompts, GREEDY)
    drafted = [sum(x) for x in zip(*(o.drafts.num_draft_tokens_per_position for o in outputs), strict=False)]
    accepted = [
        sum(x) for x in zip(*(o.drafts.num_accepted_tokens_per_position for o in outputs), strict=False)
    ]
    assert len(drafted) == 3 and all(a <= d for a, d in zip(accepted, drafted, strict=True))
    assert sum(accepted) == sum(o.drafts.num_accepted_tokens for o in outputs)
    assert sum(drafted) == sum(o.drafts.num_draft_tokens for o in outputs)
    assert accepted[0] > 0 and accepted[2] > 0  # the trained MTP module is right at every depth sometimes


def test_prefix_cache_hits_leave_output_unchanged(llm):
    """Prompts sharing a 70-token prefix (4 full blocks of 16): with prefix caching, later requests reuse the
    first one's blocks (`num_cached_tokens > 0`); greedy output equals the run without prefix caching."""
    (shared,) = heldout_token_prompts(llm.tokenizer, [70])
    suffixes = heldout_token_prompts(llm.tokenizer, [3 + i for i in range(6)])
    prompts = [shared + suffix for suffix in suffixes]
    cached = llm.replace_config(enable_prefix_caching=True)
    first = cached.generate([prompts[0]], GREEDY)  # fills the cache
    rest = cached.generate(prompts[1:], GREEDY)
    assert all(o.num_cached_tokens == 64 for o in rest)
    uncached = llm.replace_config(enable_prefix_caching=False).generate(prompts, GREEDY)
    assert [o.token_ids for o in first + rest] == [o.token_ids for o in uncached]
    assert all(o.num_cached_tokens == 0 for o in uncached)
    assert_no_blocks_held(cached)


def test_preemption_under_kv_pressure_keeps_output_and_frees_blocks(llm, prompts, reference):
    """Too few blocks for the whole batch: requests are preempted (recomputed), outputs unchanged."""
    tight = llm.replace_config(num_kv_blocks=24, block_size=8, num_speculative_tokens=1)
    outputs = tight.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == reference
    assert sum(o.num_preemptions for o in outputs) > 0
    assert_no_blocks_held(tight)


def test_abort_frees_blocks(llm, prompts):
    engine = llm.replace_config(num_speculative_tokens=1).engine
    ids = [engine.add_request(p, GREEDY) for p in prompts[:6]]
    engine.step()
    engine.step()
    for rid in ids[::2]:
        assert engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    engine.scheduler.block_manager.check_no_leaks()


def test_int8_kv_cache_agrees_with_float(llm, prompts, reference):
    """INT8 latent cache (per-token scales folded into attention): >= 99% of greedy tokens agree.

    Agreement is per token, teacher-forced, through the same paths as serving: each prompt is prefilled
    into an INT8-cache runner in one forward, then the float engine's greedy continuation is fed back one
    token per step (the absorbed decode path, every key read from the quantized paged cache), and each
    step's greedy choice is compared with the float engine's next token. (Free-running generation compounds
    one near-tie flip into a different continuation; `bench.kv_int8` reports that stricter figure too.)
    """
    int8 = llm.replace_config(kv_cache_dtype="int8")
    runner = int8.engine.runner
    same = total = 0
    for prompt, expected in zip(prompts, reference, strict=True):
        ids = llm.tokenizer.encode(prompt)
        table = [list(range(cdiv(len(ids) + len(expected), 16)))]
        step = build_model_input([ids], [0], table, 16)
        predicted = int(runner.compute_logits(runner.forward(step))[-1].argmax())
        for i, token in enumerate(expected):
            same += predicted == token
            total += 1
            step = build_model_input([[token]], [len(ids) + i], table, 16)
            predicted = int(runner.compute_logits(runner.forward(step))[-1].argmax())
    assert same / total >= 0.99, f"int8 agreement {same}/{total}"
    kv_dim, num_layers = llm.engine.model.config.kv_cache_dim, len(runner.kv_caches)
    bf16_bytes = kv_cache_bytes_per_token(kv_dim, torch.bfloat16, num_layers)
    assert runner.kv_cache_bytes_per_token / bf16_bytes < 0.55  # 84 / 160 B per layer here


def two_sample_chi_square(a: list[int], b: list[int]) -> tuple[float, int, float]:
    """Pearson's test that two equal-size samples of token ids come from one distribution.

    Returns (statistic, degrees of freedom, p-value); tokens seen fewer than 10 times in both samples
    together are pooled into one cell so every expected count is at least 5.
    """
    tokens = sorted(set(a) | set(b))
    counts_a = torch.tensor([a.count(t) for t in tokens], dtype=torch.float64)
    counts_b = torch.tensor([b.count(t) for t in tokens], dtype=torch.float64)
    rare = (counts_a + counts_b) < 10
    if rare.any():
        counts_a = torch.cat([counts_a[~rare], counts_a[rare].sum()[None]])
        counts_b = torch.cat([counts_b[~rare], counts_b[rare].sum()[None]])
    expected = (counts_a + counts_b) / 2  # equal sample sizes
    stat = float((((counts_a - expected) ** 2 + (counts_b - expected) ** 2) / expected).sum())
    dof = len(expected) - 1
    return stat, dof, float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


def test_sampling_with_speculation_preserves_the_distribution(llm):
    """Two-sample chi-square tests, significance level alpha = 0.001 each, on output tokens 2 and 3.

    600 requests sample 4 tokens at temperature 1.0 from the same prompt with k=0 (seeds 0..599), and 600
    with k=2 MTP drafts (seeds 10000..10599, so the two samples are independent). With k=2, token 2 is a
    depth-1 draft or the residual sample after its rejection, token 3 a depth-2 draft, residual or bonus.
    If speculation preserves the distribution, each test passes with probability 0.999 (both: >= 0.998);
    a biased verifier (e.g. resampling from p instead of max(0, p - q) after a rejection) fails them.
    """
    prompt = "def __init__(self, name, value):\n        self."
    num = 600

    def sample_tokens(k: int, first_seed: int) -> list[list[int]]:
        engine_llm = llm.replace_config(num_speculative_tokens=k, max_num_seqs=num, num_kv_blocks=2048)
        params = [
            SamplingParams(temperature=1.0, max_tokens=4, seed=first_seed + i, ignore_eos=True)
            for i in range(num)
        ]
        outputs = engine_llm.generate([prompt] * num, params)
        if k:  # depth-2 drafts were verified, not only depth 1
            assert sum(
                o.drafts.num_draft_tokens_per_position[1]
                for o in outputs
                if len(o.drafts.num_draft_tokens_per_position) > 1
            )
        return [o.token_ids for o in outputs]

    plain, speculative = sample_tokens(0, 0), sample_tokens(2, 10_000)
    for position in (1, 2):
        stat, dof, p_value = two_sample_chi_square(
            [t[position] for t in plain], [t[position] for t in speculative]
        )
        assert dof >= 2, "the test needs a spread-out distribution to mean anything"
        assert p_value > 0.001, (
            f"token {position + 1}: chi-square {stat:.1f} with {dof} dof, p = {p_value:.2e}"
        )


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ("", GREEDY, "empty"),
        ("x " * 2000, GREEDY, "max_model_len"),
    ],
)
def test_invalid_requests_raise_clear_errors(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], params)
    assert_no_blocks_held(llm)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"max_tokens": 0}, "max_tokens")],
)
def test_invalid_sampling_values_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def _run(engine, requests):
    """Add (prompt, params) pairs, step until done; request id -> final output."""
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return [finished[rid] for rid in ids]


@pytest.mark.parametrize(
    "changes",
    [
        {"num_speculative_tokens": 0},
        {"num_speculative_tokens": 1},
        {"num_speculative_tokens": 1, "async_scheduling": True},  # the next step has its placeholders
    ],
)
def test_a_sampling_error_fails_only_its_request(llm, prompts, reference, changes):
    """Issue 12, finding 2 (isolation): a request whose sampling raises (here a top_p of 0 that validation
    would refuse, forced past it) fails alone with finish_reason "error"; the greedy and the sampled
    requests batched with it complete. Before, the exception failed the whole step."""
    poison = SamplingParams(temperature=0.8, max_tokens=8)
    object.__setattr__(poison, "top_p", 0.0)
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=8, ignore_eos=True)
    llm_k = llm.replace_config(**changes)
    greedy, bad, good = _run(
        llm_k.engine, [(prompts[0], GREEDY), (prompts[1], poison), (prompts[2], sampled)]
    )
    assert bad.finish_reason == "error" and "top_p must be in (0, 1]" in bad.error and bad.token_ids == []
    assert greedy.token_ids == reference[0] and greedy.error is None
    assert good.finish_reason == "length" and len(good.token_ids) == 8 and good.error is None
    assert_no_blocks_held(llm_k)
    assert llm_k.engine.executor.num_tracked_requests == 0


def test_a_drafting_error_fails_only_its_request(llm, prompts, reference, monkeypatch):
    """An exception while MTP drafts for one request (injected for temperature 0.55 only) fails that
    request alone; the requests drafted in the same batch complete (greedy: the reference tokens)."""
    import pdcluster.engine.mtp_proposer as mtp_proposer

    pick, pick_batch = mtp_proposer._pick, mtp_proposer._pick_batch

    def failing_pick(logits, work):
        if work.temperature == 0.55:
            raise RuntimeError("injected drafting fault")
        return pick(logits, work)

    def failing_pick_batch(logits, works):  # the batched pick raises; the per-request retry isolates it
        if any(work.temperature == 0.55 for work in works):
            raise RuntimeError("injected drafting fault")
        return pick_batch(logits, works)

    monkeypatch.setattr(mtp_proposer, "_pick", failing_pick)
    monkeypatch.setattr(mtp_proposer, "_pick_batch", failing_pick_batch)
    llm_k = llm.replace_config(num_speculative_tokens=1)
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True)
    greedy, bad, good = _run(
        llm_k.engine,
        [
            (prompts[0], GREEDY),
            (prompts[1], SamplingParams(temperature=0.55, max_tokens=8)),
            (prompts[2], sampled),
        ],
    )
    assert bad.finish_reason == "error" and "injected drafting fault" in bad.error
    assert greedy.token_ids == reference[0] and greedy.drafts.num_draft_tokens > 0
    assert good.finish_reason == "length" and len(good.token_ids) == 8
    assert_no_blocks_held(llm_k)


def test_a_failed_step_fails_only_the_requests_it_ran(llm, prompts, reference, monkeypatch):
    """Issue 12, finding 1 (a step-level error must not fail every request): when executing a step raises,
    `step()` raises EngineStepError carrying the error outputs of the requests that step ran; requests it
    did not run (waiting for a seat, max_num_seqs=2) complete with the reference tokens afterwards."""
    from pdcluster.engine.llm import EngineStepError

    engine = llm.replace_config(max_num_seqs=2).engine
    ids = [engine.add_request(p, GREEDY) for p in prompts[:4]]
    engine.step()  # ids[0], ids[1] run; ids[2], ids[3] wait (max_num_seqs)
    execute = engine.executor.execute
    monkeypatch.setattr(
        engine.executor, "execute", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("boom"))
    )
    with pytest.raises(EngineStepError, match="engine step failed: RuntimeError") as failure:
        engine.step()
    monkeypatch.setattr(engine.executor, "execute", execute)
    assert {o.request_id: (o.finish_reason, o.error) for o in failure.value.outputs} == {
        rid: ("error", "engine step failed: RuntimeError('boom')") for rid in ids[:2]
    }
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert sorted(finished) == sorted(ids[2:])
    assert [finished[rid].token_ids for rid in ids[2:]] == reference[2:4]
    engine.scheduler.block_manager.check_no_leaks()
    assert engine.executor.num_tracked_requests == 0


def test_ttft_and_tpot_are_reported(llm, prompts):
    out = llm.generate(prompts[:2], GREEDY)
    for o in out:
        assert o.ttft_s is not None and o.ttft_s > 0 and math.isfinite(o.ttft_s)
        assert o.tpot_s is not None and o.tpot_s > 0
        assert o.finish_reason in ("stop", "length")
