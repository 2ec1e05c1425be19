"""Thin wrapper over a `tokenizers` `tokenizer.json` (byte-level BPE for the bundled model), with the
special tokens and chat template of the checkpoint's `tokenizer_config.json` where it has one."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import ByteLevel, DecodeStream

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)  # ids 0, 1, 2 in the bundled tokenizer


def check_unicode(text: str) -> None:
    """Check that `text` encodes as UTF-8. Raises ValueError: a lone surrogate (U+D800..U+DFFF), naming
    it and its index."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"not valid Unicode: U+{ord(text[e.start]):04X} at character {e.start} is a lone surrogate "
            "(half of a UTF-16 pair); send text that encodes as UTF-8"
        ) from None


def _token_text(value: Any) -> str | None:
    """A special token as `tokenizer_config.json` writes it: a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    """Text <-> token ids. `eos_token_id` ends generation; ids are Python ints."""

    def __init__(self, tokenizer: _HFTokenizer, config: dict[str, Any] | None = None) -> None:
        self._tok = tokenizer
        self.config = dict(config or {})
        self.bos_token = _token_text(self.config.get("bos_token")) or BOS_TOKEN
        self.eos_token = _token_text(self.config.get("eos_token")) or EOS_TOKEN
        self.eos_token_id = tokenizer.token_to_id(self.eos_token)
        self.bos_token_id = tokenizer.token_to_id(self.bos_token)
        self.vocab_size = tokenizer.get_vocab_size()
        # a Jinja template (str), or named ones ([{"name", "template"}]) as transformers writes them
        self.chat_template: str | list[dict[str, str]] | None = self.config.get("chat_template")

    @property
    def backend(self) -> _HFTokenizer:
        """The `tokenizers.Tokenizer` (its vocabulary, for grammar engines)."""
        return self._tok

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters one token's text holds at most: the longest vocabulary entry (no shorter than its
        decoded text)."""
        return max((len(token) for token in self._tok.get_vocab(with_added_tokens=True)), default=1) or 1

    @functools.cached_property
    def token_pieces(self) -> list[str | None] | None:
        """Index id: the text a byte-level BPE token adds after a character boundary; None where it is not
        whole characters (or is an added token), and for another decoder."""
        if type(self._tok.decoder) is not ByteLevel:
            return None
        added = set(self._tok.get_added_tokens_decoder())
        ids = [[i] for i in range(self._tok.get_vocab_size(with_added_tokens=False))]
        texts = self._tok.decode_batch(ids, skip_special_tokens=True)
        return [None if i in added or not t or "\ufffd" in t else t for i, t in enumerate(texts)]

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json` (and `tokenizer_config.json`, if present) from a checkpoint directory.
        Raises FileNotFoundError: no tokenizer.json; ValueError: a tokenizer_config.json that is not a JSON
        object (each naming the file)."""
        file = Path(path) / "tokenizer.json"
        if not file.exists():
            raise FileNotFoundError(f"{file}: no tokenizer.json in the checkpoint directory")
        config_file = Path(path) / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.exists() else {}
        if not isinstance(config, dict):
            raise ValueError(f"{config_file}: expected a JSON object, got {type(config).__name__}")
        return cls(_HFTokenizer.from_file(str(file)), config)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`. Raises ValueError for text that is not valid Unicode (`check_unicode`)."""
        try:
            return self._tok.encode(text, add_special_tokens=False).ids
        except TypeError:  # `tokenizers` says "TextInputSequence must be str" for a lone surrogate
            if isinstance(text, str):
                check_unicode(text)
            raise

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text. Raises ValueError as `encode`."""
        try:
            return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]
        except TypeError:
            for text in texts:
                if isinstance(text, str):
                    check_unicode(text)
            raise

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Text of a growing list of output token ids, decoding only the newest tokens: a `tokenizers`
    `DecodeStream`, with its windows kept here to flush an incomplete last character on `final`, or to go
    on in Python should the stream refuse a step."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._stream: DecodeStream | None = DecodeStream(skip_special_tokens=True)
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0
        self._num_fed = 0
        # Byte-level: a token of whole characters after everything emitted appends its own text, which
        # is what the stream would emit (its bytes decode alone); the stream restarts after such tokens.
        self._pieces = getattr(tokenizer, "token_pieces", None)
        self._num_streamed = 0  # tokens fed to `_stream`

    def update(self, token_ids: list[int], final: bool = False) -> str:
        """Text of `token_ids` (the whole output so far). `final`: also emit an incomplete last character."""
        num_tokens = len(token_ids)
        stream = self._stream
        num_fed = self._num_fed
        pieces = self._pieces
        if num_tokens == num_fed + 1 and self._read_offset == num_fed and pieces is not None:
            token_id = token_ids[num_fed]
            piece = pieces[token_id] if 0 <= token_id < len(pieces) else None
            if piece is not None and stream is not None:
                self.text = text = self.text + piece
                self._num_fed = self._read_offset = num_tokens
                self._prefix_offset = num_fed
                return text
            if stream is not None and self._num_streamed != num_fed:
                stream = self._stream = DecodeStream(skip_special_tokens=True)
        if stream is not None and num_tokens > self._num_fed:
            self._num_streamed = num_tokens
            new = token_ids[self._num_fed] if num_tokens == self._num_fed + 1 else token_ids[self._num_fed :]
            self._num_fed = num_tokens
            try:
                chunk = stream.step(self._tokenizer.backend, new)
            except Exception:  # noqa: BLE001 - the windows below reproduce the stream's state
                self._stream = chunk = None
            if chunk is not None:
                self.text += chunk
                self._prefix_offset, self._read_offset = self._read_offset, num_tokens
                return self.text
        if self._stream is not None and not (final and self._read_offset < num_tokens):
            return self.text
        decode = self._tokenizer.decode
        emitted = decode(token_ids[self._prefix_offset : self._read_offset])
        full = decode(token_ids[self._prefix_offset :])
        if final or (len(full) > len(emitted) and not full.endswith("\ufffd")):
            self.text += full[len(emitted) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(token_ids)
            self._stream = None  # the stream's window is behind now
        return self.text
