"""IncrementalDetokenizer against decoding the whole output, on the bundled tokenizer."""

from __future__ import annotations

from models import bundled_checkpoint_dir
from models.tokenizer import IncrementalDetokenizer, Tokenizer


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
