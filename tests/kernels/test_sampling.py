"""Sampler: probability computation (temperature, top-k, top-p), per-request seeds, logprobs."""

from __future__ import annotations

import pytest
import torch

from pdcluster.kernels.sampling import (
    apply_penalties_,
    compute_logprobs,
    group_rows_by_generator,
    probs_from_logits,
    sample,
    sample_from_probs,
    top_k_largest,
)
from tests.kernels.chi_square import chi_square_p_value

ALPHA = 0.001  # significance level of the distribution tests (fixed seeds: deterministic outcomes)


def test_temperature_only_is_softmax_and_zero_is_one_hot_argmax() -> None:
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    probs = probs_from_logits(logits, torch.tensor([1.0, 0.5, 0.0]))
    torch.testing.assert_close(probs[0], logits[0].softmax(-1))
    torch.testing.assert_close(probs[1], (logits[1] / 0.5).softmax(-1))
    assert torch.equal(probs[2], torch.nn.functional.one_hot(logits[2].argmax(), 10).float())


def test_top_k_and_top_p_keep_the_right_sets() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(5, 4)
    probs = probs_from_logits(
        logits, 1.0, top_k=torch.tensor([2, 0, 0, 0, 3]), top_p=torch.tensor([1.0, 0.4, 0.75, 0.85, 0.5])
    )
    kept = (probs > 0).tolist()
    assert kept == [
        [True, True, False, False],  # top-k 2
        [True, False, False, False],  # top-p 0.4: the first token alone reaches it
        [True, True, False, False],  # 0.5 < 0.75 <= 0.8
        [True, True, True, False],  # 0.8 < 0.85 <= 0.95
        [True, False, False, False],  # top-k 3, then top-p 0.5 of the renormalized 3
    ]
    torch.testing.assert_close(probs[0, :2], torch.tensor([0.5, 0.3]) / 0.8)
    torch.testing.assert_close(probs.sum(-1), torch.ones(5))


def test_top_p_one_keeps_tiny_tail() -> None:
    logits = torch.tensor([[30.0, 0.0, -30.0, -60.0]])
    assert bool((probs_from_logits(logits, 1.0, top_p=1.0) > 0).all())


def test_greedy_rows_are_argmax_and_consume_no_randomness() -> None:
    logits = torch.randn(4, 12, generator=torch.Generator().manual_seed(1))
    generators = [torch.Generator().manual_seed(s) for s in range(4)]
    states = [g.get_state() for g in generators]
    tokens = sample(logits, torch.zeros(4), generators=generators)
    assert torch.equal(tokens, logits.argmax(-1))
    assert all(torch.equal(g.get_state(), s) for g, s in zip(generators, states, strict=True))


def test_seeded_request_is_batch_invariant() -> None:
    """Request A (seed 7) gets the same tokens alone and in a batch with other requests, over 5 steps."""
    vocab_size = 50
    step_logits = [
        torch.randn(vocab_size, generator=torch.Generator().manual_seed(100 + i)) for i in range(5)
    ]
    alone_gen = torch.Generator().manual_seed(7)
    batched_gens = [torch.Generator().manual_seed(3), torch.Generator().manual_seed(7), None]
    for step, logits in enumerate(step_logits):
        alone = sample(logits[None], 0.8, 20, 0.9, generators=[alone_gen])
        others = torch.randn(2, vocab_size, generator=torch.Generator().manual_seed(200 + step))
        batch_logits = torch.stack((others[0], logits, others[1]))
        batched = sample(
            batch_logits,
            torch.tensor([1.0, 0.8, 0.0]),
            torch.tensor([0, 20, 5]),
            torch.tensor([0.5, 0.9, 1.0]),
            generators=batched_gens,
        )
        assert batched[1] == alone[0]


def test_rows_sharing_a_generator_draw_together_and_a_seeded_row_stays_batch_invariant() -> None:
    """Unseeded requests share one generator (one draw for their rows); a seeded row between them gets
    the tokens it gets alone; the shared rows still follow their distribution (chi-square at ALPHA)."""
    shared = torch.Generator().manual_seed(11)
    seeded = torch.Generator().manual_seed(5)
    assert group_rows_by_generator([shared, seeded, shared, None], range(4)) == [
        (shared, [0, 2]),
        (seeded, [1]),
        (None, [3]),
    ]
    probs = torch.tensor([0.1, 0.6, 0.0, 0.3])
    alone = sample_from_probs(probs[None], [torch.Generator().manual_seed(5)])
    num_rows = 4001
    generators = [seeded if row == 1 else shared for row in range(num_rows)]
    tokens = sample_from_probs(probs.expand(num_rows, 4), generators)
    assert tokens[1] == alone[0]
    counts = torch.bincount(torch.cat((tokens[:1], tokens[2:])), minlength=4)
    assert counts[2] == 0
    assert chi_square_p_value(counts, probs) > ALPHA


def test_sample_from_probs_matches_distribution() -> None:
    """20,000 draws from a 6-token distribution with a zero entry; chi-square at ALPHA."""
    probs = torch.tensor([0.05, 0.3, 0.0, 0.15, 0.4, 0.1])
    tokens = sample_from_probs(probs.expand(20_000, 6), torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=6)
    assert counts[2] == 0
    assert chi_square_p_value(counts, probs) > ALPHA


