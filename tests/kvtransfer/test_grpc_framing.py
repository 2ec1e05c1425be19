"""The hand-built chunk messages (`kvtransfer.grpc_transport.framing`) are protobuf's own bytes: what any
protobuf peer reads and writes."""

from __future__ import annotations

import pytest

from pdcluster.kvtransfer.base import ProtocolError
from pdcluster.kvtransfer.grpc_transport.framing import RawChunk, deserialize_message, encode_chunk
from pdcluster.protos import kv_transfer_pb2 as pb


def _header() -> pb.LayerHeader:
    return pb.LayerHeader(
        request_id="r", layer_idx=3, num_tokens=7, kv_dim=24, dtype="bfloat16", wire_dtype="bfloat16",
        num_bytes=336, checksum=0xDEADBEEF,
    )  # fmt: skip


@pytest.mark.parametrize(("offset_bytes", "with_header", "num_bytes"), [(0, True, 336), (300, False, 36)])
def test_encoded_chunk_parses_as_protobuf_and_back(offset_bytes, with_header, num_bytes):
    data = bytes(range(256)) * 2
    view = memoryview(data)[offset_bytes : offset_bytes + num_bytes]
    header = _header() if with_header else None
    encoded = encode_chunk(3, offset_bytes, view, header)
    parsed = pb.KVMessage.FromString(encoded)  # protobuf reads it
    assert parsed.WhichOneof("kind") == "chunk"
    chunk = parsed.chunk
    assert (chunk.layer_idx, chunk.offset_bytes, chunk.data) == (3, offset_bytes, bytes(view))
    assert chunk.HasField("header") == with_header
    # and what protobuf writes is read without copying the data
    raw = deserialize_message(parsed.SerializeToString())
    assert isinstance(raw, RawChunk) and isinstance(raw.data, memoryview)
    assert (raw.layer_idx, raw.offset_bytes, bytes(raw.data)) == (3, offset_bytes, bytes(view))
    assert raw.header == header


def test_other_messages_stay_protobuf_and_a_truncated_chunk_is_a_protocol_error():
    begin = pb.KVMessage(begin=pb.Begin(request_id="r", num_layers=5))
    assert deserialize_message(begin.SerializeToString()) == begin
    encoded = encode_chunk(0, 0, memoryview(b"x" * 100), None)
    with pytest.raises(ProtocolError, match="malformed message"):  # outer length too long: protobuf's
        deserialize_message(encoded[:-10])
    body_truncated = encoded[:1] + bytes([encoded[1] - 10]) + encoded[2:-10]
    with pytest.raises(ProtocolError, match="overruns"):
        deserialize_message(body_truncated)
