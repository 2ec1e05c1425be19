"""The control messages between the driver (`orchestrator.cluster.Cluster`) and the rank actors
(`prefill_node.actor.PrefillNode`, `decode_node.actor.DecodeNode`): frozen dataclasses, read by field name,
never by position. Plain data (ints, floats, strings, tuples; `HandoffMeta`, `SamplingParams`), so a
simulator can build them too.

    driver                         prefill rank                     decode rank
    ------                         ------------                     -----------
    load()           ─────────▶    PrefillNodeLoad                  DecodeNodeLoad
    reserve(ReserveRequest) ──────────────────────────────────────▶ ReserveResult (bound meta or no room)
    prefill(PrefillRequest) ─────▶ PrefillResult
    poll(acked_seq)  ──────────────────────────────────────────────▶ [PolledEvent(seq, DecodeEvent)]

Decode events (`DecodeEvent`): `TokenDelta` (new tokens of one handoff), `RequestError` (decode dropped
it: the handoff failed, or the engine failed it). The driver adds two of its own for a request's attempt:
`Aborted` (the client aborted) and `DecodeLost` (the decode instance died or stopped answering).

Times are seconds (`*_s` fields, from time.monotonic() differences); byte counts are ints and never sit
with the seconds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdcluster.engine.outputs import TokenLogprobs
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kvtransfer.base import HandoffMeta

if TYPE_CHECKING:
    from pdcluster.engine.compiled_forward import CompileStats


# ---- wiring -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeReady:
    """A rank actor's answer to `ready()` once its weights are loaded.

    name: `prefill-0`; pid: its process id; load_s: seconds to load the engine (weights, and the compiled
    decode forward's compilation when `compile` is on); num_blocks: KV blocks of its cache;
    num_hidden_layers / kv_dim: model facts the driver puts in `HandoffMeta` (0 on decode); compile: what
    `compile` did (`engine.compiled_forward.CompileStats`: compiled, its seconds, or why not)."""

    name: str
    pid: int
    load_s: float
    num_blocks: int
    num_hidden_layers: int = 0
    kv_dim: int = 0
    compile: CompileStats | None = None


@dataclass(frozen=True)
class InstanceGroupSpec:
    """How one rank actor of a multi-rank instance joins its instance's torch.distributed group (given to
    the actor's constructor; the group is made before the engine, which may need it to load its experts).

    rank / num_ranks: the actor's rank in the instance and the instance's ranks (devices_per_instance).
    init_method: `tcp://host:port` of the group's rendezvous, hosted by rank 0 on its node.
    barrier_port: the port on that host where the ranks first meet (`orchestrator.instance_group`).
    backend: `gloo`, `nccl` or `hccl` (`orchestrator.hardware`, the accelerator's collective backend).
    timeout_s: every collective of the group gives up after this long (`orchestrator.dispatch.
        collective_timeout_s`), so no rank waits forever for one that died or stalled.
    rendezvous_timeout_s: how long a rank waits for the others to join (they start at once, but load
        their weights at different speeds).
    Whether the ranks step in lockstep is the engine's layout (`EngineConfig.parallel`), not the group's.
    """

    rank: int
    num_ranks: int
    init_method: str
    barrier_port: int
    backend: str
    timeout_s: float
    rendezvous_timeout_s: float


# ---- loads --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrefillNodeLoad:
    """A prefill rank's load snapshot (`PrefillNode.load`).

    Attributes:
        name, pid: the rank (pid tells a restarted actor, a new process, from a stalled one).
        num_queued_prefill_tokens: prompt tokens queued or being prefilled.
        num_requests: prefill jobs in flight.
        engine_thread_alive, num_engine_errors, last_engine_error: the engine thread's health.
        engine_passes, engine_pass_s: passes of its loop the engine thread has begun, and the seconds the
            current one has run so far (the health monitor's engine watchdog, `engine_watchdog_s`).
        instance_group_error: why the rank's instance group failed (a collective timed out or broke: a
            peer rank died or stalled); the instance cannot step any more. None: the group is sound (or
            there is none).
        ep: the rank's expert-parallel figures (`rank_actor.ep_summary`); None without EP.
    """

    name: str
    pid: int
    num_queued_prefill_tokens: int
    num_requests: int
    engine_thread_alive: bool
    num_engine_errors: int
    last_engine_error: str | None
    instance_group_error: str | None = None
    ep: dict | None = None
    engine_passes: int = 0
    engine_pass_s: float = 0.0


@dataclass(frozen=True)
class DecodeNodeLoad:
    """A decode rank's load snapshot (`DecodeNode.load`).

    Attributes:
        name, pid: the rank (pid tells a restarted actor from a stalled one).
        num_free_blocks / num_total_blocks: KV cache blocks free now / in all.
        num_running: requests in the running batch.
        num_reserved: reservations waiting for their handoff.
        num_waiting_for_seat: received, waiting for a seat in the batch (max_num_seqs), holding blocks.
        engine_thread_alive, num_engine_errors, last_engine_error: the engine thread's health.
        engine_passes, engine_pass_s, instance_group_error, ep: as in `PrefillNodeLoad`.
        taken_s: when it was taken, on the rank's monotonic clock (seconds; orders snapshots of one
            process in `orchestrator.load_board.LoadBoard`).
    """

    name: str
    pid: int
    num_free_blocks: int
    num_total_blocks: int
    num_running: int
    num_reserved: int
    num_waiting_for_seat: int
    engine_thread_alive: bool
    num_engine_errors: int
    last_engine_error: str | None
    instance_group_error: str | None = None
    ep: dict | None = None
    engine_passes: int = 0
    engine_pass_s: float = 0.0
    taken_s: float = 0.0

    @property
    def batch_load(self) -> int:
        """Requests holding a place on this rank: running, reserved and waiting for a seat."""
        return self.num_running + self.num_reserved + self.num_waiting_for_seat


# ---- reserve / prefill --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReserveRequest:
    """Reserve KV blocks on decode for one handoff (prompt + first token + drafts) and expect it.

    handoff_id: unique per dispatch attempt (`<request_id>@<attempt>`); meta: the handoff as the driver
    built it (no secret yet); num_draft_tokens: MTP drafts the first step carries."""

    handoff_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    meta: HandoffMeta
    num_draft_tokens: int


@dataclass(frozen=True)
class ReserveResult:
    """`bound_meta`: the meta bound to the reservation, with the secret the prefill sender presents (give
    it to the chosen prefill rank only); None: no room on this decode instance right now. `load`: the
    rank's load snapshot right after the reservation (or the refusal), for the router
    (`orchestrator.load_board`)."""

    bound_meta: HandoffMeta | None
    load: DecodeNodeLoad | None = None

    @property
    def reserved(self) -> bool:
        return self.bound_meta is not None


@dataclass(frozen=True)
class PrefillRequest:
    """Prefill one handoff and stream it to rank `decode_rank` of decode instance `decode_index` (which
    already expects it); `meta` is the one that rank's reserve bound (with the secret).

    `awaiting_bind`: sent while decode still reserves (the driver overlaps the two): `meta` is not bound
    yet (no secret); prefill computes at once, holds the prompt's KV, and starts the handoff when a
    `PrefillBind` names the reservation (`PrefillNode.bind`), within `meta.lease_s` seconds.

    `first_token_id`: the first token the client already has (streamed from an earlier attempt's prefill
    reply, `orchestrator.dispatch`): the handoff carries it instead of the token this prefill samples, so
    the re-dispatched request continues after it.
    """

    handoff_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    meta: HandoffMeta
    decode_index: int
    decode_rank: int = 0
    awaiting_bind: bool = False
    first_token_id: int | None = None


@dataclass(frozen=True)
class PrefillBind:
    """The reservation of a prefill sent `awaiting_bind`: `meta` as rank `decode_rank` of decode instance
    `decode_index` bound it (with the secret; the decode rank may differ from the request's first choice
    when that one had no room)."""

    handoff_id: str
    meta: HandoffMeta
    decode_index: int
    decode_rank: int = 0


@dataclass(frozen=True)
class PrefillResult:
    """A finished prefill on the prefill side: the first sampled token, how many MTP drafts went with it,
    and its phases (seconds): queue_s (arrival to first scheduled), prefill_s (scheduled to handoff
    finished), last_layer_sent_s (arrival to the last layer handed to the KV sender; None: unknown),
    cpu_wait_s (of queue_s + prefill_s, how long the prefill engine thread was ready to run but waited for
    a CPU in the steps it ran while this request was in the engine: `prefill_node.thread_clock`; None where
    the OS does not say).

    first_token_text: the first token's streamed text when the driver may stream the token before decode
    admits the request (`engine.stopping.early_first_token_text`); None: decode streams it.
    """

    first_token_id: int
    num_drafts: int
    queue_s: float
    prefill_s: float
    last_layer_sent_s: float | None = None
    first_token_text: str | None = None
    cpu_wait_s: float | None = None


# ---- decode events ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Phases:
    """Per-request phase durations in seconds; None: not known (yet) by whoever built it. Each is measured
    on one process's clock (hosts' clocks need not agree), in the order a request meets them:

    route_s: the driver's routing of the attempt that ran (instance loads + the router policy).
    reserve_s: the driver's reserve call on decode (decode's `expect` starts the KV lease inside it).
    queue_s, prefill_s: prefill's wait to be scheduled, then compute until its handoff finished.
    last_layer_sent_s: prefill: arrival to the last layer handed to its KV sender.
    prefill_cpu_wait_s: of queue_s + prefill_s, the prefill engine thread's wait for a CPU (runnable, not
        running; Linux only): the share of that time other processes on the prefill node's cores took.
    kv_transfer_s: decode: `expect` until the whole handoff was received and verified (prefill overlaps it).
    admit_s: decode: received until the engine thread admitted it (decode streams the first token then;
        the driver drops it when the prefill call's reply streamed it first).
    first_decode_step_s: decode: admitted until its first stepped output.
    total_s: the driver: arrival until the latest delta.
    """

    route_s: float | None = None
    reserve_s: float | None = None
    queue_s: float | None = None
    prefill_s: float | None = None
    last_layer_sent_s: float | None = None
    prefill_cpu_wait_s: float | None = None
    kv_transfer_s: float | None = None
    admit_s: float | None = None
    first_decode_step_s: float | None = None
    total_s: float | None = None

    def merged(self, other: Phases) -> Phases:
        """These phases with every phase `other` knows replacing this one's."""
        known = {f.name: v for f in dataclasses.fields(other) if (v := getattr(other, f.name)) is not None}
        return dataclasses.replace(self, **known)

    def as_dict(self) -> dict[str, float]:
        """The known phases as `{name: seconds}` (`orchestrator.backend.PHASE_NAMES` order)."""
        return {f.name: v for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None}


@dataclass(frozen=True)
class DraftCounts:
    """Cumulative MTP draft statistics of one request: drafts proposed / accepted, in all and per draft
    depth (index 0 = the first draft token)."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_draft_tokens_per_position: tuple[int, ...] = ()
    num_accepted_tokens_per_position: tuple[int, ...] = ()


@dataclass(frozen=True)
class TokenDelta:
    """Tokens decode committed for one handoff since its previous delta (the first one carries the first
    token prefill sampled). finish_reason ("stop", "length", "abort") is set on the last (finished) delta.
    phases: what decode measured (kv_transfer_s on the first delta, first_decode_step_s on the first
    stepped one); kv_transfer_bytes: bytes of KV received on the wire for this handoff (on the deltas that
    carry kv_transfer_s), None otherwise. new_text: the text decode's engine released with these tokens
    (`engine.outputs.RequestOutput.new_text`: stop strings applied), so the edge never detokenizes.
    logprobs: one `engine.outputs.TokenLogprobs` per new token when the request asks for logprobs (the
    first token's computed on prefill, carried with the handoff), else None."""

    handoff_id: str
    new_token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: str | None = None
    phases: Phases = Phases()
    kv_transfer_bytes: int | None = None
    drafts: DraftCounts = DraftCounts()
    new_text: str = ""
    logprobs: tuple[TokenLogprobs, ...] | None = None


@dataclass(frozen=True)
class RequestError:
    """Decode dropped the handoff (its blocks are freed): the transfer failed (lease expired, sender lost,
    checksum) or the engine failed the request. `message` is one line for the client."""

    handoff_id: str
    message: str


@dataclass(frozen=True)
class Aborted:
    """Driver-side: the request was aborted (`Cluster.abort`); its attempt ends with finish_reason abort."""

    handoff_id: str


@dataclass(frozen=True)
class DecodeLost:
    """Driver-side: the attempt's decode instance died or stopped answering; what it held is gone."""

    handoff_id: str
    message: str


DecodeEvent = TokenDelta | RequestError
AttemptEvent = TokenDelta | RequestError | Aborted | DecodeLost


@dataclass(frozen=True)
class PolledEvent:
    """One decode event and its sequence number (from 1, per decode rank incarnation) for acknowledgement."""

    seq: int
    event: DecodeEvent


@dataclass(frozen=True)
class PollReply:
    """`DecodeNode.poll_with_load`: the unacknowledged events and the rank's load snapshot taken as the
    reply left (piggy-backed, so routing needs no `load` call of its own)."""

    events: list[PolledEvent]
    load: DecodeNodeLoad
