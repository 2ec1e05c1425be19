"""When and where a request stops: the one place for stop tokens, EOS, max_tokens and stop strings.

Two checks, both here:

* `check_stop_token` (the scheduler, per committed token): the model's EOS token (unless
  `SamplingParams.ignore_eos`), a token of `stop_token_ids` (kept in the output; `Request.stop_reason`),
  or the `max_tokens`-th output token. The scheduler commits tokens up to and including the first that
  stops.
* `OutputText.update` (the engine, per output): the request's detokenized text, incrementally
  (`models.tokenizer.IncrementalDetokenizer`), and the first occurrence of a `SamplingParams.stop`
  string, which finishes the request (FINISHED_STOPPED) with its text cut just before the stop string.

Streamed text (`OutputText.new_text`, `RequestOutput.new_text`): each output carries the text appended
since the request's previous output. It is held back while it could still change: an incomplete UTF-8
character at the end (a byte-level token can end mid-character) and a tail that could be the start of
a stop string. Once the request finishes, the rest is released, so the concatenated deltas of a request
equal its final `text`, and no delta ever contains (part of) a stop string that finished it.
"""

from __future__ import annotations

from pdcluster.engine.request import Request, RequestStatus
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.models.tokenizer import IncrementalDetokenizer, Tokenizer


def check_stop_token(request: Request, token_id: int, num_output_tokens: int) -> RequestStatus:
    """Whether committing `token_id` as the request's `num_output_tokens`-th output token (1-based, this
    token included) finishes it: FINISHED_STOPPED (EOS, a stop token id; sets `request.stop_reason` for
    the latter), FINISHED_LENGTH (`max_tokens` reached), else RUNNING."""
    params = request.sampling_params
    if token_id == request.eos_token_id and not params.ignore_eos:
        return RequestStatus.FINISHED_STOPPED
    if token_id in params.stop_token_ids:
        request.stop_reason = token_id
        return RequestStatus.FINISHED_STOPPED
    if num_output_tokens >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    return RequestStatus.RUNNING


def early_first_token_text(tokenizer: Tokenizer, params: SamplingParams, token_id: int) -> str | None:
    """The streamed text of `token_id` as a request's first output token, when the token may reach the
    client before the decode instance admits the request (`orchestrator.dispatch`: the prefill instance's
    reply carries it); None when only decode may stream it: the request has stop strings (decode may hold
    the text back or cut it) or asks for `logprobs` (decode reports them).

    Returns the text decode's first output streams for the token: an `OutputText` without stop strings
    over `[token_id]`, not finished ("" while the token ends mid-character; decode streams the character
    with the token that completes it). Decode's text for the token once finished (EOS, `max_tokens` 1)
    starts with it.
    """
    if params.stop or params.logprobs is not None:
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
    """One request's output text: incremental detokenization, stop strings, and the streamed delta.

    Attributes:
        text: the output's text so far, cut before a stop string that occurred; while unfinished its end
            may be held back from the stream (see `new_text`). After the final `update`, the final text.
        stopped: a stop string occurred (`text` ends just before it).
        num_streamed_chars: characters of `text` given out by `new_text` so far.
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._stop = stop
        self._max_stop_len = max(map(len, stop), default=0)
        self.text = ""
        self.stopped = False
        self.num_streamed_chars = 0

    @property
    def has_stop_strings(self) -> bool:
        """The request has `SamplingParams.stop` strings (its text must be checked after every step)."""
        return bool(self._stop)

    def update(self, output_token_ids: list[int], final: bool) -> bool:
        """Detokenize the committed output tokens (the whole list so far; only new ones are decoded) and
        look for stop strings. `final`: the request finished (releases an incomplete last character).

        Returns:
            `stopped`: True when a stop string occurs in the text; `text` is then cut before its first
            occurrence, the caller finishes the request (FINISHED_STOPPED), and later updates change
            nothing.
        """
        if self.stopped:
            return True
        # Text before `len(previous) - longest stop + 1` held no stop string: search only after it.
        search_from = max(0, len(self.text) - self._max_stop_len + 1)
        self.text = self._detokenizer.update(output_token_ids, final)
        stop_at = find_stop_string(self.text[search_from:], self._stop) if self._stop else None
        if stop_at is not None:
            self.text = self.text[: search_from + stop_at]
            self.stopped = True
        return self.stopped

    def new_text(self, finished: bool) -> str:
        """The text since the previous call, to stream. While unfinished, a tail that could start a stop
        string is held back (the detokenizer already holds back an incomplete character); once
        `finished`, the rest."""
        text = self.text
        if not finished:
            text = text[: len(text) - stop_prefix_len(text, self._stop)]
        delta = text[self.num_streamed_chars :]
        self.num_streamed_chars = max(self.num_streamed_chars, len(text))
        return delta
