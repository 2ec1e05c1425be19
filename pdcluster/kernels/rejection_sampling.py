"""Speculative decoding verification: greedy matching and lossless rejection sampling (Leviathan et al.,
arXiv 2211.17192, section 2.3, Algorithm 1; Chen et al., arXiv 2302.01318, Algorithm 2)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from pdcluster.kernels.sampling import (
    Generators,
    argmax,
    argmax_list,
    exponential_,
    group_rows_by_generator,
    sample_from_probs,
)


class VerifyResult(NamedTuple):
    """token_ids: `[num_accepted + 1]` int64, accepted drafts then one target token; num_accepted: 0..k."""

    token_ids: torch.Tensor
    num_accepted: int


def _check(
    draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor
) -> None:
    num_drafts = draft_token_ids.shape[0]
    if draft_token_ids.dim() != 1 or target_probs.dim() != 2 or target_probs.shape[0] != num_drafts + 1:
        raise ValueError(
            f"draft_token_ids must be [k] and target_probs [k + 1, V], "
            f"got {tuple(draft_token_ids.shape)} and {tuple(target_probs.shape)}"
        )
    if draft_probs is not None and draft_probs.shape != (num_drafts, target_probs.shape[1]):
        raise ValueError(
            f"draft_probs must be [{num_drafts}, {target_probs.shape[1]}], got {tuple(draft_probs.shape)}"
        )
    if num_drafts and not (
        0 <= int(draft_token_ids.min()) and int(draft_token_ids.max()) < target_probs.shape[1]
    ):
        raise ValueError("draft_token_ids outside the vocabulary")


def greedy_verify(draft_token_ids: torch.Tensor, target_probs: torch.Tensor) -> VerifyResult:
    """Greedy verification of drafts `[k]` int64 against `target_probs [k + 1, V]` (or logits): the drafts
    equal to the target argmax up to the first mismatch, then the target argmax there."""
    _check(draft_token_ids, None, target_probs)
    num_drafts = draft_token_ids.shape[0]
    target_argmax = argmax(target_probs)  # [k + 1]
    matches = draft_token_ids == target_argmax[:num_drafts]
    num_accepted = int(matches.long().cumprod(dim=0).sum())  # length of the all-match prefix
    token_ids = torch.cat((draft_token_ids[:num_accepted], target_argmax[num_accepted : num_accepted + 1]))
    return VerifyResult(token_ids, num_accepted)


def _residual(
    target_row: torch.Tensor, draft_row: torch.Tensor | None, draft_token_id: int | None
) -> torch.Tensor:
    """Unnormalized `max(0, p - q)` (q one-hot at the draft when `draft_row` is None; q = 0 for the bonus)."""
    if draft_token_id is None:  # bonus position: nothing was drafted there
        return target_row
    if draft_row is None:
        residual = target_row.clone()
        residual[draft_token_id] = (residual[draft_token_id] - 1).clamp_min(0)
    else:
        residual = (target_row - draft_row).clamp_min(0)
    return residual if bool((residual > 0).any()) else target_row


def rejection_sample(
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Lossless speculative sampling for one request (Leviathan Algorithm 1); `VerifyResult` of 1..k+1 tokens.

    draft_token_ids: `[k]` int64 (k may be 0). draft_probs: `[k, V]` float32 `q_i`, None for one-hot.
    target_probs: `[k + 1, V]` float32 `p_1..p_{k+1}` (`probs_from_logits` with the request's settings).
    Raises ValueError: inconsistent shapes or draft ids outside the vocabulary.
    """
    _check(draft_token_ids, draft_probs, target_probs)
    num_drafts = draft_token_ids.shape[0]
    uniform = torch.rand(num_drafts, generator=generator, device=target_probs.device)
    drafts = draft_token_ids.tolist()
    for i, x in enumerate(drafts):
        p_x = target_probs[i, x].float()
        q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs[i, x].float()
        # Accept with probability min(1, p(x) / q(x)), as u * q < p so that q(x) = 0 is safe.
        if bool(uniform[i] * q_x < p_x):
            continue
        # Rejected: the target keeps the mass the draft under-proposed, max(0, p - q), and samples there.
        residual = _residual(target_probs[i], None if draft_probs is None else draft_probs[i], x)
        final = sample_from_probs(residual[None], generator)[0]
        return VerifyResult(torch.cat((draft_token_ids[:i], final[None])), i)
    # All k accepted: the target's distribution after the last draft gives one extra (bonus) token.
    bonus = sample_from_probs(target_probs[num_drafts][None], generator)[0]
    return VerifyResult(torch.cat((draft_token_ids, bonus[None])), num_drafts)


class BatchVerifyResult(NamedTuple):
    """output_token_ids: `[B, max_k + 1]` int64, `num_accepted [B] + 1` tokens per row then -1 padding."""

    output_token_ids: torch.Tensor
    num_accepted: torch.Tensor

    def token_ids(self) -> list[list[int]]:
        """Per request, the accepted drafts then the target token, in one host transfer."""
        both = torch.cat((self.num_accepted[:, None], self.output_token_ids), dim=1).tolist()
        return [row[1 : row[0] + 2] for row in both]


