"""`pdcluster demo` (the target of `make demo`) for now: greedy completions of held-out prompts, one process.

Later this becomes the cluster job on clusters/local.yaml; until then it shows the bundled model on text it
never trained on. Prompts are cut from the held-out split of `models.corpus`: in sorted file order, the
first public module-level function with a one-line docstring of each file, `def` line + docstring, taken
from the first `num_prompts` files that have one (with CPython 3.11: `calendar.isleap`,
`heapq.heappush`, `shlex.split`).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, TextIO

from models.corpus import corpus_files, stdlib_dir

if TYPE_CHECKING:
    from engine.llm import LLMEngine


class DemoPrompt(NamedTuple):
    source: str  # "<file relative to the stdlib>:<function name>"
    text: str  # the function's `def` line(s) and docstring, no trailing newline


def heldout_prompts(num_prompts: int, root: Path | None = None) -> list[DemoPrompt]:
    """Up to `num_prompts` prompts from distinct held-out files (see the module docstring for the rule)."""
    root = root or stdlib_dir()
    prompts: list[DemoPrompt] = []
    for path in corpus_files("heldout", root):
        source = path.read_text(encoding="utf-8", errors="replace")
        lines = source.splitlines()
        for node in ast.parse(source).body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = node.body[0]
            docstring = ast.get_docstring(node)
            if docstring is None or "\n" in docstring:
                continue
            first_line = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            text = "\n".join(lines[first_line - 1 : doc.end_lineno])
            prompts.append(DemoPrompt(f"{path.relative_to(root)}:{node.name}", text))
            break
        if len(prompts) == num_prompts:
            break
    return prompts


def run_demo(
    engine: LLMEngine, load_s: float, model_dir: Path, max_tokens: int, out: TextIO, num_prompts: int = 3
) -> int:
    """Complete held-out prompts greedily in one batch on `engine`, print them with timings.

    Returns the exit code (0).
    """
    from engine.sampling_params import SamplingParams

    num_params = sum(p.numel() for p in engine.model.parameters())
    k = engine.config.num_speculative_tokens
    out.write(
        f"model: {model_dir} ({num_params:,} parameters), "
        f"loaded in {load_s:.2f} s on {engine.config.device}\n"
    )
    out.write(
        f"greedy, up to {max_tokens} tokens per prompt, MTP speculative decoding k={k}; "
        "prompts from held-out stdlib modules\n"
    )
    prompts = heldout_prompts(num_prompts)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    ids = [engine.add_request(p.text, params) for p in prompts]
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    for i, (prompt, rid) in enumerate(zip(prompts, ids, strict=True), start=1):
        result = finished[rid]
        out.write(f"\n=== [{i}/{len(prompts)}] {prompt.source} ===\n{prompt.text}{result.text}\n")
        acceptance = "" if result.acceptance_rate is None else f" | acceptance {result.acceptance_rate:.2f}"
        tpot = "" if result.tpot_s is None else f" | tpot {result.tpot_s * 1e3:.1f} ms"
        out.write(
            f"--- {len(result.token_ids)} tokens ({result.finish_reason}) | ttft {result.ttft_s * 1e3:.1f} ms"
            f"{tpot}{acceptance}\n"
        )
        out.flush()
    return 0
