"""Draft proposal with the model's own MTP module (DeepSeek-V3 report section 2.2 / 5.4.3), run as the
tail of the step's main forward (FusionSpec's "post-MTP layer": it reuses the main model's metadata).

After the main model has run positions `c .. c+n-1` of a request, the MTP layer runs the *same* batch, its
positions, slot mapping, block tables, sequence lengths and query starts, with inputs `(h_i, t_{i+1})`:
`t_{i+1}` is the step's next input token (an accepted draft, or a prefill chunk's next prompt token), and at
the newest committed position the token sampled this step. It writes its own latent KV (the MTP layer has
a cache like any layer, at the same slots). The output at the newest committed position predicts the token
after the sampled one: draft d_1. Rows past that position (rejected drafts) run too, on whatever input the
shifted batch gives them: attention is causal, so they do not change the committed rows, and the KV they
write sits at positions the next step rewrites, in every layer, before anything reads it (the main layers
leave rejected drafts' KV there in the same way).

For `num_speculative_tokens = k > 1` the single MTP module is chained, as deployed DeepSeek-V3 systems do:
position `p+1` gets `(MTP hidden at p, d_1)` and predicts d_2, and so on. Each chained depth is one more
small pass of one token per drafting request; its metadata is derived from the step's batch by tensor ops
(its block-table rows, position + 1, the slot in that row), not packed again. Chained positions write MTP
KV at slots the next verification step overwrites, so they must be allocated.

Drafts are greedy for greedy requests; otherwise sampled from the MTP distribution under the request's own
temperature/top-k/top-p, whose probabilities are kept for lossless rejection sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model_runner import LayerKVCallback, ModelInput, ModelRunner
from kernels.sampling import probs_from_logits


@dataclass
class MTPWork:
    """One drafting request's share of the MTP tail.

    request_row: the request's row in the step's batch (`block_tables` row).
    newest_row: flat token index, in the step's batch, of the request's newest committed position p.
    num_drafts: drafts to propose (the block table must cover `p + num_drafts - 1`).
    temperature/top_k/top_p: the request's sampling settings (temperature 0 = greedy drafts).
    generator: the request's torch.Generator for sampled drafts (None: global RNG).
    """

    request_row: int
    newest_row: int
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


def mtp_input_ids(batch: ModelInput, rows: list[int], token_ids: list[int]) -> torch.Tensor:
    """The MTP layer's inputs over the step's batch: `[num_tokens]` int64, the batch's next input token at
    each row (`input_ids` shifted by one), with `token_ids` written at the flat indices `rows` (the tokens
    sampled this step, after each request's newest committed position). A request's last row otherwise
    gets the next request's first token: a row whose output nobody reads (see the module docstring)."""
    ids = torch.empty_like(batch.input_ids)
    if batch.num_tokens:
        ids[:-1] = batch.input_ids[1:]
        ids[-1] = 0
    if rows:
        device = ids.device
        ids[torch.tensor(rows, device=device)] = torch.tensor(token_ids, dtype=ids.dtype, device=device)
    return ids


def propose(
    runner: ModelRunner,
    batch: ModelInput,
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    works: list[MTPWork],
    on_layer_kv: LayerKVCallback | None = None,
) -> list[Proposal]:
    """Run the MTP layer as the tail of the step's main forward, then chain it for drafts.

    Args:
        batch: the step's `ModelInput` (after placeholders were resolved).
        hidden: `[num_tokens, hidden_size]` the main forward's final hidden states over `batch`.
        input_ids: `[num_tokens]` int64 MTP inputs (`mtp_input_ids`).
        works: the requests to draft for (a request with no work still gets its MTP KV written).
        on_layer_kv: runs after the MTP layer's KV over the step's batch is written (not for the chained
            draft positions, whose KV the next verification step overwrites).

    Returns one `Proposal` per work item. An exception while picking one request's draft fails that
    request's proposal only (`Proposal.error`); exceptions from the batched MTP forward propagate.
    """
    out = runner.mtp_forward(batch._replace(input_ids=input_ids), hidden, on_layer_kv=on_layer_kv)
    proposals = [Proposal([], None) for _ in works]
    probs_lists: list[list[torch.Tensor]] = [[] for _ in works]
    active = [i for i, w in enumerate(works) if w.num_drafts > 0]
    if not active:
        return proposals
    device = batch.positions.device
    newest_rows = torch.tensor([works[i].newest_row for i in active], device=device)
    last_hidden = out[newest_rows]
    logits = runner.compute_logits(last_hidden)
    for row, i in enumerate(active):
        _append_pick(proposals[i], probs_lists[i], logits[row], works[i])
    # Chained depths: one token per request, metadata derived from the step's batch.
    request_rows = torch.tensor([works[i].request_row for i in active], device=device)
    positions = batch.positions[newest_rows]
    block_tables = batch.block_tables[request_rows]
    depth_limit = len(runner.model.mtp_layers) - 1
    bs = runner.block_size
    for depth in range(1, max(works[i].num_drafts for i in active)):
        keep = [j for j, i in enumerate(active) if works[i].num_drafts > depth and proposals[i].error is None]
        if not keep:
            break
        if len(keep) < len(active):
            index = torch.tensor(keep, device=device)
            active = [active[j] for j in keep]
            positions, block_tables, last_hidden = positions[index], block_tables[index], last_hidden[index]
        positions = positions + 1
        columns = torch.arange(len(active), device=device)
        chain = ModelInput(
            input_ids=torch.tensor([proposals[i].draft_token_ids[-1] for i in active], device=device),
            positions=positions,
            slot_mapping=block_tables[columns, positions // bs] * bs + positions % bs,
            block_tables=block_tables,
            seq_lens=positions + 1,
            query_start_loc=torch.arange(len(active) + 1, device=device),
        )
        last_hidden = runner.mtp_forward(chain, last_hidden, min(depth, depth_limit))
        logits = runner.compute_logits(last_hidden)
        for row, i in enumerate(active):
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
