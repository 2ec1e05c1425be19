"""Structured output: grammar-constrained decoding with xgrammar's token bitmasks."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import xgrammar as xgr

    from pdcluster.engine.outputs import ScheduledRequest
    from pdcluster.models.tokenizer import Tokenizer

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "tool_calls")
CACHE_SIZE = 256
_SEPARATORS = (",", ":")


class GrammarError(ValueError):
    """A grammar that cannot be compiled; the message names its kind and xgrammar's reason."""


def check_spec(spec: Any) -> tuple[str, str]:
    """`spec` as a `(kind, spec)` tuple."""
    if not isinstance(spec, (tuple, list)) or len(spec) != 2 or not all(isinstance(s, str) for s in spec):
        raise ValueError(f"structured_output must be None or (kind, spec) strings, got {spec!r}")
    if spec[0] not in GRAMMAR_KINDS:
        raise ValueError(f"structured_output kind must be one of {GRAMMAR_KINDS}, got {spec[0]!r}")
    return (spec[0], spec[1])


def _literal(text: str) -> str:
    """`text` as an EBNF string literal."""
    return json.dumps(text, ensure_ascii=False)


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> xgr.TokenizerInfo:
    """xgrammar's view of `tokenizer` over the model's `vocab_size` logits: the vocabulary type from
    `tokenizer.json`, special tokens blanked (never text inside a grammar), the EOS token as stop token.
    """
    import xgrammar as xgr

    backend = tokenizer.backend
    encoded = [""] * vocab_size
    for token, token_id in backend.get_vocab(with_added_tokens=True).items():
        if token_id < vocab_size:
            encoded[token_id] = token
    for token_id, added in backend.get_added_tokens_decoder().items():
        if added.special and token_id < vocab_size:
            encoded[token_id] = ""
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else None
    return xgr.TokenizerInfo(
        encoded,
        metadata["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=stop,
        add_prefix_space=metadata["add_prefix_space"],
    )


class GrammarCompiler:
    """Compiles `(kind, spec)` grammars for one tokenizer, keeping the last `CACHE_SIZE` compiled."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self._compiler = xgr.GrammarCompiler(tokenizer_info(tokenizer, vocab_size), max_threads=1)
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.vocab_size = vocab_size

    def compile(self, spec: tuple[str, str]) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec` (cached)."""
        key = check_spec(spec)
        with self._lock:
            return self._compile_cached(key)

    def _compile_cached(self, key: tuple[str, str]) -> xgr.CompiledGrammar:
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
            return compiled
        try:
            compiled = self._compile(*key)
        except GrammarError:
            raise
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/its own
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise GrammarError(f"{key[0]} does not compile: {reason}") from None
        self._cache[key] = compiled
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return compiled

    def _json(self, schema: Any, strict: bool = True) -> Any:
        return self._xgr.Grammar.from_json_schema(
            json.dumps(schema), any_whitespace=False, separators=_SEPARATORS, strict_mode=strict
        )

    def _compile(self, kind: str, spec: str) -> xgr.CompiledGrammar:
        c, xgr = self._compiler, self._xgr
        if kind == "json_schema":
            return c.compile_grammar(self._json(json.loads(spec)))
        if kind == "json_object":
            return c.compile_grammar(self._json({"type": "object"}, strict=False))
        if kind == "regex":
            return c.compile_regex(spec)
        if kind == "choice":
            choices = json.loads(spec)
            if not isinstance(choices, list) or not choices or not all(isinstance(s, str) for s in choices):
                raise GrammarError("choice must be a non-empty list of strings")
            return c.compile_grammar("root ::= " + " | ".join(_literal(s) for s in choices))
        if kind == "grammar":
            return (
                c.compile_grammar(spec) if "::=" in spec else c.compile_grammar(xgr.Grammar.from_lark(spec))
            )
        return c.compile_grammar(self._tool_calls_grammar(json.loads(spec)))

    def _tool_calls_grammar(self, spec: dict[str, Any]) -> Any:
        """Grammar for one tool call in DeepSeek-V3's format, arguments as compact JSON in a json fence."""
        xgr = self._xgr
        calls_begin, call_begin, sep, call_end, calls_end = spec["markers"]
        tools = spec["tools"]
        if not tools:
            raise GrammarError("tool_calls needs at least one tool")

        def text(s: str) -> Any:
            return xgr.Grammar.from_ebnf("root ::= " + _literal(s))

        calls = [
            xgr.Grammar.concat(
                text(f"{call_begin}function{sep}{tool['name']}\n```json\n"),
                self._json(tool.get("parameters") or {"type": "object"}, strict=False),
                text(f"\n```{call_end}"),
            )
            for tool in tools
        ]
        one = calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)
        return xgr.Grammar.concat(text(calls_begin), one, text(calls_end))


