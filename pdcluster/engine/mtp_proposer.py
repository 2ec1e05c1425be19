"""Draft proposal with the model's own MTP module (DeepSeek-V3 report section 2.2 / 5.4.3), run as the tail of
the step's main forward (FusionSpec's "post-MTP layer": it reuses the main model's metadata).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pdcluster.engine.model_runner import LayerKVCallback, ModelInput, ModelRunner
from pdcluster.kernels.sampling import argmax, probs_from_logits, sample_from_probs

if TYPE_CHECKING:
    from pdcluster.engine.structured_output import DraftMasks


@dataclass
class MTPWork:
    """One drafting request's share of the MTP tail."""

    request_row: int
    newest_row: int
    num_drafts: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    generator: torch.Generator | None = None


@dataclass
class Proposal:
    """draft_token_ids: `num_drafts` ints. draft_probs: `[num_drafts, vocab_size]` float32, or None for greedy
    drafts. error: why drafting failed for this request alone (an exception picking one of its drafts, e.g.
    from its sampling settings); the drafts are then incomplete and must not be used.
    """

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
    """Draft one token per row of MTP logits `[n, vocab_size]`, vectorized (greedy and sampled rows)."""
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
    """The drafts of the active requests, one depth at a time, kept on the device until `finish`."""

    def __init__(self, works: list[MTPWork], masks: DraftMasks | None = None) -> None:
        self.works = works
        self.masks = masks
        self.proposals = [Proposal([], None) for _ in works]
        self._tokens: list[tuple[list[int], torch.Tensor]] = []
        self._probs: list[list[torch.Tensor]] = [[] for _ in works]

    def pick(
        self, logits: torch.Tensor, active: list[int], previous: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Draft the next token of each `active` work from `logits [len(active), V]` (grammar-masked in place
        after `previous`, the depth before's drafts); returns the tokens `[len(active)]` (a failed row's is 0:
        its proposal is dropped).
        """
        if self.masks is not None:
            self.masks.mask_(logits, active, previous)
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
    sampled this step, after each request's newest committed position).
    """
    if batch.input_ids.device.type == "cpu":  # host buffers: numpy views, cheaper per call than torch ops
        ids = np.zeros(batch.num_tokens, dtype=np.int64)
        ids[:-1] = batch.input_ids.numpy()[1:]
        ids[rows] = token_ids
        return torch.from_numpy(ids)
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
    masks: DraftMasks | None = None,
) -> list[Proposal]:
    """Run the MTP layer as the tail of the step's main forward, then chain it for drafts (grammar-masked by
    `masks`, whose matchers the caller rolls back with `masks.finish`).

    hidden: `[num_tokens, hidden_size]` the main forward's final hidden states over `batch`.
    input_ids: `[num_tokens]` int64 MTP inputs (`mtp_input_ids`).
    """
    out = runner.mtp_forward(
        batch._replace(input_ids=input_ids), hidden, on_layer_kv=on_layer_kv, num_queries=num_queries
    )
    drafts = _Drafts(works, masks)
    active = [i for i, w in enumerate(works) if w.num_drafts > 0]
    if not active:
        return drafts.proposals
    device = batch.positions.device
    newest_rows = torch.tensor([works[i].newest_row for i in active], device=device)
    last_hidden = out[newest_rows]
    last_tokens = drafts.pick(runner.compute_logits(last_hidden), active)
    max_num_drafts = max(works[i].num_drafts for i in active)
    if max_num_drafts == 1:
        return drafts.finish()
    # Chained depths: one token per request, metadata derived from the step's batch.
    request_rows = torch.tensor([works[i].request_row for i in active], device=device)
    positions = batch.positions[newest_rows]
    block_tables = batch.block_tables[request_rows]
    depth_limit = len(runner.model.mtp_layers) - 1
    bs = runner.block_size
    for depth in range(1, max_num_drafts):
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
        last_tokens = drafts.pick(runner.compute_logits(last_hidden), active, last_tokens)
    return drafts.finish()
