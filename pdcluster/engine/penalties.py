"""Presence, frequency and repetition penalties from per-request token counts kept across steps."""

from __future__ import annotations

from collections.abc import Callable, KeysView

import numpy as np
import torch

from pdcluster.engine.outputs import ScheduledRequest
from pdcluster.kernels.sampling import apply_penalties_, numpy_writable, penalized

# `(item, start)` -> the request's output tokens before this step's inputs end, from output index `start` on.
OutputHistory = Callable[[ScheduledRequest, int], list[int]]


class PenaltyCounts:
    """Per penalised request a slot: output-token counts (`[slots, V]` float32), listed tokens (`[slots, W]`
    int64: distinct output tokens, plus the prompt's under repetition penalty; columns past them repeat the
    first); counted in full on first sight, then only new tokens; reset when dropped or preempted."""

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu", capacity: int = 8) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._counts = torch.zeros(capacity, vocab_size, dtype=torch.float32, device=self.device)
        self._ids = torch.zeros(capacity, 64, dtype=torch.long, device=self.device)
        self._slot_of: dict[str, int] = {}
        # per slot: output tokens counted, the request's num_preemptions then, listed tokens in column order
        self._num_counted = [0] * capacity
        self._preemptions = [0] * capacity
        self._listed: list[dict[int, None]] = [{} for _ in range(capacity)]
        self._free = list(range(capacity - 1, -1, -1))
        self._on_host = self.device.type == "cpu"  # CPU tensors: index through their numpy views

    @property
    def request_ids(self) -> KeysView[str]:
        """The requests holding a slot."""
        return self._slot_of.keys()

    def drop(self, request_ids: list[str]) -> None:
        """Give back the slots of `request_ids`; unknown ids are skipped."""
        for request_id in request_ids:
            slot = self._slot_of.pop(request_id, None)
            if slot is not None:
                self._free.append(slot)

    def counts(self, request_id: str) -> tuple[torch.Tensor, list[int], int] | None:
        """The request's output-token counts `[V]` float32, listed token ids (first listed first) and number
        of output tokens counted, if it holds a slot."""
        slot = self._slot_of.get(request_id)
        if slot is None:
            return None
        listed = self._ids[slot, : len(self._listed[slot])].tolist()
        return self._counts[slot].clone(), listed, self._num_counted[slot]

    def update(self, items: list[ScheduledRequest], history: OutputHistory) -> tuple[list[int], list[int]]:
        """Bring the slots of `items` up to their output histories; returns each item's slot and count."""
        slots: list[int] = []
        lengths: list[int] = []
        new_rows: list[int] = []  # (slot, token) of each new output token
        new_ids: list[int] = []
        listed_rows: list[int] = []  # (slot, column, token) of each newly listed token
        listed_columns: list[int] = []
        listed_ids: list[int] = []
        first_listed: list[int] = []  # slots whose first token is listed now: their padding follows
        slot_of, num_counted, preemptions = self._slot_of, self._num_counted, self._preemptions
        listed_of = self._listed
        for item in items:
            slot = slot_of.get(item.request.request_id)
            if slot is None or preemptions[slot] != item.num_preemptions:
                slot = self._reset(item, slot)
            counted = num_counted[slot]
            new = history(item, counted)
            if new:
                new_rows.extend([slot] * len(new))
                new_ids.extend(new)
                counted += len(new)
                num_counted[slot] = counted
                listed = listed_of[slot]
                if not listed:
                    first_listed.append(slot)
                for token in new:
                    if token not in listed:
                        listed_rows.append(slot)
                        listed_columns.append(len(listed))
                        listed_ids.append(token)
                        listed[token] = None
            slots.append(slot)
            lengths.append(counted)
        if new_ids:
            if self._on_host:  # numpy views: no per-call tensor construction
                np.add.at(self._counts.numpy(), (new_rows, new_ids), 1)
            else:
                index = torch.tensor([new_rows, new_ids], dtype=torch.long).to(self.device)
                self._counts.index_put_(
                    (index[0], index[1]), torch.ones(len(new_ids), device=self.device), accumulate=True
                )
        if listed_ids:
            self._ensure_width(max(len(self._listed[slot]) for slot in slots))
            if self._on_host:
                self._ids.numpy()[listed_rows, listed_columns] = listed_ids
            else:
                index = torch.tensor([listed_rows, listed_columns, listed_ids], dtype=torch.long)
                index = index.to(self.device)
                self._ids.index_put_((index[0], index[1]), index[2])
            for slot in first_listed:
                self._pad(slot)
        return slots, lengths

    def penalize_(
        self,
        logits: torch.Tensor,
        rows: list[int],
        slots: list[int],
        drafts: list[list[int]] | None,
        presence_penalty: np.ndarray,
        frequency_penalty: np.ndarray,
        repetition_penalty: np.ndarray,
        penalties_on: tuple[bool, bool, bool] | None = None,
    ) -> None:
        """Penalise `logits[rows[i]]` (`[N, V]` float32, in place) by slot `slots[i]`'s tokens and `drafts[i]`
        (None: none); penalties `[len(rows)]` float32 (`kernels.sampling.apply_penalties_`); penalties_on:
        whether each penalty is set in any row (None: found here)."""
        listed_of = self._listed
        num_listed = [len(listed_of[slot]) for slot in slots]
        if drafts is None:
            drafts = [[]] * len(rows)
            keep = [i for i, n in enumerate(num_listed) if n]  # a row listing nothing is left alone
        else:
            keep = [i for i, n in enumerate(num_listed) if n or drafts[i]]
        if not keep:
            return
        if len(keep) < len(rows):
            rows, slots, drafts = [rows[i] for i in keep], [slots[i] for i in keep], [drafts[i] for i in keep]
            num_listed = [num_listed[i] for i in keep]
            presence_penalty, frequency_penalty = presence_penalty[keep], frequency_penalty[keep]
            repetition_penalty = repetition_penalty[keep]
        width = max(num_listed)
        if penalties_on is None:
            penalties_on = presence_penalty.any(), frequency_penalty.any(), (repetition_penalty != 1).any()
        penalties = tuple(
            p if on else None
            for p, on in zip(
                (presence_penalty, frequency_penalty, repetition_penalty), penalties_on, strict=True
            )
        )
        if self._on_host and numpy_writable(logits) and not any(drafts):
            self._penalize_host(logits, rows, slots, width, penalties)
            return
        device = logits.device
        slot_index = torch.tensor(slots, dtype=torch.long).to(device)
        ids = self._ids[:, :width].index_select(0, slot_index)  # [R, W]; past a row's tokens: its first
        num_drafts = max(map(len, drafts))
        if num_drafts:
            valid = torch.arange(width, device=device) < torch.tensor(num_listed, device=device)[:, None]
            padded = [d + [-1] * (num_drafts - len(d)) for d in drafts]
            draft_ids = torch.tensor(padded, dtype=torch.long).to(device)  # [R, D], -1: none
            ids = torch.cat([ids, draft_ids], dim=1)
            valid = torch.cat([valid, draft_ids >= 0], dim=1)
            ids = torch.where(valid, ids, ids.gather(1, valid.to(torch.uint8).argmax(dim=1, keepdim=True)))
        counts = self._counts.view(-1).take(slot_index[:, None] * self.vocab_size + ids)
        if num_drafts:
            counts = counts + (ids[:, :, None] == draft_ids[:, None, :]).sum(dim=-1)
        apply_penalties_(
            logits,
            torch.tensor(rows, dtype=torch.long).to(device),
            ids,
            counts,
            *(None if p is None else torch.from_numpy(p).to(device) for p in penalties),
        )

    def _penalize_host(
        self, logits: torch.Tensor, rows: list[int], slots: list[int], width: int, penalties: tuple
    ) -> None:
        """`penalize_` without drafts, every array on the host: numpy over `[R, width]`."""
        ids = self._ids.numpy()[slots, :width]  # [R, W]; past a row's tokens: its first
        counts = self._counts.numpy()[np.asarray(slots)[:, None], ids]
        presence, frequency, repetition = penalties
        index = np.asarray(rows, dtype=np.int64)[:, None] * logits.shape[1] + ids
        flat = logits.numpy().reshape(-1)
        flat[index] = penalized(flat[index], counts, presence, frequency, repetition, where=np.where)

    def _reset(self, item: ScheduledRequest, slot: int | None) -> int:
        """A fresh slot for `item`'s request: nothing counted; its prompt listed under repetition penalty."""
        if slot is None:
            if not self._free:
                self._grow()
            slot = self._free.pop()
            self._slot_of[item.request_id] = slot
        request = item.request
        self._counts[slot].zero_()
        self._num_counted[slot] = 0
        self._preemptions[slot] = item.num_preemptions
        listed = self._listed[slot] = {}
        if request.sampling_params.repetition_penalty != 1:
            listed.update(dict.fromkeys(request.prompt_token_ids))
            self._ensure_width(len(listed))
            row = torch.tensor(list(listed), dtype=torch.long)
            self._ids[slot, : len(row)] = row.to(self.device)
            self._pad(slot)
        return slot

    def _pad(self, slot: int) -> None:
        """Fill the slot's columns past its listed tokens with its first one (a harmless repeat)."""
        self._ids[slot, len(self._listed[slot]) :] = self._ids[slot, 0]

    def _ensure_width(self, width: int) -> None:
        if width > self._ids.shape[1]:
            wider = torch.zeros(self._ids.shape[0], max(width, 2 * self._ids.shape[1]), dtype=torch.long)
            wider = wider.to(self.device)
            wider[:, : self._ids.shape[1]] = self._ids
            wider[:, self._ids.shape[1] :] = self._ids[:, :1]  # the padding: each slot's first token
            self._ids = wider

    def _grow(self) -> None:
        capacity = len(self._num_counted)
        self._counts = torch.cat([self._counts, torch.zeros_like(self._counts)])
        self._ids = torch.cat([self._ids, torch.zeros_like(self._ids)])
        self._num_counted.extend([0] * capacity)
        self._preemptions.extend([0] * capacity)
        self._listed.extend({} for _ in range(capacity))
        self._free = list(range(2 * capacity - 1, capacity - 1, -1))
