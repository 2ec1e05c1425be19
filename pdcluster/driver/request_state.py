"""The driver's record of one request and of each of its dispatch attempts (`driver.request_dispatch`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from pdcluster.driver.backend import StreamDelta
from pdcluster.driver.handoff import HandoffEvent, HandoffState, advance
from pdcluster.driver.messages import Phases, PrefillFirstToken, PrefillResult, TokenDelta
from pdcluster.driver.recompute import Resumed, resume
from pdcluster.driver.router import RankRef
from pdcluster.engine.sampling_params import SamplingParams
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
    first_reported: bool = False  # its prefill call's first reply was taken (PrefillSampled / PrefillFailed)
    prefill_reported: bool = False  # its prefill call's outcome was taken (PrefillDone / PrefillFailed)
    prefill_first: asyncio.Future | None = None  # its prefill call's first reply (`PrefillFirstToken`)
    prefill_call: asyncio.Future | None = None  # its prefill call (to its last reply), once sent
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
    """One request from `generate` to its end: its attempt in flight, what the client received, the failed
    attempts (their prefill instances not tried again); phases with `recomputed_tokens` (driver.recompute)."""

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
    streamed_token_ids: list[int] = field(default_factory=list)  # every token id the client received
    num_recomputes: int = 0  # re-dispatches after a decode instance lost its KV (`driver.recompute`)
    recomputed_tokens: int | None = None  # streamed tokens whose KV the last of them computed again
    lost: str | None = None  # what the last such loss was (for the error when its re-dispatch fails)
    params: SamplingParams | None = None  # as asked (`driver.role_moves` checks it may be re-dispatched)
    # the prefill's prompt logprobs (`PrefillResult.prompt_logprobs`) until the first delta carries them
    prompt_logprobs: tuple | None = None

    def recompute(self, lost: str, prompt_token_ids: list[int], params: SamplingParams) -> Resumed:
        """Take the re-dispatch after decode lost the KV (`lost` says how): the next attempt's prompt and
        params (`driver.recompute.resume`). Raises ValueError: nothing was left to generate."""
        resumed = resume(prompt_token_ids, params, self.streamed_token_ids)
        if resumed.first_token_id is not None:  # forced as the prefill's first token, never streamed again
            self.first_token = (resumed.first_token_id, "")
        self.num_recomputes += 1
        self.recomputed_tokens = resumed.num_recomputed_tokens
        self.lost, self.decode_streamed = lost, False
        return resumed

    def record_prefill(self, result: PrefillResult) -> None:
        """The phases of the prefill call's last reply; its prompt logprobs, for the first delta."""
        if result.prompt_logprobs is not None and not self.streamed_token_ids:
            self.prompt_logprobs = result.prompt_logprobs
        self.phases = self.phases.merged(
            Phases(
                queue_s=result.queue_s,
                prefill_s=result.prefill_s,
                last_layer_sent_s=result.last_layer_sent_s,
                prefill_cpu_wait_s=result.cpu_wait_s,
            )
        )

    def first_token_delta(self, attempt: Attempt, first: PrefillFirstToken) -> StreamDelta:
        """The client's delta of the first token of `attempt`'s prefill call (kept for a re-dispatch)."""
        assert first.first_token_text is not None
        self.first_token = (first.first_token_id, first.first_token_text)
        return self.stream_delta(
            TokenDelta(attempt.handoff_id, (first.first_token_id,), new_text=first.first_token_text)
        )

    def stream_delta(self, delta: TokenDelta | None = None) -> StreamDelta:
        """`delta` for the client with the request's phases so far (total_s now); no delta: the abort."""
        self.phases = self.phases.merged(Phases(total_s=time.monotonic() - self.arrival_s))
        phases: dict[str, float] = self.phases.as_dict()
        if self.recomputed_tokens is not None:
            phases["recomputed_tokens"] = self.recomputed_tokens
        if delta is None:
            return StreamDelta([], True, "abort", phases=phases, kv_transfer_bytes=self.kv_transfer_bytes)
        self.streamed_token_ids += delta.new_token_ids
        prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, None
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
            phases=phases,
            kv_transfer_bytes=self.kv_transfer_bytes,
            drafts=delta.drafts,
            new_text=delta.new_text,
            ranks=ranks,
            logprobs=None if delta.logprobs is None else list(delta.logprobs),
            prompt_logprobs=None if prompt_logprobs is None else list(prompt_logprobs),
        )
