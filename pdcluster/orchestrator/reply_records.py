"""The records of the driver's reply socket (`orchestrator.reply_channel`), as msgpack-ready dicts.

    done   a prefill rank's `PrefillResult` for one handoff, named by `handoff_tag` (`result_to_record`)
    ev     a decode rank's events (`TokenDelta` / `RequestError` with their sequence numbers) and its load
           snapshot (`events_to_record`)
    bind   the driver's `PrefillBind` for a prefill rank (`bind_to_record`), the handoff's secret included
    rsv    a call: the driver's `ReserveRequest` for a decode rank (`call_to_record`)
    pf     a call: the driver's `PrefillRequest` for a prefill rank (`call_to_record`)
    ans    a rank's answer to a call: the `ReserveResult` (the bound meta, its secret included, and the
           rank's load) or `PrefillResult`, or the error the call raised (`answer_to_record`)

Each `*_from_record` is the inverse and raises ValueError naming the field that is malformed (never a
secret); the channel drops such a record with a warning and goes on.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any, NamedTuple

from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kvtransfer.base import HandoffMeta, ProtocolError
from pdcluster.kvtransfer.wire import logprobs_from_list, logprobs_to_list, meta_from_dict, meta_to_dict
from pdcluster.orchestrator.messages import (
    DecodeNodeLoad,
    DraftCounts,
    Phases,
    PolledEvent,
    PrefillBind,
    PrefillRequest,
    PrefillResult,
    RequestError,
    ReserveRequest,
    ReserveResult,
    TokenDelta,
)

_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "first_token_id": (int,),
    "num_drafts": (int,),
    "queue_s": (int, float),
    "prefill_s": (int, float),
    "last_layer_sent_s": (int, float, type(None)),
    "first_token_text": (str, type(None)),
    "cpu_wait_s": (int, float, type(None)),
    "handoff_finished": (bool,),
}


def bind_to_record(bind: PrefillBind) -> dict[str, Any]:
    """The `bind` record the driver sends a prefill rank: the handoff id, the bound meta (its secret
    included: the connection is the rank's own, authenticated, on this host) and the decode rank."""
    return {
        "k": "bind",
        "rid": bind.handoff_id,
        "m": meta_to_dict(bind.meta),
        "d": bind.decode_index,
        "r": bind.decode_rank,
    }


def bind_from_record(record: dict[str, Any]) -> PrefillBind:
    """The `PrefillBind` of a `bind` record. ValueError naming what is malformed (the secret is never in
    the message)."""
    handoff_id, meta, decode_index, decode_rank = (record.get(k) for k in ("rid", "m", "d", "r"))
    if not isinstance(handoff_id, str) or not isinstance(meta, dict):
        raise ValueError("a bind record needs a string rid and a mapping m")
    for name, value in (("decode_index", decode_index), ("decode_rank", decode_rank)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} is {value!r}, not an int >= 0")
    return PrefillBind(handoff_id, _bound_meta(meta, handoff_id, "bind"), decode_index, decode_rank)


def _bound_meta(meta: dict[str, Any], handoff_id: str, what: str) -> HandoffMeta:
    """The bound meta of `what` record `handoff_id`: it must name that handoff and carry a secret."""
    try:
        bound = meta_from_dict(meta)
    except ProtocolError as e:
        raise ValueError(str(e)) from None
    if bound.request_id != handoff_id or not isinstance(bound.secret, bytes) or not bound.secret:
        raise ValueError(f"the meta of {what} {handoff_id!r} names {bound.request_id!r} or has no secret")
    return bound


def handoff_tag(secret: bytes) -> str:
    """Names one attempt's handoff in a pushed record without its secret: 16 hex digits of SHA-256 over
    the per-handoff secret decode's reservation bound (`HandoffMeta.secret`). The driver takes a pushed
    result only for the attempt whose bound meta gives the same tag, so a result for an earlier attempt
    of a reused request id is never taken for the current one."""
    return hashlib.sha256(secret).hexdigest()[:16]


def result_to_record(handoff_id: str, tag: str, result: PrefillResult) -> dict[str, Any]:
    """The `done` record a prefill rank pushes: handoff id, `handoff_tag`, the result's fields."""
    return {"k": "done", "rid": handoff_id, "tag": tag, "r": dataclasses.asdict(result)}


def result_from_record(record: dict[str, Any]) -> tuple[str, str, PrefillResult]:
    """(handoff id, tag, result) of a `done` record. ValueError naming the field when it is malformed."""
    handoff_id, tag, fields = record.get("rid"), record.get("tag"), record.get("r")
    if not isinstance(handoff_id, str) or not isinstance(tag, str) or not isinstance(fields, dict):
        raise ValueError("a done record needs a string rid, a string tag and a mapping r")
    return handoff_id, tag, _prefill_result(fields)


def _prefill_result(fields: dict[str, Any]) -> PrefillResult:
    if set(fields) != set(_FIELD_TYPES):
        raise ValueError(f"fields {sorted(fields)} are not {sorted(_FIELD_TYPES)}")
    for name, types in _FIELD_TYPES.items():
        if not isinstance(fields[name], types) or (isinstance(fields[name], bool) and bool not in types):
            raise ValueError(f"{name} is {type(fields[name]).__name__}")
    return PrefillResult(**fields)


_NUMBER = (int, float)
_PHASE_NAMES = frozenset(f.name for f in dataclasses.fields(Phases))
_LOAD_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "name": (str,),
    "pid": (int,),
    "num_free_blocks": (int,),
    "num_total_blocks": (int,),
    "num_running": (int,),
    "num_reserved": (int,),
    "num_waiting_for_seat": (int,),
    "engine_thread_alive": (bool,),
    "num_engine_errors": (int,),
    "last_engine_error": (str, type(None)),
    "instance_group_error": (str, type(None)),
    "ep": (dict, type(None)),
    "engine_passes": (int,),
    "engine_pass_s": _NUMBER,
    "taken_s": _NUMBER,
}


