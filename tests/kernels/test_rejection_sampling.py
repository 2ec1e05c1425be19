"""Speculative verification: greedy exactness, losslessness (chi-square), edge cases, batched == reference."""

from __future__ import annotations

import pytest
import torch

from pdcluster.kernels.rejection_sampling import (
    greedy_verify,
    greedy_verify_batch,
    greedy_verify_lists,
    rejection_sample,
    rejection_sample_batch,
)
from tests.kernels.chi_square import chi_square_p_value

VOCAB_SIZE = 6
NUM_TRIALS = 20_000
ALPHA = 0.001  # significance level of the chi-square tests (fixed seeds: deterministic outcomes)


def one_hot(token_ids: list[int]) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(token_ids), VOCAB_SIZE).float()


def random_probs(num_rows: int, seed: int, zeros: tuple[int, ...] = ()) -> torch.Tensor:
    probs = torch.rand(num_rows, VOCAB_SIZE, generator=torch.Generator().manual_seed(seed)) + 0.05
    probs[:, list(zeros)] = 0
    return probs / probs.sum(-1, keepdim=True)


@pytest.mark.parametrize(
    "drafts,target_argmax,expected,num_accepted",
    [
        ([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4], 3),  # all accepted + bonus
        ([1, 2, 3], [0, 2, 3, 4], [0], 0),  # first mismatch: the target's token
        ([1, 2, 3], [1, 5, 3, 4], [1, 5], 1),  # later drafts ignored after a mismatch
        ([], [2], [2], 0),  # no drafts: plain decoding
    ],
)
def test_greedy_verify_is_exact(drafts: list, target_argmax: list, expected: list, num_accepted: int) -> None:
    target_probs = 0.5 * one_hot(target_argmax) + 0.5 / VOCAB_SIZE  # not one-hot: only the argmax matters
    result = greedy_verify(torch.tensor(drafts, dtype=torch.int64), target_probs)
    assert result.token_ids.tolist() == expected and result.num_accepted == num_accepted
    # The sampled rule with one-hot (temperature 0) targets gives the same tokens, for any draft probs.
    for draft_probs in (None, random_probs(len(drafts), 0)):
        sampled = rejection_sample(
            torch.tensor(drafts, dtype=torch.int64), draft_probs, one_hot(target_argmax)
        )
        assert sampled.token_ids.tolist() == expected and sampled.num_accepted == num_accepted


def first_token_trial(target: torch.Tensor, draft: torch.Tensor | None, fixed_draft: int = 2, seed: int = 0):
    """NUM_TRIALS requests with k = 2 drafts sampled from `draft [V]` (or the fixed token when None);
    target distribution `target [V]` at every position. Returns (first emitted tokens, num_accepted)."""
    gen = torch.Generator().manual_seed(seed)
    num_drafts = 2
    if draft is None:
        draft_ids = torch.full((NUM_TRIALS * num_drafts,), fixed_draft)
        draft_probs = None
    else:
        draft_ids = torch.multinomial(draft, NUM_TRIALS * num_drafts, replacement=True, generator=gen)
        assert bool((draft[draft_ids] > 0).all())  # q(x) = 0 is never drafted
        draft_probs = draft.expand(NUM_TRIALS * num_drafts, VOCAB_SIZE)
    result = rejection_sample_batch(
        draft_ids,
        [num_drafts] * NUM_TRIALS,
        draft_probs,
        target.expand(NUM_TRIALS * (num_drafts + 1), -1),
        is_greedy=[False] * NUM_TRIALS,
        generators=gen,
    )
    return result.output_token_ids[:, 0], result.num_accepted


TARGET = torch.tensor([0.3, 0.05, 0.25, 0.1, 0.2, 0.1])
DRAFTS = {
    "close": 0.9 * TARGET + 0.1 / VOCAB_SIZE,
    "far": torch.tensor([0.02, 0.6, 0.02, 0.3, 0.03, 0.03]),
    "zeros_in_q": torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0, 0.0]),  # tokens 0, 2, 4, 5 only via the residual
    "deterministic": None,  # draft_probs=None: always drafts token 2, q one-hot
}


@pytest.mark.parametrize("name", DRAFTS)
def test_first_emitted_token_follows_target(name: str) -> None:
    """Losslessness (Leviathan et al. Appendix A.1): the first emitted token ~ p whatever q is.

    20,000 trials, V = 6, chi-square goodness of fit against p at significance ALPHA = 0.001; and the
    first-draft acceptance rate equals sum_x min(p(x), q(x)) within 4.5 binomial standard deviations.
    """
    draft = DRAFTS[name]
    first_tokens, num_accepted = first_token_trial(TARGET, draft)
    counts = torch.bincount(first_tokens, minlength=VOCAB_SIZE)
    assert chi_square_p_value(counts, TARGET) > ALPHA
    q = one_hot([2])[0] if draft is None else draft
    beta = float(torch.minimum(TARGET, q).sum())
    acceptance = float((num_accepted >= 1).double().mean())
    assert abs(acceptance - beta) < 4.5 * (beta * (1 - beta) / NUM_TRIALS) ** 0.5


def test_reference_first_token_follows_target() -> None:
    """The per-request reference, 3,000 trials with the far draft, chi-square at ALPHA = 0.001."""
    gen = torch.Generator().manual_seed(1)
    draft, counts = DRAFTS["far"], torch.zeros(VOCAB_SIZE, dtype=torch.int64)
    for _ in range(3000):
        x = torch.multinomial(draft, 1, generator=gen)
        counts[rejection_sample(x, draft[None], TARGET.expand(2, -1), gen).token_ids[0]] += 1
    assert chi_square_p_value(counts, TARGET) > ALPHA


