"""`pdcluster demo` (`make demo`): the main job on the default topology, clusters/local.yaml.

Prompts: the first public module-level function with a one-line docstring of each held-out file, in
sorted file order (`def` line + docstring).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple, TextIO

from pdcluster.models.corpus import corpus_files, stdlib_dir


class DemoPrompt(NamedTuple):
    source: str  # "<file relative to the stdlib>:<function name>"
    text: str


def heldout_prompts(num_prompts: int, root: Path | None = None) -> list[DemoPrompt]:
    """Up to `num_prompts` prompts from distinct held-out files."""
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
    cluster_path: Path,
    trace_path: Path,
    num_requests: int,
    max_tokens_cap: int,
    out: TextIO,
    num_prompts: int = 3,
) -> int:
    """Deploy `cluster_path`, show completions, replay a trace through the API, shut down.

    Returns the exit code: 0, or 1 when a request failed.
    """
    import httpx

    from pdcluster.config.slo import DEFAULT_TPOT_SLO_MS, DEFAULT_TTFT_SLO_MS
    from pdcluster.entrypoints.bench_client import run_bench
    from pdcluster.entrypoints.serve import serve

    def log(message: str) -> None:
        out.write(f"[pdcluster] {message}\n")
        out.flush()

    with serve(cluster_path, port=0, log=log) as service:
        topo = service.topology
        for i, prompt in enumerate(heldout_prompts(num_prompts), start=1):
            body = {
                "model": service.cluster.model_name,
                "prompt": prompt.text,
                "max_tokens": 32,
                "temperature": 0,
            }
            reply = httpx.post(f"{service.url}/v1/completions", json=body, timeout=120).json()
            ext = reply.get("pdcluster", {})
            phases = ", ".join(
                f"{k} {v * 1e3:.0f} ms" for k, v in ext.get("phases", {}).items() if k.endswith("_s")
            )
            out.write(
                f"\n=== [{i}/{num_prompts}] {prompt.source} ===\n{prompt.text}{reply['choices'][0]['text']}\n"
            )
            rate = ext.get("acceptance_rate")
            acceptance = "n/a (no drafts)" if rate is None else f"{rate:.2f}"
            out.write(f"--- {phases}; acceptance {acceptance}\n")
        out.write(f"\nreplaying {num_requests} requests of {trace_path.name} through {service.url}\n")
        report = run_bench(
            service.url,
            str(trace_path),
            tokenizer_dir=topo.engine_config("decode").model,
            num_requests=num_requests,
            max_tokens_cap=max_tokens_cap,
            ttft_slo_ms=topo.slo.ttft_ms or DEFAULT_TTFT_SLO_MS,
            tpot_slo_ms=topo.slo.tpot_ms or DEFAULT_TPOT_SLO_MS,
            api_key=topo.api.api_key,
        )
    out.write(report.as_table() + "\n")
    out.flush()
    return 1 if report.summary["num_failed"] else 0
