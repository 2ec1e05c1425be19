"""`engine.penalties.PenaltyCounts`: the per-request token counts kept across steps.

What they prove: after admission, growth past the initial slots and listed-token width, drops (finish,
abort) and preemptions, a slot's counts and listed tokens equal a recount from the request's history
(exact: small integer counts in float32); the penalised logits equal the CTRL/OpenAI rules applied by hand,
also for draft rows; through the engine under KV pressure (preemptions) and with MTP, every held slot equals
a recount of its request's first outputs, and nothing is left once all requests finish.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from pdcluster.engine.llm import LLM
from pdcluster.engine.outputs import ScheduledRequest
from pdcluster.engine.penalties import PenaltyCounts
from pdcluster.engine.request import Request
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.models import bundled_checkpoint_dir
from pdcluster.models.prompts import heldout_def_prompts

VOCAB = 50
PENALISED = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.5)


def _item(request: Request) -> ScheduledRequest:
    """The request scheduled for one decode step: its last committed token as input."""
    return ScheduledRequest(request, request.num_tokens - 1, 1, [], [], True, request.num_preemptions)


def _history(item: ScheduledRequest, start: int) -> list[int]:
    """The output tokens up to the step's input (as `Executor._output_history`), from `start` on."""
    request = item.request
    return request.output_token_ids[start : item.start_position + 1 - request.num_prompt_tokens]


def _recount(
    request: Request, num_outputs: int, vocab_size: int = VOCAB
) -> tuple[list[float], list[int], int]:
    """Counts `[V]` of the first `num_outputs` outputs, the listed tokens (first seen first), their number."""
    history = request.output_token_ids[:num_outputs]
    counts = Counter(history)
    prompt = request.prompt_token_ids if request.sampling_params.repetition_penalty != 1 else []
    return [float(counts[t]) for t in range(vocab_size)], list(dict.fromkeys(prompt + history)), num_outputs


def _held(state: PenaltyCounts, request_id: str) -> tuple[list[float], list[int], int]:
    counts, listed, num_counted = state.counts(request_id)
    return counts.tolist(), listed, num_counted


def test_counts_equal_a_recount_through_admission_growth_drop_and_preemption():
    rng = np.random.default_rng(0)
    state = PenaltyCounts(VOCAB, capacity=2)
    params = [PENALISED, SamplingParams(presence_penalty=1.0)]  # the second lists no prompt tokens
    requests = [
        Request(f"r{i}", rng.integers(0, VOCAB, 5 + i).tolist(), params[i % 2], output_token_ids=[3, 3])
        for i in range(5)
    ]
    live = requests[:3]  # more than the 2 initial slots
    for step in range(80):  # past the 64 initial listed-token columns
        if step == 10:
            live.append(requests[3])  # admitted mid-run, with outputs already (a resumed request)
            requests[3].append_output_token_ids(rng.integers(0, VOCAB, 6).tolist())
        if step == 20:
            state.drop([live.pop(0).request_id])  # finished: its slot goes to the next request
            live.append(requests[4])
        if step == 30:
            live[0].num_preemptions += 1  # preempted and back: recounted from scratch
            live[0].append_output_token_ids(rng.integers(0, VOCAB, 3).tolist())
        for request in live:
            request.append_output_token_ids([int(rng.integers(0, VOCAB))])
        slots, lengths = state.update([_item(r) for r in live], _history)
        assert lengths == [r.num_output_tokens for r in live]
        assert len(set(slots)) == len(live)
        for request in live:
            assert _held(state, request.request_id) == _recount(request, request.num_output_tokens)
    assert state.counts(requests[0].request_id) is None
    assert set(state.request_ids) == {r.request_id for r in live}
    state.drop([r.request_id for r in requests])
    assert not state.request_ids


def test_penalised_logits_equal_the_rules_by_hand_with_drafts():
    """Rows: a request's plain row, then its rows after 1 and 2 drafts; a request that lists nothing."""
    prompt, outputs, drafts = [4, 7, 7], [7, 9, 9, 1], [9, 2]
    request = Request("a", prompt, PENALISED, output_token_ids=outputs)
    empty = Request("b", [5], SamplingParams(presence_penalty=1.0))
    state = PenaltyCounts(VOCAB)
    slots, _ = state.update([_item(request), _item(empty)], _history)
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    expected = logits.clone()
    for row, history in enumerate([outputs, outputs + drafts[:1], outputs + drafts]):
        for token in set(prompt + history):
            value = expected[row, token]
            expected[row, token] = value / 1.5 if value > 0 else value * 1.5
        for token, count in Counter(history).items():
            expected[row, token] -= 0.25 * count + 0.5
    got = logits.clone()
    state.penalize_(
        got,
        [0, 1, 2, 4],  # row 3: not penalised
        [slots[0]] * 3 + [slots[1]],
        [[], drafts[:1], drafts, []],
        np.array([0.5] * 3 + [1.0], np.float32),
        np.array([0.25] * 3 + [0.0], np.float32),
        np.array([1.5] * 3 + [1.0], np.float32),
    )
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)  # float32: one op order against another
    assert torch.equal(got[3:], logits[3:])  # not penalised; and a request with no history lists nothing


@pytest.mark.parametrize("k", [0, 2], ids=lambda k: f"k={k}")
def test_engine_slots_equal_a_recount_under_preemption(k):
    llm = LLM(bundled_checkpoint_dir(), num_kv_blocks=24, block_size=8, num_speculative_tokens=k)
    engine = llm.engine
    params = SamplingParams(
        temperature=0.0, max_tokens=16, ignore_eos=True, presence_penalty=0.5, repetition_penalty=1.2
    )
    for prompt in heldout_def_prompts(6):
        engine.add_request(prompt, params)
    state = engine.executor.penalty_counts
    requests = dict(engine.scheduler.requests)
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        for request_id in state.request_ids:
            request = requests[request_id]
            held = _held(state, request_id)
            assert held[2] <= request.num_output_tokens
            assert held == _recount(request, held[2], len(held[0]))
            checked += 1
    assert checked > 0
    assert sum(r.num_preemptions for r in requests.values()) > 0
    assert engine.executor.num_tracked_requests == 0
