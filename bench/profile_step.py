"""Profile decode steps with pyinstrument: `python -m bench.profile_step [--k K] [--batch B] [--out FILE]`.

Builds the same engine as `bench.engine_step` (bundled checkpoint, greedy, `ignore_eos`, async scheduling
off by default), prefills `--batch` held-out prompts, runs a few untimed decode steps, then profiles
`--num-steps` calls of `LLMEngine.step()` with pyinstrument (a sampling profiler, `--interval` seconds
between samples; one step lasts a few ms, so several steps are sampled together) and writes the text
summary. Model time shows under `ModelRunner.forward / mtp_forward / compute_logits`; everything else is
host time. pyinstrument is a `dev` extra (pyproject.toml), not a runtime dependency.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.common import add_common_arguments, check_checkpoint

MODEL_CALLS = ("forward", "mtp_forward", "compute_logits")


def host_summary(root, num_steps: int, top: int = 15) -> str:
    """Flat table of the host frames: self time per function (ms per step), frames under the model calls
    (`ModelRunner.forward / mtp_forward / compute_logits`) left out, and the model / host totals."""
    self_s: dict[str, float] = {}
    model_s = 0.0

    def walk(frame, parent_key: str) -> None:
        nonlocal model_s
        name = frame.function or "?"
        if name in MODEL_CALLS and "model_runner" in (frame.file_path or ""):
            model_s += frame.time
            return
        # pyinstrument's synthetic "[self]" frames: their parent's own time
        key = parent_key if name.startswith("[") else f"{name}  {frame.file_path_short}:{frame.line_no}"
        exclusive = frame.time - sum(child.time for child in frame.children)
        self_s[key] = self_s.get(key, 0.0) + exclusive
        for child in frame.children:
            walk(child, key)

    walk(root, "root")
    host_s = sum(self_s.values())
    lines = [
        f"{num_steps} steps, {root.time:.3f} s profiled: "
        f"{num_steps} steps: model {model_s * 1e3 / num_steps:.3f} ms/step, "
        f"host {host_s * 1e3 / num_steps:.3f} ms/step (sampled; profiler overhead included)",
        f"top {top} host frames by self time (ms/step):",
    ]
    for key, seconds in sorted(self_s.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {seconds * 1e3 / num_steps:8.4f}  {key}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_step", description=__doc__.splitlines()[0])
    add_common_arguments(parser)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--k", type=int, default=0, help="num_speculative_tokens")
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--num-steps", type=int, default=60)
    parser.add_argument("--interval", type=float, default=0.0001)
    parser.add_argument("--out", type=Path, default=None, help="text summary here (default: stdout)")
    args = parser.parse_args(argv)
    check_checkpoint(args.model)
    import torch
    from pyinstrument import Profiler

    from pdcluster.engine.llm import LLM
    from pdcluster.engine.sampling_params import SamplingParams
    from pdcluster.models.prompts import heldout_token_prompts

    if args.threads:
        torch.set_num_threads(args.threads)
    prompt_len, block_size = 64, 16
    max_len = prompt_len + 16 + (args.num_steps + 8) * (args.k + 1)
    llm = LLM(
        args.model,
        num_kv_blocks=args.batch * (-(-max_len // block_size) + 1) + 8,
        block_size=block_size,
        max_num_seqs=args.batch,
        max_num_batched_tokens=max(2048, args.batch * (args.k + 1)),
        num_speculative_tokens=args.k,
        async_scheduling=args.async_scheduling,
    )
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_len - prompt_len, ignore_eos=True)
    for prompt in heldout_token_prompts(llm.tokenizer, [prompt_len] * args.batch):
        engine.add_request(prompt, params)
    for _ in range(12):  # prefill, then warm-up decode steps
        engine.step()
    profiler = Profiler(interval=args.interval)
    profiler.start()
    for _ in range(args.num_steps):
        engine.step()
    profiler.stop()
    text = host_summary(profiler.last_session.root_frame(), args.num_steps)
    text += "\n" + profiler.output_text(unicode=False, color=False, show_all=False)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
