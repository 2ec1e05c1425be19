"""Prompts cut from the held-out split of the corpus (never trained on): demo, tests and benchmarks."""

from __future__ import annotations

from pdcluster.models.corpus import read_documents
from pdcluster.models.tokenizer import Tokenizer


def heldout_def_prompts(num: int, min_chars: int = 20, max_chars: int = 400) -> list[str]:
    """`num` openings of top-level `def`s in held-out modules, lengths cycling in `[min_chars, max_chars)`.

    Raises ValueError if there are fewer than `num` such functions.
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
    """Consecutive slices of the held-out token stream of the given lengths; ValueError for a length < 1."""
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
