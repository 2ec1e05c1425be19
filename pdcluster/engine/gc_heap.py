"""Keep the cyclic garbage collector off a serving process's startup heap."""

from __future__ import annotations

import atexit
import gc

_unfreeze_registered = False


def freeze_gc_heap() -> None:
    """Collect, then `gc.freeze()` the startup heap so full collections scan only newer objects (as vLLM's
    engine core does). Cycles among frozen objects are never freed; unfrozen at exit."""
    global _unfreeze_registered
    for generation in range(3):
        gc.collect(generation)
    gc.freeze()
    if not _unfreeze_registered:
        atexit.register(gc.unfreeze)  # interpreter shutdown finalizes the heap it can see
        _unfreeze_registered = True
