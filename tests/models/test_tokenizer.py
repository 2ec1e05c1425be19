"""IncrementalDetokenizer against decoding the whole output, and encoding errors, on the bundled tokenizer."""

from __future__ import annotations

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
