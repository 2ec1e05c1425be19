"""Single-prompt text generation: the simplest correct loop, kept small on purpose.

`generate()` has no KV cache: every step runs the cache-less `model(input_ids)` over the whole sequence
so far and reads the last position's logits, so step `i` costs a forward over `num_prompt_tokens + i`
tokens. That is fine for the bundled tiny model and makes the function an easy oracle; the engine
(paged MLA cache, continuous batching, MTP) replaces its insides and keeps its contract:

* the completion stops at EOS (the tokenizer's `<|eos|>`, else `config.eos_token_id`):
  `finish_reason="stop"`, the EOS id ends `token_ids` (as in the engine and vLLM) but not `text`;
  or after `max_tokens` tokens, or when prompt + completion fill the model's context
  (`max_position_embeddings`): `finish_reason="length"`;
* temperature 0 is greedy (argmax; top-k/top-p ignored); otherwise logits are divided by the
  temperature, filtered by top-k then top-p, and sampled with a `torch.Generator` seeded per call, so
  the same seed gives the same tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from models.deepseek_v3 import DeepseekV3ForCausalLM
from models.tokenizer import Tokenizer


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token.

    `max_tokens`: most completion tokens to produce. `temperature`: 0 means greedy. `top_k`: keep the k
    most likely tokens (0 = no limit). `top_p`: keep the smallest set of most likely tokens whose
    probability adds up to at least `top_p` (1.0 = no limit). `seed`: seeds this call's generator
    (None = a fresh random seed); only used when `temperature > 0`.

    The subset of `engine.sampling_params.SamplingParams` this loop understands.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 (got {self.max_tokens})")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (got {self.temperature})")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, 0 meaning no limit (got {self.top_k})")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p})")


class GenerationTiming(NamedTuple):
    """Wall-clock seconds of one `generate()` call (model loading not included).

    `prefill_s`: the forward over the prompt. `ttft_s`: from the call's start (tokenization included) to
    the first completion token. `decode_s`: from the first token to the last. `tpot_s`: mean time per
    token after the first (`decode_s / (num_tokens - 1)`; None with fewer than 2 tokens).
    `tokens_per_s`: completion tokens per second over the whole call (`num_tokens / (ttft_s + decode_s)`).
    """

    prefill_s: float
    decode_s: float
    ttft_s: float
    tpot_s: float | None
    tokens_per_s: float


class GenerationResult(NamedTuple):
    """`token_ids`: completion token ids (a final EOS included); `text`: their decoded text (EOS dropped);
    `finish_reason`: `"stop"` (EOS) or `"length"` (max_tokens or the model's context);
    `num_prompt_tokens`: tokens the prompt encoded to."""

    token_ids: list[int]
    text: str
    finish_reason: str
    num_prompt_tokens: int
    timing: GenerationTiming

    def summary(self) -> str:
        """One human-readable line: token counts, finish reason, timings (ms, tokens/s)."""
        t = self.timing
        parts = [
            f"{len(self.token_ids)} tokens ({self.finish_reason})",
            f"prompt {self.num_prompt_tokens} tokens",
            f"ttft {t.ttft_s * 1e3:.1f} ms",
        ]
        if t.tpot_s is not None:
            parts.append(f"tpot {t.tpot_s * 1e3:.1f} ms")
        parts.append(f"{t.tokens_per_s:.1f} tokens/s")
        return " | ".join(parts)


def sample_next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick one token id.

    Args:
        logits: `[vocab_size]` float32, the next position's logits.
        params: temperature / top-k / top-p (see `SamplingParams`).
        generator: on `logits.device`; unused when greedy.
    """
    if params.temperature == 0:
        return int(logits.argmax())
    logits = logits / params.temperature
    if 0 < params.top_k < logits.numel():
        kth_largest = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if params.top_p < 1:
        sorted_logits, sorted_ids = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already reach top_p (the top token always stays).
        drop = probs.cumsum(-1) - probs >= params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, sorted_ids, sorted_logits)
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


@torch.inference_mode()
def generate(
    model: DeepseekV3ForCausalLM,
    tokenizer: Tokenizer,
    prompt: str,
    params: SamplingParams,
    on_token: Callable[[int], None] | None = None,
) -> GenerationResult:
    """Complete `prompt` (no KV cache: each step re-runs the forward over the whole sequence).

    Args:
        model: on the device the computation should run on; `model.config.max_position_embeddings`
            bounds prompt + completion.
        on_token: called with each completion token id (EOS too) as soon as it is chosen (for streaming).

    Raises:
        ValueError: the prompt encodes to no tokens, or to `max_position_embeddings` tokens or more
            (no room left for a completion).
    """
    t_start = time.perf_counter()
    device = next(model.parameters()).device
    context_len = model.config.max_position_embeddings
    eos_token_id = tokenizer.eos_token_id  # the bundled tokenizer's <|eos|>; else config.json's id
    if eos_token_id is None:
        eos_token_id = getattr(model.config, "eos_token_id", None)
    prompt_ids = tokenizer.encode(prompt)
    num_prompt_tokens = len(prompt_ids)
    if num_prompt_tokens == 0:
        raise ValueError("the prompt is empty (it encodes to no tokens)")
    if num_prompt_tokens >= context_len:
        raise ValueError(
            f"the prompt is {num_prompt_tokens} tokens; the model's context (max_position_embeddings) is "
            f"{context_len}, which leaves no room for a completion"
        )
    generator = None
    if params.temperature > 0:
        generator = torch.Generator(device=device)
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed)

    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # [1, S]
    completion: list[int] = []
    finish_reason = "length"
    prefill_s = 0.0
    t_first = t_start
    while len(completion) < params.max_tokens and ids.shape[1] < context_len:
        t_step = time.perf_counter()
        logits = model(ids)[0, -1]  # [vocab_size]
        token = sample_next_token(logits, params, generator)
        if not completion:
            t_first = time.perf_counter()
            prefill_s = t_first - t_step
        completion.append(token)
        if on_token is not None:
            on_token(token)
        if token == eos_token_id:
            finish_reason = "stop"
            break
        ids = torch.cat((ids, ids.new_tensor([[token]])), dim=1)
    t_end = time.perf_counter()

    ttft_s, decode_s = t_first - t_start, t_end - t_first
    timing = GenerationTiming(
        prefill_s=prefill_s,
        decode_s=decode_s,
        ttft_s=ttft_s,
        tpot_s=decode_s / (len(completion) - 1) if len(completion) > 1 else None,
        tokens_per_s=len(completion) / (t_end - t_start),
    )
    text = tokenizer.decode(completion)
    return GenerationResult(completion, text, finish_reason, num_prompt_tokens, timing)
