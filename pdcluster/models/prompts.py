"""Prompts cut from the held-out split of the corpus (never trained on): demo, tests and benchmarks."""

from __future__ import annotations

from pdcluster.models.corpus import read_documents
from pdcluster.models.tokenizer import Tokenizer


def heldout_def_prompts(num: int, min_chars: int = 20, max_chars: int = 400) -> list[str]:
    """`num` prompts of mixed length, each the opening of a top-level `def` in a held-out module.

    Lengths cycle deterministically through `[min_chars, max_chars)`. Raises ValueError if the held-out
    split has fewer than `num` top-level functions.
    """
    prompts: list[str] = []
    for doc in read_documents("heldout"):
        pos = doc.find("\ndef ")
        while pos >= 0 and len(prompts) < num:
            length = min_chars + (len(prompts) * 97) % (max_chars - min_chars)
            prompts.append(doc[pos + 1 : pos + 1 + length])
            pos = doc.find("\ndef ", pos + 1 + length)
        if len(prompts) >= num:
            return prompts
    raise ValueError(f"the held-out split has only {len(prompts)} top-level functions, asked for {num}")


def heldout_token_prompts(tokenizer: Tokenizer, lengths: list[int]) -> list[list[int]]:
    """Token-id prompts of exactly the given lengths, consecutive slices of the held-out token stream
    (wrapping around when it runs out).

    Raises:
        ValueError: a length < 1.
    """
    if any(n < 1 for n in lengths):
        raise ValueError(f"prompt lengths must be >= 1, got {min(lengths)}")
    stream: list[int] = []
    for ids in tokenizer.encode_batch(read_documents("heldout")):
        stream.extend(ids)
    out, pos = [], 0
    for n in lengths:
        if pos + n > len(stream):
            pos = 0
        out.append(stream[pos : pos + n] if n <= len(stream) else (stream * (n // len(stream) + 1))[:n])
        pos += n
    return out
