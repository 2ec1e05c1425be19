"""What the engine keeps per request beside the scheduler's `Request`, and the `RequestOutput` it reports."""

from __future__ import annotations

from dataclasses import dataclass

from pdcluster.engine.outputs import RequestOutput, TokenLogprobs
from pdcluster.engine.remote_prefill import PrefillOutput
from pdcluster.engine.request import Request
from pdcluster.engine.stopping import OutputText


@dataclass(eq=False)
class RequestRecord:
    """What the engine keeps for one request beside the scheduler's `Request`, from `add_request` (or
    admission after a remote prefill) until its final output.
    """

    request: Request
    prompt: str | None
    output_text: OutputText
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # index j: prompt token j (None at 0)
    prefill_result: PrefillOutput | None = None
    stream: bool = True

    def finished_prompt_logprobs(self) -> list[TokenLogprobs | None] | None:
        """The prompt logprobs once every prompt token is scored; None before, or when none were asked."""
        have = self.prompt_logprobs
        if have is None or len(have) < len(self.request.prompt_token_ids):
            return None
        return list(have)

    def output(self) -> RequestOutput:
        """The request's `RequestOutput` now; takes the text streamed since the previous one
        (`OutputText.new_text`), so call it once per output reported.
        """
        request = self.request
        status = request.status
        finish_reason = status.finish_reason
        finished = finish_reason is not None
        output_token_ids = request.output_token_ids
        arrival_time_s, first_token_time_s = request.arrival_time_s, request.first_token_time_s
        scheduled_time_s, finished_time_s = request.first_scheduled_time_s, request.finished_time_s
        output_text = self.output_text
        tpot_s = None
        if (
            len(output_token_ids) > 1
            and first_token_time_s is not None
            and request.last_token_time_s is not None
        ):
            tpot_s = (request.last_token_time_s - first_token_time_s) / (len(output_token_ids) - 1)
        return RequestOutput(
            request_id=request.request_id,
            prompt=self.prompt,
            prompt_token_ids=request.prompt_token_ids,
            text=output_text.text,
            new_text=output_text.new_text(finished=finished),
            token_ids=list(output_token_ids),
            finished=finished,
            finish_reason=finish_reason,
            num_cached_tokens=max(0, request.num_cached_tokens),
            queue_s=None if scheduled_time_s is None else scheduled_time_s - arrival_time_s,
            ttft_s=None if first_token_time_s is None else first_token_time_s - arrival_time_s,
            tpot_s=tpot_s,
            e2e_s=None if finished_time_s is None else finished_time_s - arrival_time_s,
            num_draft_tokens=request.num_draft_tokens,
            num_accepted_tokens=request.num_accepted_tokens,
            num_draft_tokens_per_position=list(request.num_draft_tokens_per_position),
            num_accepted_tokens_per_position=list(request.num_accepted_tokens_per_position),
            num_preemptions=request.num_preemptions,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            prompt_logprobs=self.finished_prompt_logprobs(),
            error=request.error,
        )
