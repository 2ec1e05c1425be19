"""`pdcluster demo` (the target of `make demo`) for now: greedy completions of held-out prompts, one process.

Later this becomes the cluster job on clusters/local.yaml; until then it shows the bundled model on text it
never trained on. Prompts are cut from the held-out split of `models.corpus`: in sorted file order, the
first public module-level function with a one-line docstring of each file, `def` line + docstring, taken
from the first `num_prompts` files that have one (with CPython 3.11: `calendar.isleap`,
`heapq.heappush`, `shlex.split`).
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, TextIO

from models.corpus import corpus_files, stdlib_dir

if TYPE_CHECKING:
    from models.deepseek_v3 import DeepseekV3ForCausalLM
    from models.tokenizer import Tokenizer


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
    load: Callable[[], tuple[DeepseekV3ForCausalLM, Tokenizer, float]],
    model_dir: Path,
    max_tokens: int,
    out: TextIO,
    num_prompts: int = 3,
) -> int:
    """Load a checkpoint with `load()`, complete held-out prompts greedily, print them with timings.

    Returns the exit code (0).
    """
    from models.generate import SamplingParams, generate

    model, tokenizer, load_s = load()
    num_params = sum(p.numel() for p in model.parameters())
    device = next(model.parameters()).device
    out.write(f"model: {model_dir} ({num_params:,} parameters), loaded in {load_s:.2f} s on {device}\n")
    out.write(f"greedy, up to {max_tokens} tokens per prompt; prompts from held-out stdlib modules\n")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    prompts = heldout_prompts(num_prompts)
    for i, prompt in enumerate(prompts, start=1):
        out.write(f"\n=== [{i}/{len(prompts)}] {prompt.source} ===\n")
        result = generate(model, tokenizer, prompt.text, params)
        out.write(f"{prompt.text}{result.text}\n")
        out.write(f"--- {result.summary()}\n")
        out.flush()
    return 0
