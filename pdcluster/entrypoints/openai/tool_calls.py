"""Tool calls in DeepSeek-V3's format, parsed from the generated text into OpenAI `tool_calls`:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    ARGUMENTS
    ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

(`markers_for` picks the spelling the checkpoint's template uses). Text before the first marker is `content`.
"""

from __future__ import annotations

import re
import uuid
from typing import Any, NamedTuple


class ToolCallMarkers(NamedTuple):
    calls_begin: str
    call_begin: str
    sep: str
    call_end: str
    calls_end: str


DEEPSEEK_V3_MARKERS = ToolCallMarkers(
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>",
)
ASCII_MARKERS = ToolCallMarkers(
    "<|tool_calls_begin|>", "<|tool_call_begin|>", "<|tool_sep|>", "<|tool_call_end|>", "<|tool_calls_end|>"
)


def markers_for(template: str | None) -> ToolCallMarkers:
    """The markers `template` writes (DeepSeek-V3's unless it writes the ASCII ones)."""
    if template and ASCII_MARKERS.calls_begin in template and DEEPSEEK_V3_MARKERS.calls_begin not in template:
        return ASCII_MARKERS
    return DEEPSEEK_V3_MARKERS


class ToolCall(NamedTuple):
    name: str
    arguments: str  # JSON text, as OpenAI's `function.arguments`
    id: str

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def _call_pattern(m: ToolCallMarkers) -> re.Pattern[str]:
    return re.compile(
        re.escape(m.call_begin)
        + r"(?P<type>.*?)"
        + re.escape(m.sep)
        + r"(?P<name>[^\n]*)\n```(?:json)?\n(?P<args>.*?)\n```"
        + re.escape(m.call_end),
        re.DOTALL,
    )


def _header_pattern(m: ToolCallMarkers) -> re.Pattern[str]:
    """A call up to its arguments: `call_begin TYPE sep NAME` and the opening fence."""
    return re.compile(
        re.escape(m.call_begin) + r"(?P<type>.*?)" + re.escape(m.sep) + r"(?P<name>[^\n]*)\n```(?:json)?\n",
        re.DOTALL,
    )


def _new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str, markers: ToolCallMarkers) -> tuple[str | None, list[ToolCall]]:
    """`(content, tool_calls)` of a whole output: the text before `calls_begin` (None when empty and there
    are calls), and every complete call after it, its arguments as the model wrote them (stripped). Text
    without the marker is all content."""
    head, found, rest = text.partition(markers.calls_begin)
    if not found:
        return text, []
    calls = [
        ToolCall(match["name"].strip(), match["args"].strip(), _new_id())
        for match in _call_pattern(markers).finditer(rest)
    ]
    if not calls:
        return text, []
    return head or None, calls


class ToolCallStream:
    """Splits a streamed output into content deltas and tool-call deltas the way OpenAI streams them: content
    until `calls_begin` (holding back a suffix that may start it); then per call one delta with its `index`,
    `id`, `type` and `function.name` (arguments "") once its header is complete, then `function.arguments`
    fragments as they arrive (a suffix that may start the closing fence held back). Joined, a call's
    fragments are `parse_tool_calls`' arguments of the whole text."""

    def __init__(self, markers: ToolCallMarkers) -> None:
        self._markers = markers
        self._header = _header_pattern(markers)
        self._closing = "\n```" + markers.call_end
        self._text = ""
        self._num_content_chars = 0
        self._calls_start = -1  # index in the text after calls_begin; -1: not seen yet
        self._pos = 0  # of the text after calls_begin: parsed up to here
        self._args_start = -1  # of the call in progress; -1: between calls
        self._sent_args = False  # of the call in progress
        self.num_calls = 0  # calls whose header was sent

    def feed(self, new_text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """`(content delta, tool-call deltas)` for `new_text`: a call's header delta (arguments "") and its
        arguments' delta are separate entries, even when one text brings both; `final`: the last text."""
        self._text += new_text
        content = ""
        if self._calls_start < 0:
            begin = self._text.find(self._markers.calls_begin, self._num_content_chars)
            if begin < 0:
                end = len(self._text)
                if not final:
                    end -= _partial_suffix(self._text, self._markers.calls_begin)
                content = self._text[self._num_content_chars : end]
                self._num_content_chars = end
                return content, []
            content = self._text[self._num_content_chars : begin]
            self._calls_start = begin + len(self._markers.calls_begin)
        rest = self._text[self._calls_start :]
        deltas: dict[tuple[int, str], dict[str, Any]] = {}  # (call index, "header" | "arguments")
        while True:
            if self._args_start < 0:
                header = self._header.search(rest, self._pos)
                if header is None:
                    break
                call = ToolCall(header["name"].strip(), "", _new_id())
                deltas[self.num_calls, "header"] = call.to_openai(self.num_calls)
                self.num_calls += 1
                self._args_start = self._pos = header.end()
                self._sent_args = False
            close = rest.find(self._closing, self._args_start)
            end = close if close >= 0 else len(rest)
            if close < 0 and not final:
                end -= _partial_suffix(rest[self._pos :], self._closing)
            fragment = rest[self._pos : end]
            if not self._sent_args:
                fragment = fragment.lstrip()
            fragment = fragment.rstrip()  # trailing whitespace waits for what follows it
            if fragment:
                self._sent_args = True
                index = self.num_calls - 1
                delta = deltas.setdefault(
                    (index, "arguments"), {"index": index, "function": {"arguments": ""}}
                )
                delta["function"]["arguments"] += fragment
                self._pos = rest.index(fragment, self._pos) + len(fragment)
            if close < 0:
                break
            self._pos = close + len(self._closing)
            self._args_start = -1
            self._sent_args = False
        return content, list(deltas.values())


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
