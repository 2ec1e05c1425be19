"""Every error of the edge as an OpenAI-style body (`protocol.error_response`), counted in the metrics, with
a message that names the field and, for mistakes users make often, says what to do."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdcluster.entrypoints.openai.metrics import ApiMetrics
from pdcluster.entrypoints.openai.protocol import ApiError, error_response


def add_error_handlers(app: FastAPI, metrics: ApiMetrics) -> None:
    """Every error as an OpenAI-style body (`protocol.error_response`), counted in `request_errors`
    (but a routing error: 404, 405)."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        metrics.errors.labels(str(exc.status_code)).inc()
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc.errors(), request.headers.get("content-type"))
        metrics.errors.labels("400").inc()
        return error_response(400, message, "invalid_request_error", param or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        metrics.errors.labels("500").inc()
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error")


_UNION_MEMBER_TAGS = frozenset({"str", "int", "float", "bool"})


def _validation_message(errors: Sequence[Any], content_type: str | None) -> tuple[str, str | None]:
    if any(e.get("type") == "json_invalid" for e in errors):
        return "the request body is not valid JSON", None
    media_type = (content_type or "").split(";")[0].strip().lower()
    if media_type != "application/json" and any(tuple(e.get("loc", ())) == ("body",) for e in errors):
        got = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
        return (
            f"the request body must be a JSON object sent with Content-Type: application/json (got {got})",
            None,
        )
    for e in errors:
        loc = tuple(e.get("loc", ()))
        if loc == ("body", "prompt", "str") and isinstance(e.get("input"), list):
            if any(isinstance(p, (str, list)) for p in e["input"]):
                return (
                    "prompt: must be text, token ids, or a list of prompts that are all text or all "
                    "lists of token ids"
                ), "prompt"
        if len(loc) >= 3 and "list[TextPart]" in loc and loc[-1] == "type" and e.get("input") != "text":
            field = _field_path(loc)
            return f"{field}: only text parts are supported, got a part of type {e.get('input')!r}", field
    parts = []
    for e in errors:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    return "invalid request: " + "; ".join(parts), (_field_path(errors[0].get("loc", ())) if errors else None)


def _field_path(loc: tuple[int | str, ...]) -> str:
    path = []
    for x in loc:
        if x == "body":
            continue
        if isinstance(x, str) and (x in _UNION_MEMBER_TAGS or "[" in x):
            break
        path.append(str(x))
    return ".".join(path)
