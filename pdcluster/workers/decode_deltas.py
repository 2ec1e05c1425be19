"""Decode's token deltas: what a decode rank sends the driver for one admission or engine output."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdcluster.driver.messages import Phases, TokenDelta
from pdcluster.engine.llm import RequestOutput
from pdcluster.engine.stopping import early_first_token_text

if TYPE_CHECKING:
    from pdcluster.kvtransfer.base import ReceivedKV
    from pdcluster.workers.decode import DecodeWorker


@dataclass
class Handoff:
    """One handoff on this node, from its admission on: the transfer's measures, when it was admitted
    (until its first stepped delta), and how many of its tokens were sent to the driver."""

    kv_transfer_s: float
    kv_transfer_bytes: int
    admitted_at_s: float | None = None
    num_sent: int = 0
    admit_s: float | None = None  # received until admitted
    # the first token's text the driver streamed from prefill's reply, not sent again (`token_delta`)
    text_streamed_by_prefill: str = ""


def token_delta(out: RequestOutput, handoff: Handoff | None) -> TokenDelta:
    """The `TokenDelta` of `out`: the tokens not sent yet (updates `handoff.num_sent`), its finish reason,
    and phases (seconds) and KV bytes on the first stepped output."""
    num_sent = handoff.num_sent if handoff is not None else 0
    phases, kv_transfer_bytes = Phases(), None
    if handoff is not None:
        handoff.num_sent = len(out.token_ids)
        if handoff.admitted_at_s is not None:  # its first stepped output
            phases = Phases(
                kv_transfer_s=handoff.kv_transfer_s,
                admit_s=handoff.admit_s,
                first_decode_step_s=time.monotonic() - handoff.admitted_at_s,
            )
            kv_transfer_bytes = handoff.kv_transfer_bytes
            handoff.admitted_at_s = None
    new_text = out.new_text
    if handoff is not None and handoff.text_streamed_by_prefill:  # a first token that finished it
        new_text = new_text.removeprefix(handoff.text_streamed_by_prefill)
        handoff.text_streamed_by_prefill = ""
    return TokenDelta(
        out.request_id,
        tuple(out.token_ids[num_sent:]),
        finished=out.finished,
        finish_reason=out.finish_reason if out.finished else None,
        phases=phases,
        kv_transfer_bytes=kv_transfer_bytes,
        drafts=out.drafts,
        new_text=new_text,
        logprobs=None if out.logprobs is None else tuple(out.logprobs[num_sent:]),
    )


def admit(worker: DecodeWorker, handoff_id: str, received: ReceivedKV) -> list[TokenDelta]:
    """Under the engine lock: admit a received handoff into `worker`'s engine; its first token's delta."""
    assert worker.receiver is not None
    extras = received.extras
    worker.receiver.release(handoff_id)
    now_s = time.monotonic()
    with worker._admissions_lock:
        received_at_s = worker._received_at_s.pop(handoff_id, now_s)
    handoff = Handoff(
        received.elapsed_s,
        int(received.num_wire_bytes),
        admitted_at_s=now_s,
        admit_s=now_s - received_at_s,
    )
    worker._handoffs[handoff_id] = handoff
    worker._checkpoint("admit")
    params = worker.engine.scheduler.reserved[handoff_id].sampling_params
    worker.engine.admit_remote_prefill(
        handoff_id,
        extras.first_token_id,
        extras.draft_token_ids,
        extras.draft_probs,
        extras.first_token_logprobs,
    )
    handoff.num_sent = 1
    early_text = early_first_token_text(worker.engine.tokenizer, params, extras.first_token_id)
    request = worker.engine.scheduler.get_request(handoff_id)
    if request is None:
        handoff.text_streamed_by_prefill = early_text or ""
        if early_text is None:
            handoff.num_sent = 0
        return []
    text = worker.engine.take_new_text(handoff_id)
    first = (extras.first_token_id,)
    if early_text is not None:
        first, text = (), text.removeprefix(early_text)
    return [
        TokenDelta(
            handoff_id,
            first,
            phases=Phases(kv_transfer_s=handoff.kv_transfer_s, admit_s=handoff.admit_s),
            kv_transfer_bytes=handoff.kv_transfer_bytes,
            new_text=text,
            logprobs=(extras.first_token_logprobs,) if first and extras.first_token_logprobs else None,
        )
    ]
