"""The `pdcluster` command line: a thin shell over library functions.

    pdcluster generate --prompt "def fibonacci(n):"        # complete one prompt with the bundled model
    pdcluster generate --prompt "..." --json               # machine-readable result with timings
    pdcluster demo                                         # what `make demo` runs: the cluster job
    pdcluster deploy clusters/local.yaml                   # serve a topology behind the OpenAI API
    pdcluster validate clusters/*.yaml                     # pre-flight check of topology files

Every error the user can cause (bad option values, a bad topology file, a missing or broken checkpoint, a
port in use or a host that is not this machine's) is one line on stderr per problem and exit code 2,
never a traceback; `deploy` finds all it can before it starts Ray (`orchestrator.preflight`, also what
`validate --for-deploy` reports). `deploy` shuts down the same way on Ctrl-C and SIGTERM, exit code 0.
Torch and the model code are imported only by the subcommand that needs them, so `--help` and option
errors answer at once.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from models import bundled_checkpoint_dir

if TYPE_CHECKING:
    import torch

    from engine.llm import LLMEngine, RequestOutput
    from engine.sampling_params import SamplingParams
    from models.tokenizer import Tokenizer
    from orchestrator.topology import Topology

PROG = "pdcluster"
EXIT_USAGE = 2


class CliError(Exception):
    """A problem the user can fix; `main` prints it as one line and exits with code 2."""


# ---- option types (argparse turns their ValueError/ArgumentTypeError into "argument --x: message") ----
def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _probability(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [0, 65535], got {text}")
    return value


_port.__name__ = "port"
_positive_int.__name__ = "positive integer"  # argparse names the type in "invalid <type> value" errors
_non_negative_int.__name__ = "integer"
_non_negative_float.__name__ = "number"
_probability.__name__ = "number"


# ---- shared steps ----------------------------------------------------------------------------------
def resolve_device(name: str) -> torch.device:
    """`cpu`, `cuda[:i]` or `npu[:i]` as a `torch.device`; torch_npu is imported only for `npu`."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise CliError(f"--device {name!r}: not a device name (expected cpu, cuda[:i] or npu[:i])") from exc
    if device.type == "npu":
        try:
            import torch_npu  # noqa: F401
        except ImportError as exc:
            raise CliError("--device npu needs torch_npu (pip install 'pdcluster[npu]')") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CliError(f"--device {name}: this torch build or machine has no CUDA device")
    return device


def load_engine(args: argparse.Namespace) -> tuple[LLMEngine, float]:
    """Build an engine over `args.model` with the CLI's engine options; returns it and the seconds taken."""
    from engine.config import EngineConfig
    from engine.llm import LLMEngine

    model_dir: Path = args.model
    hint = ""
    if model_dir.resolve() == bundled_checkpoint_dir():
        hint = " (the bundled checkpoint is written by `python -m models.train_tiny`, ~30-40 min on 2 cores)"
    if not model_dir.is_dir():
        raise CliError(f"model directory not found: {model_dir}{hint}")
    device = resolve_device(args.device)
    from models.loader import check_checkpoint_dir
    from orchestrator.preflight import one_line

    try:  # headers, shapes and tokenizer, before any weight is read (a truncated file is named)
        check_checkpoint_dir(model_dir)
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot load the checkpoint: {one_line(str(exc))}{hint}") from exc
    t_start = time.perf_counter()
    try:
        engine = LLMEngine(
            EngineConfig(
                model=str(model_dir),
                device=str(device),
                num_speculative_tokens=getattr(args, "num_speculative_tokens", 0),
                kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
                async_scheduling=getattr(args, "async_scheduling", False),
            )
        )
    except (OSError, ValueError, RuntimeError) as exc:
        raise CliError(f"cannot load the checkpoint: {one_line(str(exc))}{hint}") from exc
    return engine, time.perf_counter() - t_start


