"""EP4 through the deployed cluster: one decode instance of 4 ranks, the 8 routed experts split 2 per rank
with no redundant experts (test_cluster_ep.py runs EP2 with redundant ones), behind a prefill instance of
2 ranks (EP2), the KV over the torch_distributed transport (one gloo group of all 6 rank actors, each also
in its instance's own group; test_cluster_ep.py runs gRPC). Consecutive requests go round robin to each of
the 4 decode ranks (the other 3 idle in lockstep meanwhile); each one's greedy tokens and MTP (k=1)
drafted/accepted counts equal one single-device engine's."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from pdcluster.driver.router import RankRef
from pdcluster.engine.llm import LLM
from pdcluster.models import bundled_checkpoint_dir
from pdcluster.models.prompts import heldout_def_prompts
from tests.cluster.conftest import assert_nothing_held, deployed_with_loop
from tests.cluster.test_cluster_ep import GREEDY, ep_topology, generate

pytestmark = pytest.mark.slow


def test_ep4_decode_ranks_match_one_engine(ray_session) -> None:
    prompts = heldout_def_prompts(4, min_chars=60, max_chars=300)
    llm = LLM(bundled_checkpoint_dir(), num_speculative_tokens=1)
    expected = [llm.generate([llm.tokenizer.encode(p)], GREEDY)[0] for p in prompts]
    topology = ep_topology(num_decode_ranks=4, num_decode_instances=1, redundant=0)
    topology = dataclasses.replace(
        topology, kv_transfer=dataclasses.replace(topology.kv_transfer, transport="torch_distributed")
    )
    with deployed_with_loop(topology) as cluster:
        routes: dict[str, RankRef] = {}
        for i, (prompt, want) in enumerate(zip(prompts, expected, strict=True)):
            coro = asyncio.wait_for(generate(cluster, f"r{i}", prompt, GREEDY, routes), 120)
            tokens, last = cluster.test_loop.run_until_complete(coro)
            assert tokens == want.token_ids, (i, routes[f"r{i}"])
            assert (last.drafts.num_draft_tokens, last.drafts.num_accepted_tokens) == (
                want.drafts.num_draft_tokens,
                want.drafts.num_accepted_tokens,
            )
        assert sorted(routes.values()) == [RankRef(0, r) for r in range(4)]
        ep = {name: r["ep"] for name, r in cluster.stats()["ranks"].items() if name.startswith("decode")}
        assert sorted((e["rank"], e["num_ranks"]) for e in ep.values()) == [(r, 4) for r in range(4)]
        assert_nothing_held(cluster)
