"""When and where a request stops: the one place for stop tokens, EOS, max_tokens and stop strings."""

from __future__ import annotations

from pdcluster.engine.request import Request, RequestStatus
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.models.tokenizer import IncrementalDetokenizer, Tokenizer


def check_stop_token(request: Request, token_id: int, num_output_tokens: int) -> RequestStatus:
    """Whether committing `token_id` as the request's `num_output_tokens`-th output token (1-based, this token
    included) finishes it: FINISHED_STOPPED (EOS, a stop token id; sets `request.stop_reason` for the
    latter), FINISHED_LENGTH (`max_tokens` reached), else RUNNING. A structured request's grammar allows EOS
    only once it is complete: its EOS stops it even under `ignore_eos` (no free text past the grammar).
    """
    params = request.sampling_params
    if token_id == request.eos_token_id and (not params.ignore_eos or params.structured_output is not None):
        return RequestStatus.FINISHED_STOPPED
    if token_id in params.stop_token_ids:
        request.stop_reason = token_id
        return RequestStatus.FINISHED_STOPPED
    if num_output_tokens >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    return RequestStatus.RUNNING


def early_first_token_text(tokenizer: Tokenizer, params: SamplingParams, token_id: int) -> str | None:
    """The streamed text of `token_id` as a request's first output token, when the token may reach the client
    before the decode instance admits the request (`driver.dispatch`: the prefill call's first reply
    carries it); None when only decode may stream it: stop strings (decode may hold the text back or cut
    it), `logprobs` (decode reports them), `prompt_logprobs` (prefill's last reply brings them).
    """
    if params.stop or params.logprobs is not None or params.prompt_logprobs is not None:
        return None
    text = OutputText(tokenizer)
    text.update([token_id], final=False)
    return text.new_text(finished=False)


def find_stop_string(text: str, stop: tuple[str, ...]) -> int | None:
    """Index in `text` of the earliest occurrence of any of the `stop` strings, None if none occurs."""
    hits = [text.find(s) for s in stop if s in text]
    return min(hits) if hits else None


def stop_prefix_len(text: str, stop: tuple[str, ...]) -> int:
    """Characters at the end of `text` that could be the start of a stop string (0 without one)."""
    best = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class OutputText:
    """One request's output text: incremental detokenization, stop strings, and the streamed delta."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._stop = stop
        self._max_stop_len = max(map(len, stop), default=0)
        self.text = ""
        self.stopped = False
        self.num_streamed_chars = 0
        # The request has `SamplingParams.stop` strings (its text must be checked after every step).
        self.has_stop_strings = bool(stop)

    def update(self, output_token_ids: list[int], final: bool) -> bool:
        """Detokenize the committed output tokens (the whole list so far; only new ones are decoded) and look
        for stop strings.
        """
        if self.stopped:
            return True
        if not self._stop:
            self.text = self._detokenizer.update(output_token_ids, final)
            return False
        # Text before `len(previous) - longest stop + 1` held no stop string: search only after it.
        search_from = max(0, len(self.text) - self._max_stop_len + 1)
        self.text = self._detokenizer.update(output_token_ids, final)
        stop_at = find_stop_string(self.text[search_from:], self._stop)
        if stop_at is not None:
            self.text = self.text[: search_from + stop_at]
            self.stopped = True
        return self.stopped

    def new_text(self, finished: bool) -> str:
        """The text since the previous call, to stream."""
        text = self.text
        if not finished and self._stop:
            text = text[: len(text) - stop_prefix_len(text, self._stop)]
        delta = text[self.num_streamed_chars :]
        self.num_streamed_chars = max(self.num_streamed_chars, len(text))
        return delta
