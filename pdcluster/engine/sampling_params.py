"""Per-request sampling and stopping parameters (in the spirit of vLLM's `SamplingParams`).

`top_p` must stay > 0 in float32; `temperature` is 0 (greedy) or >= `MIN_TEMPERATURE`, as a smaller one
overflows float32 logits / T; `top_k` fits int64 (>= the vocabulary size disables it).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from pdcluster.engine.structured_output import check_spec

MIN_TEMPERATURE = 1e-5
"""The smallest positive temperature (see the module docstring); 0 means greedy."""
MAX_SEED = 2**64 - 1
"""The largest seed: `torch.Generator.manual_seed` takes unsigned 64-bit seeds."""
MAX_TOP_K = 2**63 - 1
"""The largest top_k: the sampler holds it in an int64 tensor."""
MAX_LOGIT_BIAS = 100.0
"""`logit_bias` values lie in [-100, 100] (OpenAI's range)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop (each field checked; ValueError names a bad one).

    temperature: 0 (greedy: argmax, `top_p`/`top_k`/`seed` unused) or finite >= `MIN_TEMPERATURE`.
    top_p: nucleus mass in (0, 1]; 1 keeps all. top_k: <= `MAX_TOP_K`; 0 or -1 disables.
    seed: in [0, `MAX_SEED`]; None seeds from OS entropy. max_tokens: >= 1 (then FINISHED_LENGTH).
    stop_token_ids: finish the request (FINISHED_STOPPED), kept in the output like EOS. stop: stop strings
    on the detokenized text (`engine.stopping`). ignore_eos: generate past EOS. logprobs: None, or how many
    top log-probabilities per output token (0: the sampled token's only; `engine.outputs.TokenLogprobs`).
    prompt_logprobs: None, or how many top log-probabilities per prompt token (`engine.prompt_logprobs`).
    structured_output: None or `(kind, spec)`, a grammar the output must match (`engine.structured_output`).
    presence_penalty, frequency_penalty: in [-2, 2], OpenAI's definitions. repetition_penalty: finite > 0,
    1 off (CTRL, Keskar et al. 2019, section 4.1). min_tokens: EOS and stop tokens are masked before this
    many outputs, <= max_tokens. logit_bias: (token id, bias) pairs or a dict, bias in [-100, 100].
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_output: tuple[str, str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and frozen into tuples, so the params stay hashable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        if not all(isinstance(pair, tuple | list) and len(pair) == 2 for pair in bias):
            raise ValueError(f"logit_bias must be (token id, bias) pairs, got {self.logit_bias!r}")
        object.__setattr__(self, "logit_bias", tuple((t, b) for t, b in bias))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))

        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE:g}: a smaller one overflows "
                f"logits / temperature in float32 or is greedy in effect (send 0), got {self.temperature!r}"
            )
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if _to_float32(self.top_p) == 0:
            raise ValueError(f"top_p must be > 0 in float32 (the sampler's precision), got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= 1, or 0 / -1 to disable it, got {self.top_k!r}")
        if self.top_k > MAX_TOP_K:
            raise ValueError(f"top_k must be <= 2**63 - 1 (int64), got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be None or an int, got {self.seed!r}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**64) (a torch.Generator seed), got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be ints >= 0, got {list(self.stop_token_ids)!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {list(self.stop)!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise ValueError(f"{name} must be None or an int >= 0, got {value!r}")
        if self.structured_output is not None:
            object.__setattr__(self, "structured_output", check_spec(self.structured_output))
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        penalty = self.repetition_penalty
        if not _is_real(penalty) or not math.isfinite(penalty) or penalty <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {penalty!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an int in [0, max_tokens], got {self.min_tokens!r}")
        for token_id, value in self.logit_bias:
            if not _is_int(token_id) or token_id < 0:
                raise ValueError(f"logit_bias token ids must be ints >= 0, got {token_id!r}")
            if not _is_real(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {value!r}")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise ValueError("logit_bias names a token id twice")
        object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias)))

    @property
    def is_greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0)."""
        return self.temperature == 0

    @property
    def has_logit_processors(self) -> bool:
        """True when a penalty, `logit_bias` or `min_tokens` changes the logits before sampling."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
            or self.min_tokens
            or self.logit_bias
        )

    @property
    def top_k_enabled(self) -> bool:
        """True when `top_k` filters the distribution (0 and -1 mean off)."""
        return self.top_k > 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _to_float32(value: float) -> float:
    """`value` rounded to the nearest float32 (for values in float32's range, as top_p in (0, 1])."""
    return struct.unpack("f", struct.pack("f", value))[0]
