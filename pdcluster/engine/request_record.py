"""What the engine keeps per request beside the scheduler's `Request`, and the `RequestOutput` it reports."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pdcluster.engine.outputs import RequestOutput, RequestUpdate, TokenLogprobs
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
        finish_reason = request.status.finish_reason
        finished = finish_reason is not None
        output_token_ids = request.output_token_ids
        num_output_tokens = len(output_token_ids)
        arrival_time_s, first_token_time_s = request.arrival_time_s, request.first_token_time_s
        scheduled_time_s, finished_time_s = request.first_scheduled_time_s, request.finished_time_s
        last_token_time_s = request.last_token_time_s
        output_text = self.output_text
        tpot_s = None
        if num_output_tokens > 1 and first_token_time_s is not None and last_token_time_s is not None:
            tpot_s = (last_token_time_s - first_token_time_s) / (num_output_tokens - 1)
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is not None:
            prompt_logprobs = self.finished_prompt_logprobs()
        logprobs = self.logprobs
        # positional, in `RequestOutput`'s field order: a keyword call costs twice as much per step
        return RequestOutput(
            request.request_id,
            self.prompt,
            request.prompt_token_ids,
            output_text.text,
            output_token_ids[:],
            finished,
            finish_reason,
            request.num_cached_tokens if request.num_cached_tokens > 0 else 0,
            None if scheduled_time_s is None else scheduled_time_s - arrival_time_s,
            None if first_token_time_s is None else first_token_time_s - arrival_time_s,
            tpot_s,
            None if finished_time_s is None else finished_time_s - arrival_time_s,
            request.drafts,
            request.num_preemptions,
            None if logprobs is None else logprobs[:],
            prompt_logprobs,
            request.error,
            output_text.new_text(finished),
        )


def step_outputs(
    records: dict[str, RequestRecord],
    updates: list[RequestUpdate],
    logprobs: dict[str, list[TokenLogprobs]] | None,
    stop_request: Callable[[Request], None],
    finished_output: Callable[[RequestRecord], RequestOutput],
) -> list[RequestOutput]:
    """The outputs of one step's `updates`, in their order: logprobs kept, text detokenized where it is read
    (a streamed or finished request, or one with stop strings; `stop_request` finishes a request a stop
    string ended), an output for each streamed request and, by `finished_output`, each finished one.
    """
    outputs: list[RequestOutput] = []
    for update in updates:
        record = records[update.request_id]
        request = record.request
        if logprobs and record.logprobs is not None:
            record.logprobs.extend(logprobs.get(update.request_id, [])[: len(update.new_token_ids)])
        stream, text = record.stream, record.output_text
        finished = request.status.is_finished
        if (stream or finished or text.has_stop_strings) and text.update(request.output_token_ids, finished):
            stop_request(request)
            finished = True
        if finished:
            outputs.append(finished_output(record))
        elif stream:
            outputs.append(record.output())
    return outputs
