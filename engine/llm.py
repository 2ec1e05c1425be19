"""Offline API in the spirit of vLLM's: `LLM(model=DIR, **engine_args).generate(prompts, SamplingParams)`.

`LLMEngine` is the step loop of one instance (a prefill or decode node wraps one):

    add_request(...)   between steps
    step()             schedule -> execute (forward, sample/verify, MTP drafts) -> commit -> outputs
    abort_request(...) between steps

With `async_scheduling`, step N+1 is scheduled and its inputs are packed on the calling thread while step
N's forward runs on a worker thread (see `engine.async_loop`); each `step()` then returns the outputs of
the step before, and the tokens are the same as the synchronous loop's.

Failures are confined to the requests they concern: an error in one request's sampling or drafting
finishes that request alone (finish_reason "error", `RequestOutput.error`); an exception in the batched
execution of a step (synchronous loop) finishes the requests that step ran and raises `EngineStepError`
with their outputs, while requests it did not run go on with the next `step()`.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from engine.async_loop import AsyncStepLoop
from engine.config import EngineConfig
from engine.executor import Executor
from engine.model_runner import LayerKVCallback, ModelRunner
from engine.outputs import SchedulerOutput, TokenLogprobs
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.scheduler_policy import SchedulerConfig, cdiv
from kernels.kv_quant import dequantize_kv_int8
from kernels.paged_mla import gather_kv, write_kv
from models.deepseek_v3 import DeepseekV3ForCausalLM
from models.dtypes import MODEL_DTYPES, torch_dtype
from models.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class RequestOutput:
    """The result of one request.

    Times are seconds on the engine's monotonic clock: `ttft_s` arrival -> first token, `tpot_s` mean gap
    between later tokens, `queue_s` arrival -> first scheduled. `acceptance_rate` is accepted / proposed
    draft tokens (None without speculative decoding); the per-position lists count each draft depth.
    `logprobs`: one `TokenLogprobs` per output token when `SamplingParams.logprobs` is set, else None.
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
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None  # finish_reason "error": why the request failed

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None


class EngineStepError(RuntimeError):
    """`LLMEngine.step()` (synchronous loop): executing the step raised, so the state of the requests it
    ran (KV written, sampling) is unknown. Those requests are finished with finish_reason "error" and
    their blocks freed; requests the step did not run are untouched and continue with the next `step()`.

    Attributes:
        outputs: what the failed `step()` would have returned: the final outputs of the step's requests
            (finish_reason "error", `error` set) and of requests finished outside the step (aborts,
            admissions), which the caller must still report.
    """

    def __init__(self, message: str, outputs: list[RequestOutput]) -> None:
        super().__init__(message)
        self.outputs = outputs


class PrefillResult(NamedTuple):
    """What a prefill-only request hands to decode besides its prompt KV (`LLMEngine.pop_prefill_result`).

    first_token_id: the token sampled after the prompt.
    draft_token_ids: MTP drafts proposed after it (empty without speculative decoding).
    draft_probs: `[num_drafts, vocab_size]` float32 MTP probabilities of sampled drafts; None when greedy.
    last_hidden: `[hidden_size]` final hidden state at the last prompt position.
    """

    first_token_id: int
    draft_token_ids: list[int]
    draft_probs: torch.Tensor | None
    last_hidden: torch.Tensor


# Called once per layer (MTP layer: index num_hidden_layers) when a prefill-only request's prompt KV of that
# layer is complete: (request_id, layer_idx, latent_kv [num_prompt_tokens, kv_dim] in the model dtype).
PromptKVCallback = Callable[[str, int, torch.Tensor], None]


