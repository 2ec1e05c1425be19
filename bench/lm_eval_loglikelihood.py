"""lm-evaluation-harness, unmodified, against our server: its `local-completions` model scores the local
multiple-choice task `bench/lm_eval/code_choices.yaml` (40 Python snippets, 120 continuations, nothing
downloaded) by loglikelihood, which it asks for as `/v1/completions` with `echo`, `logprobs: 1` and
`max_tokens: 1` over batches of token-id prompts (`tokenized_requests`), counting the context's tokens with
the bundled checkpoint's tokenizer loaded locally (`tokenizer_backend=huggingface`).

    python -m bench.lm_eval_loglikelihood --json [--server cluster|colocated] [--batch-size 4]

`--server cluster` deploys clusters/local.yaml in this process (prefill + decode on Ray, MTP on: what
`pdcluster deploy` serves); `colocated` serves one engine (`bench.colocated_server`'s setup). lm-eval runs as
its own CLI (`python -m lm_eval run ...`) in a child process. Prints accuracy, the number of loglikelihood
requests lm-eval made and of completions the server finished, and whether every HTTP request succeeded (the
server's `pdcluster_request_errors_total` stayed 0). Needs the `eval` extra (`pip install -e .[eval]`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from bench.common import environment, main_with, new_parser

ROOT = Path(__file__).resolve().parent.parent
TASK_DIR = ROOT / "bench" / "lm_eval"
TASK = "pdcluster_code_choices"
LM_EVAL_TIMEOUT_S = 1800


@contextlib.contextmanager
def served(kind: str, topology: str, compile_decode: bool) -> Iterator[str]:
    """The OpenAI server's base URL while it serves: the deployed cluster, or one colocated engine."""
    from pdcluster.config import load_topology

    topo = load_topology(topology)
    topo = dataclasses.replace(topo, api=dataclasses.replace(topo.api, host="127.0.0.1", port=0))
    if not compile_decode:
        topo = dataclasses.replace(topo, decode=dataclasses.replace(topo.decode, compile=False))
    if kind == "cluster":
        from pdcluster.entrypoints.serve import serve

        with serve(topo, log=lambda m: print(m, file=sys.stderr, flush=True)) as service:
            yield service.url
        return
    from pdcluster.driver.backend import LocalEngineBackend
    from pdcluster.entrypoints.openai.app import build_topology_app
    from pdcluster.entrypoints.openai.server import ServerThread

    backend = LocalEngineBackend(topo.engine_config("decode"))
    try:
        with ServerThread(build_topology_app(backend, topo)) as server:
            yield server.url
    finally:
        backend.shutdown()