def test_compute_logprobs() -> None:
    logits = torch.randn(3, 9, generator=torch.Generator().manual_seed(2))
    token_ids = torch.tensor([0, 4, 8])
    result = compute_logprobs(logits, token_ids, num_top=3)
    reference = logits.log_softmax(-1)
    torch.testing.assert_close(result.token_logprobs, reference.gather(1, token_ids[:, None])[:, 0])
    expected_ranks = [
        int((reference[b] > reference[b, t]).sum()) + 1 for b, t in enumerate(token_ids.tolist())
    ]
    assert result.token_ranks.tolist() == expected_ranks
    torch.testing.assert_close(result.top_logprobs, reference.sort(-1, descending=True).values[:, :3])
    assert torch.equal(result.top_token_ids[:, 0], logits.argmax(-1))
    assert compute_logprobs(logits, token_ids, 0).top_token_ids.shape == (3, 0)


def test_invalid_arguments_raise() -> None:
    with pytest.raises(ValueError, match="temperature"):
        probs_from_logits(torch.zeros(2, 3), torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="top_p"):
        probs_from_logits(torch.zeros(2, 3), 1.0, top_p=0.0)
    with pytest.raises(ValueError, match="num_top"):
        compute_logprobs(torch.zeros(2, 3), torch.zeros(2, dtype=torch.int64), 4)


def test_argmax_is_torchs_argmax_ties_nan_and_all() -> None:
    """`kernels.sampling.argmax` (numpy's on CPU float32/float64, torch's otherwise) gives exactly
    `torch.argmax(dim=-1)`: the first index on ties, NaN as the largest, -inf rows, strided views, 1-D,
    empty batches, and the bfloat16 fallback; int64 either way."""
    from pdcluster.kernels.sampling import argmax, argmax_list

    nan, inf = float("nan"), float("inf")
    special = torch.tensor(
        [[1.0, nan, 3.0, nan], [-inf, -inf, -inf, -inf], [2.0, 5.0, 5.0, 1.0], [inf, nan, 0.0, 0.0]]
    )
    generator = torch.Generator().manual_seed(0)
    cases = [
        special,
        special.double(),
        torch.randn(32, 4096, generator=generator),
        torch.randn(6, 20, generator=generator)[:, ::3],  # a strided view
        torch.randn(3, 4, 7, generator=generator),  # leading dimensions kept
        torch.randn(17, generator=generator),  # 1-D: a 0-d result
        torch.zeros(0, 9),  # no rows
        torch.randint(0, 3, (8, 5), generator=generator).float(),  # many ties
        torch.randn(5, 11, generator=generator).bfloat16(),  # torch's own path
    ]
    for x in cases:
        got, expected = argmax(x), x.argmax(dim=-1)
        assert got.dtype == torch.int64 and got.shape == expected.shape
        assert torch.equal(got, expected), x
        assert argmax_list(x) == expected.tolist()  # the host-list variant
    with torch.inference_mode():  # the engine's mode: numpy reads an inference tensor too
        x = torch.randn(4, 10, generator=generator)
        assert torch.equal(argmax(x), x.argmax(dim=-1))


def test_top_k_largest_equals_topk_on_the_chunked_path() -> None:
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(7, 4096, generator=generator)
    x[0, 100:110] = 9.0  # ties at the top, within one chunk
    x[1, ::64] = 9.0  # every chunk's maximum equal
    for k in (1, 5, 20):
        values, indices = top_k_largest(x, k)
        torch.testing.assert_close(values, x.topk(k, dim=-1).values, rtol=0, atol=0)
        assert torch.equal(x.gather(1, indices), values)
        assert all(len(set(row)) == k for row in indices.tolist())


@pytest.mark.parametrize("contiguous", [True, False], ids=["numpy-branch", "torch-branch"])
def test_apply_penalties_equals_a_dense_reference(contiguous: bool) -> None:
    """Rows with repeated tokens, padding, no tokens at all, and tokens in both prompt and output; contiguous
    CPU logits take the numpy branch, a transposed view the torch one (the path other devices use)."""
    generator = torch.Generator().manual_seed(6)
    num_rows, vocab_size = 5, 50
    logits = torch.randn(num_rows, vocab_size, generator=generator) * 3
    outputs = torch.randint(0, vocab_size, (num_rows, 12), generator=generator)
    prompts = torch.randint(0, vocab_size + 1, (num_rows, 9), generator=generator)  # some V: padding
    outputs[2], prompts[2] = vocab_size, vocab_size  # a row listing nothing
    outputs[3, 6:] = vocab_size
    outputs[4, :4] = prompts[4, :4].clamp(max=vocab_size - 1)
    presence = torch.tensor([0.5, 0.0, 1.0, -0.5, 2.0])
    frequency = torch.tensor([0.25, 1.0, 0.0, 0.5, -1.0])
    repetition = torch.tensor([1.3, 1.0, 2.0, 0.7, 1.1])
    expected = logits.clone()
    for r in range(num_rows):
        out = [t for t in outputs[r].tolist() if t < vocab_size]
        seen = set(out) | {t for t in prompts[r].tolist() if t < vocab_size}
        for t in seen:
            v = expected[r, t]
            expected[r, t] = v / repetition[r] if v > 0 else v * repetition[r]
        for t in set(out):
            expected[r, t] = expected[r, t] - frequency[r] * out.count(t) - presence[r]
    counts = torch.zeros(num_rows, vocab_size + 1).scatter_add_(1, outputs, torch.ones(outputs.shape))
    ids = torch.cat([outputs, prompts], dim=1)
    listed = ids < vocab_size
    ids = torch.where(listed, ids, ids.gather(1, listed.to(torch.uint8).argmax(dim=1, keepdim=True)))
    keep = listed.any(dim=1).nonzero()[:, 0]  # a row listing nothing is not passed
    got = logits.clone() if contiguous else logits.t().contiguous().t()
    assert got.is_contiguous() == contiguous
    apply_penalties_(
        got, keep, ids[keep], counts.gather(1, ids)[keep], presence[keep], frequency[keep], repetition[keep]
    )
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)  # float32 rounding of one op order
    assert torch.equal(got[2], logits[2])