class LLMEngine:
    """One engine instance: model, KV cache, scheduler, executor."""

    def __init__(self, config: EngineConfig, model: DeepseekV3ForCausalLM | None = None) -> None:
        self.config = config
        self.model = model or DeepseekV3ForCausalLM.from_pretrained(
            config.model, device=config.device, dtype=torch_dtype(config.dtype, "dtype", MODEL_DTYPES)
        )
        self.tokenizer = Tokenizer.from_dir(config.model)
        # The tokenizer's end-of-text token, else the config's (public DeepSeek tokenizers name it otherwise).
        self.eos_token_id = (
            self.tokenizer.eos_token_id
            if self.tokenizer.eos_token_id is not None
            else self.model.config.eos_token_id
        )
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
            adaptive_min_accept_prob=config.adaptive_speculation_min_accept_prob
            if config.adaptive_speculation
            else None,
        )
        self._async_loop = AsyncStepLoop(self.scheduler, self.executor) if config.async_scheduling else None
        self._prompts: dict[str, str | None] = {}
        self._texts: dict[str, str] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._finished: dict[str, Request] = {}
        self._ids = itertools.count()
        self._prefill_results: dict[str, PrefillResult] = {}
        self._reserved_slots: dict[str, torch.Tensor] = {}  # reserved request id -> prompt slots [P]
        self._logprobs: dict[str, list[TokenLogprobs]] = {}  # request id -> per committed output token

    # ---- requests ------------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time_s: float | None = None,
        prefill_only: bool = False,
    ) -> str:
        """Queue a prompt (text or token ids). Returns the request id.

        `prefill_only`: the prefill half of a disaggregated request: it stops after its first sampled token
        (max_tokens 1); with MTP the step that samples it also runs the MTP layer over the prompt and
        proposes the first drafts. Pass `on_prompt_kv` to `step` to receive its KV per layer, and take the
        first token, drafts and last hidden state with `pop_prefill_result` once it finished.

        Raises:
            ValueError: empty prompt, prompt + max_tokens over `max_model_len`, a request the KV cache
                could never hold, or `logprobs` over the vocabulary size.
        """
        params = sampling_params or SamplingParams()
        if params.logprobs is not None and params.logprobs > self.model.config.vocab_size:
            raise ValueError(f"logprobs must be <= the vocabulary size {self.model.config.vocab_size}")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty (no tokens)")
        if any(not 0 <= t < self.model.config.vocab_size for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.model.config.vocab_size})")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if prefill_only:
            params = dataclasses.replace(params, max_tokens=1, stop=())
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time_s=time.monotonic() if arrival_time_s is None else arrival_time_s,
            export_kv=prefill_only,
        )
        self.scheduler.add_request(request)
        if params.logprobs is not None:
            self._logprobs[request_id] = []
        self._prompts[request_id] = text
        self._texts[request_id] = ""
        return request_id

    def pop_prefill_result(self, request_id: str) -> PrefillResult | None:
        """The first token, drafts and last hidden state of a finished prefill-only request (once)."""
        return self._prefill_results.pop(request_id, None)

    # ---- requests prefilled elsewhere (decode side of a disaggregated request) ------------------------
    def reserve_remote_prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        num_draft_tokens: int = 0,
        arrival_time_s: float | None = None,
    ) -> bool:
        """Hold KV blocks for a request whose prompt KV another instance computes: the prompt, the first
        token and `num_draft_tokens` drafts (what its first decode step writes). Between steps.

        Then `write_prompt_kv` per layer (any thread), and `admit_remote_prefill` (between steps), or
        `release_remote_prefill` on failure. Returns False (nothing held) when the blocks are not free now.

        Raises:
            ValueError: a duplicate id, a bad prompt, a request that could never fit, or `logprobs` (the
                first token's log-probabilities stay on the prefill instance: not supported yet).
        """
        if sampling_params.logprobs is not None:
            raise ValueError("logprobs are not supported for requests prefilled on another instance yet")
        if not prompt_token_ids or any(not 0 <= t < self.model.config.vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be non-empty and in [0, {self.model.config.vocab_size})")
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=sampling_params,
            eos_token_id=self.eos_token_id,
            arrival_time_s=time.monotonic() if arrival_time_s is None else arrival_time_s,
        )
        num_prompt_tokens = len(prompt_token_ids)
        if not self.scheduler.reserve(request, num_prompt_tokens + 1 + num_draft_tokens):
            return False
        slots = self.scheduler.block_manager.slot_mapping(request, 0, num_prompt_tokens)
        self._reserved_slots[request_id] = torch.tensor(slots, dtype=torch.long, device=self.runner.device)
        return True

    def write_prompt_kv(self, request_id: str, layer_idx: int, latent_kv: torch.Tensor) -> None:
        """Write one layer's received prompt KV (`[num_prompt_tokens, kv_dim]`, model dtype; MTP layer at
        index num_hidden_layers) into the reserved blocks. Safe from a receive thread while steps run: the
        reserved blocks belong to no scheduled request.

        Raises:
            KeyError: no reservation; ValueError: a shape mismatch.
        """
        slots = self._reserved_slots[request_id]
        write_kv(
            self.runner.kv_caches[layer_idx],
            latent_kv.to(self.runner.device, self.runner.dtype),
            slots,
            self.runner.kv_scales[layer_idx],
        )

    def admit_remote_prefill(
        self,
        request_id: str,
        first_token_id: int,
        draft_token_ids: list[int] = (),  # type: ignore[assignment]
        draft_probs: torch.Tensor | None = None,
    ) -> None:
        """Admit a reserved request whose prompt KV is written (every layer, MTP included) with its first
        token and drafts. Between steps. It joins the running batch at the next `step()` if fewer than
        `max_num_seqs` requests run, else waits for a seat there (holding its blocks; never an error).
        Its output (first token included) comes with the first `step()` that runs it; when the first
        token already finished it (max_tokens=1, EOS), also from `pop_finished_outputs()`, as nothing is
        left to step for it.

        Raises:
            KeyError: no reservation.
        """
        self._reserved_slots.pop(request_id)
        request = self.scheduler.reserved[request_id]
        status = self.scheduler.admit_reserved(request_id, first_token_id, list(draft_token_ids))
        self._prompts[request_id] = None
        self._texts[request_id] = self._detokenize(request, final=status.is_finished)
        if status.is_finished:
            self._finished[request_id] = request
        elif request.spec_token_ids:
            self.executor.set_draft_probs(request_id, draft_probs)

    def release_remote_prefill(self, request_id: str) -> bool:
        """Give back a reservation's blocks (handoff failed or cancelled). Between steps. False if unknown."""
        self._reserved_slots.pop(request_id, None)
        return self.scheduler.release_reserved(request_id)

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

    def pop_finished_outputs(self, request_ids: list[str] | None = None) -> list[RequestOutput]:
        """Between steps: the outputs of requests that finished outside a step (the first token of
        `admit_remote_prefill` finished them, or `abort_request`), which the next `step()` would report,
        and forgets them (`request_ids`: only those). Lets a caller with nothing left to step get them
        at once, or drop an aborted request's output."""
        ids = list(self._finished) if request_ids is None else [r for r in request_ids if r in self._finished]
        return [self._output(self._finished.pop(rid)) for rid in ids]

    # ---- the step ------------------------------------------------------------------------------------
    def step(
        self,
        on_layer_kv: LayerKVCallback | None = None,
        on_prompt_kv: PromptKVCallback | None = None,
    ) -> list[RequestOutput]:
        """Run one step; returns outputs of the requests that produced tokens or finished.

        With `async_scheduling` the step submitted by this call is still running when it returns: the
        outputs are those of the previous call's step (none on the first call), and `on_layer_kv` is
        called on the worker thread, for the step submitted by this call.

        `on_prompt_kv(request_id, layer_idx, latent_kv)` (synchronous loop only): for each prefill-only
        request whose last prompt chunk runs in this step, called right after each layer's KV is written,
        main layers then the MTP layer, with the whole prompt's KV of that layer (read back from the paged
        cache, so earlier chunks and prefix-cache hits are included).

        A request whose own sampling or drafting raised comes back finished with finish_reason "error".

        Raises:
            EngineStepError: (synchronous loop) executing the step raised; the requests it ran are
                finished with an error (in `EngineStepError.outputs`), the others go on. With
                `async_scheduling` such an exception propagates unchanged.
        """
        if on_prompt_kv is not None and self._async_loop is not None:
            raise ValueError("on_prompt_kv needs the synchronous loop (async_scheduling=False)")
        if self._async_loop is None:
            output = self.scheduler.schedule()
            exporting = [item for item in output.scheduled if item.samples and item.request.export_kv]
            hook = on_layer_kv
            if exporting and on_prompt_kv is not None:
                hook = self._prompt_kv_hook(exporting, on_layer_kv, on_prompt_kv)
            try:
                runner_output = self.executor.execute(output, hook)
            except Exception as e:  # noqa: BLE001 - fail the requests this step ran, not the engine
                raise self._step_failed(output, e) from e
            for item in exporting:
                rid = item.request_id
                sampled = runner_output.sampled_token_ids.get(rid)
                if sampled:
                    self._prefill_results[rid] = PrefillResult(
                        first_token_id=sampled[-1],
                        draft_token_ids=list(runner_output.spec_token_ids.get(rid, [])),
                        draft_probs=runner_output.draft_probs.get(rid),
                        last_hidden=runner_output.last_hidden_states[rid],
                    )
            updates = self.scheduler.update_from_output(output, runner_output)
        else:
            output, runner_output, updates = self._async_loop.step(on_layer_kv)
        for update in updates:
            if update.request_id in self._logprobs and runner_output is not None:
                new = runner_output.logprobs.get(update.request_id, [])
                self._logprobs[update.request_id].extend(new[: len(update.new_token_ids)])
        requests = {item.request_id: item.request for item in output.scheduled} if output else {}
        results = []
        for update in updates:
            request = requests[update.request_id]
            self._texts[update.request_id] = self._detokenize(request, final=update.finished)
            stop_at = self._find_stop_string(request)
            if stop_at is not None and update.finished:  # the stop string came before max_tokens / EOS
                request.status = RequestStatus.FINISHED_STOPPED
            elif stop_at is not None:
                self.scheduler.finish_request(update.request_id, RequestStatus.FINISHED_STOPPED)
            if request.is_finished:
                self._finished[update.request_id] = request
                if self._async_loop is None:  # async: the executor drops it after the step in flight
                    self.executor.drop([update.request_id])
            results.append(self._output(request))
        updated = {u.request_id for u in updates}
        for request_id, request in self._finished.items():  # finished outside the step (abort, admission)
            if request_id not in updated:
                results.append(self._output(request))
        self._finished.clear()
        if self._async_loop is not None and not self.scheduler.has_unfinished():
            self._async_loop.drain()
        return results

    def _step_failed(self, output: SchedulerOutput, error: Exception) -> EngineStepError:
        """Finish every request `output` scheduled with FINISHED_ERROR (blocks freed, executor state
        dropped) and return the `EngineStepError` carrying their outputs and those of requests finished
        outside the step."""
        message = f"engine step failed: {error!r}"
        failed = [item.request for item in output.scheduled]
        for request in failed:
            if self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ERROR, message):
                self._finished[request.request_id] = request
        self.executor.drop([request.request_id for request in failed])
        outputs = [self._output(request) for request in self._finished.values()]
        self._finished.clear()
        return EngineStepError(message, outputs)

    def _prompt_kv_hook(
        self,
        items: list,
        on_layer_kv: LayerKVCallback | None,
        on_prompt_kv: PromptKVCallback,
    ) -> LayerKVCallback:
        runner = self.runner
        tables = [
            (item.request_id, torch.tensor(item.block_ids, dtype=torch.long), item.request.num_prompt_tokens)
            for item in items
        ]

        def hook(layer_idx: int, latent_kv: torch.Tensor, batch) -> None:
            if on_layer_kv is not None:
                on_layer_kv(layer_idx, latent_kv, batch)
            for request_id, table, num_prompt_tokens in tables:
                latent, scale = gather_kv(
                    runner.kv_caches[layer_idx],
                    table.to(runner.device),
                    num_prompt_tokens,
                    runner.kv_scales[layer_idx],
                )
                if scale is not None:
                    latent = dequantize_kv_int8(latent, scale, runner.dtype)
                on_prompt_kv(request_id, layer_idx, latent)

        return hook

    def _detokenize(self, request: Request, final: bool) -> str:
        detokenizer = self._detokenizers.get(request.request_id)
        if detokenizer is None:
            detokenizer = self._detokenizers[request.request_id] = IncrementalDetokenizer(self.tokenizer)
        return detokenizer.update(request.output_token_ids, final)

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
            logprobs=list(self._logprobs[rid]) if rid in self._logprobs else None,
            error=request.error,
        )
        if request.is_finished:
            self._logprobs.pop(rid, None)
            self._prompts.pop(rid, None)
            self._texts.pop(rid, None)
            self._detokenizers.pop(rid, None)
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
                engine.pop_finished_outputs([rid])
                engine._logprobs.pop(rid, None)
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