def counters(url: str) -> dict[str, float]:
    """The server's request counters (`/metrics`): finished requests by finish_reason, errors by status."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(("pdcluster_requests_total", "pdcluster_request_errors_total")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    with served(args.server, args.topology, args.compile) as url, tempfile.TemporaryDirectory() as tmp:
        out_dir = args.output_dir or tmp
        model_name = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        before = counters(url)
        model_args = ",".join(
            [
                f"base_url={url}/v1/completions",
                f"model={model_name}",
                f"tokenizer={args.model}",
                "tokenizer_backend=huggingface",
                "tokenized_requests=True",
                f"num_concurrent={args.num_concurrent}",
                "max_retries=1",
                f"max_length={args.max_length}",
            ]
        )
        command = [
            sys.executable, "-m", "lm_eval", "run",
            "--model", "local-completions", "--model_args", model_args,
            "--tasks", TASK, "--include_path", str(TASK_DIR), "--batch_size", str(args.batch_size),
            "--output_path", out_dir, "--log_samples",
        ]  # fmt: skip
        started = time.perf_counter()
        done = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, timeout=LM_EVAL_TIMEOUT_S, env=os.environ
        )
        elapsed_s = time.perf_counter() - started
        if done.returncode != 0:
            raise RuntimeError(f"lm_eval exited with {done.returncode}: {done.stderr[-3000:]}")
        after = counters(url)
        results = json.loads(next(Path(out_dir).rglob("results_*.json")).read_text())
        samples = [json.loads(line) for p in Path(out_dir).rglob("samples_*.jsonl") for line in p.open()]
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after.keys() | before.keys()}
    finished = {k: v for k, v in delta.items() if k.startswith("pdcluster_requests_total") and v}
    errors = {k: v for k, v in delta.items() if k.startswith("pdcluster_request_errors_total") and v}
    task = results["results"][TASK]
    pairs = direct_loglikelihoods(args.model, samples)
    num_requests = sum(len(s["resps"]) for s in samples)
    return {
        "benchmark": "lm_eval_loglikelihood",
        "config": {
            "server": args.server,
            "topology": args.topology,
            "decode_compiled": args.compile,
            "batch_size": args.batch_size,
            "num_concurrent": args.num_concurrent,
            "lm_eval_version": _version("lm_eval"),
        },
        "task": TASK,
        "num_docs": len(samples),
        "accuracy": task["acc,none"],
        "accuracy_stderr": task.get("acc_stderr,none"),
        "num_loglikelihood_requests": num_requests,
        "num_server_completions": int(sum(finished.values())),
        "server_finish_reasons": finished,
        "server_errors": errors,
        # what lm-eval summed from our logprobs vs a cache-less forward of the same weights in this process
        "max_abs_diff_vs_direct_forward": max(abs(a - b) for a, b in pairs),
        "num_compared": len(pairs),
        "all_requests_succeeded": not errors and int(sum(finished.values())) == num_requests,
        "lm_eval_s": round(elapsed_s, 2),
        "environment": environment(args.model),
    }


def direct_loglikelihoods(model_dir: Path, samples: list[dict]) -> list[tuple[float, float]]:
    """(lm-eval's loglikelihood, a cache-less forward's) of every request in `samples`: the continuation's
    token logprobs summed, its tokens split from the context as lm-eval's `_encode_pair` splits them."""
    import torch

    from pdcluster.engine.llm import LLM

    llm = LLM(model_dir)
    pairs = []
    for sample in samples:
        arguments = sample["arguments"]  # {"gen_args_i": {"arg_0": context, "arg_1": continuation}}
        if isinstance(arguments, dict):
            arguments = [[a["arg_0"], a["arg_1"]] for a in arguments.values()]
        for (context, continuation), resp in zip(arguments, sample["filtered_resps"], strict=True):
            n_spaces = len(context) - len(context.rstrip())
            if n_spaces:
                context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
            context_enc = llm.tokenizer.encode(context)
            continuation_enc = llm.tokenizer.encode(context + continuation)[len(context_enc) :]
            num_context = len(context_enc)
            with torch.no_grad():
                tokens = torch.tensor([context_enc + continuation_enc])  # what lm-eval sends
                rows = llm.engine.model(tokens)[0].float().log_softmax(-1)
            targets = torch.tensor(continuation_enc)
            direct = rows[num_context - 1 : -1].gather(1, targets[:, None]).sum().item()
            pairs.append((float(resp[0]), direct))
    return pairs


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist.replace("_", "-"))
    except PackageNotFoundError:
        return None


def table(report: dict[str, Any]) -> str:
    r = report
    return (
        f"{r['task']} on {r['config']['server']}: accuracy {r['accuracy']:.3f} over {r['num_docs']} docs; "
        f"{r['num_loglikelihood_requests']} loglikelihood requests, "
        f"{r['num_server_completions']} completions served, all succeeded: {r['all_requests_succeeded']}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = new_parser("bench.lm_eval_loglikelihood", __doc__)
    parser.add_argument("--server", choices=("cluster", "colocated"), default="cluster")
    parser.add_argument("--topology", default="clusters/local.yaml", help="topology YAML served")
    parser.add_argument("--batch-size", type=int, default=4, help="prompts per HTTP request (lm-eval's)")
    parser.add_argument("--num-concurrent", type=int, default=2, help="lm-eval's concurrent HTTP requests")
    parser.add_argument("--output-dir", default=None, help="keep lm-eval's results and samples here")
    parser.add_argument("--compile", action="store_true", help="compile the decode forward (slow to load)")
    parser.add_argument("--max-length", type=int, default=256, help="lm-eval's context limit (tokens)")
    return main_with(parser, argv, run, table)


if __name__ == "__main__":
    raise SystemExit(main())
