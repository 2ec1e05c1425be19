"""IncrementalDetokenizer against decoding the whole output, and encoding errors, on the bundled tokenizer."""

from __future__ import annotations

import random

import pytest

from pdcluster.models import bundled_checkpoint_dir
from pdcluster.models.tokenizer import IncrementalDetokenizer, Tokenizer


def test_incremental_text_equals_a_full_decode_at_every_step():
    tokenizer = Tokenizer.from_dir(bundled_checkpoint_dir())
    text = 'def grüße(x):\n    """Ünïcödé — 漢字 🙂"""\n    return x  # done\n'
    ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer)
    for n in range(1, len(ids) + 1):
        partial = detokenizer.update(ids[:n])
        full = tokenizer.decode(ids[:n])
        assert "\ufffd" not in partial
        assert full.rstrip("\ufffd").startswith(partial)
    assert detokenizer.update(ids, final=True) == text


def test_invalid_unicode_is_a_value_error_naming_the_code_point():
    """Issue 12, finding 3: a lone surrogate (what JSON's "\\ud800" decodes to) made `tokenizers` raise
    TypeError("TextInputSequence must be str"), an HTTP 500; it is a ValueError saying what is wrong."""
    tokenizer = Tokenizer.from_dir(bundled_checkpoint_dir())
    message = r"^not valid Unicode: U\+D800 at character 4 is a lone surrogate"
    with pytest.raises(ValueError, match=message):
        tokenizer.encode("x = \ud800")
    with pytest.raises(ValueError, match=message):
        tokenizer.encode_batch(["ok", "x = \ud800"])
    assert tokenizer.encode("x = \U0001f600") == tokenizer.encode_batch(["x = \U0001f600"])[0]  # a real pair


def test_token_piece_fast_path_gives_the_stream_text_on_any_ids():
    """Byte-level tokens of whole characters append their own text instead of a `DecodeStream` step; on
    arbitrary ids (special tokens, partial UTF-8 bytes, invalid sequences) every intermediate and the
    final text equal those of the detokenizer without the pieces (the stream and the Python windows)."""
    tokenizer = Tokenizer.from_dir(bundled_checkpoint_dir())
    pieces = tokenizer.token_pieces
    assert pieces is not None and any(p is None for p in pieces) and any(p is not None for p in pieces)
    rng = random.Random(0)
    for trial in range(100):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))]
        fast, reference = IncrementalDetokenizer(tokenizer), IncrementalDetokenizer(tokenizer)
        reference._pieces = None  # the stream only
        for n in range(1, len(ids) + 1):
            assert fast.update(ids[:n]) == reference.update(ids[:n]), (trial, ids[:n])
        assert fast.update(ids, final=True) == reference.update(ids, final=True) == tokenizer.decode(ids)
