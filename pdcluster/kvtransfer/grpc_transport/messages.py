"""The gRPC transport's limits, metadata keys, protobuf <-> kvtransfer types and status codes."""

from __future__ import annotations

import dataclasses

import grpc
import torch

from pdcluster.engine.outputs import TokenLogprobs
from pdcluster.kvtransfer.base import (
    ChecksumMismatch,
    HandoffExtras,
    HandoffMeta,
    HandoffRefused,
    KVTransferError,
    ProtocolError,
    SenderLost,
    TransferAborted,
    TransferTimeout,
)
from pdcluster.kvtransfer.wire import (
    LayerHeader,
    extras_checksum,
    tensor_from_record,
    tensor_to_record,
    verify_extras,
)
from pdcluster.protos import kv_transfer_pb2 as pb

GRPC_MAX_MESSAGE_BYTES = 4 << 20  # gRPC's default receive limit; both ends set it explicitly
MESSAGE_OVERHEAD_BYTES = 64 << 10
DEFAULT_MAX_CHUNK_BYTES = GRPC_MAX_MESSAGE_BYTES - MESSAGE_OVERHEAD_BYTES
TRANSFER_METHOD = "/pdcluster.kvtransfer.KVTransfer/Transfer"
HANDOFF_ID_KEY = "pdcluster-handoff-id"
HANDOFF_SECRET_KEY = "pdcluster-handoff-secret-bin"

ERROR_TO_CODE: list[tuple[type[KVTransferError], grpc.StatusCode]] = [
    (HandoffRefused, grpc.StatusCode.UNAUTHENTICATED),  # before its base class ProtocolError
    (ChecksumMismatch, grpc.StatusCode.DATA_LOSS),
    (SenderLost, grpc.StatusCode.CANCELLED),  # before its base class TransferTimeout: first match wins
    (TransferTimeout, grpc.StatusCode.DEADLINE_EXCEEDED),
    (TransferAborted, grpc.StatusCode.ABORTED),
    (KVTransferError, grpc.StatusCode.FAILED_PRECONDITION),
]
CODE_TO_ERROR = {code: cls for cls, code in ERROR_TO_CODE} | {
    grpc.StatusCode.FAILED_PRECONDITION: ProtocolError
}


BEGIN_FIELDS = tuple(f.name for f in dataclasses.fields(HandoffMeta) if f.name != "secret")
LAYER_HEADER_FIELDS = tuple(f.name for f in dataclasses.fields(LayerHeader))


def meta_to_proto(meta: HandoffMeta) -> pb.Begin:
    """The stream's `Begin`: every `HandoffMeta` field but the secret (sent as call metadata)."""
    return pb.Begin(**{name: getattr(meta, name) for name in BEGIN_FIELDS})


def meta_from_proto(begin: pb.Begin) -> HandoffMeta:
    """`HandoffMeta` of a received `Begin` (no secret); ProtocolError for fields it refuses."""
    try:
        return HandoffMeta(**{name: getattr(begin, name) for name in BEGIN_FIELDS})
    except ValueError as e:
        raise ProtocolError(f"malformed Begin for {begin.request_id!r}: {e}") from None


def header_to_proto(header: LayerHeader) -> pb.LayerHeader:
    return pb.LayerHeader(**header.to_dict())


def header_from_proto(header: pb.LayerHeader) -> LayerHeader:
    return LayerHeader(**{name: getattr(header, name) for name in LAYER_HEADER_FIELDS})


def _raw_tensor(tensor: torch.Tensor) -> pb.RawTensor:
    return pb.RawTensor(**tensor_to_record(tensor))


def extras_to_proto(extras: HandoffExtras) -> pb.Finish:
    finish = pb.Finish(
        first_token_id=extras.first_token_id,
        draft_token_ids=extras.draft_token_ids,
        checksum=extras_checksum(extras),
    )
    if extras.draft_probs is not None:
        finish.draft_probs.CopyFrom(_raw_tensor(extras.draft_probs))
    logprobs = extras.first_token_logprobs
    if logprobs is not None:
        finish.first_token_logprobs.CopyFrom(
            pb.TokenLogprobs(
                logprob=logprobs.logprob,
                rank=logprobs.rank,
                top_token_ids=logprobs.top_token_ids,
                top_logprobs=logprobs.top_logprobs,
            )
        )
    return finish


def extras_from_proto(request_id: str, finish: pb.Finish) -> HandoffExtras:
    """`HandoffExtras` of a received `Finish`; ProtocolError if malformed, ChecksumMismatch on a bad CRC."""

    def tensor(raw: pb.RawTensor) -> torch.Tensor:
        return tensor_from_record({"dtype": raw.dtype, "shape": list(raw.shape), "data": raw.data})

    try:
        extras = HandoffExtras(
            first_token_id=finish.first_token_id,
            draft_token_ids=list(finish.draft_token_ids),
            draft_probs=tensor(finish.draft_probs) if finish.HasField("draft_probs") else None,
        )
        if finish.HasField("first_token_logprobs"):
            lp = finish.first_token_logprobs
            extras.first_token_logprobs = TokenLogprobs(
                finish.first_token_id, lp.logprob, lp.rank, list(lp.top_token_ids), list(lp.top_logprobs)
            )
    except (ValueError, RuntimeError) as e:
        raise ProtocolError(f"{request_id}: malformed extras: {e}") from None
    verify_extras(request_id, extras, finish.checksum)
    return extras


def error_from_rpc(error: grpc.RpcError) -> KVTransferError:
    code, details = error.code(), error.details()  # type: ignore[attr-defined]
    cls = CODE_TO_ERROR.get(code, KVTransferError)
    return cls(f"gRPC {code.name}: {details}")


def status_code_for(error: KVTransferError) -> grpc.StatusCode:
    return next(code for cls, code in ERROR_TO_CODE if isinstance(error, cls))
