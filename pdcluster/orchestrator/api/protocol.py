"""The OpenAI wire format at the edge: request schemas (pydantic), their validation, error bodies and the
response bodies of /v1/completions and /v1/chat/completions (whole and streamed chunks).

Errors are OpenAI-style bodies `{"error": {"message", "type", "param", "code"}}` (`error_response`);
`ApiError` is what the routes and the edge bookkeeping raise to answer one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from pdcluster.models.tokenizer import check_unicode

if TYPE_CHECKING:
    from pdcluster.orchestrator.api.generation import Generation

MAX_STOP_STRINGS = 16
RETRY_AFTER_S = 1  # the Retry-After header (seconds) of a 429 (edge full) and of a 503 (backend unavailable)


# ---- request schemas (pydantic at the edge) -------------------------------------------------------------
def _check_unicode(value: Any) -> Any:
    """Field validator: `value` (a str, or a list whose str items are checked) unchanged when all its text
    is valid Unicode; a lone surrogate raises `models.tokenizer.check_unicode`'s ValueError, which
    pydantic turns into a 400 naming the field (before tokenization)."""
    for text in value if isinstance(value, list) else [value]:
        if isinstance(text, str):
            check_unicode(text)
    return value


# Every request model validates strictly: a JSON value of the wrong type is a 400 naming the field, never
# converted ("10" is not max_tokens 10, true is not token id 1, 1e30 is not an integer). A JSON integer is
# still a valid float (temperature: 1).
STRICT = ConfigDict(extra="ignore", strict=True)  # extra: OpenAI clients send fields we do not use (user)


class StreamOptions(BaseModel):
    """OpenAI `stream_options`: `include_usage` adds a last chunk with an empty `choices` list carrying
    `usage`, before `data: [DONE]` (what vLLM's and SGLang's clients, `vllm bench serve` among them, read
    the completion token count from)."""

    model_config = STRICT

    include_usage: bool = False


class CommonRequest(BaseModel):
    """The fields /v1/completions and /v1/chat/completions share (sampling, stop strings, streaming)."""

    model_config = STRICT

    model: str | None = Field(None, description="the served model's id (GET /v1/models); None: that one")
    max_tokens: int | None = Field(
        None, description="output tokens at most; None: 16 (completions) or the rest of the context (chat)"
    )
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = Field(0, description="extension: keep the k most likely tokens; 0 or -1 disables")
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = Field(False, description="extension: generate past EOS (benchmarks)")
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # read only to refuse them (`reject_unsupported`): accepted silently, they would be ignored
    logit_bias: dict[str, Any] | None = None
    # structured output (`api.structured`): OpenAI's, and vLLM's extensions
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    _check_stop = field_validator("stop")(_check_unicode)


class CompletionRequest(CommonRequest):
    prompt: str | list[int] = Field(..., description="text, or token ids of the served model's tokenizer")
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    _check_prompt = field_validator("prompt")(_check_unicode)


class TextPart(BaseModel):
    """One part of a message's `content` in OpenAI's list form (what current OpenAI SDKs send); only text
    parts: an image or audio part is a 400 naming it."""

    model_config = STRICT

    type: Literal["text"]
    text: str

    _check_text = field_validator("text")(_check_unicode)


class FunctionCall(BaseModel):
    model_config = STRICT

    name: str
    arguments: str  # JSON text


class ToolCallIn(BaseModel):
    """A tool call of an earlier assistant message (OpenAI's `tool_calls` item)."""

    model_config = STRICT

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """A chat message; `content` is a string or a list of text parts, joined with "\n" as vLLM joins
    them; None for an assistant message that only calls tools."""

    model_config = STRICT

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    _check_content = field_validator("content")(_check_unicode)

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template reads it (`content` a string)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


class FunctionDefinition(BaseModel):
    model_config = STRICT

    name: str = Field(..., min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: FunctionDefinition


class ChatCompletionRequest(CommonRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    add_generation_prompt: bool = Field(
        True, description="extension: end the prompt with the assistant's turn"
    )


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize body: `prompt` (completions form) or `messages` (chat form, through the template)."""

    model_config = STRICT

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None

    _check_prompt = field_validator("prompt")(_check_unicode)


class DetokenizeRequest(BaseModel):
    model_config = STRICT

    model: str | None = None
    tokens: list[int]


def reject_unsupported(body: CompletionRequest | ChatCompletionRequest) -> None:
    """Refuse the OpenAI options this server does not implement (n != 1, penalties, logprobs, echo, best_of,
    logit_bias, suffix), rather than ignore them.

    Raises:
        ApiError: 400 naming the option (`param`).
    """
    if body.n != 1:
        raise ApiError(
            400, f"n must be 1 (got {body.n}): this server returns one choice per request", param="n"
        )
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) != 0:
            raise ApiError(400, f"{name} is not supported by this server (must be 0)", param=name)
    if body.logit_bias:
        raise ApiError(400, "logit_bias is not supported by this server", param="logit_bias")
    if isinstance(body, ChatCompletionRequest):
        if body.logprobs or body.top_logprobs is not None:
            raise ApiError(400, "logprobs is not supported by this server", param="logprobs")
        return
    if body.suffix:
        raise ApiError(400, "suffix is not supported by this server", param="suffix")
    if body.logprobs is not None:
        raise ApiError(400, "logprobs is not supported by this server", param="logprobs")
    if body.echo:
        raise ApiError(400, "echo is not supported by this server", param="echo")
    if body.best_of not in (None, 1):
        raise ApiError(
            400, f"best_of must be 1 (got {body.best_of}): one completion per request", param="best_of"
        )


# ---- errors -----------------------------------------------------------------------------------------------
class ApiError(Exception):
    """Answered as an OpenAI-style error body with `status_code` (`response()`)."""

    def __init__(
        self, status_code: int, message: str, type_: str = "invalid_request_error", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type_
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.status_code)

    def response(self) -> JSONResponse:
        """The error body; 429 and 503 (worth retrying) carry `Retry-After: RETRY_AFTER_S`."""
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.status_code in (429, 503) else None
        return error_response(self.status_code, self.message, self.type, self.param, headers)


def error_body(message: str, type_: str, param: str | None, code: int) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}`, `code` the HTTP status."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(
    status_code: int,
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """An OpenAI-style error body answered with `status_code` and `headers` (none added here)."""
    return JSONResponse(error_body(message, type_, param, status_code), status_code, headers=headers)


# ---- response bodies ------------------------------------------------------------------------------------
Endpoint = Literal["completion", "chat"]


def response_body(
    gen: Generation,
    endpoint: Endpoint,
    text: str | None,
    finish: str | None,
    *,
    chunk: bool,
    first: bool = False,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A response body of `gen` carrying `text` with `finish` (its finish_reason; None mid-stream).

    Args:
        endpoint: "completion" (`object: text_completion`, `choices[0].text`) or "chat"
            (`chat.completion` with `choices[0].message`; a chunk: `chat.completion.chunk` with
            `choices[0].delta`, whose first one names the role).
        chunk: an SSE chunk (the `pdcluster` extension only on the last, `finish` set; `usage` never: the
            `include_usage` chunk carries it, counted once) rather than the whole response (with both).
        first: the stream's first chunk (chat: the delta carries `role: assistant`).
        tool_calls: chat: the message's `tool_calls` (OpenAI form; in a chunk, with their `index`).
    """
    choice: dict[str, Any] = {"index": 0}
    if endpoint == "completion":
        object_ = "text_completion"
        choice["text"] = text
    else:
        message: dict[str, Any] = {"role": "assistant", "content": text} if first or not chunk else {}
        if chunk and not first:
            message["content"] = text
        if tool_calls:
            message["tool_calls"] = tool_calls
        object_ = "chat.completion.chunk" if chunk else "chat.completion"
        choice["delta" if chunk else "message"] = message
    choice.update(logprobs=None, finish_reason=finish)
    prepared = gen.prepared
    body: dict[str, Any] = {
        "id": prepared.request_id,
        "object": object_,
        "created": prepared.created_s,
        "model": prepared.model,
        "choices": [choice],
    }
    if not chunk:
        body["usage"] = gen.usage()
    if finish is not None or not chunk:
        body["pdcluster"] = gen.extension()
    return body


def usage_chunk(gen: Generation, endpoint: Endpoint) -> dict[str, Any]:
    """The chunk `stream_options.include_usage` asks for after the last one: `choices: []` and `usage`."""
    prepared = gen.prepared
    return {
        "id": prepared.request_id,
        "object": "text_completion" if endpoint == "completion" else "chat.completion.chunk",
        "created": prepared.created_s,
        "model": prepared.model,
        "choices": [],
        "usage": gen.usage(),
    }
