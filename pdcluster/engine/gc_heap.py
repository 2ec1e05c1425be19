"""Keep the cyclic garbage collector off a serving process's startup heap."""

from __future__ import annotations

import atexit
import gc

_unfreeze_registered = False


def freeze_gc_heap() -> None:
    """Collect, then move every object the collector tracks into its permanent generation (`gc.freeze`), so
    the oldest generation's collections scan only what was allocated since (as vLLM's engine core does after
    start-up: `vllm.utils.gc_utils.freeze_gc_heap`). For a process that keeps its engine until it exits:
    cyclic garbage among frozen objects is never collected. Unfrozen again at exit."""
    global _unfreeze_registered
    for generation in range(3):
        gc.collect(generation)
    gc.freeze()
    if not _unfreeze_registered:
        atexit.register(gc.unfreeze)  # interpreter shutdown finalizes the heap it can see
        _unfreeze_registered = True
