"""Executes one scheduled step: forward, sample or verify drafts, propose the next drafts with MTP.

Drafts are verified by `kernels.rejection_sampling` (Leviathan et al. 2023, Algorithm 1).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

import numpy as np
import torch

from pdcluster.engine.input_batch import SamplingArrays
from pdcluster.engine.model_runner import (
    InputBuffers,
    LayerKVCallback,
    ModelInput,
    ModelRunner,
    build_model_input,
)
from pdcluster.engine.mtp_proposer import MTPWork, mtp_input_ids, propose
from pdcluster.engine.outputs import (
    PLACEHOLDER_TOKEN_ID,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)
from pdcluster.engine.penalties import PenaltyCounts
from pdcluster.engine.prompt_logprobs import prompt_logprobs, wants_prompt_logprobs
from pdcluster.engine.sampler import process_logits_isolated, sample_isolated, token_logprobs_isolated
from pdcluster.engine.spec_policy import DEFAULT_DECAY, choose_num_speculative_tokens, decay_counts
from pdcluster.engine.step_inputs import (
    PreparedStep,
    StepResult,
    last_step_results,
    logit_rows,
    resolve_placeholders,
)
from pdcluster.engine.structured_output import StructuredOutputs

# `Executor.run`'s `on_sampled`: request id -> the tokens one step sampled for it, before its drafts.
SampledCallback = Callable[[dict[str, list[int]]], None]


class Executor:
    """Device-side half of the engine step."""

    def __init__(
        self,
        runner: ModelRunner,
        num_speculative_tokens: int = 0,
        max_num_tokens: int = 2048,
        max_num_reqs: int = 64,
        max_num_blocks_per_req: int | None = None,
        adaptive_min_accept_prob: float | None = None,
        structured_outputs: StructuredOutputs | None = None,
    ) -> None:
        self.structured_outputs = structured_outputs
        if num_speculative_tokens and not runner.model.mtp_layers:
            raise ValueError("num_speculative_tokens > 0 needs a checkpoint with an MTP module")
        self.runner = runner
        self.num_speculative_tokens = num_speculative_tokens
        self.max_num_speculative_tokens = num_speculative_tokens
        self.adaptive_min_accept_prob = adaptive_min_accept_prob
        # Adaptive k: decayed drafts proposed / accepted per depth over the batch, and k chosen per step.
        self._drafted_per_position: list[float] = []
        self._accepted_per_position: list[float] = []
        self.num_steps_per_k: dict[int, int] = {}
        self._generators: dict[str, torch.Generator | None] = {}
        self._shared_generator = torch.Generator(runner.device).manual_seed(secrets.randbits(63))
        self._draft_probs: dict[str, torch.Tensor | None] = {}
        self._last_step: dict[str, StepResult] | None = {}  # None: build from `_last_step_parts`
        num_columns = min(runner.num_blocks, max_num_blocks_per_req or runner.num_blocks)
        self.max_num_blocks_per_req = num_columns
        self._buffers = [
            InputBuffers(max_num_tokens, max_num_reqs, num_columns, runner.block_size, runner.device)
            for _ in range(2)
        ]
        self._num_prepared = 0
        self.penalty_counts = PenaltyCounts(runner.config.vocab_size, runner.device)

    @property
    def num_tracked_requests(self) -> int:
        """Requests with per-request state (generators, draft distributions, penalty counts)."""
        return len(self._generators.keys() | self._draft_probs.keys() | self.penalty_counts.request_ids)

    def _generator(self, item: ScheduledRequest) -> torch.Generator | None:
        """A seeded request's own generator; unseeded requests share one seeded from OS entropy."""
        request_id = item.request_id
        if request_id not in self._generators:
            seed = item.request.sampling_params.seed
            self._generators[request_id] = (
                self._shared_generator
                if seed is None
                else torch.Generator(self.runner.device).manual_seed(seed)
            )
        return self._generators[request_id]

    def set_draft_probs(self, request_id: str, draft_probs: torch.Tensor | None) -> None:
        """Draft distributions (`[num_drafts, vocab_size]` float32; None: greedy) of drafts from prefill."""
        if draft_probs is None:
            self._draft_probs.pop(request_id, None)
        else:
            self._draft_probs[request_id] = draft_probs.to(self.runner.device)

    def drop(self, request_ids: list[str]) -> None:
        """Forget per-request state (finished, aborted or preempted requests)."""
        for request_id in request_ids:
            self._generators.pop(request_id, None)
            self._draft_probs.pop(request_id, None)
        self.penalty_counts.drop(request_ids)

    def prepare(self, output: SchedulerOutput) -> PreparedStep:
        """Pack the scheduled requests into the next persistent buffer set from the scheduler's persistent
        rows (`output.rows`) with whole-batch numpy ops (`InputBuffers.pack_rows`).
        Raises ValueError: requests scheduled without `output.rows`, or a step the buffers or rows do not
        cover (see `pack_rows`); a request that mixes placeholders and known tokens."""
        scheduled = output.scheduled
        if not scheduled:
            return PreparedStep(None, [0], [])
        step_rows = output.rows
        if step_rows is None or len(step_rows.row_index) != len(scheduled):
            raise ValueError("SchedulerOutput.rows must give the row of every scheduled request")
        buffers = self._buffers[self._num_prepared % 2]
        self._num_prepared += 1
        batch = buffers.pack_rows(step_rows)
        rows, row_index = step_rows.rows, step_rows.row_index
        sampling, (plain, processed) = rows.sampling_of(row_index), rows.row_flags(row_index)
        if step_rows.decode is not None:  # one known input per request: no placeholder, one query each
            return PreparedStep(batch, list(range(len(scheduled) + 1)), [], sampling, plain, 1, processed)
        # Placeholders, for the whole batch at once: count them per request over the packed input ids.
        num_tokens, num_reqs = batch.num_tokens, len(scheduled)
        qsl = buffers.host_query_start_loc[: num_reqs + 1]
        placeholder_items: list[int] = []
        # Only inputs the scheduler wrote as uncommitted (placeholders, drafts) can be placeholders.
        uncommitted = step_rows.num_uncommitted_inputs
        is_placeholder = buffers.host_input_ids[:num_tokens] == PLACEHOLDER_TOKEN_ID if uncommitted else None
        if is_placeholder is not None and is_placeholder.any():
            cumulative = np.concatenate(([0], np.cumsum(is_placeholder, dtype=np.int64)))
            counts, lens = cumulative[qsl[1:]] - cumulative[qsl[:-1]], np.diff(qsl)
            mixed = np.flatnonzero((counts > 0) & (counts < lens))
            if mixed.size:
                request_id = scheduled[int(mixed[0])].request_id
                raise ValueError(f"request {request_id!r} mixes placeholders and known tokens")
            placeholder_items = np.flatnonzero(counts).tolist()
        return PreparedStep(batch, qsl.tolist(), placeholder_items, sampling, plain, None, processed)

    def execute(
        self,
        output: SchedulerOutput,
        on_layer_kv: LayerKVCallback | None = None,
        join_collectives: bool = False,
        on_sampled: SampledCallback | None = None,
    ) -> ModelRunnerOutput:
        """Run one step (`prepare` then `run`)."""
        prepared = self.prepare(output)
        if join_collectives or on_sampled is not None:
            return self.run(output, prepared, on_layer_kv, join_collectives, on_sampled)
        return self.run(output, prepared, on_layer_kv)

    def run(
        self,
        output: SchedulerOutput,
        prepared: PreparedStep,
        on_layer_kv: LayerKVCallback | None = None,
        join_collectives: bool = False,
        on_sampled: SampledCallback | None = None,
        before_forward: Callable[[], None] | None = None,
    ) -> ModelRunnerOutput:
        """Execute a prepared step: drop finished/preempted requests' state, resolve placeholders from the
        last step's results, call `before_forward` (a batch runs), forward, sample or verify, propose drafts.
        Raises RuntimeError: placeholders of a request the previous step sampled nothing for."""
        self.drop(output.finished_request_ids + output.preempted_request_ids)
        if self.structured_outputs is not None:
            self.structured_outputs.drop(output.finished_request_ids + output.preempted_request_ids)
        batch = prepared.batch
        mtp_passes_before = self.runner.num_mtp_forwards
        if batch is None:
            self._last_step = {}
            if join_collectives:
                self._join_empty_passes(main=True, num_mtp_done=0)
            return ModelRunnerOutput({})
        scheduled = output.scheduled  # the last results are built for these (placeholders resolved)
        if prepared.placeholder_items:
            scheduled = self._resolve_placeholders(scheduled, prepared)
        starts, uniform = prepared.query_start_loc, prepared.num_queries
        if uniform is None:  # the inputs per request, when every request runs as many
            uniform = scheduled[0].num_scheduled_tokens
            uniform = uniform if all(item.num_scheduled_tokens == uniform for item in scheduled) else None
        if before_forward is not None:
            before_forward()
        hidden = self.runner.forward(batch, on_layer_kv, num_queries=uniform)
        plain = prepared.plain  # nothing below asks for logprobs, prompt logprobs or structured output
        scored = [] if plain else wants_prompt_logprobs(scheduled)
        prompt_lp = prompt_logprobs(self.runner, scheduled, scored, hidden, starts) if scored else {}
        decode = output.rows is not None and output.rows.decode is not None  # all sample, none exports
        sampling = [*range(len(scheduled))] if decode else [i for i, x in enumerate(scheduled) if x.samples]
        sampled: dict[str, list[int]] = {}
        failed: dict[str, str] = {}
        logprobs: dict[str, list[TokenLogprobs]] = {}
        if sampling:
            items = scheduled if decode else [scheduled[i] for i in sampling]
            one_row_each = uniform == 1 and len(sampling) == len(scheduled)  # a decode step without drafts
            rows = hidden if one_row_each else logit_rows(hidden, items, sampling, starts)
            logits, grammar_failed = self._logits(items, rows, plain)
            params = prepared.sampling
            if params is not None and len(sampling) < len(scheduled):
                params = params.take(np.asarray(sampling, dtype=np.int64))
            if params is None:
                params = SamplingArrays.of([item.request.sampling_params for item in items])
            if params.any_processed:  # a processor that raises fails its request alone
                logits, processing_failed = process_logits_isolated(
                    items, logits, params, self._output_history, self.penalty_counts,
                    lambda: self._logits(items, rows, plain)[0],
                )  # fmt: skip
                grammar_failed.update(processing_failed)
            sampled, failed = self.sample(items, logits, params)
            for request_id, error in grammar_failed.items():
                sampled.pop(request_id, None)
                failed[request_id] = error
            if self.structured_outputs is not None and self.structured_outputs.num_tracked_requests:
                self.structured_outputs.accept(items, sampled)
            if on_sampled is not None:
                on_sampled({rid: tokens for rid, tokens in sampled.items() if rid not in failed})
            if not plain:
                logprobs, logprobs_failed = token_logprobs_isolated(items, logits, sampled, params)
                failed.update(logprobs_failed)

        if self.adaptive_min_accept_prob is not None and self.max_num_speculative_tokens:
            self._adapt_num_speculative_tokens(
                [scheduled[i] for i in sampling if scheduled[i].request_id in sampled], sampled
            )
        spec: dict[str, list[int]] = {}
        if self.num_speculative_tokens:
            k = self.num_speculative_tokens
            self.num_steps_per_k[k] = self.num_steps_per_k.get(k, 0) + 1
            spec = self._propose(scheduled, batch, hidden, starts, sampled, failed, on_layer_kv, uniform)
        exp = [] if decode else sampling  # prefill-only requests (handed off): their draft distributions
        exporting = [scheduled[i].request_id for i in exp if scheduled[i].request.export_kv]
        draft_probs = {rid: self._draft_probs.get(rid) for rid in exporting if rid not in failed}
        # what the next step's placeholders resolve to, built when one asks (`_last_results`)
        self._last_step = None
        self._last_step_parts = (scheduled, sampling, dict(sampled), dict(spec), failed)
        for request_id in failed:
            sampled.pop(request_id, None)
            spec.pop(request_id, None)
        if join_collectives:
            self._join_empty_passes(main=False, num_mtp_done=self.runner.num_mtp_forwards - mtp_passes_before)
        return ModelRunnerOutput(sampled, spec, draft_probs, logprobs, failed, prompt_lp)

    def _join_empty_passes(self, main: bool, num_mtp_done: int) -> None:
        """EP: run the passes this step skipped over an empty batch, joining every MoE collective."""
        runner = self.runner
        empty = build_model_input([], [], [], runner.block_size, runner.device)
        if main:
            runner.forward(empty)
        if not self.max_num_speculative_tokens:
            return
        hidden = torch.zeros(0, runner.config.hidden_size, dtype=runner.dtype, device=runner.device)
        depth_limit = len(runner.model.mtp_layers) - 1
        for depth in range(num_mtp_done, self.max_num_speculative_tokens):
            runner.mtp_forward(empty, hidden, min(depth, depth_limit))

    def _output_history(self, item: ScheduledRequest, start: int = 0) -> list[int]:
        """The request's output tokens (incl. the last step's) before this step's inputs end, from `start`."""
        request = item.request
        end = item.start_position + item.num_scheduled_tokens - len(item.spec_token_ids)
        end -= item.num_placeholders
        begin = request.num_prompt_tokens + start
        previous = self._last_results().get(item.request_id) if item.num_placeholders else None
        if previous is None:
            return request.all_token_ids[begin:end]
        end -= len(previous.token_ids) - 1
        if begin > end:
            return previous.token_ids[begin - end :]
        return request.all_token_ids[begin:end] + previous.token_ids

    def sample(
        self, items: list[ScheduledRequest], logits: torch.Tensor, params: SamplingArrays | None = None
    ) -> tuple[dict[str, list[int]], dict[str, str]]:
        """`sampler.sample_isolated` of `items`, logits `[sum(k_i + 1), V]` (`params` None: from items)."""
        return sample_isolated(items, logits, self._generator, self._draft_probs, params)

    def _logits(self, items: list[ScheduledRequest], rows: torch.Tensor, plain: bool) -> tuple:
        """Logits `[R, V]` of hidden `rows` `[R, H]`, grammar-masked; request id -> error of failed masks."""
        logits = self.runner.compute_logits(rows)
        if plain or not any(item.request.sampling_params.structured_output for item in items):
            return logits, {}
        if self.structured_outputs is None:
            no = "structured output is not available on this engine"
            return logits, {i.request_id: no for i in items if i.request.sampling_params.structured_output}
        return logits, self.structured_outputs.mask_logits(items, logits)

    def _adapt_num_speculative_tokens(
        self, items: list[ScheduledRequest], sampled: dict[str, list[int]]
    ) -> None:
        """Fold this step's verification results into the decayed counters and choose the next k."""
        drafted: list[int] = []
        accepted: list[int] = []
        for item in items:
            num_drafts = len(item.spec_token_ids)
            num_accepted = len(sampled[item.request_id]) - 1
            for counts, n in ((drafted, num_drafts), (accepted, num_accepted)):
                counts.extend([0] * (num_drafts - len(counts)))
                for i in range(n):
                    counts[i] += 1
        if drafted:
            self._drafted_per_position = decay_counts(self._drafted_per_position, drafted, DEFAULT_DECAY)
            self._accepted_per_position = decay_counts(self._accepted_per_position, accepted, DEFAULT_DECAY)
        self.num_speculative_tokens = choose_num_speculative_tokens(
            self._accepted_per_position,
            self._drafted_per_position,
            self.max_num_speculative_tokens,
            self.adaptive_min_accept_prob,
        )

    def _resolve_placeholders(
        self, scheduled: list[ScheduledRequest], prepared: PreparedStep
    ) -> list[ScheduledRequest]:
        """`step_inputs.resolve_placeholders` with this executor's last step results."""
        return resolve_placeholders(scheduled, prepared, self._last_results(), self.runner.block_size)

    def _last_results(self) -> dict[str, StepResult]:
        """Request id -> its result of the last step that ran a batch (`last_step_results`)."""
        if self._last_step is None:
            self._last_step = last_step_results(*self._last_step_parts)
        return self._last_step

    def _propose(
        self,
        scheduled: list[ScheduledRequest],
        batch: ModelInput,
        hidden: torch.Tensor,
        starts: list[int],
        sampled: dict[str, list[int]],
        failed: dict[str, str],
        on_layer_kv: LayerKVCallback | None = None,
        num_queries: int | None = None,
    ) -> dict[str, list[int]]:
        """Run the MTP layer over this step's batch to propose drafts; adds requests that fail to `failed`."""
        rows: list[int] = []
        next_ids: list[int] = []
        works: list[MTPWork] = []
        owners: list[ScheduledRequest] = []
        for i, item in enumerate(scheduled):
            if item.request_id in failed:
                continue
            start, n = item.start_position, item.num_scheduled_tokens
            if item.samples:
                new_tokens = sampled[item.request_id]
                num_valid = n - (len(item.spec_token_ids) - (len(new_tokens) - 1))
                after = new_tokens[-1]
            else:
                num_valid = n
                following = item.request.all_token_ids[start + n : start + n + 1]
                if not following:
                    continue
                after = following[0]
            newest_row = starts[i] + num_valid - 1
            rows.append(newest_row)
            next_ids.append(after)
            num_drafts = self._num_drafts(item, start + num_valid) if item.samples else 0
            if num_drafts == 0:
                continue
            params = item.request.sampling_params
            works.append(
                MTPWork(
                    request_row=i,
                    newest_row=newest_row,
                    num_drafts=num_drafts,
                    temperature=params.temperature,
                    top_k=params.top_k,
                    top_p=params.top_p,
                    generator=self._generator(item),
                )
            )
            owners.append(item)
        input_ids = mtp_input_ids(batch, rows, next_ids)
        spec: dict[str, list[int]] = {}
        outputs = self.structured_outputs
        masks = outputs.draft_masks([item.request_id for item in owners]) if outputs is not None else None
        try:
            proposals = propose(self.runner, batch, hidden, input_ids, works, on_layer_kv, num_queries, masks)
        finally:
            if masks is not None:
                masks.finish()
        for item, proposal in zip(owners, proposals, strict=True):
            if proposal.error is not None:
                failed[item.request_id] = proposal.error
            elif proposal.draft_token_ids:
                spec[item.request_id] = proposal.draft_token_ids
                self._draft_probs[item.request_id] = proposal.draft_probs
        return spec

    def _num_drafts(self, item: ScheduledRequest, newest_position: int) -> int:
        """Drafts that fit the request's allocated slots (chained MTP steps write KV ahead)."""
        capacity = len(item.block_ids) * self.runner.block_size
        return max(0, min(self.num_speculative_tokens, capacity - newest_position + 1))
