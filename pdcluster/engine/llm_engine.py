"""`LLMEngine`: the step loop of one instance (a prefill or decode node wraps one)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.distributed import ProcessGroup

from pdcluster.engine.async_loop import AsyncStepLoop
from pdcluster.engine.compile_setup import compile_stats, install_compiled_forwards
from pdcluster.engine.compiled_forward import CompileStats
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.elastic_ep import roll_back_step
from pdcluster.engine.engine_build import assign_kv_pool, build_executor, build_kv_and_scheduler
from pdcluster.engine.expert_parallel import EPStats, setup_expert_parallel
from pdcluster.engine.model_runner import LayerKVCallback
from pdcluster.engine.outputs import RequestOutput, SchedulerOutput, TokenLogprobs
from pdcluster.engine.prompt_logprobs import record_prompt_logprobs
from pdcluster.engine.remote_prefill import (
    PrefillOutput,
    PromptKVCallback,
    RemotePrefillReservations,
    export_callbacks,
    prefill_result,
)
from pdcluster.engine.request import Request, RequestStatus
from pdcluster.engine.request_record import RequestRecord, step_outputs
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.stopping import OutputText
from pdcluster.models.deepseek_v3 import DeepseekV3ForCausalLM
from pdcluster.models.dtypes import MODEL_DTYPES, torch_dtype
from pdcluster.models.tokenizer import Tokenizer

__all__ = [
    "CompileStats",
    "EngineStepError",
    "LLMEngine",
    "PrefillOutput",
    "PromptKVCallback",
    "RequestOutput",
    "RequestRecord",
]

logger = logging.getLogger(__name__)


class EngineStepError(RuntimeError):
    """`LLMEngine.step()` (synchronous loop) raised executing the step: its requests' state is unknown."""

    def __init__(self, message: str, outputs: list[RequestOutput]) -> None:
        super().__init__(message)
        self.outputs = outputs