class StructuredOutputs:
    """One engine's grammar state (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._matchers: dict[str, Any] = {}

    @property
    def compiler(self) -> GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size)
            return self._compiler

    @property
    def num_tracked_requests(self) -> int:
        return len(self._matchers)

    def drop(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._matchers.pop(request_id, None)

    def _matcher(self, item: ScheduledRequest) -> Any:
        matcher = self._matchers.get(item.request_id)
        if matcher is None:
            import xgrammar as xgr

            matcher = xgr.GrammarMatcher(
                self.compiler.compile(item.request.sampling_params.structured_output)
            )
            for token_id in item.request.output_token_ids:
                if not matcher.accept_token(token_id):
                    raise GrammarError(f"output token {token_id} is outside the grammar")
            self._matchers[item.request_id] = matcher
        return matcher

    def mask_logits(self, items: list[ScheduledRequest], logits: torch.Tensor) -> dict[str, str]:
        """Mask, in place, the rows of `logits` `[sum(k_i + 1), vocab_size]` float32 (request i's `k_i + 1`
        rows after request i-1's) of the structured requests among `items`.
        """
        import xgrammar as xgr

        failed: dict[str, str] = {}
        rows: list[int] = []
        bitmask: torch.Tensor | None = None  # [rows of logits, ceil(vocab_size / 32)] int32, -1: all allowed
        offset = 0
        for item in items:
            num_rows = len(item.spec_token_ids) + 1
            if item.request.sampling_params.structured_output is not None:
                if bitmask is None:
                    bitmask = xgr.allocate_token_bitmask(logits.shape[0], self._vocab_size)
                try:
                    self._fill_masks(item, bitmask, offset)
                    rows.extend(range(offset, offset + num_rows))
                except Exception as exc:  # noqa: BLE001 - this request's grammar, this request's failure
                    failed[item.request_id] = f"structured output: {exc}"
            offset += num_rows
        if rows:
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self._vocab_size, indices=rows)
        return failed

    def _fill_masks(self, item: ScheduledRequest, bitmask: torch.Tensor, offset: int) -> None:
        """Fill the request's `k + 1` bitmask rows from `offset`: row j follows committed tokens + drafts."""
        matcher = self._matcher(item)
        drafts = item.spec_token_ids
        num_advanced = 0
        for j in range(len(drafts) + 1):
            if matcher.is_terminated():
                break
            matcher.fill_next_token_bitmask(bitmask, offset + j)
            if j == len(drafts) or not matcher.accept_token(drafts[j]):
                break
            num_advanced += 1
        if num_advanced:
            matcher.rollback(num_advanced)

    def accept(self, items: list[ScheduledRequest], sampled: dict[str, list[int]]) -> None:
        """Advance the structured requests' grammars by the tokens sampled for them."""
        for item in items:
            matcher = self._matchers.get(item.request_id)
            for token_id in sampled.get(item.request_id, ()) if matcher is not None else ():
                if matcher.is_terminated():
                    break
                matcher.accept_token(token_id)

    def draft_masks(self, request_ids: list[str]) -> DraftMasks | None:
        """Masks for the MTP drafts of `request_ids` (one per `MTPWork`); None when none is structured."""
        matchers = [self._matchers.get(request_id) for request_id in request_ids]
        return DraftMasks(matchers, self._vocab_size) if any(m is not None for m in matchers) else None


class DraftMasks:
    """The grammar masks of MTP drafts, one depth at a time: each structured request's draft is chosen among
    the tokens its grammar allows after its committed tokens and its earlier drafts. The matchers advance by
    the drafts while drafting and `finish` rolls them back. Verification still masks and checks every draft.
    """

    def __init__(self, matchers: list[Any | None], vocab_size: int) -> None:
        self._matchers = matchers
        self._advanced = [0] * len(matchers)
        self._live = [m is not None and not m.is_terminated() for m in matchers]
        self._vocab_size = vocab_size

    def mask_(self, logits: torch.Tensor, active: list[int], previous: torch.Tensor | None) -> None:
        """Mask in place the rows of MTP `logits` `[len(active), vocab_size]` float32 (row j: work
        `active[j]`) of structured requests. previous: `[len(active)]` int64, each row's draft at the depth
        before (None at the first depth), accepted by its matcher first.
        """
        rows = [j for j, i in enumerate(active) if self._live[i]]
        if not rows:
            return
        import xgrammar as xgr

        previous_ids = previous.tolist() if previous is not None else None
        bitmask = xgr.allocate_token_bitmask(len(active), self._vocab_size)
        filled: list[int] = []
        for j in rows:
            i = active[j]
            matcher = self._matchers[i]
            try:
                if previous_ids is not None:
                    if not matcher.accept_token(previous_ids[j]):
                        self._live[i] = False
                        continue
                    self._advanced[i] += 1
                if matcher.is_terminated():
                    self._live[i] = False
                    continue
                matcher.fill_next_token_bitmask(bitmask, j)
                filled.append(j)
            except Exception:  # noqa: BLE001 - drafts left unmasked are still verified under the grammar
                self._live[i] = False
        if filled:
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self._vocab_size, indices=filled)

    def finish(self) -> None:
        """Roll every matcher back to its committed tokens."""
        for i, matcher in enumerate(self._matchers):
            if self._advanced[i]:
                matcher.rollback(self._advanced[i])
                self._advanced[i] = 0