class TextStreamer:
    """Writes `prefix` (the prompt) and then a completion to a text stream as its tokens arrive.

    The prefix is written with the first token (or by `finish`), so nothing is printed for a prompt that
    `generate` rejects. Each step decodes all completion tokens so far and writes only the new suffix,
    holding back text that ends in an incomplete UTF-8 character (a byte-level token can end mid-character).
    """

    def __init__(self, tokenizer: Tokenizer, out: TextIO, prefix: str = "") -> None:
        self._tokenizer = tokenizer
        self._out = out
        self._pending_prefix = prefix
        self._ids: list[int] = []
        self._num_written_chars = 0

    def _write(self, text: str) -> None:
        self._out.write(self._pending_prefix + text[self._num_written_chars :])
        self._out.flush()
        self._pending_prefix = ""
        self._num_written_chars = len(text)

    def __call__(self, token_id: int) -> None:
        self._ids.append(token_id)
        text = self._tokenizer.decode(self._ids)
        if not text.endswith("\ufffd"):
            self._write(text)

    def finish(self, text: str) -> None:
        """Write whatever is still held back of the final completion `text`, and a newline."""
        self._write(text + "\n")


# ---- subcommands -----------------------------------------------------------------------------------
def _sampling_params(args: argparse.Namespace, max_tokens: int) -> SamplingParams:
    from engine.sampling_params import SamplingParams

    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
        )
    except ValueError as exc:
        raise CliError(str(exc)) from exc


def _queue(engine: LLMEngine, args: argparse.Namespace, prompt: str) -> str:
    """Queue one prompt; max_tokens is capped so prompt + completion fit the model's context."""
    num_prompt_tokens = len(engine.tokenizer.encode(prompt))
    room = engine.max_model_len - num_prompt_tokens
    if num_prompt_tokens == 0:
        raise CliError("the prompt encodes to no tokens")
    if room < 1:
        raise CliError(
            f"the prompt has {num_prompt_tokens} tokens and leaves no room for a completion in the model's "
            f"context of {engine.max_model_len} tokens"
        )
    try:
        return engine.add_request(prompt, _sampling_params(args, min(args.max_tokens, room)))
    except ValueError as exc:
        raise CliError(str(exc)) from exc


def _result_json(out: RequestOutput, load_s: float) -> dict:
    ttft = out.ttft_s
    decode_s = None if out.e2e_s is None or ttft is None else out.e2e_s - ttft
    return {
        "text": out.text,
        "token_ids": out.token_ids,
        "finish_reason": out.finish_reason,
        "num_prompt_tokens": len(out.prompt_token_ids),
        "timing": {
            "load_s": load_s,
            "queue_s": out.queue_s,
            "prefill_s": None if ttft is None or out.queue_s is None else ttft - out.queue_s,
            "ttft_s": ttft,
            "decode_s": decode_s,
            "tpot_s": out.tpot_s,
            "e2e_s": out.e2e_s,
            "tokens_per_s": len(out.token_ids) / out.e2e_s if out.e2e_s else None,
        },
        "spec_decode": {
            "num_draft_tokens": out.num_draft_tokens,
            "num_accepted_tokens": out.num_accepted_tokens,
            "acceptance_rate": out.acceptance_rate,
            "acceptance_rate_per_position": [
                a / d if d else None
                for a, d in zip(
                    out.num_accepted_tokens_per_position, out.num_draft_tokens_per_position, strict=True
                )
            ],
        },
    }


def _summary_line(out: RequestOutput) -> str:
    parts = [
        f"{len(out.token_ids)} tokens ({out.finish_reason})",
        f"prompt {len(out.prompt_token_ids)} tokens",
    ]
    if out.ttft_s is not None:
        parts.append(f"ttft {out.ttft_s * 1e3:.1f} ms")
    if out.tpot_s is not None:
        parts.append(f"tpot {out.tpot_s * 1e3:.1f} ms")
    if out.e2e_s:
        parts.append(f"{len(out.token_ids) / out.e2e_s:.1f} tokens/s")
    if out.acceptance_rate is not None:
        parts.append(
            f"acceptance {out.acceptance_rate:.2f} ({out.num_accepted_tokens}/{out.num_draft_tokens})"
        )
    return " | ".join(parts)