class LLMEngine:
    """One engine, or one rank of an EP instance (`config.parallel`; `group`: its process group)."""

    def __init__(
        self,
        config: EngineConfig,
        model: DeepseekV3ForCausalLM | None = None,
        group: ProcessGroup | None = None,
        shared_kv_cache: bool = False,
    ) -> None:
        self.config = config
        dtype = torch_dtype(config.dtype, "dtype", MODEL_DTYPES)
        # EP: this rank's shard of experts and the runtime that keeps the ranks in lockstep; else None.
        model, self.ep = setup_expert_parallel(config, model, group, dtype)
        self.model = model or DeepseekV3ForCausalLM.from_pretrained(
            config.model, device=config.device, dtype=dtype
        )
        self.tokenizer = Tokenizer.from_dir(config.model)
        # The tokenizer's end-of-text token, else the config's (public DeepSeek tokenizers name it otherwise).
        eos = self.tokenizer.eos_token_id
        self.eos_token_id = eos if eos is not None else self.model.config.eos_token_id
        model_cfg = self.model.config
        self.max_model_len = config.max_model_len or model_cfg.max_position_embeddings
        if self.max_model_len > model_cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                f"{model_cfg.max_position_embeddings}"
            )
        self.kv_layout, self.runner, self.scheduler = build_kv_and_scheduler(
            config, self.model, self.max_model_len, shared_kv_cache
        )
        self.executor = build_executor(config, self.runner, self.scheduler, self.tokenizer)
        self._compile_s = 0.0
        self._compile_error: str | None = None
        if config.compile:
            self._compile_s, self._compile_error = install_compiled_forwards(
                self.runner, config, self.executor.max_num_blocks_per_req
            )
        self.remote_prefills = RemotePrefillReservations(self.scheduler, self.runner)
        self._async_loop = AsyncStepLoop(self.scheduler, self.executor) if config.async_scheduling else None
        self._records: dict[str, RequestRecord] = {}
        self._finished: list[str] = []
        self._ids = itertools.count()
        self.hold_on_ep_failure = False  # EP: a lost peer's step is rolled back (`step`)

    def add_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time_s: float | None = None,
        prefill_only: bool = False,
        stream: bool = True,
    ) -> str:
        """Queue a prompt (text or token ids). Raises ValueError: empty prompt, prompt + max_tokens over
        `max_model_len`, a request the KV cache could never hold, `logprobs` over the vocabulary size, a
        `logit_bias` token id outside it, or a `structured_output` grammar that does not compile
        (`engine.structured_output.GrammarError`)."""
        params = sampling_params or SamplingParams()
        if max(params.logprobs or 0, params.prompt_logprobs or 0) > (vocab := self.model.config.vocab_size):
            raise ValueError(f"logprobs and prompt_logprobs must be <= the vocabulary size {vocab}")
        bad = next((t for t, _ in params.logit_bias if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias token id {bad} is outside the vocabulary [0, {vocab})")
        if params.structured_output is not None:
            self.executor.structured_outputs.compiler.compile(params.structured_output)
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty (no tokens)")
        if any(not 0 <= t < self.model.config.vocab_size for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.model.config.vocab_size})")
        request_id = request_id if request_id is not None else str(next(self._ids))
        max_tokens = params.max_tokens
        if prefill_only:
            # min_tokens >= 1 still holds EOS and stop tokens back from the first token
            params = dataclasses.replace(params, max_tokens=1, stop=(), min_tokens=min(params.min_tokens, 1))
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time_s=time.monotonic() if arrival_time_s is None else arrival_time_s,
            export_kv=prefill_only,
        )
        assign_kv_pool(self.kv_layout, request, max_tokens, self.config.block_size)
        self.scheduler.add_request(request)
        self._records[request_id] = self._new_record(request, text)
        self._records[request_id].stream = stream
        return request_id

    def _new_record(self, request: Request, prompt: str | None) -> RequestRecord:
        params = request.sampling_params
        return RequestRecord(
            request,
            prompt,
            OutputText(self.tokenizer, params.stop),
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )

    def pop_prefill_result(self, request_id: str) -> PrefillOutput | None:
        """The first token and drafts of a finished prefill-only request (once)."""
        record = self._records.get(request_id)
        if record is None or record.prefill_result is None or not record.request.is_finished:
            return None
        del self._records[request_id]
        return record.prefill_result._replace(prompt_logprobs=record.finished_prompt_logprobs())

    def reserve_remote_prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        num_draft_tokens: int = 0,
        arrival_time_s: float | None = None,
    ) -> bool:
        """Hold KV blocks for a request whose prompt KV another instance computes: the prompt, the first token
        and `num_draft_tokens` drafts (what its first decode step writes).
        Raises ValueError: a duplicate id, a bad prompt, or a request that could never fit."""
        vocab_size = self.model.config.vocab_size
        if not prompt_token_ids or any(not 0 <= t < vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be non-empty and in [0, {vocab_size})")
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=sampling_params,
            eos_token_id=self.eos_token_id,
            arrival_time_s=time.monotonic() if arrival_time_s is None else arrival_time_s,
        )
        assign_kv_pool(self.kv_layout, request, sampling_params.max_tokens, self.config.block_size)
        return self.remote_prefills.reserve(request, num_draft_tokens)

    def write_prompt_kv(self, request_id: str, layer_idx: int, *kv: Any, **named: Any) -> int | None:
        """`RemotePrefillReservations.write_prompt_kv` (the same arguments)."""
        return self.remote_prefills.write_prompt_kv(request_id, layer_idx, *kv, **named)

    def reserved_block_ids(self, request_id: str) -> list[int]:
        """The block table of a reservation (`reserve_remote_prefill`), in position order."""
        return self.remote_prefills.block_ids(request_id)

    def admit_remote_prefill(
        self,
        request_id: str,
        first_token_id: int,
        draft_token_ids: list[int] = (),  # type: ignore[assignment]
        draft_probs: torch.Tensor | None = None,
        first_token_logprobs: TokenLogprobs | None = None,
    ) -> None:
        """Admit a reserved request whose prompt KV is written (every layer, MTP included) with its first
        token, its logprobs (computed on prefill; None: the request asks for none) and drafts.
        Raises KeyError: no reservation."""
        request, status = self.remote_prefills.admit(request_id, first_token_id, list(draft_token_ids))
        record = self._records[request_id] = self._new_record(request, None)
        if record.logprobs is not None and first_token_logprobs is not None:
            record.logprobs.append(first_token_logprobs)
        self._update_text(record)
        if request.is_finished:
            self._finished.append(request_id)
        elif request.spec_token_ids:
            self.executor.set_draft_probs(request_id, draft_probs)

    def take_new_text(self, request_id: str) -> str:
        """Between steps: the text released for `request_id` since its previous output
        (`RequestOutput.new_text`), taken now, so its next output carries only what follows.
        """
        record = self._records.get(request_id)
        if record is None:
            return ""
        return record.output_text.new_text(finished=record.request.is_finished)

    def release_remote_prefill(self, request_id: str) -> bool:
        """Give back a reservation's blocks (handoff failed or cancelled)."""
        return self.remote_prefills.release(request_id)

    def abort_request(self, request_id: str) -> bool:
        """Abort a queued or running request and free its KV blocks."""
        request = self.scheduler.get_request(request_id)
        if request is None or not self.scheduler.abort(request_id):
            return False
        self._finished.append(request_id)
        if self._async_loop is not None and not self.scheduler.has_unfinished():
            self._async_loop.drain()
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def pop_finished_outputs(self, request_ids: list[str] | None = None) -> list[RequestOutput]:
        """Between steps: the outputs of requests that finished outside a step (the first token of
        `admit_remote_prefill` finished them, or `abort_request`), which the next `step()` would report,
        and forgets them (`request_ids`: only those).
        """
        wanted = (
            list(self._finished) if request_ids is None else [r for r in request_ids if r in self._finished]
        )
        self._finished = [r for r in self._finished if r not in wanted]
        return [self._output(self._records[rid]) for rid in wanted]

    def step(
        self,
        on_layer_kv: LayerKVCallback | None = None,
        on_prompt_kv: PromptKVCallback | None = None,
        while_executing: Callable[[], AbstractContextManager[Any]] | None = None,
        on_first_token: Callable[[str, int], None] | None = None,
    ) -> list[RequestOutput]:
        """Run one step; returns outputs of the requests that produced tokens or finished.

        Raises:
            EngineStepError: (synchronous loop) executing the step raised; its requests finished with an
            error (`EngineStepError.outputs`; EP: every request, none with `hold_on_ep_failure`: rolled
            back), the others go on. With `async_scheduling` such an exception propagates unchanged.
        """
        if (on_prompt_kv is not None or on_first_token is not None) and self._async_loop is not None:
            raise ValueError("on_prompt_kv and on_first_token need the synchronous loop (no async loop)")
        if self._async_loop is None:
            output = self.scheduler.schedule()
            decode = output.rows is not None and output.rows.decode is not None  # none exports
            exporting = (
                [] if decode else [it for it in output.scheduled if it.samples and it.request.export_kv]
            )
            hook, flush_prompt_kv, on_sampled = on_layer_kv, None, None
            if exporting:
                last_layer_idx = self.model.main_layers[-1].layer_idx
                hook, flush_prompt_kv, on_sampled = export_callbacks(
                    self.runner, exporting, on_layer_kv, on_prompt_kv, on_first_token, last_layer_idx
                )

            try:
                k = self.executor.max_num_speculative_tokens
                lockstep = self.ep is not None and self.ep.begin_step(bool(output.scheduled), k)
                with while_executing() if while_executing is not None else contextlib.nullcontext():
                    runner_output = self.executor.execute(
                        output, hook, join_collectives=lockstep, on_sampled=on_sampled
                    )
                if flush_prompt_kv is not None:
                    flush_prompt_kv()
            except Exception as e:  # noqa: BLE001 - fail the requests this step ran, not the engine
                raise self._step_failed(output, e) from e
            if self.ep is not None:
                self.ep.end_step(lockstep, was_idle=not output.scheduled)
            for item in exporting:
                self._records[item.request_id].prefill_result = prefill_result(runner_output, item.request_id)
            updates = self.scheduler.update_from_output(output, runner_output)
        else:
            output, runner_output, updates = self._async_loop.step(on_layer_kv)
        if runner_output is not None and runner_output.prompt_logprobs:
            record_prompt_logprobs(self._records, runner_output.prompt_logprobs)
        logprobs = runner_output.logprobs if runner_output is not None else None
        results = self._step_outputs(self._records, updates, logprobs, self._stop_request, self._final_output)
        if self._finished:  # finished outside the step (abort, admission); reported once
            updated = {u.request_id for u in updates}
            results += [self._output(self._records[rid]) for rid in self._finished if rid not in updated]
            self._finished = []
        if self._async_loop is not None and not self.scheduler.has_unfinished():
            self._async_loop.drain()
        return results

    def compile_stats(self) -> CompileStats:
        """What `config.compile` did here (`engine.compiled_forward.CompileStats`): compiled or not, why not,
        the compile time at load and the steps that ran the compiled graphs.
        """
        return compile_stats(self.runner, self.config.compile, self._compile_s, self._compile_error)

    def ep_stats(self) -> EPStats | None:
        """Expert-parallel figures of this rank (`engine.expert_parallel.EPStats`); None on one device."""
        return self.ep.stats() if self.ep is not None else None

    def _step_failed(self, output: SchedulerOutput, error: Exception) -> EngineStepError:
        """Finish `output`'s scheduled requests with FINISHED_ERROR and return the `EngineStepError`."""
        message = f"engine step failed: {error!r}"
        failed = [item.request for item in output.scheduled]
        if self.ep is not None:
            self.ep.failure = self.ep.failure or str(error)
            message = f"expert-parallel instance failed: {error}"
            if self.hold_on_ep_failure and roll_back_step(self.scheduler, output, error):
                return EngineStepError(message, [])
            failed = [r.request for r in self._records.values() if not r.request.is_finished]
        for request in failed:
            if self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ERROR, message):
                self._finished.append(request.request_id)
        self.executor.drop([request.request_id for request in failed])
        outputs = [self._output(self._records[rid]) for rid in self._finished]
        self._finished = []
        return EngineStepError(message, outputs)

    _step_outputs = staticmethod(step_outputs)  # an attribute: `bench.engine_step` times it

    def _update_text(self, record: RequestRecord) -> None:
        """Detokenize the request's new output tokens; a stop string finishes it with FINISHED_STOPPED."""
        request = record.request
        if record.output_text.update(request.output_token_ids, final=request.is_finished):
            self._stop_request(request)

    def _stop_request(self, request: Request) -> None:
        """Finish `request` with FINISHED_STOPPED (a stop string ended it)."""
        if request.is_finished:
            request.status = RequestStatus.FINISHED_STOPPED
        else:
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)

    def _final_output(self, record: RequestRecord) -> RequestOutput:
        """`_output` of a request that finished in the step (the executor forgets it too)."""
        if self._async_loop is None:
            self.executor.drop([record.request.request_id])
        return self._output(record)

    def _output(self, record: RequestRecord) -> RequestOutput:
        """The request's output now; its record is forgotten with its final output (unless prefill result)."""
        request = record.request
        if not record.stream and not record.output_text.has_stop_strings:
            # not detokenized on the step path (see `add_request`): its text now, up to its last token
            record.output_text.update(request.output_token_ids, final=request.is_finished)
        out = record.output()
        if request.is_finished and record.prefill_result is None:
            self._records.pop(request.request_id, None)
        return out
