"""Control messages between the driver and the rank actors: frozen dataclasses, read by field name."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdcluster.engine.outputs import TokenLogprobs
from pdcluster.engine.request import DraftCounts
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kvtransfer.base import HandoffMeta

if TYPE_CHECKING:
    from pdcluster.engine.compiled_forward import CompileStats


# ---- wiring -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeReady:
    """A rank actor's answer to `ready()` once its weights are loaded."""

    name: str
    pid: int
    load_s: float
    num_blocks: int
    num_hidden_layers: int = 0
    kv_dim: int = 0
    compile: CompileStats | None = None


@dataclass(frozen=True)
class InstanceGroupSpec:
    """How a rank actor joins its instance's torch.distributed group (made before its engine)."""

    rank: int
    num_ranks: int
    init_method: str
    barrier_port: int
    backend: str
    timeout_s: float
    rendezvous_timeout_s: float
    secret: str = dataclasses.field(default="", repr=False)  # the rendezvous's (`driver.instance_group`)


# ---- loads --------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class RankLoad:
    """What every rank's load snapshot carries: who answered, and its engine thread's health
    (`workers.rank.RankWorker._engine_health`)."""

    name: str
    pid: int
    engine_thread_alive: bool
    num_engine_errors: int
    last_engine_error: str | None
    instance_group_error: str | None = None
    ep: dict | None = None
    engine_passes: int = 0
    engine_pass_s: float = 0.0
    collective_wait_s: float = 0.0  # how long its engine has been blocked in one instance-group collective


@dataclass(frozen=True, kw_only=True)
class PrefillNodeLoad(RankLoad):
    """A prefill rank's load snapshot (`PrefillWorker.load`)."""

    num_queued_prefill_tokens: int
    num_requests: int


@dataclass(frozen=True, kw_only=True)
class DecodeNodeLoad(RankLoad):
    """A decode rank's load snapshot (`DecodeWorker.load`)."""

    num_free_blocks: int
    num_total_blocks: int
    num_running: int
    num_reserved: int
    num_waiting_for_seat: int
    taken_s: float = 0.0

    @property
    def batch_load(self) -> int:
        """Requests holding a place on this rank: running, reserved and waiting for a seat."""
        return self.num_running + self.num_reserved + self.num_waiting_for_seat


# ---- reserve / prefill --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReserveRequest:
    """Reserve KV blocks on decode for one handoff (prompt + first token + drafts) and expect it."""

    handoff_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    meta: HandoffMeta
    num_draft_tokens: int


@dataclass(frozen=True)
class ReserveResult:
    """`bound_meta`: the meta bound to the reservation, with the secret for the chosen prefill rank only;
    None: no room on this decode instance right now."""

    bound_meta: HandoffMeta | None
    load: DecodeNodeLoad | None = None

    @property
    def reserved(self) -> bool:
        return self.bound_meta is not None


@dataclass(frozen=True)
class PrefillRequest:
    """Prefill one handoff and stream it to rank `decode_rank` of decode instance `decode_index`, under the
    `meta` (with the secret) that rank's reserve bound."""

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
class PrefillFirstToken:
    """The prefill call's first reply, as the token is sampled. `first_token_text` None: decode streams it
    (`engine.stopping.early_first_token_text`) or the client has it. `queue_s`: arrival to first step."""

    first_token_id: int
    first_token_text: str | None = None
    queue_s: float | None = None


@dataclass(frozen=True)
class PrefillResult:
    """The prefill call's last reply (its KV and drafts went to the sender); phases in seconds (`cpu_wait_s`:
    runnable but waiting for a CPU, `workers.thread_clock`; None: unknown)."""

    first_token_id: int
    num_drafts: int
    queue_s: float
    prefill_s: float
    last_layer_sent_s: float | None = None
    cpu_wait_s: float | None = None
    # `SamplingParams.prompt_logprobs` (None at index 0): scored on prefill, sent to the client from here
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None


# ---- decode events ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Phases:
    """Per-request phase durations in seconds, each on one process's clock; None: not known (yet)."""

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
        """The known phases as `{name: seconds}` (`driver.backend.PHASE_NAMES` order)."""
        return {f.name: v for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None}


@dataclass(frozen=True)
class TokenDelta:
    """Tokens decode committed for one handoff since its previous delta (the first: prefill's token too)."""

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
    """`DecodeWorker.poll_with_load`: the unacknowledged events and the rank's load snapshot taken as the
    reply left (piggy-backed, so routing needs no `load` call of its own)."""

    events: list[PolledEvent]
    load: DecodeNodeLoad