def _run(
    engine: LLMEngine, on_output: Callable[[RequestOutput], None] | None = None
) -> dict[str, RequestOutput]:
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if on_output is not None:
                on_output(out)
            if out.finished:
                finished[out.request_id] = out
    return finished


def cmd_generate(args: argparse.Namespace) -> int:
    if args.batch_file is not None:
        try:
            prompts = [
                line.rstrip("\n").replace("\\n", "\n") for line in args.batch_file.read_text().splitlines()
            ]
        except OSError as exc:
            raise CliError(f"cannot read --batch-file: {exc}") from exc
        prompts = [p for p in prompts if p.strip()]
        if not prompts:
            raise CliError(f"--batch-file {args.batch_file} has no prompts (one per line)")
    elif args.prompt == "":
        raise CliError("--prompt is empty; give the text to continue, e.g. --prompt 'def fibonacci(n):'")
    else:
        prompts = [args.prompt]
    _sampling_params(args, args.max_tokens)  # option errors before the slow model load
    engine, load_s = load_engine(args)
    ids = [_queue(engine, args, p) for p in prompts]

    streamer = None
    if not args.json and len(prompts) == 1:
        streamer = TextStreamer(engine.tokenizer, sys.stdout, prefix=prompts[0])
        seen = [0]

        def stream(out: RequestOutput) -> None:
            for token_id in out.token_ids[seen[0] :]:
                streamer(token_id)
            seen[0] = len(out.token_ids)

    outputs = _run(engine, stream if streamer is not None else None)
    results = [outputs[i] for i in ids]
    if args.json:
        if len(results) == 1:
            print(json.dumps(_result_json(results[0], load_s)))
        else:
            print(
                json.dumps({"outputs": [_result_json(r, load_s) for r in results], **_batch_summary(results)})
            )
    elif streamer is not None:
        streamer.finish(results[0].text)
        print(f"{_summary_line(results[0])} | load {load_s:.2f} s", file=sys.stderr)
    else:
        for i, (prompt, out) in enumerate(zip(prompts, results, strict=True), start=1):
            print(f"=== [{i}/{len(results)}] ===\n{prompt}{out.text}\n--- {_summary_line(out)}")
        print(json.dumps(_batch_summary(results)), file=sys.stderr)
    return 0


def _batch_summary(results: list[RequestOutput]) -> dict:
    drafted = sum(r.num_draft_tokens for r in results)
    accepted = sum(r.num_accepted_tokens for r in results)
    return {
        "num_requests": len(results),
        "num_output_tokens": sum(len(r.token_ids) for r in results),
        "acceptance_rate": accepted / drafted if drafted else None,
    }


def cmd_demo(args: argparse.Namespace) -> int:
    from orchestrator.cluster import DeployError
    from orchestrator.demo import run_demo
    from orchestrator.topology import TopologyError

    if not args.trace.exists():
        raise CliError(f"--trace {args.trace}: no such file (the public traces live in ../shared/traces)")
    try:
        return run_demo(args.cluster, args.trace, args.num_requests, args.max_tokens_cap, sys.stdout)
    except (TopologyError, DeployError) as exc:
        raise CliError(str(exc)) from exc


def _deploy_preflight(path: Path, port: int | None) -> Topology:
    """`path` read and checked as `pdcluster deploy` needs it (`orchestrator.preflight`), before Ray.

    Raises:
        TopologyError: the file's own problems, else every reason deploy would refuse it here and now.
    """
    from orchestrator.preflight import deploy_issues
    from orchestrator.topology import TopologyError, read_topology

    loaded = read_topology(path)
    issues = loaded.locate(deploy_issues(loaded.topology, port=port))
    if issues:
        raise TopologyError(issues)
    return loaded.topology