def _event_to_record(item: PolledEvent) -> list[Any]:
    event = item.event
    if isinstance(event, RequestError):
        return [item.seq, "error", event.handoff_id, event.message]
    drafts = event.drafts
    return [
        item.seq,
        "delta",
        event.handoff_id,
        list(event.new_token_ids),
        event.finished,
        event.finish_reason,
        event.phases.as_dict(),
        event.kv_transfer_bytes,
        [
            drafts.num_draft_tokens,
            drafts.num_accepted_tokens,
            list(drafts.num_draft_tokens_per_position),
            list(drafts.num_accepted_tokens_per_position),
        ],
        event.new_text,
        None if event.logprobs is None else [logprobs_to_list(lp) for lp in event.logprobs],
    ]


def events_to_record(events: Sequence[PolledEvent], load: DecodeNodeLoad) -> dict[str, Any]:
    """The `ev` record a decode rank pushes: its events (`[seq, "delta", fields...]` or `[seq, "error",
    handoff id, message]`) and its load snapshot's fields."""
    return {"k": "ev", "e": [_event_to_record(item) for item in events], "l": dataclasses.asdict(load)}


def _check(name: str, value: Any, types: tuple[type, ...]) -> Any:
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise ValueError(f"{name} is {type(value).__name__}")
    return value


def _ints(name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ValueError(f"{name} is {type(value).__name__}, not a list")
    return tuple(_check(name, v, (int,)) for v in value)


def _event_from_record(fields: Any) -> PolledEvent:
    if not isinstance(fields, list) or len(fields) < 2:
        raise ValueError("an event is a list [seq, kind, ...]")
    seq, kind = _check("seq", fields[0], (int,)), fields[1]
    if kind == "error" and len(fields) == 4:
        _, _, handoff_id, message = fields
        return PolledEvent(
            seq, RequestError(_check("handoff_id", handoff_id, (str,)), _check("message", message, (str,)))
        )
    if kind != "delta" or len(fields) != 11:
        raise ValueError(f"event {seq}: kind {kind!r} with {len(fields)} fields")
    _, _, handoff_id, token_ids, finished, finish_reason, phases, num_bytes, drafts, new_text, logprobs = (
        fields
    )
    if logprobs is not None and (not isinstance(logprobs, list) or len(logprobs) != len(token_ids)):
        raise ValueError(f"event {seq}: logprobs {logprobs!r} for {len(token_ids)} tokens")
    if not isinstance(phases, dict) or not set(phases) <= _PHASE_NAMES:
        raise ValueError(f"event {seq}: phases {phases!r}")
    for name, seconds in phases.items():
        _check(name, seconds, _NUMBER)
    if not isinstance(drafts, list) or len(drafts) != 4:
        raise ValueError(f"event {seq}: drafts {drafts!r}")
    delta = TokenDelta(
        handoff_id=_check("handoff_id", handoff_id, (str,)),
        new_token_ids=_ints("new_token_ids", token_ids),
        finished=_check("finished", finished, (bool,)),
        finish_reason=_check("finish_reason", finish_reason, (str, type(None))),
        phases=Phases(**phases),
        kv_transfer_bytes=_check("kv_transfer_bytes", num_bytes, (int, type(None))),
        drafts=DraftCounts(
            _check("num_draft_tokens", drafts[0], (int,)),
            _check("num_accepted_tokens", drafts[1], (int,)),
            _ints("num_draft_tokens_per_position", drafts[2]),
            _ints("num_accepted_tokens_per_position", drafts[3]),
        ),
        new_text=_check("new_text", new_text, (str,)),
        logprobs=None if logprobs is None else tuple(logprobs_from_list(lp) for lp in logprobs),
    )
    return PolledEvent(seq, delta)


def events_from_record(record: dict[str, Any]) -> tuple[list[PolledEvent], DecodeNodeLoad]:
    """(events in sequence, load snapshot) of an `ev` record. ValueError naming what is malformed (a field
    of the wrong type, events out of sequence)."""
    events, load = record.get("e"), record.get("l")
    if not isinstance(events, list) or not events or not isinstance(load, dict):
        raise ValueError("an ev record needs a non-empty list e and a mapping l")
    items = [_event_from_record(fields) for fields in events]
    if any(b.seq != a.seq + 1 for a, b in zip(items, items[1:], strict=False)):
        raise ValueError(f"events out of sequence: {[item.seq for item in items]}")
    return items, _load_from_dict(load)


def _load_from_dict(load: dict[str, Any]) -> DecodeNodeLoad:
    if set(load) != set(_LOAD_FIELD_TYPES):
        raise ValueError(f"load fields {sorted(load)} are not {sorted(_LOAD_FIELD_TYPES)}")
    for name, types in _LOAD_FIELD_TYPES.items():
        _check(name, load[name], types)
    return DecodeNodeLoad(**load)


# ---- calls (driver -> rank) and their answers -----------------------------------------------------------
_PARAM_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))
CALL_KINDS = {"rsv": "reserve", "pf": "prefill"}  # record kind -> the rank's method it stands for


