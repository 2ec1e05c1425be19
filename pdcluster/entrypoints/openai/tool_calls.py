"""Tool calls in DeepSeek-V3's format, parsed from the generated text into OpenAI `tool_calls`:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    ARGUMENTS
    ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

(`markers_for` picks the spelling the checkpoint's template uses). Text before the first marker is `content`.
"""

from __future__ import annotations

import json
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


def _new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str, markers: ToolCallMarkers) -> tuple[str | None, list[ToolCall]]:
    """`(content, tool_calls)` of a whole output: the text before `calls_begin` (None when empty and there
    are calls), and every complete call after it. Text without the marker is all content."""
    head, found, rest = text.partition(markers.calls_begin)
    if not found:
        return text, []
    calls = [
        ToolCall(match["name"].strip(), _normalize(match["args"]), _new_id())
        for match in _call_pattern(markers).finditer(rest)
    ]
    if not calls:
        return text, []
    return head or None, calls


def _normalize(arguments: str) -> str:
    """Arguments as the model wrote them, compacted when they are JSON."""
    try:
        return json.dumps(json.loads(arguments), ensure_ascii=False, separators=(",", ":"))
    except ValueError:
        return arguments.strip()


class ToolCallStream:
    """Splits a streamed output into content deltas and whole tool calls: content until `calls_begin`
    (holding back a suffix that may start it), then each call as one delta once its `call_end` arrived."""

    def __init__(self, markers: ToolCallMarkers) -> None:
        self._markers = markers
        self._pattern = _call_pattern(markers)
        self._text = ""
        self._num_content_chars = 0
        self._in_calls = False
        self._num_parsed_chars = 0  # of the text after calls_begin
        self.num_calls = 0

    def feed(self, new_text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """`(content delta, tool-call deltas)` for `new_text`; `final`: the last text (nothing held)."""
        self._text += new_text
        content = ""
        if not self._in_calls:
            begin = self._text.find(self._markers.calls_begin, self._num_content_chars)
            if begin >= 0:
                content = self._text[self._num_content_chars : begin]
                self._in_calls = True
                self._calls_start = begin + len(self._markers.calls_begin)
            else:
                end = (
                    len(self._text) if final else len(self._text) - _partial_suffix(self._text, self._markers)
                )
                content = self._text[self._num_content_chars : end]
                self._num_content_chars = end
                return content, []
        deltas = []
        rest = self._text[self._calls_start :]
        for match in self._pattern.finditer(rest, self._num_parsed_chars):
            call = ToolCall(match["name"].strip(), _normalize(match["args"]), _new_id())
            deltas.append(call.to_openai(self.num_calls))
            self.num_calls += 1
            self._num_parsed_chars = match.end()
        return content, deltas


def _partial_suffix(text: str, markers: ToolCallMarkers) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `calls_begin`."""
    marker = markers.calls_begin
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
