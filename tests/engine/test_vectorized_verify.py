"""One vectorized sample/verify for the whole batch (engine.sampler, engine.mtp_proposer._pick_batch):
exact accepted counts and tokens on hand-made logits, one host transfer, seeded requests as alone."""

from __future__ import annotations

import torch

from pdcluster.engine.input_batch import SamplingArrays
from pdcluster.engine.mtp_proposer import MTPWork, _pick, _pick_batch
from pdcluster.engine.outputs import ScheduledRequest
from pdcluster.engine.request import Request
from pdcluster.engine.sampler import sample_isolated, sample_or_verify
from pdcluster.kernels.rejection_sampling import rejection_sample
from pdcluster.kernels.sampling import probs_from_logits

VOCAB = 10


def scheduled(request_id: str, drafts: list[int], **sampling) -> ScheduledRequest:
    from pdcluster.engine.sampling_params import SamplingParams

    request = Request(request_id, [1, 2, 3], SamplingParams(**sampling), arrival_time_s=0.0)
    return ScheduledRequest(request, 3, len(drafts) + 1, list(drafts), [0], True)


def peaked(argmaxes: list[int]) -> torch.Tensor:
    """Logits `[len, VOCAB]` with all the mass (at any temperature >= 0.1) on `argmaxes[row]`."""
    logits = torch.full((len(argmaxes), VOCAB), -1e4)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 0.0
    return logits


def verify(items, logits, generator_of, draft_probs) -> dict[str, list[int]]:
    return sample_or_verify(
        items,
        logits,
        generator_of,
        draft_probs,
        SamplingArrays.of([i.request.sampling_params for i in items]),
    )


def count_tolist(monkeypatch) -> list[int]:
    """Counts reads of tensor data to host objects: `Tensor.tolist` and `Tensor.numpy` (the CPU path's)."""
    calls = [0]
    for name in ("tolist", "numpy"):
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, **kwargs):
            calls[0] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    return calls


def test_greedy_verify_exact_tokens_in_one_host_transfer(monkeypatch):
    items = [scheduled("a", [5, 7], temperature=0.0), scheduled("b", [], temperature=0.0),
             scheduled("c", [2, 3, 4], temperature=0.0), scheduled("d", [6], temperature=0.0)]  # fmt: skip
    # a: accepts 5, rejects 7 -> target 1; b: no drafts -> 8; c: all 3 accepted + bonus 9; d: rejects -> 0
    logits = peaked([5, 1, 3] + [8] + [2, 3, 4, 9] + [0, 6])
    calls = count_tolist(monkeypatch)
    result = verify(items, logits, lambda item: None, {})
    assert result == {"a": [5, 1], "b": [8], "c": [2, 3, 4, 9], "d": [0]}
    assert calls[0] == 1


def test_plain_greedy_decode_is_one_argmax_and_one_transfer(monkeypatch):
    items = [scheduled(str(i), [], temperature=0.0) for i in range(5)]
    calls = count_tolist(monkeypatch)
    assert verify(items, peaked([3, 1, 4, 1, 5]), lambda item: None, {}) == {
        "0": [3], "1": [1], "2": [4], "3": [1], "4": [5]}  # fmt: skip
    assert calls[0] == 1


def test_sampled_rows_accept_exactly_where_the_target_has_all_the_mass():
    """Temperature 1 with all the mass on one token per row: a draft equal to it is accepted (u * 1 < 1),
    one with no mass rejected and the recovered token is that token: exact counts without seeds."""
    items = [scheduled("g", [5, 7], temperature=0.0), scheduled("s", [2, 8, 4], temperature=1.0),
             scheduled("t", [3], temperature=1.0, seed=11)]  # fmt: skip
    logits = peaked([5, 6, 0] + [2, 3, 4, 9] + [3, 1])  # g: [5, 6]; s: 2 accepted, 8 rejected -> 3; t: [3, 1]
    shared = torch.Generator().manual_seed(0)
    own = torch.Generator().manual_seed(11)
    result = verify(items, logits, lambda item: own if item.request.sampling_params.seed else shared, {})
    assert result == {"g": [5, 6], "s": [2, 3], "t": [3, 1]}


