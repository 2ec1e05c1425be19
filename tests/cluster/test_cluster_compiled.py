"""The decode pool's default, `compile` on, through a deployed cluster: the one test in the suite whose
deployment compiles (every other one opts out, tests/conftest.py).

clusters/local.yaml (MTP k=1) with the decode pool's `compile` left at its default and `max_num_seqs` 4
(buckets 1, 2, 4: one q=2 graph, the cheapest compile). Four prompts sent at once, so decode steps run
batches of 1 to 4 padded up to their buckets. What it proves: each prompt's greedy tokens and MTP
drafted/accepted counts equal one eager single engine's, one request at a time; the decode rank ran
compiled steps and no uniform step fell back to eager (`RankWorker.compile_stats`), prefill compiled
nothing; deploy's log says the decode forward is being compiled and that it was; nothing stays held.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from pdcluster.config import load_topology
from pdcluster.engine.compiled_forward import CompileStats
from pdcluster.engine.llm import LLM
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.models import bundled_checkpoint_dir
from pdcluster.models.prompts import heldout_def_prompts
from tests.cluster.conftest import assert_nothing_held, deployed_with_loop, request_bound_s
from tests.cluster.test_cluster_ep import generate

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
DECODE_MAX_NUM_SEQS = 4


def test_default_compiled_decode_matches_one_eager_engine(ray_session) -> None:
    topo = load_topology("clusters/local.yaml")
    assert topo.compiles("decode") and not topo.compiles("prefill")  # the defaults under test (cpu)
    topo = dataclasses.replace(
        topo,
        kv_transfer=dataclasses.replace(topo.kv_transfer, timeout_s=20),
        decode=dataclasses.replace(
            topo.decode, max_num_seqs=DECODE_MAX_NUM_SEQS, kv_cache_memory_bytes=16 << 20
        ),
        prefill=dataclasses.replace(topo.prefill, kv_cache_memory_bytes=16 << 20),
    )
    assert topo.decode.num_speculative_tokens == 1
    prompts = heldout_def_prompts(DECODE_MAX_NUM_SEQS, min_chars=40, max_chars=300)
    llm = LLM(bundled_checkpoint_dir(), num_speculative_tokens=1)  # EngineConfig.compile: False
    expected = [llm.generate([llm.tokenizer.encode(p)], GREEDY)[0] for p in prompts]

    log: list[str] = []
    with deployed_with_loop(topo, log=log.append) as cluster:

        async def all_at_once():
            return await asyncio.gather(
                *(generate(cluster, f"r{i}", prompt, GREEDY) for i, prompt in enumerate(prompts))
            )

        results = cluster.test_loop.run_until_complete(
            asyncio.wait_for(all_at_once(), request_bound_s(cluster))
        )
        for i, ((tokens, last), want) in enumerate(zip(results, expected, strict=True)):
            assert tokens == want.token_ids, i
            assert last.finish_reason == "length"
            assert (last.drafts.num_draft_tokens, last.drafts.num_accepted_tokens) == (
                want.drafts.num_draft_tokens,
                want.drafts.num_accepted_tokens,
            ), i
        decode, prefill = ray_session.get(
            [a.compile_stats.remote() for a in (cluster.decode_actors[0], cluster.prefill_actors[0])],
            timeout=cluster.call_timeout_s,
        )
        assert decode.requested and decode.compiled and decode.error is None and decode.compile_s > 0
        assert decode.num_compiled_steps > 0 and decode.num_eager_fallbacks == 0, decode
        assert prefill == CompileStats(requested=False, compiled=False)
        assert_nothing_held(cluster)
    assert any("then compiling the decode forward on the decode instances" in line for line in log), log
    (ready,) = [line for line in log if line.lstrip().startswith("decode-0 ready")]
    assert "the decode forward compiled in" in ready, log
