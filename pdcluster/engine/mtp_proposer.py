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
temperature/top-k/top-p, whose probabilities are kept for lossless rejection sampling. Each depth is
picked for every drafting request at once (one argmax, batched masks, draws grouped by generator) and the
drafts of all depths reach the host in one transfer at the end; when the batched pick raises, the depth
is picked request by request and only the requests that still raise fail.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdcluster.engine.model_runner import LayerKVCallback, ModelInput, ModelRunner
from pdcluster.kernels.sampling import argmax, probs_from_logits, sample_from_probs


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
    """Draft one token from MTP logits `[vocab_size]`: one request alone (the fallback of `_pick_batch`)."""
    if work.temperature == 0.0:
        return int(argmax(logits)), None
    probs = probs_from_logits(
        logits[None],
        torch.tensor([work.temperature]),
        torch.tensor([work.top_k]),
        torch.tensor([work.top_p]),
    )[0]
    token = int(sample_from_probs(probs[None], [work.generator])[0])
    return token, probs


def _pick_batch(logits: torch.Tensor, works: list[MTPWork]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft one token per row of MTP logits `[n, vocab_size]` (row j for `works[j]`), vectorized: one
    argmax over all rows; the sampled rows' distributions (temperature/top-k/top-p masks) in one batch
    and their draws grouped by generator (`kernels.sampling.sample_from_probs`: a seeded request draws
    alone from its own generator, the unseeded ones in one call from the shared one), which makes a
    seeded request's drafts the same as `_pick`'s, whatever the batch.

    Returns `(tokens [n] int64, probs [n, vocab_size] float32 or None when every row is greedy; greedy
    rows' probabilities are unused)`. Raises what the kernels raise (validation, before any draw)."""
    tokens = argmax(logits)
    sampled = [j for j, w in enumerate(works) if w.temperature != 0.0]
    if not sampled:
        return tokens, None
    rows = sampled if len(sampled) < len(works) else slice(None)
    sampled_probs = probs_from_logits(
        logits[rows],
        torch.tensor([works[j].temperature for j in sampled]),
        torch.tensor([works[j].top_k for j in sampled]),
        torch.tensor([works[j].top_p for j in sampled]),
    )
    tokens[rows] = sample_from_probs(sampled_probs, [works[j].generator for j in sampled])
    if isinstance(rows, slice):
        return tokens, sampled_probs
    probs = torch.zeros(len(works), logits.shape[1], dtype=torch.float32, device=logits.device)
    probs[rows] = sampled_probs
    return tokens, probs


class _Drafts:
    """The drafts of the active requests, one depth at a time, kept on the device until `finish`.

    Each depth is picked for all active rows at once (`_pick_batch`); if that raises, row by row
    (`_pick`), and only the rows that still raise fail (their `Proposal.error`)."""

    def __init__(self, works: list[MTPWork]) -> None:
        self.works = works
        self.proposals = [Proposal([], None) for _ in works]
        self._tokens: list[tuple[list[int], torch.Tensor]] = []  # (work indices, tokens [n]) per depth
        self._probs: list[list[torch.Tensor]] = [[] for _ in works]

    def pick(self, logits: torch.Tensor, active: list[int]) -> torch.Tensor:
        """Draft the next token of each `active` work from `logits [len(active), V]`; returns the tokens
        `[len(active)]` (a failed row's is 0: its proposal is dropped)."""
        works = [self.works[i] for i in active]
        try:
            tokens, probs = _pick_batch(logits, works)
        except Exception:  # noqa: BLE001 - find the request(s) it came from, below
            tokens, probs = self._pick_alone(logits, active)
        if probs is not None:
            for row, i in enumerate(active):
                if works[row].temperature != 0.0:
                    self._probs[i].append(probs[row])
        self._tokens.append((active, tokens))
        return tokens

    def _pick_alone(self, logits: torch.Tensor, active: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.zeros(len(active), dtype=torch.long, device=logits.device)
        probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        for row, i in enumerate(active):
            if self.proposals[i].error is not None:
                continue
            try:
                token, row_probs = _pick(logits[row], self.works[i])
            except Exception as e:  # noqa: BLE001 - one request's drafting error is that request's failure
                self.proposals[i].error = f"drafting failed: {e!r}"
                continue
            tokens[row] = token
            if row_probs is not None:
                probs[row] = row_probs
        return tokens, probs

    def finish(self) -> list[Proposal]:
        """The proposals, with every depth's tokens moved to the host in one transfer."""
        if self._tokens:
            flat = torch.cat([tokens for _, tokens in self._tokens]).tolist()
            offset = 0
            for active, _ in self._tokens:
                for i in active:
                    self.proposals[i].draft_token_ids.append(flat[offset])
                    offset += 1
        for i, proposal in enumerate(self.proposals):
            if proposal.error is not None:
                proposal.draft_token_ids, proposal.draft_probs = [], None
            elif self._probs[i]:
                proposal.draft_probs = torch.stack(self._probs[i])
        return self.proposals


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
    num_queries: int | None = None,
) -> list[Proposal]:
    """Run the MTP layer as the tail of the step's main forward, then chain it for drafts.

    Args:
        batch: the step's `ModelInput` (after placeholders were resolved).
        hidden: `[num_tokens, hidden_size]` the main forward's final hidden states over `batch`.
        input_ids: `[num_tokens]` int64 MTP inputs (`mtp_input_ids`).
        works: the requests to draft for (a request with no work still gets its MTP KV written).
        on_layer_kv: runs after the MTP layer's KV over the step's batch is written (not for the chained
            draft positions, whose KV the next verification step overwrites).
        num_queries: the step's query tokens per request when uniform (the compiled MTP pass may take it).

    Returns one `Proposal` per work item. An exception while picking one request's draft fails that
    request's proposal only (`Proposal.error`); exceptions from the batched MTP forward propagate.
    """
    out = runner.mtp_forward(
        batch._replace(input_ids=input_ids), hidden, on_layer_kv=on_layer_kv, num_queries=num_queries
    )
    drafts = _Drafts(works)
    active = [i for i, w in enumerate(works) if w.num_drafts > 0]
    if not active:
        return drafts.proposals
    device = batch.positions.device
    newest_rows = torch.tensor([works[i].newest_row for i in active], device=device)
    last_hidden = out[newest_rows]
    last_tokens = drafts.pick(runner.compute_logits(last_hidden), active)
    # Chained depths: one token per request, metadata derived from the step's batch.
    request_rows = torch.tensor([works[i].request_row for i in active], device=device)
    positions = batch.positions[newest_rows]
    block_tables = batch.block_tables[request_rows]
    depth_limit = len(runner.model.mtp_layers) - 1
    bs = runner.block_size
    for depth in range(1, max(works[i].num_drafts for i in active)):
        proposals = drafts.proposals
        keep = [j for j, i in enumerate(active) if works[i].num_drafts > depth and proposals[i].error is None]
        if not keep:
            break
        if len(keep) < len(active):
            index = torch.tensor(keep, device=device)
            active = [active[j] for j in keep]
            positions, block_tables, last_hidden = positions[index], block_tables[index], last_hidden[index]
            last_tokens = last_tokens[index]
        positions = positions + 1
        columns = torch.arange(len(active), device=device)
        chain = ModelInput(
            input_ids=last_tokens,
            positions=positions,
            slot_mapping=block_tables[columns, positions // bs] * bs + positions % bs,
            block_tables=block_tables,
            seq_lens=positions + 1,
            query_start_loc=torch.arange(len(active) + 1, device=device),
        )
        last_hidden = runner.mtp_forward(chain, last_hidden, min(depth, depth_limit))
        last_tokens = drafts.pick(runner.compute_logits(last_hidden), active)
    return drafts.finish()
