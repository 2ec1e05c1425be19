"""Thin wrapper over a `tokenizers` `tokenizer.json` (byte-level BPE for the bundled model)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)  # ids 0, 1, 2 in the bundled tokenizer


class Tokenizer:
    """Text <-> token ids. `eos_token_id` ends generation; ids are Python ints."""

    def __init__(self, tokenizer: _HFTokenizer) -> None:
        self._tok = tokenizer
        self.eos_token_id = tokenizer.token_to_id(EOS_TOKEN)
        self.bos_token_id = tokenizer.token_to_id(BOS_TOKEN)
        self.vocab_size = tokenizer.get_vocab_size()

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json` from a checkpoint directory. Raises FileNotFoundError naming the file."""
        file = Path(path) / "tokenizer.json"
        if not file.exists():
            raise FileNotFoundError(f"{file}: no tokenizer.json in the checkpoint directory")
        return cls(_HFTokenizer.from_file(str(file)))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
