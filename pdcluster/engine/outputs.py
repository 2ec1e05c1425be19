"""Plain data passed between the scheduler, the model runner and the engine loop each step.

Scheduler.schedule() -> SchedulerOutput -> model runner -> ModelRunnerOutput
    -> Scheduler.update_from_output(...) -> list[RequestUpdate] -> engine loop -> RequestOutput -> API
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from pdcluster.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    import torch

    from pdcluster.engine.input_batch import ScheduledRows

# Stands in `ScheduledRequest.token_ids` for a token sampled by the step still in flight (asynchronous
# scheduling); the executor replaces it with that step's sample before the forward.
PLACEHOLDER_TOKEN_ID = -1


class ScheduledRequest(NamedTuple):
    """One request's share of a step, for the model runner. Its input token ids are not stored here:
    the executor packs them from the scheduler's persistent rows (`SchedulerOutput.rows`); `token_ids`
    and `slot_mapping` rebuild them per request, for checks and tests.

    Attributes:
        request: the request (read-only for the runner; `sampling_params`, `request_id`).
        start_position: position of the first input: the request's computed tokens before this step.
        num_scheduled_tokens: inputs this step, at positions `start_position ..`: committed tokens, then
            `num_placeholders` placeholders, then `spec_token_ids`.
        spec_token_ids: the draft tokens among them (the tail of the inputs), to verify.
        block_ids: the request's block table after this step's allocation; the step's KV goes to
            positions `[start_position, start_position + num_scheduled_tokens)`.
        samples: the step reaches the end of the committed tokens, so it yields tokens: logits at the
            last `len(spec_token_ids) + 1` inputs. False for a prefill chunk that is not the last.
        num_preemptions: the request's preemption count when scheduled; a result for an earlier
            incarnation (preempted since, then readmitted) is discarded.
        num_placeholders: inputs that are `PLACEHOLDER_TOKEN_ID` (asynchronous scheduling): the token the
            previous, still running step samples for this request; they precede the drafts.
    """

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
        """`[num_scheduled_tokens]` the inputs as scheduled: committed tokens, placeholders, drafts (a
        fresh list, built on each call; the committed part is read from `request.all_token_ids`, whose
        committed prefix never changes)."""
        num_committed = self.num_scheduled_tokens - self.num_placeholders - len(self.spec_token_ids)
        start = self.start_position
        committed = self.request.all_token_ids[start : start + num_committed]
        return committed + [PLACEHOLDER_TOKEN_ID] * self.num_placeholders + list(self.spec_token_ids)

    def slot_mapping(self, block_size: int) -> list[int]:
        """`[num_scheduled_tokens]` cache slot `block_id * block_size + offset` of each input.

        Raises:
            IndexError: `block_ids` does not cover the inputs' positions.
        """
        start = self.start_position
        blocks = self.block_ids
        return [
            blocks[p // block_size] * block_size + p % block_size
            for p in range(start, start + self.num_scheduled_tokens)
        ]


@dataclass(frozen=True)
class SchedulerOutput:
    """What one step runs.

    Attributes:
        scheduled: per scheduled request, in batch order (decodes, prefill chunks, admissions).
        num_scheduled_tokens: request id -> tokens computed this step.
        total_num_scheduled_tokens: their sum (<= max_num_batched_tokens).
        new_request_ids: requests admitted this step (new or resumed after preemption).
        preempted_request_ids: requests preempted this step; the runner drops their per-request state.
        finished_request_ids: requests finished or aborted since the previous step; the runner drops
            their per-request state.
        rows: `scheduled` as rows of the scheduler's persistent batch (`engine.input_batch`), what the
            executor packs; None when nothing is scheduled.
    """

    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    new_request_ids: list[str]
    preempted_request_ids: list[str]
    finished_request_ids: list[str]
    rows: ScheduledRows | None = None


class TokenLogprobs(NamedTuple):
    """Log-probabilities of one output token under the distribution it was sampled from: `log_softmax` of
    the target model's logits at its position after logit_bias, penalties and min_tokens, divided by the
    temperature (1 when greedy), before top-k/top-p (`engine.sampler.token_logprobs`).

    Attributes:
        token_id: the output token.
        logprob: its log-probability.
        rank: 1 + the number of tokens with a strictly larger log-probability.
        top_token_ids: the `SamplingParams.logprobs` most likely tokens, most likely first.
        top_logprobs: their log-probabilities.
    """

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class RequestOutput:
    """The result of one request, as of one `LLMEngine.step()` (or `pop_finished_outputs`).

    `text` is the output's text so far (cumulative), cut before the first stop string; `new_text` is what
    this output adds to the request's stream: the text since the request's previous output, held back
    while it could still change (an incomplete UTF-8 character, a tail that could start a stop string;
    see `engine.stopping`). The `new_text` of all of a request's outputs concatenate to its final `text`.

    Times are seconds on the engine's monotonic clock: `ttft_s` arrival -> first token, `tpot_s` mean gap
    between later tokens, `queue_s` arrival -> first scheduled. `acceptance_rate` is accepted / proposed
    draft tokens (None without speculative decoding); the per-position lists count each draft depth.
    `logprobs`: one `TokenLogprobs` per output token when `SamplingParams.logprobs` is set, else None.
    """

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
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_draft_tokens_per_position: list[int] = field(default_factory=list)
    num_accepted_tokens_per_position: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None  # finish_reason "error": why the request failed
    new_text: str = ""

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None


@dataclass(frozen=True)
class ModelRunnerOutput:
    """What the model runner (with the sampler and the MTP drafter) returns for a step.

    Attributes:
        sampled_token_ids: request id -> the accepted draft tokens followed by one sampled (bonus or
            recovered) token, for each request whose `ScheduledRequest.samples` is True. Requests in the
            middle of a prefill may be absent; tokens given for them are ignored.
        spec_token_ids: request id -> draft tokens proposed for the next step (empty without MTP).
        draft_probs: request id -> `[num_drafts, vocab_size]` float32 MTP probabilities of sampled drafts
            (None for greedy drafts), for requests with `Request.export_kv` whose step sampled (a prefill
            to hand off to decode).
        logprobs: request id -> one `TokenLogprobs` per token of `sampled_token_ids`, for requests whose
            `SamplingParams.logprobs` is not None. With speculative decoding, an accepted draft's come from
            the verification forward's target logits at its position.
        failed: request id -> why its tokens could not be produced (an exception while sampling,
            verifying or drafting for that request alone). The scheduler finishes it with FINISHED_ERROR;
            the step's other requests are unaffected. Tokens given for it are ignored.
    """

    sampled_token_ids: dict[str, list[int]]
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    draft_probs: dict[str, torch.Tensor | None] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


class RequestUpdate(NamedTuple):
    """New committed tokens of one request after a step.

    Attributes:
        request_id: the request.
        new_token_ids: tokens committed this step (truncated at a stop token or at max_tokens).
        status: RUNNING, or the finished status when this step finished the request.
    """

    request_id: str
    new_token_ids: list[int]
    status: RequestStatus

    @property
    def finished(self) -> bool:
        return self.status.is_finished
