"""The OpenAI wire format at the edge: request schemas (pydantic), their validation, error bodies and the
response bodies of /v1/completions and /v1/chat/completions (whole and streamed chunks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pdcluster.entrypoints.openai.logprobs import MAX_TOP_LOGPROBS
from pdcluster.models.tokenizer import check_unicode

if TYPE_CHECKING:
    from pdcluster.entrypoints.openai.generation import Generation

MAX_STOP_STRINGS = 16
MAX_CHOICES = 16  # n and best_of at most
MAX_PROMPTS = 64  # prompts of one completions request at most
RETRY_AFTER_S = 1  # the Retry-After header (seconds) of a 429 (edge full) and of a 503 (backend unavailable)


# ---- request schemas (pydantic at the edge) -------------------------------------------------------------
def _check_unicode(value: Any) -> Any:
    for text in value if isinstance(value, list) else [value]:
        if isinstance(text, str):
            check_unicode(text)
    return value


# Strict: a JSON value of the wrong type is a 400 naming the field, never converted.
STRICT = ConfigDict(extra="ignore", strict=True)  # extra: OpenAI clients send fields we do not use (user)


class StreamOptions(BaseModel):
    """OpenAI `stream_options`: `include_usage` adds a last chunk with empty `choices` carrying `usage`."""

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
    n: int = Field(1, description=f"choices to return, 1 .. {MAX_CHOICES}; the prompt is prefilled once")
    ignore_eos: bool = Field(False, description="extension: generate past EOS (benchmarks)")
    presence_penalty: float = Field(0.0, description="in [-2, 2], subtracted from seen tokens' logits")
    frequency_penalty: float = Field(0.0, description="in [-2, 2], times a token's output count")
    repetition_penalty: float = Field(1.0, description="extension: > 0, CTRL's rule over prompt and output")
    min_tokens: int = Field(0, description="extension: EOS and stop_token_ids held back before this many")
    stop_token_ids: list[int] | None = Field(None, description="extension: token ids that end the output")
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (a string) -> bias in [-100, 100]"
    )
    # read only to refuse them (`reject_unsupported`): accepted silently, they would be ignored
    # structured output (`api.structured`): OpenAI's, and vLLM's extensions
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    _check_stop = field_validator("stop")(_check_unicode)


class CompletionRequest(CommonRequest):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        ..., description="text or token ids of the served model's tokenizer; a list of them: one choice each"
    )
    logprobs: int | None = Field(None, description="top alternatives per output token, 0 .. 20")
    echo: bool = Field(
        False,
        description="the prompt's text before the output's; with logprobs, the prompt tokens' logprobs too "
        "(the first one's None); max_tokens 0: the prompt only (scored, nothing generated)",
    )
    best_of: int | None = Field(
        None, description="generate this many, return the n with the best logprob sum"
    )
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

    @model_validator(mode="after")
    def _check_role_fields(self) -> ChatMessage:
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id (the id of the call it answers)")
        if self.role in ("system", "user") and self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        return self

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
    top_logprobs: int | None = Field(None, description="with logprobs: alternatives per token, 0 .. 20")
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
    """Refuse the OpenAI options this server does not implement (suffix; several prompts streamed) rather
    than ignore them, out-of-range choice and logprobs counts, and max_tokens 0 without echo (as vLLM).

    Raises ApiError: 400 naming the option (`param`).
    """
    if not 1 <= body.n <= MAX_CHOICES:
        raise ApiError(400, f"n must be in [1, {MAX_CHOICES}], got {body.n}", param="n")
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None:
            _check_num_logprobs(body.top_logprobs, "top_logprobs")
            if not body.logprobs:
                raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return
    if body.suffix:
        raise ApiError(400, "suffix is not supported by this server", param="suffix")
    if body.logprobs is not None:
        _check_num_logprobs(body.logprobs, "logprobs")
    if body.max_tokens == 0 and not body.echo:
        raise ApiError(
            400, "max_tokens must be >= 1 (0 only with echo: score the prompt)", param="max_tokens"
        )
    if isinstance(body.prompt, list) and body.prompt and not isinstance(body.prompt[0], int):
        if not 1 <= len(body.prompt) <= MAX_PROMPTS:
            raise ApiError(400, f"a list of prompts must hold 1 .. {MAX_PROMPTS}", param="prompt")
        if body.stream or (body.best_of or body.n) > body.n:
            raise ApiError(400, "several prompts cannot be streamed or use best_of > n", param="prompt")
    if body.best_of is not None:
        if not body.n <= body.best_of <= MAX_CHOICES:
            raise ApiError(400, f"best_of must be in [n, {MAX_CHOICES}], got {body.best_of}", param="best_of")
        if body.stream and body.best_of != body.n:
            raise ApiError(400, "best_of > n cannot be streamed", param="best_of")


def _check_num_logprobs(value: int, param: str) -> None:
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"{param} must be in [0, {MAX_TOP_LOGPROBS}], got {value}", param=param)


def num_top_logprobs(body: CompletionRequest | ChatCompletionRequest) -> int | None:
    """Alternatives per output token the response carries; None: no logprobs in the response."""
    if isinstance(body, ChatCompletionRequest):
        return (body.top_logprobs or 0) if body.logprobs else None
    return body.logprobs


def logit_bias(body: CommonRequest) -> dict[int, float]:
    """`body.logit_bias` keyed by token id. Raises ApiError 400 for a key that is not an integer."""
    try:
        return {int(k): v for k, v in (body.logit_bias or {}).items()}
    except ValueError:
        raise ApiError(400, "logit_bias keys must be token ids (integers)", param="logit_bias") from None


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
    index: int = 0,
) -> dict[str, Any]:
    """A response body of `gen` carrying `text` with `finish` (its finish_reason; None mid-stream)."""
    choice: dict[str, Any] = {"index": index}
    if endpoint == "completion":
        object_ = "text_completion"
        choice["text"] = gen.prepared.echo_text + (text or "") if first or not chunk else text
    else:
        message: dict[str, Any] = {"role": "assistant", "content": text} if first or not chunk else {}
        if chunk and not first:
            message["content"] = text
        if tool_calls:
            message["tool_calls"] = tool_calls
        object_ = "chat.completion.chunk" if chunk else "chat.completion"
        choice["delta" if chunk else "message"] = message
    choice.update(logprobs=gen.logprobs_body(endpoint, chunk), finish_reason=finish)
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
