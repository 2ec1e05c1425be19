"""The driver's record of one request and of each of its dispatch attempts (`driver.request_dispatch`):
one record per request and one per attempt, instead of parallel dicts keyed by id.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from pdcluster.driver.backend import StreamDelta
from pdcluster.driver.handoff import HandoffEvent, HandoffState, advance
from pdcluster.driver.messages import Phases, TokenDelta
from pdcluster.driver.router import RankRef
from pdcluster.kvtransfer.base import HandoffMeta


def rank_name(role: str, ref: RankRef) -> str:
    """`decode-0` for rank 0 of decode instance 0, `decode-0.1` for its rank 1 (`Instance.rank_name`)."""
    return f"{role}-{ref.instance}" + (f".{ref.rank}" if ref.rank else "")


@dataclass
class Attempt:
    """One dispatch of a request: its handoff id (unique per attempt), the (instance, rank) pair, the meta
    decode's reserve bound (with the secret; None until reserved), and its event queue."""

    handoff_id: str
    prefill: RankRef
    decode: RankRef
    meta: HandoffMeta | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    prefill_reported: bool = False  # its prefill call's outcome was taken (PrefillDone / PrefillFailed)
    prefill_call: asyncio.Future | None = None  # its prefill call, once sent
    prefill_sent_s: float | None = None  # time.monotonic() when it was sent
    state: HandoffState = HandoffState.ROUTED  # the handoff (`driver.handoff`)

    def advance(self, *events: HandoffEvent) -> None:
        """Apply `events` in order to the handoff's state. Raises `handoff.IllegalTransition`."""
        for event in events:
            self.state = advance(self.state, event)

    @property
    def prefill_index(self) -> int:
        return self.prefill.instance

    @property
    def decode_index(self) -> int:
        return self.decode.instance


@dataclass
class DriverRequest:
    """One request from `generate` to its end: its attempt in flight, what the client received, and the
    failed attempts (their prefill instances are not tried again)."""

    request_id: str
    arrival_s: float
    attempt: Attempt | None = None
    aborted: bool = False
    finished: bool = False
    decode_streamed: bool = False  # a decode delta carried tokens to the client (no re-dispatch after)
    # (token id, text): the first token, when a prefill reply streamed it; a re-dispatch keeps it
    first_token: tuple[int, str] | None = None
    phases: Phases = Phases()
    kv_transfer_bytes: int | None = None
    errors: list[str] = field(default_factory=list)
    excluded_prefills: set[int] = field(default_factory=set)

    def stream_delta(self, delta: TokenDelta | None = None) -> StreamDelta:
        """`delta` for the client with the request's phases so far (total_s now); no delta: the abort."""
        self.phases = self.phases.merged(Phases(total_s=time.monotonic() - self.arrival_s))
        if delta is None:
            return StreamDelta(
                [], True, "abort", phases=self.phases.as_dict(), kv_transfer_bytes=self.kv_transfer_bytes
            )
        drafts = delta.drafts
        ranks = {}
        if self.attempt is not None:
            ranks = {
                role: rank_name(role, ref)
                for role, ref in (("prefill", self.attempt.prefill), ("decode", self.attempt.decode))
            }
        return StreamDelta(
            new_token_ids=list(delta.new_token_ids),
            finished=delta.finished,
            finish_reason=delta.finish_reason,
            phases=self.phases.as_dict(),
            kv_transfer_bytes=self.kv_transfer_bytes,
            num_draft_tokens=drafts.num_draft_tokens,
            num_accepted_tokens=drafts.num_accepted_tokens,
            num_draft_tokens_per_position=list(drafts.num_draft_tokens_per_position),
            num_accepted_tokens_per_position=list(drafts.num_accepted_tokens_per_position),
            new_text=delta.new_text,
            ranks=ranks,
            logprobs=None if delta.logprobs is None else list(delta.logprobs),
        )