class _RaggedDrafts(NamedTuple):
    """`B` requests' drafts laid out as a padded `[B, max_k]` grid (see `_ragged_drafts`)."""

    drafts: torch.Tensor
    is_draft: torch.Tensor
    draft_rows: torch.Tensor
    target_rows: torch.Tensor


def _ragged_drafts(
    draft_token_ids: torch.Tensor, num_draft_tokens: Sequence[int], num_target_rows: int, device: torch.device
) -> _RaggedDrafts:
    """Check the ragged layout (`N = sum(k_b)` drafts, `N + B` target rows) and pad it to a grid."""
    batch, num_drafts = len(num_draft_tokens), int(draft_token_ids.shape[0])
    if sum(num_draft_tokens) != num_drafts or num_target_rows != num_drafts + batch:
        raise ValueError(
            f"{num_drafts} drafts and {num_target_rows} target rows "
            f"for num_draft_tokens {list(num_draft_tokens)}"
        )
    num_draft = torch.as_tensor(num_draft_tokens, dtype=torch.int64, device=device)  # [B]
    draft_start = num_draft.cumsum(0) - num_draft  # [B]
    max_drafts = int(num_draft.max()) if batch else 0
    positions = torch.arange(max_drafts + 1, device=device)  # [max_k + 1]
    is_draft = positions[None, :max_drafts] < num_draft[:, None]  # [B, max_k]
    draft_rows = torch.where(is_draft, draft_start[:, None] + positions[None, :max_drafts], 0)
    target_rows = (draft_start + torch.arange(batch, device=device))[:, None] + positions  # [B, max_k + 1]
    target_rows = torch.minimum(target_rows, (target_rows[:, :1] + num_draft[:, None]))  # clamp padding
    drafts = torch.where(is_draft, draft_token_ids.to(device)[draft_rows], 0)  # [B, max_k]
    return _RaggedDrafts(drafts, is_draft, draft_rows, target_rows)


def _num_accepted(accept: torch.Tensor, is_draft: torch.Tensor) -> torch.Tensor:
    return (accept & is_draft).long().cumprod(dim=1).sum(dim=1)


def _batch_result(
    drafts: torch.Tensor, num_accepted: torch.Tensor, final_token: torch.Tensor
) -> BatchVerifyResult:
    """Rows of the accepted drafts, then `final_token [B]`, then -1 padding."""
    batch, max_drafts = drafts.shape
    positions = torch.arange(max_drafts, device=drafts.device)
    output = torch.full((batch, max_drafts + 1), -1, dtype=torch.int64, device=drafts.device)
    output[:, :max_drafts] = torch.where(positions[None] < num_accepted[:, None], drafts, -1)
    output.scatter_(1, num_accepted[:, None], final_token[:, None])
    return BatchVerifyResult(output, num_accepted)