def _interrupt_on_sigterm() -> None:
    """Make SIGTERM do what Ctrl-C does: raise KeyboardInterrupt in the main thread, wherever it is (a
    second SIGTERM while shutting down is only logged). `Cluster.deploy` keeps this handler across
    `ray.init` (`orchestrator.ray_runtime.keeping_sigterm_handler`)."""
    import signal

    def on_sigterm(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, lambda *_: print("[pdcluster] already shutting down", flush=True))
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)


def cmd_deploy(args: argparse.Namespace) -> int:
    from orchestrator.cluster import DeployError
    from orchestrator.serve import serve
    from orchestrator.topology import TopologyError

    try:
        topology = _deploy_preflight(args.file, args.port)
    except TopologyError as exc:
        raise CliError(str(exc)) from exc
    _interrupt_on_sigterm()
    try:
        with serve(topology, port=args.port, log=lambda m: print(f"[pdcluster] {m}", flush=True)) as service:
            print(f"[pdcluster] ready: {service.url}/v1/models — Ctrl-C or SIGTERM to stop", flush=True)
            try:
                while True:
                    time.sleep(0.5)
            except KeyboardInterrupt:
                print("[pdcluster] shutting down", flush=True)
        print("[pdcluster] stopped", flush=True)
    except KeyboardInterrupt:  # before the service was up, or a second Ctrl-C while shutting down
        print("[pdcluster] interrupted; what had started is shut down", flush=True)
    except (TopologyError, DeployError) as exc:
        raise CliError(str(exc)) from exc
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from orchestrator.preflight import actor_layer_issues
    from orchestrator.topology import TopologyError, read_topology

    exit_code = 0
    for path in args.files:
        try:
            if args.for_deploy:
                topology = _deploy_preflight(path, None)
                notes = []
            else:
                loaded = read_topology(path)
                topology = loaded.topology
                notes = loaded.locate(actor_layer_issues(topology))
        except TopologyError as exc:
            print(exc, file=sys.stderr)
            exit_code = 1
            continue
        print(f"{path}: ok — {topology.summary()}" + (" (deployable here)" if args.for_deploy else ""))
        for note in notes:
            where = f"{note.file}:{note.line}" if note.line else note.file
            print(f"{where}: note: {note.reason} (valid as a plan; --for-deploy refuses it)", file=sys.stderr)
    return exit_code


def cmd_bench(args: argparse.Namespace) -> int:
    """Replay a trace against an endpoint (`--endpoint local`: an in-process single-engine server)."""
    import httpx

    from orchestrator.bench_client import run_bench
    from orchestrator.trace import load_trace

    try:
        load_trace(args.trace, num_requests=1)  # a bad trace fails before any server starts
    except (OSError, ValueError) as exc:
        raise CliError(str(exc)) from exc
    server = backend = None
    endpoint = args.endpoint
    if endpoint == "local":  # one LocalEngineBackend behind the API on 127.0.0.1, a free port
        from engine.config import EngineConfig
        from orchestrator.api.app import build_app
        from orchestrator.api.server import ServerThread
        from orchestrator.backend import LocalEngineBackend

        backend = LocalEngineBackend(
            EngineConfig(
                model=str(args.model), device=args.device, num_speculative_tokens=args.num_speculative_tokens
            )
        )
        server = ServerThread(build_app(backend)).start()
        endpoint = server.url
    try:
        report = run_bench(
            endpoint,
            str(args.trace),
            tokenizer_dir=str(args.model),
            num_requests=args.num_requests,
            time_scale=args.time_scale,
            max_tokens_cap=args.max_tokens_cap,
            ttft_slo_ms=args.ttft_slo_ms,
            tpot_slo_ms=args.tpot_slo_ms,
            api_key=args.api_key,
            show_progress=not args.json,
        )
    except (OSError, ValueError) as exc:
        raise CliError(str(exc)) from exc
    except httpx.HTTPError as exc:
        raise CliError(f"{endpoint}: {exc}") from exc
    finally:
        if server is not None:
            server.stop()
        if backend is not None:
            backend.shutdown()
    print(json.dumps(report.as_json(), indent=2) if args.json else report.as_table())
    return 1 if report.summary["num_failed"] else 0


