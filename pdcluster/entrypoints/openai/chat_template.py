"""Chat templates: the checkpoint's Jinja `chat_template`, rendered as transformers' `apply_chat_template`."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pdcluster.models.tokenizer import Tokenizer

PLAIN_JOIN_DOC = """\
No chat template in the checkpoint: the messages' contents are joined with a blank line ("\\n\\n"), roles
dropped, and the model continues the text of the last message."""


class ChatTemplateError(ValueError):
    """The template raised (`raise_exception`, a Jinja error) for these messages; the message says why."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format_: str) -> str:
    return datetime.now().strftime(format_)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def select_template(chat_template: str | list[dict[str, str]] | None, with_tools: bool) -> str | None:
    """The template string of a `tokenizer_config.json` `chat_template`: a string, or named templates of
    which "tool_use" serves requests with tools and "default" the others (as transformers picks)."""
    if chat_template is None or isinstance(chat_template, str):
        return chat_template
    named = {t["name"]: t["template"] for t in chat_template}
    if with_tools and "tool_use" in named:
        return named["tool_use"]
    return named.get("default")


class ChatTemplate:
    """Renders chat messages into a prompt with one tokenizer's template (compiled once per template)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._env = _environment()
        self._compiled: dict[str, jinja2.Template] = {}

    @property
    def has_template(self) -> bool:
        return self._tokenizer.chat_template is not None

    def template_text(self, with_tools: bool = False) -> str | None:
        return select_template(self._tokenizer.chat_template, with_tools)

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt text of `messages` (OpenAI message dicts, `content` a string or None).

        Raises ChatTemplateError: the template raised for these messages, with its message.
        """
        source = self.template_text(with_tools=bool(tools))
        if source is None:
            return "\n\n".join(m.get("content") or "" for m in messages)
        template = self._compiled.get(source)
        if template is None:
            template = self._compiled[source] = self._env.from_string(source)
        special = {k: v for k, v in self._tokenizer.config.items() if k.endswith("_token") and v}
        special = {k: v.get("content") if isinstance(v, dict) else v for k, v in special.items()}
        special.update(bos_token=self._tokenizer.bos_token, eos_token=self._tokenizer.eos_token)
        try:
            return template.render(
                messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **special
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused these messages: {exc}") from None
