"""Chat templates rendered as transformers' `apply_chat_template` renders them (transformers: test oracle
only), on the bundled checkpoint's DeepSeek-V3-style template; and tool calls parsed from its output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdcluster.entrypoints.openai.chat_template import ChatTemplate, ChatTemplateError
from pdcluster.entrypoints.openai.tool_calls import (
    ASCII_MARKERS,
    DEEPSEEK_V3_MARKERS,
    ToolCallStream,
    markers_for,
    parse_tool_calls,
)
from pdcluster.models import bundled_checkpoint_dir
from pdcluster.models.tokenizer import Tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city — °C",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "import os\n"}],
    [
        {"role": "system", "content": "S1"},
        {"role": "system", "content": "S2"},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL, CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c1", "content": "20"},
        {"role": "assistant", "content": "Sunny, 20."},
        {"role": "user", "content": "Thanks"},
    ],
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(bundled_checkpoint_dir())


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(bundled_checkpoint_dir()))


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendering_equals_transformers(
    tokenizer, hf_tokenizer, messages, tools, add_generation_prompt
) -> None:
    ours = ChatTemplate(tokenizer).render(messages, tools, add_generation_prompt)
    theirs = hf_tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert ours == theirs
    assert ours.startswith("<|bos|>") and ours.endswith("<|Assistant|>") == add_generation_prompt
    ids = tokenizer.encode(ours)
    assert ids == hf_tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1  # BOS once, one token


def test_the_tiny_markers_are_a_few_plain_tokens_that_decode_back(tokenizer) -> None:
    """The bundled vocabulary has no room for added tokens: its template spells DeepSeek-V3's markers in
    ASCII, which its BPE splits into a few tokens (not dozens of bytes, as the full-width forms) and which
    decode back to themselves."""
    for marker in ("<|User|>", "<|Assistant|>", *ASCII_MARKERS):
        ids = tokenizer.encode(marker)
        assert len(ids) <= 12 and tokenizer.decode(ids) == marker
    assert markers_for(ChatTemplate(tokenizer).template_text(with_tools=True)) == ASCII_MARKERS


def test_no_template_is_the_plain_join_and_errors_are_chat_template_errors(tokenizer, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((bundled_checkpoint_dir() / "tokenizer.json").read_bytes())
    plain = Tokenizer.from_dir(tmp_path)
    assert plain.chat_template is None and plain.bos_token_id == tokenizer.bos_token_id
    messages = [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]
    assert ChatTemplate(plain).render(messages) == "a\n\nb"
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{{ raise_exception('only user messages') }}"})
    )
    with pytest.raises(ChatTemplateError, match="only user messages"):
        ChatTemplate(Tokenizer.from_dir(tmp_path)).render(messages)


V3_OUTPUT = (
    "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
    '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n'
    '```json\n{"zone": "CET"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)


def test_deepseek_v3_tool_calls_are_parsed() -> None:
    content, calls = parse_tool_calls(V3_OUTPUT, DEEPSEEK_V3_MARKERS)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"zone": "CET"}),
    ]
    assert len({c.id for c in calls}) == 2
    assert parse_tool_calls("no calls here", DEEPSEEK_V3_MARKERS) == ("no calls here", [])
    ascii_text = V3_OUTPUT
    for v3, plain in zip(DEEPSEEK_V3_MARKERS, ASCII_MARKERS, strict=True):
        ascii_text = ascii_text.replace(v3, plain)
    assert [c.name for c in parse_tool_calls(ascii_text, ASCII_MARKERS)[1]] == ["get_weather", "get_time"]


def _accumulate(deltas: list[dict]) -> list[dict]:
    """Tool-call deltas joined per index as the openai SDK's stream helpers join them."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        call = calls.setdefault(delta["index"], {"id": None, "name": None, "arguments": ""})
        if "id" in delta:
            assert call["id"] is None  # the header comes once
            call["id"], call["name"] = delta["id"], delta["function"]["name"]
        call["arguments"] += delta["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_streamed_tool_calls_equal_the_whole_parse(piece: int) -> None:
    """First the header (index, id, name), then argument fragments as they arrive; joined, the whole parse."""
    stream = ToolCallStream(DEEPSEEK_V3_MARKERS)
    content, deltas, per_feed = "", [], []
    for i in range(0, len(V3_OUTPUT), piece):
        text, calls = stream.feed(V3_OUTPUT[i : i + piece])
        assert "<" not in text  # a possible start of the marker is held back
        headers = [d for d in calls if "name" in d.get("function", {})]
        assert all(d["function"]["arguments"] == "" for d in headers)  # a header never carries arguments
        content += text
        deltas += calls
        per_feed.append(calls)
    text, calls = stream.feed("", final=True)
    content += text
    deltas += calls
    assert content == "Let me check."
    _, whole = parse_tool_calls(V3_OUTPUT, DEEPSEEK_V3_MARKERS)
    joined = _accumulate(deltas)
    assert [(c["name"], c["arguments"]) for c in joined] == [(c.name, c.arguments) for c in whole]
    assert all(c["id"].startswith("call_") for c in joined) and joined[0]["id"] != joined[1]["id"]
    assert not any("```" in d["function"]["arguments"] for d in deltas)
    first = next(d for d in deltas if d["index"] == 0)  # even when one feed brings header and arguments
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    if piece == 1:  # the arguments arrive in fragments
        assert sum(1 for d in deltas if d["index"] == 0 and d["function"]["arguments"]) > 5
    plain = ToolCallStream(DEEPSEEK_V3_MARKERS)
    assert plain.feed("a <") == ("a ", []) and plain.feed("b", final=True) == ("<b", [])


def test_a_streamed_call_cut_short_sends_what_was_written() -> None:
    """finish_reason "length" inside the arguments: the fragments so far, the held-back suffix on final."""
    stream = ToolCallStream(DEEPSEEK_V3_MARKERS)
    cut = V3_OUTPUT[: V3_OUTPUT.index('"Paris"') + 4]
    _, deltas = stream.feed(cut)
    _, last = stream.feed("", final=True)
    assert _accumulate(deltas + last)[0]["arguments"] == '{"city": "Par'
    assert stream.num_calls == 1


def test_a_deepseek_v3_spelled_named_template_equals_transformers(tmp_path: Path) -> None:
    """The same template with DeepSeek-V3's full-width markers and BOS/EOS names, given as named templates
    ("default" and "tool_use", as transformers reads them): rendered alike, its tool-call markers found."""
    transformers = pytest.importorskip("transformers")
    source = ChatTemplate(Tokenizer.from_dir(bundled_checkpoint_dir())).template_text()
    for plain, v3 in zip(ASCII_MARKERS, DEEPSEEK_V3_MARKERS, strict=True):
        source = source.replace(plain, v3)
    source = source.replace("<|User|>", "<｜User｜>").replace("<|Assistant|>", "<｜Assistant｜>")
    (tmp_path / "tokenizer.json").write_bytes((bundled_checkpoint_dir() / "tokenizer.json").read_bytes())
    config = {
        "bos_token": {"__type": "AddedToken", "content": "<｜begin▁of▁sentence｜>", "special": True},
        "eos_token": "<｜end▁of▁sentence｜>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": [
            {"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}"},
            {"name": "tool_use", "template": source},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    ours = ChatTemplate(Tokenizer.from_dir(tmp_path))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    messages = CONVERSATIONS[2]
    rendered = ours.render(messages, TOOLS)
    assert rendered == hf.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert rendered.startswith("<｜begin▁of▁sentence｜>S1") and DEEPSEEK_V3_MARKERS.calls_begin in rendered
    assert ours.render(messages[:1]) == "<｜begin▁of▁sentence｜>S1"  # no tools: the default template
    assert markers_for(ours.template_text(with_tools=True)) == DEEPSEEK_V3_MARKERS
