"""Plain data passed between the scheduler, the model runner and the engine loop each step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from pdcluster.engine.request import DraftCounts, Request, RequestStatus

if TYPE_CHECKING:
    import torch

    from pdcluster.engine.input_batch import ScheduledRows

PLACEHOLDER_TOKEN_ID = -1


class ScheduledRequest(NamedTuple):
    """One request's share of a step, for the model runner."""

    request: Request
    start_position: int
    num_scheduled_tokens: int
    spec_token_ids: list[int]
    block_ids: list[int]
    samples: bool
    num_preemptions: int = 0
    num_placeholders: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def token_ids(self) -> list[int]:
        """`[num_scheduled_tokens]` the inputs as scheduled: committed tokens, placeholders, drafts (a fresh
        list, built on each call; the committed part is read from `request.all_token_ids`, whose committed
        prefix never changes).
        """
        num_committed = self.num_scheduled_tokens - self.num_placeholders - len(self.spec_token_ids)
        start = self.start_position
        committed = self.request.all_token_ids[start : start + num_committed]
        return committed + [PLACEHOLDER_TOKEN_ID] * self.num_placeholders + list(self.spec_token_ids)

    def slot_mapping(self, block_size: int) -> list[int]:
        """`[num_scheduled_tokens]` cache slot `block_id * block_size + offset` of each input.
        Raises IndexError: `block_ids` does not cover the inputs' positions."""
        start = self.start_position
        blocks = self.block_ids
        return [
            blocks[p // block_size] * block_size + p % block_size
            for p in range(start, start + self.num_scheduled_tokens)
        ]


@dataclass(frozen=True)
class SchedulerOutput:
    """What one step runs."""

    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    new_request_ids: list[str]
    preempted_request_ids: list[str]
    finished_request_ids: list[str]
    rows: ScheduledRows | None = None


class TokenLogprobs(NamedTuple):
    """Log-probabilities of one output token under the distribution it was sampled from: `log_softmax` of the
    target model's logits at its position after logit_bias, penalties and min_tokens, divided by the
    temperature (1 when greedy), before top-k/top-p (`engine.sampler.token_logprobs`).
    """

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class RequestOutput:
    """The result of one request, as of one `LLMEngine.step()` (or `pop_finished_outputs`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int = 0
    queue_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    drafts: DraftCounts = DraftCounts()
    num_preemptions: int = 0
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # [num_prompt_tokens], None at index 0
    error: str | None = None
    new_text: str = ""

    @property
    def acceptance_rate(self) -> float | None:
        return self.drafts.acceptance_rate


@dataclass(frozen=True)
class ModelRunnerOutput:
    """What the model runner (with the sampler and the MTP drafter) returns for a step.

    draft_probs: request id -> `[num_drafts, vocab_size]` float32 MTP probabilities of sampled drafts
    """

    sampled_token_ids: dict[str, list[int]]
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    draft_probs: dict[str, torch.Tensor | None] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    # request id -> (first prompt index scored, entries): `engine.prompt_logprobs.PromptLogprobs`
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)


class RequestUpdate(NamedTuple):
    """New committed tokens of one request after a step."""

    request_id: str
    new_token_ids: list[int]
    status: RequestStatus

    @property
    def finished(self) -> bool:
        return self.status.is_finished
