"""Offline API in the spirit of vLLM's: `LLM(model=DIR, **engine_args).generate(prompts, SamplingParams)`.

`LLMEngine` is the step loop of one instance (a prefill or decode node wraps one):

    add_request(...)   between steps
    step()             schedule -> execute (forward, sample/verify, MTP drafts) -> commit -> outputs
    abort_request(...) between steps

With `async_scheduling`, step N+1 is scheduled and its inputs are packed on the calling thread while step
N's forward runs on a worker thread (see `engine.async_loop`); each `step()` then returns the outputs of
the step before, and the tokens are the same as the synchronous loop's.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.async_loop import AsyncStepLoop
from engine.config import EngineConfig
from engine.executor import Executor
from engine.model_runner import LayerKVCallback, ModelRunner
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.scheduler_policy import SchedulerConfig, cdiv
from models.deepseek_v3 import DeepseekV3ForCausalLM
from models.tokenizer import Tokenizer


@dataclass
class RequestOutput:
    """The result of one request.

    Times are seconds on the engine's monotonic clock: `ttft_s` arrival -> first token, `tpot_s` mean gap
    between later tokens, `queue_s` arrival -> first scheduled. `acceptance_rate` is accepted / proposed
    draft tokens (None without speculative decoding); the per-position lists count each draft depth.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int = 0
    queue_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_draft_tokens_per_position: list[int] = field(default_factory=list)
    num_accepted_tokens_per_position: list[int] = field(default_factory=list)
    num_preemptions: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LLMEngine:
    """One engine instance: model, KV cache, scheduler, executor."""

    def __init__(self, config: EngineConfig, model: DeepseekV3ForCausalLM | None = None) -> None:
        self.config = config
        torch.manual_seed(config.seed)
        self.model = model or DeepseekV3ForCausalLM.from_pretrained(
            config.model, device=config.device, dtype=_DTYPES[config.dtype]
        )
        self.tokenizer = Tokenizer.from_dir(config.model)
        model_cfg = self.model.config
        self.max_model_len = config.max_model_len or model_cfg.max_position_embeddings
        if self.max_model_len > model_cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                f"{model_cfg.max_position_embeddings}"
            )
        num_blocks = config.num_kv_blocks
        if num_blocks is None:
            probe = ModelRunner(self.model, 1, config.block_size, config.kv_cache_dtype)
            num_blocks = max(
                1, config.kv_cache_memory_bytes // (probe.kv_cache_bytes_per_token * config.block_size)
            )
        self.runner = ModelRunner(self.model, num_blocks, config.block_size, config.kv_cache_dtype)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                block_size=config.block_size,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                num_lookahead_tokens=max(0, config.num_speculative_tokens - 1),
            ),
            num_blocks,
            config.enable_prefix_caching,
            num_draft_placeholders=config.num_speculative_tokens if config.async_scheduling else 0,
        )
        self.executor = Executor(
            self.runner,
            config.num_speculative_tokens,
            max_num_tokens=config.max_num_batched_tokens,
            max_num_reqs=config.max_num_seqs,
            # positions < max_model_len, plus the lookahead slots of chained MTP drafts
            max_num_blocks_per_req=cdiv(
                self.max_model_len + config.num_speculative_tokens, config.block_size
            ),
        )
        self._async_loop = AsyncStepLoop(self.scheduler, self.executor) if config.async_scheduling else None
        self._prompts: dict[str, str | None] = {}
        self._texts: dict[str, str] = {}
        self._finished: dict[str, Request] = {}
        self._ids = itertools.count()

    # ---- requests ------------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time_s: float | None = None,
    ) -> str:
        """Queue a prompt (text or token ids). Returns the request id.

        Raises:
            ValueError: empty prompt, prompt + max_tokens over `max_model_len`, or a request the KV cache
                could never hold.
        """
        params = sampling_params or SamplingParams()
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty (no tokens)")
        if any(not 0 <= t < self.model.config.vocab_size for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.model.config.vocab_size})")
        request_id = request_id if request_id is not None else str(next(self._ids))
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_id=self.tokenizer.eos_token_id,
            arrival_time_s=time.monotonic() if arrival_time_s is None else arrival_time_s,
        )
        self.scheduler.add_request(request)
        self._prompts[request_id] = text
        self._texts[request_id] = ""
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Abort a queued or running request and free its KV blocks. False if it is unknown/finished."""
        request = self.scheduler.get_request(request_id)
        if request is None or not self.scheduler.abort(request_id):
            return False
        self._finished[request_id] = request
        if self._async_loop is not None and not self.scheduler.has_unfinished():
            self._async_loop.drain()
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ------------------------------------------------------------------------------------
    def step(self, on_layer_kv: LayerKVCallback | None = None) -> list[RequestOutput]:
        """Run one step; returns outputs of the requests that produced tokens or finished.

        With `async_scheduling` the step submitted by this call is still running when it returns: the
        outputs are those of the previous call's step (none on the first call), and `on_layer_kv` is
        called on the worker thread, for the step submitted by this call.
        """
        if self._async_loop is None:
            output = self.scheduler.schedule()
            runner_output = self.executor.execute(output, on_layer_kv)
            updates = self.scheduler.update_from_output(output, runner_output)
        else:
            output, updates = self._async_loop.step(on_layer_kv)
        requests = {item.request_id: item.request for item in output.scheduled} if output else {}
        results = []
        for update in updates:
            request = requests[update.request_id]
            self._texts[update.request_id] = self._detokenize(request)
            stop_at = self._find_stop_string(request)
            if stop_at is not None and not update.finished:
                self.scheduler.finish_request(update.request_id, RequestStatus.FINISHED_STOPPED)
            if request.is_finished:
                self._finished[update.request_id] = request
                if self._async_loop is None:  # async: the executor drops it after the step in flight
                    self.executor.drop([update.request_id])
            results.append(self._output(request))
        for request_id in list(self._finished):
            if request_id not in {u.request_id for u in updates}:
                results.append(self._output(self._finished[request_id]))
            self._finished.pop(request_id)
        if self._async_loop is not None and not self.scheduler.has_unfinished():
            self._async_loop.drain()
        return results

    def _detokenize(self, request: Request) -> str:
        return self.tokenizer.decode(request.output_token_ids)

    def _find_stop_string(self, request: Request) -> int | None:
        text = self._texts[request.request_id]
        hits = [text.find(s) for s in request.sampling_params.stop if s in text]
        if not hits:
            return None
        self._texts[request.request_id] = text[: min(hits)]
        return min(hits)

    def _output(self, request: Request) -> RequestOutput:
        rid = request.request_id
        out = RequestOutput(
            request_id=rid,
            prompt=self._prompts.get(rid),
            prompt_token_ids=request.prompt_token_ids,
            text=self._texts.get(rid, ""),
            token_ids=list(request.output_token_ids),
            finished=request.is_finished,
            finish_reason=request.status.finish_reason,
            num_cached_tokens=max(0, request.num_cached_tokens),
            queue_s=request.queue_time_s,
            ttft_s=request.ttft_s,
            tpot_s=request.tpot_s,
            e2e_s=None
            if request.finished_time_s is None
            else request.finished_time_s - request.arrival_time_s,
            num_draft_tokens=request.num_draft_tokens,
            num_accepted_tokens=request.num_accepted_tokens,
            num_draft_tokens_per_position=list(request.num_draft_tokens_per_position),
            num_accepted_tokens_per_position=list(request.num_accepted_tokens_per_position),
            num_preemptions=request.num_preemptions,
        )
        if request.is_finished:
            self._prompts.pop(rid, None)
            self._texts.pop(rid, None)
        return out


class LLM:
    """Offline batch generation: `LLM(model=DIR, num_speculative_tokens=1).generate(prompts, params)`.

    Keyword arguments are `EngineConfig` fields (device, dtype, block_size, num_kv_blocks, kv_cache_dtype,
    max_num_batched_tokens, max_num_seqs, enable_prefix_caching, enable_chunked_prefill,
    num_speculative_tokens, async_scheduling, ...).
    """

    def __init__(self, model: str | Path, **engine_args) -> None:
        self.engine = LLMEngine(EngineConfig(model=str(model), **engine_args))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns outputs in prompt order.

        Raises:
            ValueError: an invalid prompt (see `LLMEngine.add_request`); nothing is queued then.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        engine = self.engine
        ids = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                ids.append(engine.add_request(prompt, p or SamplingParams()))
        except ValueError:
            for rid in ids:  # all or nothing: withdraw the prompts queued before the bad one
                engine.abort_request(rid)
                engine._finished.pop(rid, None)
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
