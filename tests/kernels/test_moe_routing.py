"""MoE routing (`kernels.moe.grouped_topk`) and dispatch (`models.moe_dispatch.LocalDispatcher`) against
brute-force per-token loops."""

from __future__ import annotations

import math

import pytest
import torch

from pdcluster.kernels.moe import grouped_topk
from pdcluster.models.moe_dispatch import LocalDispatcher


@pytest.fixture(autouse=True)
def _seed_torch() -> None:
    """Tests in this file that draw from torch's global generator draw the same numbers on every run."""
    torch.manual_seed(0)


def route_one_token(
    logits: list[float],
    bias: list[float] | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> dict[int, float]:
    """DeepSeek-V3 routing for one token in plain Python: `{expert id: gate weight}`.

    Selection uses `sigmoid(logit) + bias`; a group's score is the sum of its two best biased scores; only
    the `topk_group` best groups compete. Gate weights use the *unbiased* sigmoid scores.
    """
    num_experts = len(logits)
    scores = [1.0 / (1.0 + math.exp(-x)) for x in logits]
    choice = [s + (bias[e] if bias is not None else 0.0) for e, s in enumerate(scores)]
    per_group = num_experts // n_group
    groups = [list(range(g * per_group, (g + 1) * per_group)) for g in range(n_group)]
    group_score = [sum(sorted((choice[e] for e in members), reverse=True)[:2]) for members in groups]
    best_groups = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
    allowed = [e for g in best_groups for e in groups[g]]
    chosen = sorted(allowed, key=lambda e: -choice[e])[:top_k]
    total = sum(scores[e] for e in chosen) if norm_topk_prob else 1.0
    return {e: scores[e] / total * routed_scaling_factor for e in chosen}


def as_dicts(weights: torch.Tensor, ids: torch.Tensor) -> list[dict[int, float]]:
    return [dict(zip(i.tolist(), w.tolist(), strict=True)) for w, i in zip(weights, ids, strict=True)]


@pytest.mark.parametrize(
    ("num_experts", "n_group", "topk_group", "top_k", "norm_topk_prob", "with_bias"),
    [
        (8, 1, 1, 2, True, True),
        (16, 4, 2, 4, True, True),
        (16, 8, 3, 5, False, True),
        (32, 4, 1, 6, True, False),
        (12, 3, 2, 3, False, False),
    ],
)
def test_grouped_topk_matches_per_token_loop(
    num_experts, n_group, topk_group, top_k, norm_topk_prob, with_bias
):
    num_tokens = 40
    gen = torch.Generator().manual_seed(num_experts * 100 + n_group)
    logits = torch.randn(num_tokens, num_experts, generator=gen) * 2
    bias = 0.3 * torch.randn(num_experts, generator=gen) if with_bias else None
    kwargs = dict(
        top_k=top_k,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=norm_topk_prob,
        routed_scaling_factor=2.5,
    )

    weights, ids = grouped_topk(logits, bias, **kwargs)

    assert weights.shape == ids.shape == (num_tokens, top_k)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    got = as_dicts(weights, ids)
    for t in range(num_tokens):
        want = route_one_token(logits[t].tolist(), None if bias is None else bias.tolist(), **kwargs)
        assert got[t].keys() == want.keys(), f"token {t}"
        for e, w in want.items():
            assert got[t][e] == pytest.approx(w, rel=1e-5), f"token {t} expert {e}"
    if with_bias:  # the bias must matter for this data, or the test proves nothing about it
        _, unbiased_ids = grouped_topk(logits, None, **kwargs)
        assert (ids.sort(-1).values != unbiased_ids.sort(-1).values).any()


def test_bias_is_for_selection_only() -> None:
    """The bias moves experts in or out of the top-k, but gate weights are the unbiased sigmoid scores."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([-10.0, 0.0, 0.0, 10.0])  # expert 0 (best score) is pushed out, 3 (worst) pulled in
    kwargs = dict(top_k=2, n_group=1, topk_group=1, routed_scaling_factor=2.5)

    weights, ids = grouped_topk(logits, bias, norm_topk_prob=True, **kwargs)
    assert ids.tolist() == [[3, 1]]
    s3, s1 = torch.sigmoid(torch.tensor(-1.0)), torch.sigmoid(torch.tensor(1.0))
    torch.testing.assert_close(weights, 2.5 * torch.stack((s3, s1))[None] / (s3 + s1), rtol=1e-6, atol=0)

    weights, ids = grouped_topk(logits, bias, norm_topk_prob=False, **kwargs)
    torch.testing.assert_close(weights, 2.5 * torch.stack((s3, s1))[None], rtol=1e-6, atol=0)

    _, ids = grouped_topk(logits, None, norm_topk_prob=True, **kwargs)
    assert ids.tolist() == [[0, 1]]


def test_group_limit_uses_sum_of_two_best_and_masks_other_groups() -> None:
    """4 groups of 2 with top-2 sums 1.0, 1.39, 0.9, 0.5. Expert 0 has the single best score, but group 1
    has the best top-2 sum, so with topk_group=1 both picks come from group 1 and expert 0 is masked out
    (a max-based group score would have picked group 0)."""
    scores = torch.tensor([[0.95, 0.05, 0.7, 0.69, 0.5, 0.4, 0.3, 0.2]])
    logits = torch.logit(scores)
    kwargs = dict(top_k=2, norm_topk_prob=False, routed_scaling_factor=1.0)

    weights, ids = grouped_topk(logits, None, n_group=4, topk_group=1, **kwargs)
    assert ids.tolist() == [[2, 3]]
    torch.testing.assert_close(weights, torch.tensor([[0.7, 0.69]]), rtol=1e-6, atol=0)

    _, ids = grouped_topk(logits, None, n_group=4, topk_group=2, **kwargs)  # groups 1 and 0
    assert ids.tolist() == [[0, 2]]

    # +0.25 on group 2 lifts its top-2 sum to 1.4, above group 1 (1.39) and group 0: groups 2 and 1 compete,
    # expert 4 wins with biased 0.75, but its gate weight stays its own score 0.5.
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.25, 0.25, 0.0, 0.0])
    weights, ids = grouped_topk(logits, bias, n_group=4, topk_group=2, **kwargs)
    assert ids.tolist() == [[4, 2]]
    torch.testing.assert_close(weights, torch.tensor([[0.5, 0.7]]), rtol=1e-6, atol=0)

    _, ids = grouped_topk(logits, None, n_group=1, topk_group=1, **kwargs)  # no group limit
    assert ids.tolist() == [[0, 2]]


# ---- dispatch / combine -----------------------------------------------------------------------------


def dense_moe(hidden, topk_ids, topk_weights, experts) -> torch.Tensor:
    """out[t] = sum_k topk_weights[t, k] * experts[topk_ids[t, k]](hidden[t]), one token at a time."""
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for e, w in zip(topk_ids[t].tolist(), topk_weights[t], strict=True):
            out[t] += w * experts[e](hidden[t : t + 1])[0]
    return out


def run_local(dispatcher, hidden, topk_ids, topk_weights, experts) -> torch.Tensor:
    dispatched = dispatcher.dispatch(hidden, topk_ids, topk_weights)
    outputs, start = [], 0
    for e, num_rows in enumerate(dispatched.rows_per_expert):
        outputs.append(experts[e](dispatched.hidden[start : start + num_rows]))
        start += num_rows
    return dispatcher.combine(torch.cat(outputs), dispatched.handle)


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k"), [(13, 6, 2), (5, 8, 3), (1, 4, 4)])
def test_local_dispatcher_equals_dense_loop(num_tokens, num_experts, top_k) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    hidden = torch.randn(num_tokens, 10, generator=gen)
    topk_ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    topk_weights = torch.rand(num_tokens, top_k, generator=gen)
    mats = torch.randn(num_experts, 10, 10, generator=gen)
    experts = [lambda x, m=m: torch.tanh(x @ m) for m in mats]

    dispatcher = LocalDispatcher(num_experts)
    dispatched = dispatcher.dispatch(hidden, topk_ids, topk_weights)

    assert dispatched.rows_per_expert == [int((topk_ids == e).sum()) for e in range(num_experts)]
    assert sum(dispatched.rows_per_expert) == dispatched.hidden.shape[0] == num_tokens * top_k
    # rows are grouped by expert, tokens in order within each expert (a stable sort)
    start = 0
    for e, num_rows in enumerate(dispatched.rows_per_expert):
        tokens = [t for t in range(num_tokens) if e in topk_ids[t].tolist()]
        assert dispatched.handle.token_ids[start : start + num_rows].tolist() == tokens
        assert torch.equal(dispatched.hidden[start : start + num_rows], hidden[tokens])
        start += num_rows

    out = run_local(dispatcher, hidden, topk_ids, topk_weights, experts)
    torch.testing.assert_close(out, dense_moe(hidden, topk_ids, topk_weights, experts), rtol=1e-5, atol=1e-6)


def test_local_dispatcher_with_idle_experts_and_a_hot_expert() -> None:
    hidden = torch.randn(6, 4)
    topk_ids = torch.tensor([[2, 0]] * 6)  # experts 1 and 3 get nothing, expert 2 gets every token
    topk_weights = torch.rand(6, 2)
    experts = [lambda x, s=s: x * s for s in (1.0, 2.0, 3.0, 4.0)]
    dispatcher = LocalDispatcher(4)
    assert dispatcher.dispatch(hidden, topk_ids, topk_weights).rows_per_expert == [6, 0, 6, 0]
    out = run_local(dispatcher, hidden, topk_ids, topk_weights, experts)
    expected = hidden * (3.0 * topk_weights[:, :1] + 1.0 * topk_weights[:, 1:])
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
