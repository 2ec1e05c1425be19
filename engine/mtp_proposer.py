"""Draft proposal with the model's own MTP module (DeepSeek-V3 report section 2.2 / 5.4.3).

After the main model has run positions `c .. c+n-1` of a request and their next tokens are committed, the
MTP layer runs the same positions with inputs `(h_i, t_{i+1})`, writing its own latent KV (the MTP layer has
a cache like any layer, at the same slots). The output at the last position predicts the token after the
newest committed one: draft d_1. For `num_speculative_tokens = k > 1` the single MTP module is chained, as
deployed DeepSeek-V3 systems do: position `p+1` gets `(MTP hidden at p, d_1)` and predicts d_2, and so on.
Chained positions write MTP KV at slots the next verification step overwrites, so they must be allocated.

Drafts are greedy for greedy requests; otherwise sampled from the MTP distribution under the request's own
temperature/top-k/top-p, whose probabilities are kept for lossless rejection sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model_runner import LayerKVCallback, ModelRunner, build_model_input
from kernels.sampling import probs_from_logits


@dataclass
class MTPWork:
    """One request's MTP work for this step.

    start_position: first position c the main model ran this step and that is now committed.
    next_token_ids: `t_{c+1} .. t_{c+n}` (committed), one per position run.
    prev_hidden: `[n, hidden_size]` main-model hidden states at positions `c .. c+n-1`.
    block_table: the request's block ids (must cover `c + n - 1 + num_drafts - 1`).
    num_drafts: drafts to propose after this (0 for a prefill chunk that is not the last).
    temperature/top_k/top_p: the request's sampling settings (temperature 0 = greedy drafts).
    generator: the request's torch.Generator for sampled drafts (None: global RNG).
    """

    start_position: int
    next_token_ids: list[int]
    prev_hidden: torch.Tensor
    block_table: list[int]
    num_drafts: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    generator: torch.Generator | None = None


@dataclass
class Proposal:
    """draft_token_ids: `num_drafts` ints.
    draft_probs: `[num_drafts, vocab_size]` float32, or None for greedy drafts.
    error: why drafting failed for this request alone (an exception picking one of its drafts, e.g.
        from its sampling settings); the drafts are then incomplete and must not be used. None: success."""

    draft_token_ids: list[int]
    draft_probs: torch.Tensor | None
    error: str | None = None


def _pick(logits: torch.Tensor, work: MTPWork) -> tuple[int, torch.Tensor | None]:
    """Draft one token from MTP logits `[vocab_size]`."""
    if work.temperature == 0.0:
        return int(logits.argmax()), None
    probs = probs_from_logits(
        logits[None],
        torch.tensor([work.temperature]),
        torch.tensor([work.top_k]),
        torch.tensor([work.top_p]),
    )[0]
    token = int(torch.multinomial(probs, 1, generator=work.generator))
    return token, probs


def propose(
    runner: ModelRunner, works: list[MTPWork], on_layer_kv: LayerKVCallback | None = None
) -> list[Proposal]:
    """Run the MTP layer over each request's committed positions, then chain it for drafts.

    `on_layer_kv` runs after the MTP layer's KV of the committed positions is written (not for the
    chained draft positions, whose KV the next verification step overwrites).

    Returns one `Proposal` per work item (empty for `num_drafts == 0`). An exception while picking one
    request's draft fails that request's proposal only (`Proposal.error`); exceptions from the batched
    MTP forward propagate.
    """
    if not works:
        return []
    batch = build_model_input(
        [w.next_token_ids for w in works],
        [w.start_position for w in works],
        [w.block_table for w in works],
        runner.block_size,
        runner.device,
    )
    prev_hidden = torch.cat([w.prev_hidden for w in works])
    hidden = runner.mtp_forward(batch, prev_hidden, on_layer_kv=on_layer_kv)
    last_rows = batch.query_start_loc[1:] - 1
    proposals = [Proposal([], None) for _ in works]
    probs_lists: list[list[torch.Tensor]] = [[] for _ in works]
    active = [i for i, w in enumerate(works) if w.num_drafts > 0]
    if not active:
        return proposals
    last_hidden = {i: hidden[last_rows[i]] for i in active}
    last_position = {i: works[i].start_position + len(works[i].next_token_ids) - 1 for i in active}
    logits = runner.compute_logits(torch.stack([last_hidden[i] for i in active]))
    for row, i in enumerate(active):
        _append_pick(proposals[i], probs_lists[i], logits[row], works[i])
    depth_limit = len(runner.model.mtp_layers) - 1
    for depth in range(1, max(works[i].num_drafts for i in active)):
        active = [i for i in active if works[i].num_drafts > depth and proposals[i].error is None]
        if not active:
            break
        chain = build_model_input(
            [[proposals[i].draft_token_ids[-1]] for i in active],
            [last_position[i] + 1 for i in active],
            [works[i].block_table for i in active],
            runner.block_size,
            runner.device,
        )
        out = runner.mtp_forward(
            chain, torch.stack([last_hidden[i] for i in active]), min(depth, depth_limit)
        )
        logits = runner.compute_logits(out)
        for row, i in enumerate(active):
            last_hidden[i] = out[row]
            last_position[i] += 1
            _append_pick(proposals[i], probs_lists[i], logits[row], works[i])
    for i, plist in enumerate(probs_lists):
        if plist and proposals[i].error is None:
            proposals[i].draft_probs = torch.stack(plist)
    return proposals


def _append_pick(
    proposal: Proposal, probs_list: list[torch.Tensor], logits: torch.Tensor, work: MTPWork
) -> None:
    """Draft one more token into `proposal` (its probabilities into `probs_list`); an exception fails
    this proposal alone (`proposal.error`), not the batch."""
    try:
        token, probs = _pick(logits, work)
    except Exception as e:  # noqa: BLE001 - one request's drafting error is that request's failure
        proposal.error = f"drafting failed: {e!r}"
        return
    proposal.draft_token_ids.append(token)
    if probs is not None:
        probs_list.append(probs)
