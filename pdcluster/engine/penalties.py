"""Presence, frequency and repetition penalties from per-request token counts kept across steps (as vLLM v1's
sampler and SGLang's penalizer orchestrator keep them), updated with each step's new output tokens only.
"""

from __future__ import annotations

from collections.abc import Callable, KeysView

import numpy as np
import torch

from pdcluster.engine.outputs import ScheduledRequest
from pdcluster.kernels.sampling import apply_penalties

# `(item, start)` -> the request's output tokens before this step's inputs end, from output index `start` on.
OutputHistory = Callable[[ScheduledRequest, int], list[int]]


class PenaltyCounts:
    """Output-token counts `[slots, V]` float32 and prompt presence `[slots, V]` bool of the requests with a
    penalty, one slot each, taken on first sight and counted from its whole output history then; later steps
    add only the tokens that history gained. A slot is reset when its request is dropped (finished, aborted,
    preempted) or comes back preempted since, so it always equals a recount of the history.
    """

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu", capacity: int = 8) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._counts = torch.zeros(capacity, vocab_size, dtype=torch.float32, device=self.device)
        self._prompt = torch.zeros(capacity, vocab_size, dtype=torch.bool, device=self.device)
        self._slot_of: dict[str, int] = {}
        # per slot: (output tokens counted, the request's num_preemptions when they were)
        self._counted: list[tuple[int, int]] = [(0, 0)] * capacity
        self._free = list(range(capacity - 1, -1, -1))

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

    def counts(self, request_id: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The request's output-token counts `[V]` float32 and prompt presence `[V]` bool (views), if held."""
        slot = self._slot_of.get(request_id)
        return None if slot is None else (self._counts[slot], self._prompt[slot])

    def update(self, items: list[ScheduledRequest], history: OutputHistory) -> tuple[list[int], list[int]]:
        """Bring the slots of `items` up to their output histories; returns each item's slot and number of
        output tokens before this step's inputs end.
        """
        slots: list[int] = []
        lengths: list[int] = []
        new_slots: list[int] = []
        new_ids: list[int] = []
        for item in items:
            request = item.request
            slot = self._slot_of.get(item.request_id)
            counted, preemptions = (0, -1) if slot is None else self._counted[slot]
            if slot is None or preemptions != item.num_preemptions:
                slot = self._take(item.request_id) if slot is None else slot
                counted = 0
                self._counts[slot].zero_()
                self._prompt[slot].zero_()
                if request.sampling_params.repetition_penalty != 1:
                    prompt = torch.tensor(request.prompt_token_ids, dtype=torch.long, device=self.device)
                    self._prompt[slot, prompt] = True
            new = history(item, counted)
            if new:
                new_slots.extend([slot] * len(new))
                new_ids.extend(new)
                counted += len(new)
            self._counted[slot] = (counted, item.num_preemptions)
            slots.append(slot)
            lengths.append(counted)
        if new_ids:
            index = torch.tensor([new_slots, new_ids], dtype=torch.long).to(self.device)
            self._counts.index_put_(
                (index[0], index[1]), torch.ones(len(new_ids), device=self.device), accumulate=True
            )
        return slots, lengths

    def penalize(
        self,
        logits: torch.Tensor,
        slots: list[int],
        drafts: list[list[int]],
        presence_penalty: np.ndarray,
        frequency_penalty: np.ndarray,
        repetition_penalty: np.ndarray,
    ) -> torch.Tensor:
        """`logits` `[R, V]` float32 penalised (a new tensor, `kernels.sampling.apply_penalties`): row r by
        slot `slots[r]`'s counts plus `drafts[r]`, the drafts before its position; penalties `[R]` float32.
        """
        device = logits.device
        index = torch.tensor(slots, dtype=torch.long).to(device)
        counts = self._counts.index_select(0, index)  # [R, V]
        if any(drafts):
            rows = [r for r, ids in enumerate(drafts) for _ in ids]
            ids = [token for ids in drafts for token in ids]
            counts.index_put_(
                (torch.tensor(rows, device=device), torch.tensor(ids, device=device)),
                torch.ones(len(ids), device=device),
                accumulate=True,
            )
        repetition = (repetition_penalty != 1).any()
        return apply_penalties(
            logits,
            counts,
            self._prompt.index_select(0, index) if repetition else None,
            _tensor_if_any(presence_penalty, presence_penalty.any(), device),
            _tensor_if_any(frequency_penalty, frequency_penalty.any(), device),
            _tensor_if_any(repetition_penalty, repetition, device),
        )

    def _take(self, request_id: str) -> int:
        if not self._free:
            capacity = len(self._counted)
            self._counts = torch.cat([self._counts, torch.zeros_like(self._counts)])
            self._prompt = torch.cat([self._prompt, torch.zeros_like(self._prompt)])
            self._counted.extend([(0, 0)] * capacity)
            self._free = list(range(2 * capacity - 1, capacity - 1, -1))
        slot = self._free.pop()
        self._slot_of[request_id] = slot
        return slot


def _tensor_if_any(values: np.ndarray, any_on: bool, device: torch.device) -> torch.Tensor | None:
    return torch.from_numpy(values).to(device) if any_on else None