def _greedy_accept(ragged: _RaggedDrafts, target_argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy rule over a grid: accept drafts while they equal the target argmax, then the argmax."""
    max_drafts = ragged.drafts.shape[1]
    num_accepted = _num_accepted(ragged.drafts == target_argmax[:, :max_drafts], ragged.is_draft)
    return num_accepted, target_argmax.gather(1, num_accepted[:, None])[:, 0]


def greedy_verify_batch(
    draft_token_ids: torch.Tensor, num_draft_tokens: Sequence[int], target_logits: torch.Tensor
) -> BatchVerifyResult:
    """Greedy verification of `B` requests with ragged draft counts.

    draft_token_ids: `[N]` int64, the requests' drafts concatenated, `N = sum(num_draft_tokens)`.
    target_logits: `[N + B, V]` target logits (or probabilities: only the argmax is used, the first
        index on ties); request b's `k_b + 1` rows follow request b-1's.
    Raises ValueError: inconsistent shapes.
    """
    device = target_logits.device
    ragged = _ragged_drafts(draft_token_ids, num_draft_tokens, target_logits.shape[0], device)
    target_argmax = argmax(target_logits)[ragged.target_rows]  # [B, max_k + 1]
    num_accepted, final_token = _greedy_accept(ragged, target_argmax)
    return _batch_result(ragged.drafts, num_accepted, final_token)


def greedy_verify_lists(
    draft_token_ids: Sequence[Sequence[int]], target_logits: torch.Tensor
) -> list[list[int]]:
    """`greedy_verify_batch(...).token_ids()` with the drafts as host lists: one argmax over the target rows,
    then the accept rule per request on host ints (no per-step grid of small tensors).

    draft_token_ids: request b's `k_b` drafts. target_logits: `[sum(k_b) + B, V]`, as `greedy_verify_batch`.
    Raises ValueError: a row count other than `sum(k_b) + B`.
    """
    num_rows = sum(map(len, draft_token_ids)) + len(draft_token_ids)
    if target_logits.shape[0] != num_rows:
        raise ValueError(f"{target_logits.shape[0]} target rows for {num_rows} drafts and bonus tokens")
    target = argmax_list(target_logits)
    tokens: list[list[int]] = []
    row = 0
    for drafts in draft_token_ids:
        num_accepted, k = 0, len(drafts)
        while num_accepted < k and drafts[num_accepted] == target[row + num_accepted]:
            num_accepted += 1
        tokens.append(target[row : row + num_accepted + 1])  # the accepted drafts equal the argmax
        row += k + 1
    return tokens


def rejection_sample_batch(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: Sequence[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    is_greedy: Sequence[bool] | torch.Tensor,
    generators: Generators = None,
) -> BatchVerifyResult:
    """Verify `B` requests with ragged draft counts in one vectorized pass.

    draft_token_ids: `[N]` int64, the requests' drafts concatenated, `N = sum(num_draft_tokens)`.
    draft_probs: `[N, V]` float32 draft distributions, or None for deterministic drafters.
    target_probs: `[N + B, V]` float32; request b's `k_b + 1` rows follow request b-1's.
    is_greedy: `[B]` bool, temperature 0 requests (verified by argmax, no randomness).
    Raises ValueError: inconsistent shapes.
    """
    batch = len(num_draft_tokens)
    num_drafts, vocab_size = int(draft_token_ids.shape[0]), target_probs.shape[1]
    device = target_probs.device
    ragged = _ragged_drafts(draft_token_ids, num_draft_tokens, target_probs.shape[0], device)
    if draft_probs is not None and draft_probs.shape != (num_drafts, vocab_size):
        raise ValueError(f"draft_probs must be [{num_drafts}, {vocab_size}], got {tuple(draft_probs.shape)}")
    greedy_flags = is_greedy
    is_greedy = torch.as_tensor(is_greedy, dtype=torch.bool, device=device)
    per_request = generators is not None and not isinstance(generators, torch.Generator)
    if per_request and len(generators) != batch:
        raise ValueError(f"{len(generators)} generators for {batch} requests")

    drafts, draft_rows = ragged.drafts, ragged.draft_rows
    max_drafts = drafts.shape[1]
    target = target_probs[ragged.target_rows].float()  # [B, max_k + 1, V]
    p_x = target[:, :max_drafts].gather(-1, drafts[..., None])[..., 0]  # [B, max_k]
    q_x = (
        torch.ones_like(p_x)
        if draft_probs is None
        else draft_probs[draft_rows].float().gather(-1, drafts[..., None])[..., 0]
    )

    # Randomness in per-request order: k_b uniforms, then V exponentials; none for greedy requests.
    uniform = torch.zeros(batch, max_drafts, device=device)
    noise = torch.ones(batch, vocab_size, device=device)
    if isinstance(greedy_flags, torch.Tensor):
        sampled = (~is_greedy).nonzero().flatten().tolist()
    else:  # host-side flags: no device round trip
        sampled = [b for b, greedy in enumerate(greedy_flags) if not greedy]
    if per_request:
        for generator, rows in group_rows_by_generator(generators, sampled):
            if len(rows) == 1:
                b = rows[0]
                uniform[b, : num_draft_tokens[b]] = torch.rand(
                    num_draft_tokens[b], generator=generator, device=device
                )
                exponential_(noise[b], generator)
            else:  # requests sharing one generator (unseeded): one draw for the group
                uniform[rows] = torch.rand(len(rows), max_drafts, generator=generator, device=device)
                noise[rows] = exponential_(torch.empty(len(rows), vocab_size, device=device), generator)
    elif sampled:
        uniform[sampled] = torch.rand(len(sampled), max_drafts, generator=generators, device=device)
        noise[sampled] = exponential_(noise[sampled], generators)

    # Accept x_i with probability min(1, p_i(x_i) / q_i(x_i)) up to the first rejection (greedy: argmax).
    greedy_accepted, greedy_final = _greedy_accept(ragged, argmax(target))
    num_accepted = torch.where(
        is_greedy, greedy_accepted, _num_accepted(uniform * q_x < p_x, ragged.is_draft)
    )

    # The final token: from p at the first rejection (residual max(0, p - q)) or the bonus p_{k+1}.
    final_p = target[torch.arange(batch, device=device), num_accepted]  # [B, V]
    rejected = num_accepted < ragged.is_draft.sum(dim=1)
    final_q = torch.zeros_like(final_p)  # q at the final position: 0 for the bonus
    if max_drafts:
        at = num_accepted.clamp_max(max_drafts - 1)[:, None]  # [B, 1], meaningful for rejected rows only
        if draft_probs is None:  # one-hot q at the rejected draft
            final_q.scatter_(1, drafts.gather(1, at), rejected[:, None].float())
        else:
            final_q = torch.where(rejected[:, None], draft_probs[draft_rows.gather(1, at)[:, 0]].float(), 0.0)
    residual = (final_p - final_q).clamp_min(0)
    residual = torch.where((residual > 0).any(dim=-1, keepdim=True), residual, final_p)
    sampled_final = argmax(residual / noise.clamp_min(torch.finfo(torch.float32).tiny))
    final_token = torch.where(is_greedy, greedy_final, sampled_final)
    return _batch_result(drafts, num_accepted, final_token)