# ---- parser ----------------------------------------------------------------------------------------
class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the descriptions' line breaks; wraps option help normally."""


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        type=Path,
        default=bundled_checkpoint_dir(),
        metavar="DIR",
        help="checkpoint directory in Hugging Face layout: config.json (model_type deepseek_v3), "
        "model.safetensors (or an index + shards), tokenizer.json. "
        f"Default: the bundled tiny checkpoint, {bundled_checkpoint_dir()}",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="where the model runs: cpu, cuda[:i] or npu[:i] (npu needs torch_npu). Default: cpu",
    )


def _add_engine_options(p: argparse.ArgumentParser, default_k: int = 0) -> None:
    p.add_argument(
        "--num-speculative-tokens",
        type=_non_negative_int,
        default=default_k,
        metavar="K",
        help="draft K tokens per step with the model's own MTP module and verify them in one forward "
        f"(speculative decoding; lossless: greedy output is unchanged). 0 = off. Default: {default_k}",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "int8"),
        default="auto",
        help="KV cache element type: auto = the model dtype; int8 = per-token scales, about half the bytes "
        "of bf16 (a quarter of float32). Default: auto",
    )
    p.add_argument(
        "--async-scheduling",
        action="store_true",
        help="schedule and pack step N+1 on the CPU while step N runs (same outputs)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Disaggregated prefill/decode serving for DeepSeek-V3-architecture models.",
        formatter_class=_HelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    bundled = bundled_checkpoint_dir()
    gen = sub.add_parser(
        "generate",
        help="complete one prompt with a checkpoint (default: the bundled tiny model)",
        formatter_class=_HelpFormatter,
        description=f"""\
Complete one prompt on one device, in this process (no cluster involved).

The default model is the bundled tiny DeepSeek-V3 checkpoint in
  {bundled}
(~7M parameters, MLA + DeepSeekMoE + MTP, trained by `python -m models.train_tiny` on
the Python standard library's source; see its MODEL_CARD.md). It continues Python code;
it is not a chat model and knows nothing else.

Output: the prompt followed by the completion, streamed to stdout as tokens are chosen;
then one line on stderr with the token count, finish reason and timings.
Generation stops at the end-of-text token (finish reason "stop"), after --max-tokens
tokens, or when prompt + completion fill the model's context (both "length").""",
        epilog="""\
--json prints one JSON object instead:
  text               the completion only (the prompt is not repeated)
  token_ids          completion token ids (ends with the end-of-text token on "stop")
  finish_reason      "stop" or "length"
  num_prompt_tokens  tokens the prompt encoded to
  timing             seconds unless the name says otherwise:
    load_s           reading the checkpoint and tokenizer
    prefill_s        the forward pass over the prompt
    ttft_s           time to first token: tokenizing + prefill + sampling
    decode_s         from the first token to the last
    tpot_s           time per output token after the first (null with fewer than 2)
    tokens_per_s     tokens generated per second, prefill included, load excluded

examples:
  pdcluster generate --prompt 'def fibonacci(n):'
  pdcluster generate --prompt 'import os' --temperature 0.8 --top-p 0.95 --seed 1 --json""",
    )
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", metavar="TEXT", help="text to continue (must not be empty)")
    source.add_argument(
        "--batch-file",
        type=Path,
        metavar="FILE",
        help="generate for every prompt in FILE, one per line (a literal \\n in a line is a newline), "
        "batched by the engine; blank lines are skipped",
    )
    _add_model_options(gen)
    gen.add_argument(
        "--max-tokens",
        type=_positive_int,
        default=64,
        metavar="N",
        help="most tokens to generate (tokens, not characters: the bundled tokenizer averages "
        "~3.4 characters of Python per token). Default: 64",
    )
    gen.add_argument(
        "--temperature",
        type=_non_negative_float,
        default=0.0,
        metavar="T",
        help="sampling temperature; 0 is greedy (always the most likely token; deterministic). Default: 0",
    )
    gen.add_argument(
        "--top-k",
        type=_non_negative_int,
        default=0,
        metavar="K",
        help="sample only among the K most likely tokens; 0 = no limit. Ignored when greedy. Default: 0",
    )
    gen.add_argument(
        "--top-p",
        type=_probability,
        default=1.0,
        metavar="P",
        help="sample only among the most likely tokens whose probabilities add up to P (nucleus sampling); "
        "1 = no limit. Ignored when greedy. Default: 1",
    )
    gen.add_argument(
        "--seed",
        type=int,
        default=None,
        metavar="S",
        help="random seed for sampling; the same seed, prompt and options give the same output. "
        "Default: a different seed each run",
    )
    _add_engine_options(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON object (fields below) instead")
    gen.set_defaults(func=cmd_generate)

    from orchestrator.topology import DEFAULT_TOPOLOGY_PATH
    from orchestrator.trace import default_trace_dir

    demo = sub.add_parser(
        "demo",
        help="the main job: deploy clusters/local.yaml, replay 50 Azure trace requests, print a summary",
        formatter_class=_HelpFormatter,
        description=f"""\
What `make demo` runs. Starts a local Ray cluster from the embedded default topology
({DEFAULT_TOPOLOGY_PATH}: one prefill and one decode actor serving the bundled tiny
model, KV streamed layer by layer over gRPC, MTP speculative decoding on decode), puts the
OpenAI-compatible API in front of it on a free port, completes three held-out prompts,
replays the first --num-requests requests of the Azure conversation trace at their
arrival times (lengths scaled to the model's context; the scaling is printed), prints
TTFT/TPOT percentiles, throughput, goodput under the SLO, MTP acceptance and KV transfer
time, then shuts everything down.""",
    )
    demo.add_argument("--cluster", type=Path, default=DEFAULT_TOPOLOGY_PATH, metavar="FILE", help="topology")
    demo.add_argument(
        "--trace",
        type=Path,
        default=default_trace_dir() / "AzureLLMInferenceTrace_conv.csv",
        metavar="FILE",
        help="trace to replay (Azure .csv or Mooncake .jsonl). Default: the Azure conversation trace",
    )
    demo.add_argument("--num-requests", type=_positive_int, default=50, metavar="N", help="Default: 50")
    demo.add_argument(
        "--max-tokens-cap",
        type=_positive_int,
        default=64,
        metavar="N",
        help="cap on each request's output tokens (the trace's output lengths are clamped). Default: 64",
    )
    demo.set_defaults(func=cmd_demo)

    deploy = sub.add_parser(
        "deploy",
        help="serve a topology (prefill + decode pools on Ray) behind the OpenAI API until interrupted",
        formatter_class=_HelpFormatter,
        description="""\
Validate FILE, connect to the Ray cluster in RAY_ADDRESS (or start a local one), create one
placement group per instance, start the prefill and decode actors (progress is logged while
weights load), wire the KV transfer, and serve /v1/completions, /v1/chat/completions,
/v1/models, /health and /metrics on api.host:api.port until Ctrl-C or SIGTERM.
Both shut down the same way (HTTP server, actors, placement groups, Ray if deploy started
it), also while starting, and exit with code 0.

Before Ray starts, FILE is checked as `pdcluster validate --for-deploy FILE` checks it (the
file, the one-device-per-instance limit, the checkpoint, that the address can be bound); each
problem is one FILE:LINE: reason line and the exit code is 2. So is an error after Ray started
(an actor that fails to load its weights, the port taken meanwhile), after everything started
is shut down.""",
    )
    deploy.add_argument("file", type=Path, metavar="FILE", help="topology YAML (see clusters/README.md)")
    deploy.add_argument("--port", type=_port, default=None, help="override api.port (0: a free port)")
    deploy.set_defaults(func=cmd_deploy)

    validate = sub.add_parser(
        "validate",
        help="check topology YAML files (clusters/*.yaml) without starting anything",
        formatter_class=_HelpFormatter,
        description="""\
Read each topology file and check it: keys and types, choices, parallelism against the
model's config.json, device counts and placement (clusters/README.md lists the rules).
Prints one summary line per valid file on stdout and one FILE:LINE: reason line per
problem on stderr. Exit code: 0 all files valid, 1 some file invalid, 2 usage error.

A file is checked as a plan: it may describe a cluster this machine is not part of. What
`pdcluster deploy` cannot run yet (instances of more than one device, tensor or expert
parallel) is valid as a plan and printed as a "note" line on stderr.

--for-deploy checks what `pdcluster deploy FILE` checks before it starts Ray, here and now:
also the actor layer's one-device-per-instance limit (an error, no longer a note), the
checkpoint as this machine sees it (config.json, safetensors headers not truncated, every
tensor present with its shape, tokenizer.json; no weights are read) and that api.host:api.port
can be bound. A file it calls ok is one deploy will not refuse before starting Ray.""",
    )
    validate.add_argument("files", nargs="+", type=Path, metavar="FILE", help="topology YAML files")
    validate.add_argument(
        "--for-deploy",
        action="store_true",
        help="also check what `pdcluster deploy` needs on this machine (see above)",
    )
    validate.set_defaults(func=cmd_validate)

    bench = sub.add_parser(
        "bench",
        help="replay a request trace against an OpenAI-compatible endpoint: TTFT/TPOT, throughput, goodput",
        formatter_class=_HelpFormatter,
        description="""\
Replay a public trace (Azure CSV or Mooncake JSONL; a bare name is looked up in
../shared/traces) against an endpoint, streaming, at the trace's arrival times. Input lengths
are scaled to the served model's context (the output says how); prompts are held-out Python
source sent as token ids. Prints TTFT/TPOT/e2e percentiles, throughput, goodput under the SLO,
mean acceptance rate and mean KV transfer time. Exit code 1 if any request failed.""",
    )
    bench.add_argument(
        "--endpoint",
        required=True,
        metavar="URL",
        help="base URL, e.g. http://127.0.0.1:8000; 'local' serves --model in-process",
    )
    bench.add_argument(
        "--trace", required=True, type=Path, metavar="FILE", help="trace file (.csv or .jsonl)"
    )
    bench.add_argument(
        "--num-requests",
        type=_positive_int,
        default=None,
        metavar="N",
        help="replay the first N requests. Default: all",
    )
    bench.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        metavar="X",
        help="divide arrival times by X (X > 1 replays faster). Default: 1",
    )
    bench.add_argument(
        "--max-tokens-cap",
        type=_positive_int,
        default=128,
        metavar="N",
        help="cap on each request's output tokens. Default: 128",
    )
    bench.add_argument("--ttft-slo-ms", type=float, default=1000.0, metavar="MS", help="Default: 1000")
    bench.add_argument("--tpot-slo-ms", type=float, default=100.0, metavar="MS", help="Default: 100")
    bench.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    bench.add_argument("--json", action="store_true", help="print the summary as JSON (no progress bar)")
    _add_model_options(bench)
    bench.add_argument(
        "--num-speculative-tokens",
        type=_non_negative_int,
        default=0,
        metavar="K",
        help="MTP draft tokens for --endpoint local. Default: 0",
    )
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the `pdcluster` command; returns the exit code (0 ok, 2 usage or input error)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or an option error (2, message already on stderr)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except CliError as exc:  # one line per problem (a topology file's issues: one FILE:LINE: reason each)
        for line in str(exc).splitlines() or [""]:
            print(f"{PROG} {args.command}: error: {line}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
