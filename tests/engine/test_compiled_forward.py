"""The compiled forwards (`engine.compiled_forward`, `engine.compiled_prefill`, EngineConfig `compile`):
buckets, the dense MoE they trace, and the one compile-axis test: greedy tokens identical with compile on
and off for k = 0, 1, 3 (async scheduling on for k = 1) and chunked prefill, the compiled graphs used; a
compilation that fails at load (injected) leaves the engine running eagerly. Compilation is slow, so this
is the only engine test that compiles (a small `max_num_seqs`: few buckets)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from pdcluster.engine.compiled_forward import CompiledDecodeForward, CompileStats, batch_size_buckets
from pdcluster.engine.llm import LLM
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.models import bundled_checkpoint_dir
from pdcluster.models.deepseek_v3 import DeepseekV3MoE
from pdcluster.models.prompts import heldout_def_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


def test_batch_size_buckets() -> None:
    assert batch_size_buckets(1) == [1]
    assert batch_size_buckets(4) == [1, 2, 4]
    assert batch_size_buckets(30) == [1, 2, 4, 8, 16, 24, 30]
    assert batch_size_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


@pytest.fixture(scope="module")
def eager() -> LLM:
    return LLM(bundled_checkpoint_dir(), num_kv_blocks=256, max_num_seqs=4)


def test_dense_moe_equals_routed_moe(eager: LLM) -> None:
    layer = next(m for m in eager.engine.model.modules() if isinstance(m, DeepseekV3MoE))
    hidden = torch.randn(9, eager.engine.model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        # Same function, other summation order over experts: float32 rounding only.
        torch.testing.assert_close(layer.forward_dense(hidden), layer(hidden), rtol=1e-5, atol=1e-5)


def test_int8_cache_is_not_compiled(eager: LLM) -> None:
    int8 = eager.replace_config(compile=True, kv_cache_dtype="int8")
    why_not = CompiledDecodeForward.supported(int8.engine.runner)
    assert why_not is not None and "int8" in why_not
    assert int8.engine.runner.compiled is None
    assert int8.engine.compile_stats() == CompileStats(requested=True, compiled=False, error=why_not)


def test_a_compilation_that_fails_at_load_runs_eagerly_with_a_warning(
    eager: LLM, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Injected: every graph torch.compile returns raises inductor's error for a missing C++ compiler on its
    first call (where torch.compile really compiles, in `warm_up`). The engine still starts, warns naming
    the error, installs no compiled forward, and its greedy tokens equal the eager engine's."""
    from torch._inductor.exc import CppCompileError, InductorError

    error = InductorError(CppCompileError(["g++", "graph.cpp"], "g++: command not found"), None)

    def failing_compile(fn, **options):
        def graph(*args):
            raise error

        return graph

    prompts = heldout_def_prompts(3)
    expected = [o.token_ids for o in eager.generate(prompts, GREEDY)]
    monkeypatch.setattr(torch, "compile", failing_compile)
    with caplog.at_level(logging.WARNING, logger="pdcluster.engine.llm_engine"):
        failed = eager.replace_config(compile=True)
    named = "InductorError: CppCompileError: C++ compile error"
    (record,) = [r for r in caplog.records if r.name == "pdcluster.engine.llm_engine"]
    assert record.levelno == logging.WARNING and named in record.getMessage()
    assert record.exc_info is not None and record.exc_info[1] is error  # the traceback in the log
    assert failed.engine.runner.compiled is None
    stats = failed.engine.compile_stats()
    assert dataclasses.replace(stats, compile_s=0.0) == CompileStats(
        requested=True, compiled=False, error=named
    )
    assert [o.token_ids for o in failed.generate(prompts, GREEDY)] == expected


@pytest.mark.parametrize(
    "changes",
    [{"num_speculative_tokens": 0}, {"num_speculative_tokens": 1, "async_scheduling": True},
     {"num_speculative_tokens": 3}, {"num_speculative_tokens": 0, "max_num_batched_tokens": 24}],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()),
)  # fmt: skip
def test_greedy_output_identical_with_compile_on_and_off(eager: LLM, changes: dict) -> None:
    """Decode steps run the compiled decode graph, prefill and mixed steps of up to 64 tokens the compiled
    ragged-batch graph (`engine.compiled_prefill`); a budget of 24 tokens chunks every prompt, so every
    prefill step runs it."""
    prompts = heldout_def_prompts(6)  # more requests than max_num_seqs: requests join and finish
    eager_outputs = eager.replace_config(**changes).generate(prompts, GREEDY)
    compiled = eager.replace_config(compile=True, **changes)
    outputs = compiled.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in eager_outputs]
    # The drafts too (the depth-0 MTP pass runs compiled with drafts): the same accepted counts per
    # position. Greedy drafts are argmaxes, which the compiled graph's other summation order does not move
    # on the bundled model (as for the tokens above).
    assert [o.drafts.num_accepted_tokens_per_position for o in outputs] == [
        o.drafts.num_accepted_tokens_per_position for o in eager_outputs
    ]
    forward = compiled.engine.runner.compiled
    assert forward is not None and forward.num_compiled_steps > 0 and forward.num_eager_fallbacks == 0
    k = changes["num_speculative_tokens"]
    assert (forward.num_compiled_mtp_passes > 0) == (k > 0)
    stats = compiled.engine.compile_stats()
    assert (stats.requested, stats.compiled, stats.error, stats.compile_s > 0) == (True, True, None, True)
    assert (stats.num_compiled_steps, stats.num_eager_fallbacks) == (forward.num_compiled_steps, 0)
    assert stats.num_compiled_mtp_passes == forward.num_compiled_mtp_passes
    prefill = compiled.engine.runner.compiled_prefill
    assert prefill is not None and prefill.num_eager_fallbacks == 0
    assert stats.num_compiled_prefill_steps == prefill.num_compiled_steps > 0