class RankCall(NamedTuple):
    """A call the driver sends on a rank's reply connection: `call_id` (unique per driver, echoed by the
    answer, so an answer is only ever taken for the send it answers) and the request."""

    call_id: int
    request: ReserveRequest | PrefillRequest


class CallAnswer(NamedTuple):
    """A rank's answer to a `RankCall`: its call id, record kind, handoff id, and the result or the error
    the call raised."""

    call_id: int
    kind: str
    handoff_id: str
    outcome: ReserveResult | PrefillResult | Exception


def _params_to_dict(params: SamplingParams) -> dict[str, Any]:
    fields = dataclasses.asdict(params)
    fields["stop_token_ids"], fields["stop"] = list(fields["stop_token_ids"]), list(fields["stop"])
    return fields


def call_to_record(call: RankCall) -> dict[str, Any]:
    """The record of a call the driver sends a rank instead of a Ray call: `rsv` (a `ReserveRequest` for a
    decode rank: the meta unbound) or `pf` (a `PrefillRequest` for a prefill rank: the meta bound, with its
    secret, unless `awaiting_bind`; the connection is the rank's own, authenticated, on this host)."""
    request = call.request
    record = {
        "id": call.call_id,
        "rid": request.handoff_id,
        "t": list(request.prompt_token_ids),
        "p": _params_to_dict(request.params),
        "m": meta_to_dict(request.meta),
    }
    if isinstance(request, ReserveRequest):
        return {"k": "rsv", **record, "n": request.num_draft_tokens}
    return {
        "k": "pf",
        **record,
        "d": request.decode_index,
        "r": request.decode_rank,
        "ab": request.awaiting_bind,
        "ft": request.first_token_id,
    }


def call_from_record(record: dict[str, Any]) -> RankCall:
    """The call of a `rsv` or `pf` record. ValueError naming what is malformed (the sampling parameters
    are checked as `SamplingParams` checks a client's; never the secret)."""
    kind, handoff_id, tokens, params, meta = (record.get(k) for k in ("k", "rid", "t", "p", "m"))
    if kind not in CALL_KINDS:
        raise ValueError(f"a {kind!r} record is not a call")
    call_id = _check("call id", record.get("id"), (int,))
    if not isinstance(handoff_id, str) or not isinstance(params, dict) or not isinstance(meta, dict):
        raise ValueError(f"a {kind} record needs a string rid and mappings p and m")
    token_ids = _ints("prompt_token_ids", tokens)
    if not token_ids or min(token_ids) < 0:
        raise ValueError(f"{handoff_id}: prompt_token_ids must be a non-empty list of ints >= 0")
    if set(params) != _PARAM_NAMES:
        raise ValueError(f"sampling parameters {sorted(params)} are not {sorted(_PARAM_NAMES)}")
    try:
        sampling = SamplingParams(**params)
        handoff = meta_from_dict(meta)
    except (TypeError, ProtocolError) as e:
        raise ValueError(str(e)) from None
    if handoff.request_id != handoff_id:
        raise ValueError(f"the meta of {kind} {handoff_id!r} names {handoff.request_id!r}")
    if kind == "rsv":
        num_drafts = _check("num_draft_tokens", record.get("n"), (int,))
        if num_drafts < 0:
            raise ValueError(f"{handoff_id}: num_draft_tokens is {num_drafts}, not >= 0")
        if handoff.secret:
            raise ValueError(f"the meta of reserve {handoff_id!r} has a secret (decode makes it)")
        return RankCall(call_id, ReserveRequest(handoff_id, token_ids, sampling, handoff, num_drafts))
    awaiting_bind = _check("awaiting_bind", record.get("ab"), (bool,))
    first_token_id = _check("first_token_id", record.get("ft"), (int, type(None)))
    decode_index, decode_rank = record.get("d"), record.get("r")
    for name, value in (("decode_index", decode_index), ("decode_rank", decode_rank)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} is {value!r}, not an int >= 0")
    if awaiting_bind == bool(handoff.secret):
        raise ValueError(f"the meta of prefill {handoff_id!r} must carry a secret exactly when it is bound")
    request = PrefillRequest(
        handoff_id, token_ids, sampling, handoff, decode_index, decode_rank, awaiting_bind, first_token_id
    )
    return RankCall(call_id, request)


