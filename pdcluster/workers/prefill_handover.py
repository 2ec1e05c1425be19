"""`HandOver`: a prefill rank's handoff of a job once its KV is computed: bind, send its layers, finish."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from pdcluster.driver.messages import PrefillBind, PrefillFirstToken, PrefillResult
from pdcluster.engine.stopping import early_first_token_text
from pdcluster.kvtransfer.base import HandoffExtras
from pdcluster.workers.prefill_job import Job

if TYPE_CHECKING:
    from pdcluster.workers.prefill import PrefillWorker


class HandOver:
    """The hand-over steps of `worker`'s jobs, on its engine thread."""

    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker

    def send_computed_layers(self, job: Job) -> None:
        """Send the layers `job` holds (`job.layers`, computed before its bind, or this step's), in order."""
        sender = self.worker._sender(job)
        for layer_idx in sorted(job.layers):
            latent_kv, scale = job.layers.pop(layer_idx)
            sender.send_layer(job.request_id, layer_idx, latent_kv, scale)
            job.num_layers_sent += 1
            job.last_layer_sent_s = time.monotonic()

    def first_token(self, request_id: str, token_id: int) -> None:
        """`LLMEngine.step`'s `on_first_token`: wake `PrefillWorker.prefill_first`."""
        job = self.worker._active.get(request_id)
        if job is None or job.step_error is not None:
            return
        try:
            forced = job.request.first_token_id
            request = self.worker.engine.scheduler.get_request(request_id)
            job.first = PrefillFirstToken(
                token_id if forced is None else forced,
                None  # the client has it
                if forced is not None
                else early_first_token_text(self.worker.engine.tokenizer, job.request.params, token_id),
                None if request is None else request.queue_time_s,
            )
        except Exception as e:  # noqa: BLE001 - fails this job after the step, not the step's others
            job.step_error = f"its first token's reply failed: {e!r}"
            return
        job.sampled.set()

    def complete(self, request_id: str, finish_reason: str | None, queue_s: float) -> None:
        job = self.worker._active.get(request_id)
        if job is None:
            return
        result = self.worker.engine.pop_prefill_result(request_id)
        if result is None:
            self.worker._fail(request_id, f"finished ({finish_reason}) without a sampled token")
            return
        if not job.bound:  # its KV (job.layers) waits for the reservation (`bind`)
            job.pending = (result, queue_s)
            return
        self.hand_over(job, result, queue_s)

    def bind(self, bind: PrefillBind) -> None:
        job = self.worker._active.get(bind.handoff_id)
        if job is None or job.bound:  # failed or aborted meanwhile
            return
        try:
            self.begin(job, bind)
        except Exception as e:  # noqa: BLE001 - fails this request only
            self.worker._fail(job.request_id, f"beginning the handoff failed: {e!r}", abort_engine=True)
            return
        if job.pending is not None:
            result, queue_s = job.pending
            job.pending = None
            self.hand_over(job, result, queue_s)

    def begin(self, job: Job, bind: PrefillBind) -> None:
        """Bind `job` to the reservation and begin its handoff on the sender (raises what `begin` raises)."""
        job.bind(bind.meta, bind.decode_index, bind.decode_rank)
        self.worker._sender(job).begin(bind.meta)

    def hand_over(self, job: Job, result: Any, queue_s: float) -> None:
        request_id = job.request_id
        forced = job.request.first_token_id
        if forced is not None and forced != result.first_token_id:
            result = result._replace(
                first_token_id=forced, draft_token_ids=[], draft_probs=None, first_token_logprobs=None
            )
        sender = self.worker._sender(job)
        try:
            self.send_computed_layers(job)
            num_layers = job.request.meta.num_layers
            assert job.meta is not None
            if job.num_layers_sent != num_layers:
                raise RuntimeError(f"{job.num_layers_sent} of {num_layers} layers computed")
            sender.finish(
                request_id,
                HandoffExtras(
                    first_token_id=result.first_token_id,
                    draft_token_ids=result.draft_token_ids,
                    draft_probs=result.draft_probs,
                    first_token_logprobs=result.first_token_logprobs,
                ),
            )
        except Exception as e:  # noqa: BLE001
            self.worker._fail(request_id, repr(e))
            return
        job.result = PrefillResult(
            first_token_id=result.first_token_id,
            num_drafts=len(result.draft_token_ids),
            queue_s=queue_s,
            prefill_s=time.monotonic() - job.arrival_s - queue_s,
            last_layer_sent_s=None
            if job.last_layer_sent_s is None
            else job.last_layer_sent_s - job.arrival_s,
            cpu_wait_s=job.cpu_wait_s,
            prompt_logprobs=None if result.prompt_logprobs is None else tuple(result.prompt_logprobs),
        )
        self.worker._finish_job(job)
