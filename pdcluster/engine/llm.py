"""Offline API in the spirit of vLLM's: `LLM(model=DIR, **engine_args).generate(prompts, SamplingParams)`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.llm_engine import (
    EngineStepError,
    LLMEngine,
    PrefillOutput,
    PromptKVCallback,
    RequestOutput,
)
from pdcluster.engine.sampling_params import SamplingParams

__all__ = ["LLM", "EngineStepError", "LLMEngine", "PrefillOutput", "PromptKVCallback", "RequestOutput"]


class LLM:
    """Offline batch generation: `LLM(model=DIR, num_speculative_tokens=1).generate(prompts, params)`."""

    def __init__(self, model: str | Path, **engine_args) -> None:
        self.engine = LLMEngine(EngineConfig(model=str(model), **engine_args))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns outputs in prompt order.
        Raises ValueError: an invalid prompt (see `LLMEngine.add_request`); nothing is queued then."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        engine = self.engine
        ids = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                ids.append(engine.add_request(prompt, p or SamplingParams(), stream=False))
        except ValueError:
            for rid in ids:
                engine.abort_request(rid)
                engine.pop_finished_outputs([rid])
            raise
        results: dict[str, RequestOutput] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out
        return [results[rid] for rid in ids]

    def replace_config(self, **changes) -> LLM:
        """A new LLM over the same weights with other engine arguments (tests compare settings)."""
        new = object.__new__(LLM)
        new.engine = LLMEngine(dataclasses.replace(self.engine.config, **changes), model=self.engine.model)
        new.tokenizer = new.engine.tokenizer
        return new
