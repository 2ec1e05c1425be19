"""The MTP layer runs as the tail of the step's main forward (engine.mtp_proposer): same metadata, right
drafts."""

from __future__ import annotations

import pytest
import torch

from pdcluster.engine.llm import LLM
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.models import bundled_checkpoint_dir
from pdcluster.models.prompts import heldout_def_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
METADATA = ("positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc")


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(bundled_checkpoint_dir(), num_kv_blocks=512, block_size=16)


def record_passes(engine) -> list[tuple[str, object]]:
    """Wrap the runner's forward / mtp_forward in place; returns the list of (kind, batch) they append."""
    runner = engine.runner
    passes: list[tuple[str, object]] = []
    forward, mtp_forward = runner.forward, runner.mtp_forward

    def recording_forward(batch, *args, **kwargs):
        passes.append(("main", batch))
        return forward(batch, *args, **kwargs)

    def recording_mtp_forward(batch, *args, **kwargs):
        passes.append(("mtp", batch))
        return mtp_forward(batch, *args, **kwargs)

    runner.forward, runner.mtp_forward = recording_forward, recording_mtp_forward
    return passes


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_tail_reuses_the_step_metadata(llm, k):
    """Every step runs the main forward then the MTP layer over the very same metadata tensors (no second
    packing), and at most k - 1 chained one-token passes after it."""
    engine = llm.replace_config(num_speculative_tokens=k).engine
    passes = record_passes(engine)
    prompts = heldout_def_prompts(4)
    for prompt in prompts:
        engine.add_request(prompt, GREEDY)
    num_steps = 0
    while engine.has_unfinished_requests():
        passes.clear()
        engine.step()
        num_steps += 1
        assert [kind for kind, _ in passes[:2]] == ["main", "mtp"]
        main, tail = passes[0][1], passes[1][1]
        for name in METADATA:
            assert getattr(tail, name) is getattr(main, name), name
        assert tail.num_tokens == main.num_tokens
        chained = passes[2:]
        assert len(chained) <= k - 1
        for kind, batch in chained:
            assert kind == "mtp"
            assert batch.query_start_loc.tolist() == list(range(len(batch.seq_lens) + 1))
            assert (batch.seq_lens == batch.positions + 1).all()
    assert num_steps > 1


def test_first_drafts_match_a_cacheless_mtp(llm):
    """Each d_1 the engine proposes (k=1, greedy) is the argmax of the cacheless MTP module run over the
    final sequence (`DeepseekV3ForCausalLM.mtp_forward` on the main model's hidden states) at the newest
    committed position. Float rounding differs between the paged, batched path and the dense one, so a
    near tie may flip: at least 98% must agree."""
    engine = llm.replace_config(num_speculative_tokens=1).engine
    executor = engine.executor
    drafts: dict[str, list[tuple[int, int]]] = {}  # request id -> (newest committed position, d_1)
    run = executor.run

    def recording_run(output, prepared, *args, **kwargs):
        result = run(output, prepared, *args, **kwargs)
        for item in output.scheduled:
            spec = result.spec_token_ids.get(item.request_id)
            if spec:
                num_accepted = len(result.sampled_token_ids[item.request_id]) - 1
                num_valid = item.num_scheduled_tokens - len(item.spec_token_ids) + num_accepted
                newest = item.start_position + num_valid - 1
                drafts.setdefault(item.request_id, []).append((newest, spec[0]))
        return result

    executor.run = recording_run
    prompts = heldout_def_prompts(6)
    ids = {engine.add_request(p, GREEDY): llm.tokenizer.encode(p) for p in prompts}
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    model = engine.model
    same = total = 0
    for request_id, prompt_ids in ids.items():
        sequence = torch.tensor([prompt_ids + outputs[request_id].token_ids])
        with torch.no_grad():
            hidden = model.hidden_states(sequence)
            _, logits = model.mtp_forward(hidden[:, :-1], sequence[:, 1:])
        expected = logits[0].argmax(-1).tolist()  # expected[p]: the token at p + 2, from (h_p, t_{p+1})
        for newest, draft in drafts[request_id]:
            # d_1 follows the token at newest + 1 (sampled this step): MTP row `newest`.
            if newest < len(expected):
                same += draft == expected[newest]
                total += 1
    assert total > 50
    assert same / total >= 0.98, f"{same}/{total} first drafts agree with the cacheless MTP"
