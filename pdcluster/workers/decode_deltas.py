"""Decode's token deltas: what a decode rank sends the driver for one engine output of one handoff."""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdcluster.driver.messages import DraftCounts, Phases, TokenDelta
from pdcluster.engine.llm import RequestOutput


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
    drafts = DraftCounts(
        out.num_draft_tokens,
        out.num_accepted_tokens,
        tuple(out.num_draft_tokens_per_position),
        tuple(out.num_accepted_tokens_per_position),
    )
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
        drafts=drafts,
        new_text=new_text,
        logprobs=None if out.logprobs is None else tuple(out.logprobs[num_sent:]),
    )
