"""KV precision by length through the cluster (issue 38): a topology's `kv_precision` bands reach both pools,
short requests run in INT8 and long ones in 16-bit on prefill and decode alike, their KV crossing each
transport in the request's own dtype, and every request's greedy tokens equal one engine's under the same
policy (which `tests/engine/test_kv_precision.py` checks against single-dtype engines)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from pdcluster.config import load_topology
from pdcluster.config.quality import KVBandConfig, KVPrecisionConfig
from pdcluster.driver.cluster import Cluster
from pdcluster.engine.kv_precision import request_kv_cache_dtype
from pdcluster.engine.llm import LLM
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.models import bundled_checkpoint_dir
from pdcluster.models.prompts import heldout_token_prompts
from tests.cluster.conftest import assert_nothing_held, request_bound_s

pytestmark = pytest.mark.slow

BANDS = KVPrecisionConfig(
    short=KVBandConfig(max_tokens=48, kv_cache_dtype="int8"),
    long=KVBandConfig(kv_cache_dtype="bfloat16", key_layers="0-0", key_layers_dtype="float32"),
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPT_LENGTHS = [12, 30, 40, 90]  # + 16 tokens: int8, int8, bfloat16 (56), bfloat16


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    llm = LLM(bundled_checkpoint_dir(), num_speculative_tokens=1, kv_precision=BANDS.policy())
    prompts = heldout_token_prompts(llm.tokenizer, PROMPT_LENGTHS)
    return [llm.generate([p], GREEDY)[0].token_ids for p in prompts]


def test_request_kv_cache_dtype_follows_the_band():
    policy = BANDS.policy()
    assert [request_kv_cache_dtype(policy, "auto", n, 16) for n in PROMPT_LENGTHS] == [
        "int8",
        "int8",
        "auto",
        "auto",
    ]
    assert request_kv_cache_dtype(None, "int8", 1000, 16) == "int8"


@pytest.mark.parametrize("transport", ["grpc", "shm", "torch_distributed"])
def test_mixed_precision_requests_match_one_engine(ray_session, expected, transport) -> None:
    topo = load_topology("clusters/local.yaml")
    topo = dataclasses.replace(
        topo,
        kv_precision=BANDS,
        kv_transfer=dataclasses.replace(topo.kv_transfer, transport=transport, timeout_s=20),
        decode=dataclasses.replace(topo.decode, kv_cache_memory_bytes=16 << 20, compile=False),
        prefill=dataclasses.replace(topo.prefill, kv_cache_memory_bytes=16 << 20),
    )
    cluster = Cluster.deploy(topo)
    try:
        prompts = heldout_token_prompts(cluster.tokenizer, PROMPT_LENGTHS)

        async def one(i: int) -> list[int]:
            tokens = []
            async for delta in cluster.generate(f"r{i}", prompts[i], GREEDY):
                tokens += delta.new_token_ids
            return tokens

        async def run():  # all at once: decode's batches mix INT8 and 16-bit requests
            return await asyncio.gather(*[one(i) for i in range(len(prompts))])

        got = asyncio.run(asyncio.wait_for(run(), request_bound_s(cluster)))
        assert got == expected
        assert_nothing_held(cluster)
    finally:
        cluster.shutdown()
