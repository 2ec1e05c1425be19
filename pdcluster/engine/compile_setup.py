"""EngineConfig `compile`: install the compiled forwards in an engine's runner at load, and report them."""

from __future__ import annotations

import logging
import time

from pdcluster.engine.compiled_forward import CompiledDecodeForward, CompileStats
from pdcluster.engine.compiled_prefill import CompiledPrefillForward

logger = logging.getLogger("pdcluster.engine.llm_engine")
MAX_ERROR_CHARS = 300


def _first_line(message: str) -> str:
    """The first non-empty line of an exception's message, at most MAX_ERROR_CHARS characters."""
    line = next((part.strip() for part in message.splitlines() if part.strip()), "")
    return line if len(line) <= MAX_ERROR_CHARS else line[: MAX_ERROR_CHARS - 3] + "..."


def install_compiled_forwards(runner, config, max_num_blocks_per_req: int) -> tuple[float, str | None]:
    """Compile and install `runner.compiled` (decode) and `runner.compiled_prefill` (ragged batches)."""
    why_not = CompiledDecodeForward.supported(runner)
    if why_not is not None:
        logger.warning("compile is on, but the decode forward runs eagerly: %s", why_not)
        return 0.0, why_not
    started_s = time.perf_counter()
    try:
        # q = k + 1 query tokens per request: with drafts, every decode step but the last ones
        compiled = CompiledDecodeForward(
            runner, config.max_num_seqs, (config.num_speculative_tokens + 1,), max_num_blocks_per_req
        )
        compiled.warm_up()
        prefill = CompiledPrefillForward(runner)
        prefill.warm_up()
    except Exception as e:  # noqa: BLE001 - any failure of an optional speed-up: run eagerly instead
        compile_s = time.perf_counter() - started_s
        error = f"{type(e).__name__}: {_first_line(str(e))}"
        logger.warning(
            "compiling the decode forward failed after %.1f s (%s); every step runs the eager forward "
            "(same tokens, slower decode). Set compile: false to skip the attempt.",
            compile_s,
            error,
            exc_info=e,
        )
        return compile_s, error
    runner.compiled, runner.compiled_prefill = compiled, prefill
    return time.perf_counter() - started_s, None


def compile_stats(runner, requested: bool, compile_s: float, error: str | None) -> CompileStats:
    """`CompileStats` of `runner`'s compiled forwards now."""
    compiled, prefill = runner.compiled, runner.compiled_prefill
    return CompileStats(
        requested=requested,
        compiled=compiled is not None,
        compile_s=compile_s,
        error=error,
        num_compiled_steps=compiled.num_compiled_steps if compiled is not None else 0,
        num_eager_fallbacks=(compiled.num_eager_fallbacks if compiled is not None else 0)
        + (prefill.num_eager_fallbacks if prefill is not None else 0),
        num_compiled_mtp_passes=compiled.num_compiled_mtp_passes if compiled is not None else 0,
        num_compiled_prefill_steps=prefill.num_compiled_steps if prefill is not None else 0,
    )
