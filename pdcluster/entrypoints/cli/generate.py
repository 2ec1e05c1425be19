"""`pdcluster generate`: complete prompts with a checkpoint on one device in this process (no cluster)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from pdcluster.entrypoints.cli.common import (
    CliError,
    add_model_options,
    non_negative_float,
    non_negative_int,
    positive_int,
    probability,
)
from pdcluster.models import bundled_checkpoint_dir

if TYPE_CHECKING:
    import torch

    from pdcluster.engine.llm import LLMEngine, RequestOutput
    from pdcluster.engine.sampling_params import SamplingParams


def resolve_device(name: str) -> torch.device:
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
    """An engine over `args.model` with the CLI's options, and the seconds it took to build."""
    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm import LLMEngine

    model_dir: Path = args.model
    hint = ""
    if model_dir.resolve() == bundled_checkpoint_dir():
        hint = (
            " (the bundled checkpoint is written by `python -m pdcluster.models.train_tiny`,"
            " ~30-40 min on 2 cores)"
        )
    if not model_dir.is_dir():
        raise CliError(f"model directory not found: {model_dir}{hint}")
    device = resolve_device(args.device)
    from pdcluster.config.preflight import one_line
    from pdcluster.models.loader import check_checkpoint_dir

    try:
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
    """Writes the prompt, then the completion as the engine releases text; nothing for a rejected prompt."""

    def __init__(self, out: TextIO, prefix: str = "") -> None:
        self._out = out
        self._pending_prefix = prefix

    def __call__(self, new_text: str) -> None:
        if new_text:
            self._out.write(self._pending_prefix + new_text)
            self._out.flush()
            self._pending_prefix = ""

    def finish(self) -> None:
        self._out.write(self._pending_prefix + "\n")
        self._out.flush()
        self._pending_prefix = ""


def _sampling_params(args: argparse.Namespace, max_tokens: int) -> SamplingParams:
    from pdcluster.engine.sampling_params import SamplingParams

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
    """Queue one prompt, max_tokens capped so prompt + completion fit the context."""
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
        "spec_decode": out.drafts.summary(),
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
    d = out.drafts
    if d.acceptance_rate is not None:
        parts.append(f"acceptance {d.acceptance_rate:.2f} ({d.num_accepted_tokens}/{d.num_draft_tokens})")
    return " | ".join(parts)