def test_equal_distributions_always_accept() -> None:
    probs = random_probs(4, seed=3)  # k = 3 drafts + bonus row
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        drafts = torch.multinomial(probs[:3], 1, generator=gen)[:, 0]
        result = rejection_sample(drafts, probs[:3], probs, gen)
        assert result.num_accepted == 3 and torch.equal(result.token_ids[:3], drafts)


def test_draft_with_zero_target_probability_is_always_rejected() -> None:
    target = random_probs(2, seed=4, zeros=(3,))
    gen = torch.Generator().manual_seed(0)
    for _ in range(100):
        result = rejection_sample(torch.tensor([3]), random_probs(1, seed=5), target, gen)
        assert result.num_accepted == 0 and result.token_ids.tolist() != [3]


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_batch_equals_per_request_reference(with_draft_probs: bool) -> None:
    """Ragged k (0..4), mixed greedy/sampled requests, per-request generators: token-for-token equal."""
    num_draft_tokens = [3, 0, 4, 1, 2, 4, 0, 3, 2, 1, 4, 2]
    is_greedy = [b % 4 == 1 for b in range(len(num_draft_tokens))]
    num_drafts = sum(num_draft_tokens)
    setup = torch.Generator().manual_seed(6)
    target_probs = random_probs(num_drafts + len(num_draft_tokens), seed=7)
    draft_probs = random_probs(num_drafts, seed=8) if with_draft_probs else None
    # Half the drafts equal the target argmax at their position, so greedy requests accept some.
    request_of_draft = torch.repeat_interleave(
        torch.arange(len(num_draft_tokens)), torch.tensor(num_draft_tokens)
    )
    target_argmax = target_probs[torch.arange(num_drafts) + request_of_draft].argmax(-1)
    random_ids = torch.randint(0, VOCAB_SIZE, (num_drafts,), generator=setup)
    draft_ids = torch.where(torch.rand(num_drafts, generator=setup) < 0.5, target_argmax, random_ids)
    seeds = list(range(100, 100 + len(num_draft_tokens)))
    batched = rejection_sample_batch(
        draft_ids,
        num_draft_tokens,
        draft_probs,
        target_probs,
        is_greedy,
        [torch.Generator().manual_seed(s) for s in seeds],
    )
    draft_start, target_start = 0, 0
    for b, k in enumerate(num_draft_tokens):
        drafts = draft_ids[draft_start : draft_start + k]
        target = target_probs[target_start : target_start + k + 1]
        if is_greedy[b]:
            expected = greedy_verify(drafts, target)
        else:
            probs = None if draft_probs is None else draft_probs[draft_start : draft_start + k]
            expected = rejection_sample(drafts, probs, target, torch.Generator().manual_seed(seeds[b]))
        draft_start, target_start = draft_start + k, target_start + k + 1
        row = batched.output_token_ids[b]
        assert row[: expected.num_accepted + 1].tolist() == expected.token_ids.tolist()
        assert bool((row[expected.num_accepted + 1 :] == -1).all())
        assert int(batched.num_accepted[b]) == expected.num_accepted
    assert batched.output_token_ids.shape == (len(num_draft_tokens), 5)


def test_greedy_verify_batch_equals_greedy_verify_per_request() -> None:
    """Ragged k (0..4), logits with ties (first index wins): the batched greedy rule equals the per-request
    reference, and `token_ids()` drops exactly the padding."""
    num_draft_tokens = [3, 0, 4, 1, 2, 0, 2]
    num_drafts, batch = sum(num_draft_tokens), len(num_draft_tokens)
    gen = torch.Generator().manual_seed(11)
    logits = torch.randint(0, 3, (num_drafts + batch, VOCAB_SIZE), generator=gen).float()  # many ties
    request_of_draft = torch.repeat_interleave(torch.arange(batch), torch.tensor(num_draft_tokens))
    target_argmax = logits[torch.arange(num_drafts) + request_of_draft].argmax(-1)
    random_ids = torch.randint(0, VOCAB_SIZE, (num_drafts,), generator=gen)
    draft_ids = torch.where(torch.rand(num_drafts, generator=gen) < 0.7, target_argmax, random_ids)
    batched = greedy_verify_batch(draft_ids, num_draft_tokens, logits)
    expected, draft_start, target_start = [], 0, 0
    for k in num_draft_tokens:
        one = greedy_verify(
            draft_ids[draft_start : draft_start + k], logits[target_start : target_start + k + 1]
        )
        expected.append(one.token_ids.tolist())
        assert len(expected[-1]) == one.num_accepted + 1
        draft_start, target_start = draft_start + k, target_start + k + 1
    assert batched.token_ids() == expected
    ragged = draft_ids.split(num_draft_tokens)
    assert greedy_verify_lists([d.tolist() for d in ragged], logits) == expected  # the host-list variant
    assert batched.num_accepted.tolist() == [len(t) - 1 for t in expected]
    assert any(len(t) - 1 < k for t, k in zip(expected, num_draft_tokens, strict=True))  # some rejections
    assert any(len(t) - 1 == k > 0 for t, k in zip(expected, num_draft_tokens, strict=True))  # all accepted
    with pytest.raises(ValueError, match="target rows"):
        greedy_verify_batch(draft_ids, num_draft_tokens, logits[:-1])
    with pytest.raises(ValueError, match="target rows"):
        greedy_verify_lists([d.tolist() for d in ragged], logits[:-1])


def test_invalid_arguments_raise() -> None:
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample(torch.tensor([1, 2]), None, random_probs(2, 0))
    with pytest.raises(ValueError, match="vocabulary"):
        greedy_verify(torch.tensor([VOCAB_SIZE]), random_probs(2, 0))
    with pytest.raises(ValueError, match="target rows"):
        rejection_sample_batch(torch.tensor([1]), [1], None, random_probs(3, 0), [False])
