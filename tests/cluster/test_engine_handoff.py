"""The engine halves of a disaggregated request, in one process and without a transport: a prefill-only
request on one engine, its prompt KV (MTP layer included), first token and drafts admitted into another.
Proves the handoff state is complete: greedy tokens and MTP acceptance equal a single engine's."""

from __future__ import annotations

import crc32c
import pytest
import torch

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.llm import LLMEngine
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kernels.paged_mla import gather_kv
from pdcluster.models import bundled_checkpoint_dir

PROMPTS = [
    "def add(a, b):\n    return",
    'import os\nimport sys\n\n\ndef main(argv):\n    """Parse the arguments and',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
]


@pytest.fixture(scope="module")
def model():
    engine = LLMEngine(EngineConfig(model=str(bundled_checkpoint_dir()), num_kv_blocks=64))
    return engine.model


def _engine(model, k: int, **kw) -> LLMEngine:
    config = EngineConfig(
        model=str(bundled_checkpoint_dir()), num_kv_blocks=64, num_speculative_tokens=k, **kw
    )
    return LLMEngine(config, model=model)


def _run_single(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict:
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=str(i))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


@pytest.mark.parametrize("k", [0, 1, 2])
def test_prefill_decode_handoff_matches_single_engine(model, k: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    single = _engine(model, k)
    prompts = [single.tokenizer.encode(p) for p in PROMPTS]
    expected = _run_single(single, prompts, params)

    prefill = _engine(model, k, max_num_batched_tokens=16)  # chunked prompts
    decode = _engine(model, k)
    num_layers = model.config.num_hidden_layers + (1 if k else 0)
    received: dict[str, dict[int, object]] = {}
    order: dict[str, list[object]] = {}  # per request: layer indices and ("first token", id), as called

    def on_prompt_kv(rid, layer, kv, scale) -> None:
        received.setdefault(rid, {})[layer] = kv
        order.setdefault(rid, []).append(layer)

    for i, p in enumerate(prompts):
        prefill.add_request(p, params, request_id=str(i), prefill_only=True)
        assert decode.reserve_remote_prefill(str(i), p, params, num_draft_tokens=k)
    while prefill.has_unfinished_requests():
        prefill.step(
            on_prompt_kv=on_prompt_kv,
            on_first_token=lambda rid, token: order.setdefault(rid, []).append(("first token", token)),
        )
    main_layers = list(range(model.config.num_hidden_layers))
    for rid in map(str, range(len(prompts))):
        assert sorted(received[rid]) == list(range(num_layers))
        for layer, kv in received[rid].items():
            if k == 1:  # as DecodeWorker writes a received layer: its CRC-32C computed while it is copied
                crc = decode.write_prompt_kv(rid, layer, kv, checksum_start=0)
                assert crc == crc32c.crc32c(kv.contiguous().view(torch.uint8).numpy())
            else:
                assert decode.write_prompt_kv(rid, layer, kv) is None
        result = prefill.pop_prefill_result(rid)
        assert len(result.draft_token_ids) == k
        # The first token is reported once, before the last main layer's KV (nothing left to overlap its
        # send) and the MTP layer's (the drafts are proposed after it): the token prefill_result reports.
        mtp_layers = list(range(len(main_layers), num_layers))
        first = ("first token", result.first_token_id)
        assert order[rid] == [*main_layers[:-1], first, main_layers[-1], *mtp_layers]
        decode.admit_remote_prefill(rid, result.first_token_id, result.draft_token_ids, result.draft_probs)
    prefill.scheduler.block_manager.check_no_leaks()
    got = {}
    while decode.has_unfinished_requests():
        for out in decode.step():
            if out.finished:
                got[out.request_id] = out
    decode.scheduler.block_manager.check_no_leaks()
    for rid, out in expected.items():
        assert got[rid].token_ids == out.token_ids
        assert got[rid].drafts.num_accepted_tokens == out.drafts.num_accepted_tokens
        assert got[rid].drafts.num_draft_tokens == out.drafts.num_draft_tokens


def test_write_prompt_kv_checksums_the_bytes_as_given(model) -> None:
    """A layer in another dtype than the cache's is cast on the way in; the CRC is of the bytes given (what
    the sender checksummed), and what is stored is the cast. An int8 layer (with scales) takes no checksum."""
    decode = _engine(model, 0)
    prompt = list(range(2, 40))
    assert decode.reserve_remote_prefill("r", prompt, SamplingParams(max_tokens=4), 0)
    other = torch.float32 if decode.runner.dtype != torch.float32 else torch.bfloat16
    kv = torch.randn(len(prompt), model.config.kv_cache_dim, generator=torch.Generator().manual_seed(0)).to(
        other
    )
    assert decode.write_prompt_kv("r", 0, kv, checksum_start=7) == crc32c.crc32c(
        kv.view(torch.uint8).numpy(), 7
    )
    table, _ = decode.remote_prefills._tables["r"]
    stored, _ = gather_kv(decode.runner.kv_caches[0], table, len(prompt))
    assert torch.equal(stored, kv.to(decode.runner.dtype))
    with pytest.raises(ValueError, match="not int8"):
        decode.write_prompt_kv("r", 0, kv.to(torch.int8), torch.ones(len(prompt)), checksum_start=0)
    assert decode.release_remote_prefill("r")
    decode.scheduler.block_manager.check_no_leaks()


def test_released_reservation_frees_blocks(model) -> None:
    decode = _engine(model, 1)
    assert decode.reserve_remote_prefill("r", list(range(2, 40)), SamplingParams(max_tokens=4), 1)
    assert decode.scheduler.block_manager.num_free_blocks < 64
    assert decode.release_remote_prefill("r")
    decode.scheduler.block_manager.check_no_leaks()


def test_remote_prefilled_requests_beyond_max_num_seqs_all_complete(model) -> None:
    """Issue 12, finding 1: more handoffs admitted than the decode engine's `max_num_seqs` (and its input
    buffers, sized by it) wait for a seat and all complete with the single engine's greedy tokens; before,
    the step holding them all raised `... exceeds the input buffers` and every request failed."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts_text = PROMPTS + ["def mul(a, b):\n    return", "for i in range(10):\n    print("]
    single = _engine(model, 1)
    prompts = [single.tokenizer.encode(p) for p in prompts_text]
    expected = _run_single(single, prompts, params)

    prefill = _engine(model, 1)
    decode = _engine(model, 1, max_num_seqs=2)
    received: dict[str, dict[int, object]] = {}
    for i, p in enumerate(prompts):
        prefill.add_request(p, params, request_id=str(i), prefill_only=True)
        assert decode.reserve_remote_prefill(str(i), p, params, num_draft_tokens=1)
    while prefill.has_unfinished_requests():
        prefill.step(
            on_prompt_kv=lambda rid, layer, kv, scale: received.setdefault(rid, {}).update({layer: kv})
        )
    for rid in map(str, range(len(prompts))):
        for layer, kv in received[rid].items():
            decode.write_prompt_kv(rid, layer, kv)
        result = prefill.pop_prefill_result(rid)
        decode.admit_remote_prefill(rid, result.first_token_id, result.draft_token_ids, result.draft_probs)
    got = {}
    while decode.has_unfinished_requests():
        assert len(decode.scheduler.running) <= 2
        for out in decode.step():
            if out.finished:
                got[out.request_id] = out
    assert {rid: out.token_ids for rid, out in got.items()} == {
        rid: out.token_ids for rid, out in expected.items()
    }
    assert {out.finish_reason for out in got.values()} == {"length"}
    decode.scheduler.block_manager.check_no_leaks()
