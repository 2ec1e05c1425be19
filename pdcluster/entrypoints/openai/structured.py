"""What a request asks its output to match, as the engine's `(kind, spec)` grammar
(`engine.structured_output`), and tool calling's part of it.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from pdcluster.driver.backend import ServingBackend
from pdcluster.engine.structured_output import GrammarCompiler, GrammarError
from pdcluster.entrypoints.openai.protocol import ApiError, ChatCompletionRequest, CommonRequest
from pdcluster.entrypoints.openai.tool_calls import ToolCallMarkers

Grammar = tuple[str, str]  # (kind, spec) of `engine.structured_output`
_EXTENSION_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def _schema_text(value: Any, param: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ApiError(400, f"{param}: the schema is not valid JSON ({exc})", param=param) from None
    if not isinstance(value, (dict, bool)):
        raise ApiError(400, f"{param}: a JSON schema must be an object", param=param)
    return json.dumps(value)


def _extension(kind: str, value: Any, param: str) -> Grammar:
    """One of vLLM's guided_* values as a grammar."""
    if kind == "json_schema":
        return kind, _schema_text(value, param)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise ApiError(400, f"{param} must be a non-empty list of strings", param=param)
        return kind, json.dumps(value)
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"{param} must be a non-empty string", param=param)
    return kind, value


def _response_format(value: dict[str, Any]) -> Grammar | None:
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object", ""
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ApiError(
                400, "response_format.json_schema must be an object with a schema", param="response_format"
            )
        return "json_schema", _schema_text(spec["schema"], "response_format.json_schema.schema")
    raise ApiError(
        400,
        f"response_format.type must be text, json_object or json_schema, got {kind!r}",
        param="response_format",
    )


def requested_grammar(body: CommonRequest, markers: ToolCallMarkers) -> tuple[Grammar | None, str | None]:
    """`(grammar, the field it came from)`, `(None, None)` when the output is free.

    Raises ApiError: 400 naming the field: two sources, a malformed value, a named tool that is not in
        `tools`, tool_choice without tools.
    """
    found: list[tuple[Grammar, str]] = []
    if body.response_format is not None:
        grammar = _response_format(body.response_format)
        if grammar is not None:
            found.append((grammar, "response_format"))
    for kind, name in (
        ("json_schema", "json"),
        ("regex", "regex"),
        ("choice", "choice"),
        ("grammar", "grammar"),
    ):
        value = getattr(body, f"guided_{name}")
        if value is not None:
            found.append((_extension(kind, value, f"guided_{name}"), f"guided_{name}"))
    for name, value in (body.structured_outputs or {}).items():
        if name in _EXTENSION_KINDS and value is not None:
            param = f"structured_outputs.{name}"
            found.append((_extension(_EXTENSION_KINDS[name], value, param), param))
    if isinstance(body, ChatCompletionRequest):
        grammar = tool_grammar(body, markers)
        if grammar is not None:
            found.append((grammar, "tool_choice"))
    if len(found) > 1:
        names = " and ".join(param for _, param in found)
        raise ApiError(400, f"ask for one structured output at a time, got {names}", param=found[1][1])
    return found[0] if found else (None, None)


def tool_grammar(body: ChatCompletionRequest, markers: ToolCallMarkers) -> Grammar | None:
    """The grammar of `tool_choice` "required" or named; None for "auto", "none" or no tools."""
    choice = body.tool_choice
    tools = body.tools or []
    if choice is None or choice in ("auto", "none"):
        return None
    if not tools:
        raise ApiError(400, "tool_choice needs tools", param="tool_choice")
    if choice == "required":
        chosen = tools
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        chosen = [t for t in tools if t.function.name == name]
        if not chosen:
            raise ApiError(
                400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice"
            )
    else:
        raise ApiError(
            400,
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name"}}',
            param="tool_choice",
        )
    spec = {
        "markers": list(markers),
        "tools": [{"name": t.function.name, "parameters": t.function.parameters} for t in chosen],
    }
    return "tool_calls", json.dumps(spec)


class EdgeGrammars:
    """Compiles requested grammars at the edge (compiled ones cached), so a bad one is a 400 before the
    request reaches an engine. xgrammar is loaded at the first structured request."""

    def __init__(self, backend: ServingBackend) -> None:
        self._backend = backend
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    def check(self, grammar: Grammar, param: str) -> None:
        """Raises ApiError 400 naming `param` and the reason when `grammar` does not compile. Blocking."""
        with self._lock:
            if self._compiler is None:
                vocab_size = getattr(self._backend, "vocab_size", None) or self._backend.tokenizer.vocab_size
                self._compiler = GrammarCompiler(self._backend.tokenizer, vocab_size)
        try:
            self._compiler.compile(grammar)
        except GrammarError as exc:
            raise ApiError(400, f"{param}: {exc}", param=param) from None
        except ValueError as exc:  # a spec the compiler could not read (malformed JSON schema text)
            raise ApiError(400, f"{param}: {grammar[0]} does not compile: {exc}", param=param) from None