def test_a_seeded_request_verifies_as_it_would_alone():
    """A seeded request's tokens in a mixed batch (greedy, unseeded, seeded) equal the per-request
    reference `rejection_sample` with a generator of the same seed (it draws from its own generator only)."""
    torch.manual_seed(0)
    logits = torch.randn(2 + 3 + 4, VOCAB)
    draft_probs = torch.softmax(torch.randn(3, VOCAB), dim=-1)
    drafts = draft_probs.argmax(dim=-1).tolist()
    items = [scheduled("g", [1], temperature=0.0), scheduled("u", [2, 3], temperature=0.9),
             scheduled("s", drafts, temperature=0.7, top_k=5, top_p=0.9, seed=1234)]  # fmt: skip
    shared = torch.Generator().manual_seed(99)
    for _ in range(3):  # three different generator states of the others: same tokens for "s"
        own = {"u": shared, "s": torch.Generator().manual_seed(1234), "g": None}

        def generator_of(item, own=own):
            return own[item.request_id]

        shared.manual_seed(int(torch.randint(0, 1000, ())))
        result = verify(items, logits, generator_of, {"s": draft_probs})
        target = probs_from_logits(logits[5:], 0.7, 5, 0.9)
        reference = rejection_sample(
            torch.tensor(drafts), draft_probs, target, torch.Generator().manual_seed(1234)
        )
        assert result["s"] == reference.token_ids.tolist()
        first, second = int(logits[0].argmax()), int(logits[1].argmax())
        assert result["g"] == ([1, second] if first == 1 else [first])


def test_a_failing_request_falls_back_alone():
    """Isolation: a request whose settings make the batch raise (a top_p of 0 forced past validation)
    fails alone; the others get the tokens they get without it."""
    items = [scheduled("a", [5], temperature=0.0), scheduled("bad", [1], temperature=0.8),
             scheduled("c", [2], temperature=0.0)]  # fmt: skip
    object.__setattr__(items[1].request.sampling_params, "top_p", 0.0)
    logits = peaked([5, 6] + [1, 1] + [3, 4])
    sampled, failed = sample_isolated(items, logits, lambda item: None, {})
    assert sampled == {"a": [5, 6], "c": [3]}
    assert list(failed) == ["bad"] and "top_p must be in (0, 1]" in failed["bad"]


def test_batched_draft_pick_equals_the_per_request_pick_for_seeded_requests():
    """`_pick_batch`: greedy rows are the argmax; a seeded row's draft and probabilities equal `_pick`'s
    with a generator of the same seed, whatever else is in the batch."""
    torch.manual_seed(1)
    logits = torch.randn(4, VOCAB)
    works = [
        MTPWork(0, 0, 1),
        MTPWork(1, 1, 1, temperature=0.8, top_k=4, generator=torch.Generator().manual_seed(5)),
        MTPWork(2, 2, 1, temperature=1.0, generator=torch.Generator().manual_seed(0)),
        MTPWork(3, 3, 1, temperature=0.6, top_p=0.8, generator=torch.Generator().manual_seed(77)),
    ]
    tokens, probs = _pick_batch(logits, works)
    assert int(tokens[0]) == int(logits[0].argmax())
    for row, seed in ((1, 5), (3, 77)):
        alone = MTPWork(0, 0, 1, works[row].temperature, works[row].top_k, works[row].top_p,
                        torch.Generator().manual_seed(seed))  # fmt: skip
        token, row_probs = _pick(logits[row], alone)
        assert int(tokens[row]) == token
        torch.testing.assert_close(probs[row], row_probs, rtol=0, atol=0)