def _run_to_completion(
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


def run(args: argparse.Namespace) -> int:
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
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    engine, load_s = load_engine(args)
    ids = [_queue(engine, args, p) for p in prompts]

    streamer = None
    if not args.json and len(prompts) == 1:
        streamer = TextStreamer(sys.stdout, prefix=prompts[0])

    outputs = _run_to_completion(engine, None if streamer is None else lambda out: streamer(out.new_text))
    results = [outputs[i] for i in ids]
    if args.json:
        if len(results) == 1:
            print(json.dumps(_result_json(results[0], load_s)))
        else:
            print(
                json.dumps({"outputs": [_result_json(r, load_s) for r in results], **_batch_summary(results)})
            )
    elif streamer is not None:
        streamer.finish()
        print(f"{_summary_line(results[0])} | load {load_s:.2f} s", file=sys.stderr)
    else:
        for i, (prompt, out) in enumerate(zip(prompts, results, strict=True), start=1):
            print(f"=== [{i}/{len(results)}] ===\n{prompt}{out.text}\n--- {_summary_line(out)}")
        print(json.dumps(_batch_summary(results)), file=sys.stderr)
    return 0


def _batch_summary(results: list[RequestOutput]) -> dict:
    drafted = sum(r.drafts.num_draft_tokens for r in results)
    accepted = sum(r.drafts.num_accepted_tokens for r in results)
    return {
        "num_requests": len(results),
        "num_output_tokens": sum(len(r.token_ids) for r in results),
        "acceptance_rate": accepted / drafted if drafted else None,
    }


def _add_engine_options(p: argparse.ArgumentParser, default_k: int = 0) -> None:
    p.add_argument(
        "--num-speculative-tokens",
        type=non_negative_int,
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


NAME = "generate"
HELP = "complete one prompt with a checkpoint (default: the bundled tiny model)"
DESCRIPTION = f"""\
Complete one prompt on one device, in this process (no cluster involved).

The default model is the bundled tiny DeepSeek-V3 checkpoint in
  {bundled_checkpoint_dir()}
(~7M parameters, MLA + DeepSeekMoE + MTP, trained by `python -m pdcluster.models.train_tiny` on
the Python standard library's source; see its MODEL_CARD.md). It continues Python code;
it is not a chat model and knows nothing else.

Output: the prompt followed by the completion, streamed to stdout as tokens are chosen;
then one line on stderr with the token count, finish reason and timings.
Generation stops at the end-of-text token (finish reason "stop"), after --max-tokens
tokens, or when prompt + completion fill the model's context (both "length")."""
EPILOG = """\
--json prints one JSON object instead:
  text               the completion only (the prompt is not repeated)
  token_ids          completion token ids (ends with the end-of-text token on "stop")
  finish_reason      "stop" or "length"
  num_prompt_tokens  tokens the prompt encoded to
  timing             seconds unless the name says otherwise:
    load_s           reading the checkpoint and tokenizer
    queue_s          from the request's arrival to its first scheduled step
    prefill_s        the forward pass over the prompt (ttft_s - queue_s)
    ttft_s           time to first token: tokenizing + queue + prefill + sampling
    decode_s         from the first token to the last
    tpot_s           time per output token after the first (null with fewer than 2)
    e2e_s            from arrival to the last token
    tokens_per_s     tokens generated per second, prefill included, load excluded
  spec_decode        MTP speculative decoding (0, null and [] with --num-speculative-tokens 0):
    num_draft_tokens, num_accepted_tokens   draft tokens proposed / accepted
    acceptance_rate                         accepted / proposed (null when none was proposed)
    acceptance_rate_per_position            the same per draft position (1st, 2nd, ... draft)

examples:
  pdcluster generate --prompt 'def fibonacci(n):'
  pdcluster generate --prompt 'import os' --temperature 0.8 --top-p 0.95 --seed 1 --json"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", metavar="TEXT", help="text to continue (must not be empty)")
    source.add_argument(
        "--batch-file",
        type=Path,
        metavar="FILE",
        help="generate for every prompt in FILE, one per line (a literal \\n in a line is a newline), "
        "batched by the engine; blank lines are skipped",
    )
    add_model_options(parser)
    parser.add_argument(
        "--max-tokens",
        type=positive_int,
        default=64,
        metavar="N",
        help="most tokens to generate (tokens, not characters: the bundled tokenizer averages "
        "~3.4 characters of Python per token). Default: 64",
    )
    parser.add_argument(
        "--temperature",
        type=non_negative_float,
        default=0.0,
        metavar="T",
        help="sampling temperature; 0 is greedy (always the most likely token; deterministic). Default: 0",
    )
    parser.add_argument(
        "--top-k",
        type=non_negative_int,
        default=0,
        metavar="K",
        help="sample only among the K most likely tokens; 0 = no limit. Ignored when greedy. Default: 0",
    )
    parser.add_argument(
        "--top-p",
        type=probability,
        default=1.0,
        metavar="P",
        help="sample only among the most likely tokens whose probabilities add up to P (nucleus sampling); "
        "1 = no limit. Ignored when greedy. Default: 1",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        metavar="S",
        help="random seed for sampling; the same seed, prompt and options give the same output. "
        "Default: a different seed each run",
    )
    _add_engine_options(parser)
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        metavar="N",
        help="torch intra-op threads (torch.set_num_threads). On a machine other jobs keep busy, 1 is "
        "much faster than one per core: idle-waiting threads spin for cores they do not get. "
        "Default: torch's own choice (one per core)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object (fields below) instead")