class RankCallRaised(RuntimeError):
    """A call sent on a rank's reply connection raised an error other than ValueError or RuntimeError
    (its class is named in the message)."""


def answer_to_record(
    call: RankCall, outcome: ReserveResult | PrefillResult | BaseException
) -> dict[str, Any]:
    """The `ans` record a rank answers a call with (`c`: the call's record kind): a reserve's
    `ReserveResult` (the bound meta, its secret included, or none: no room; and the rank's load), a
    prefill's `PrefillResult`, or the error the call raised as `[class name, message]`."""
    kind, handoff_id = call_kind(call.request), call.request.handoff_id
    if isinstance(outcome, BaseException):
        return error_answer_record(call.call_id, kind, handoff_id, outcome)
    record: dict[str, Any] = {"k": "ans", "id": call.call_id, "c": kind, "rid": handoff_id}
    if isinstance(outcome, PrefillResult):
        return {**record, "ok": dataclasses.asdict(outcome)}
    bound = None if outcome.bound_meta is None else meta_to_dict(outcome.bound_meta)
    load = None if outcome.load is None else dataclasses.asdict(outcome.load)
    return {**record, "ok": {"m": bound, "l": load}}


def error_answer_record(call_id: int, kind: str, handoff_id: str, error: BaseException) -> dict[str, Any]:
    """The `ans` record of a call (id, record kind, handoff id) that raised `error`: `[class name, message]`
    (also for a call the rank could not read, whose request is unknown)."""
    return {
        "k": "ans",
        "id": call_id,
        "c": kind,
        "rid": handoff_id,
        "err": [type(error).__name__, str(error)],
    }


def call_kind(call: ReserveRequest | PrefillRequest) -> str:
    """The record kind of `call`: `rsv` or `pf`."""
    return "rsv" if isinstance(call, ReserveRequest) else "pf"


_RAISED = {"ValueError": ValueError, "RuntimeError": RuntimeError}


def answer_from_record(record: dict[str, Any]) -> CallAnswer:
    """The `CallAnswer` of an `ans` record: the result, or the error to raise. A
    ValueError (a request the instance could never hold) or RuntimeError (a failed prefill) the call raised
    comes back as such, any other as `RankCallRaised`. ValueError (raised) naming what is malformed, never
    the secret."""
    call_id, kind, handoff_id, error, ok = (record.get(k) for k in ("id", "c", "rid", "err", "ok"))
    if kind not in CALL_KINDS or not isinstance(handoff_id, str):
        raise ValueError("an answer needs a call kind c (rsv or pf) and a string rid")
    _check("call id", call_id, (int,))
    if error is not None:
        if not (isinstance(error, list) and len(error) == 2 and all(isinstance(x, str) for x in error)):
            raise ValueError(f"{handoff_id}: err is not [class name, message]")
        name, message = error
        raised = _RAISED[name](message) if name in _RAISED else RankCallRaised(f"{name}: {message}")
        return CallAnswer(call_id, kind, handoff_id, raised)
    if not isinstance(ok, dict):
        raise ValueError(f"{handoff_id}: an answer needs err or a mapping ok")
    if kind == "pf":
        return CallAnswer(call_id, kind, handoff_id, _prefill_result(ok))
    meta, load = ok.get("m"), ok.get("l")
    if not isinstance(meta, dict | type(None)) or not isinstance(load, dict | type(None)):
        raise ValueError(f"{handoff_id}: m and l must be mappings or nil")
    bound = None if meta is None else _bound_meta(meta, handoff_id, "reserve answer")
    return CallAnswer(
        call_id, kind, handoff_id, ReserveResult(bound, None if load is None else _load_from_dict(load))
    )
