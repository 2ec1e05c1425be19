"""`KVMessage{chunk}` bytes built and read by hand, so a chunk's payload is copied once per side.

Wire-compatible with `protos/kv_transfer.proto`: `KVMessage.chunk` is field 2 (tag 0x12); in `LayerChunk`
`layer_idx` 1 (0x08), `offset_bytes` 2 (0x10), `data` 3 (0x1a), `header` 4 (0x22); the rest is protobuf.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from google.protobuf.message import DecodeError

from pdcluster.kvtransfer.base import ProtocolError
from pdcluster.protos import kv_transfer_pb2 as pb

KV_MESSAGE_CHUNK_TAG = 0x12
_VARINT, _LENGTH_DELIMITED = 0, 2


class RawChunk(NamedTuple):
    """A received `LayerChunk`: `data` a memoryview into the message; `header` only at offset 0."""

    layer_idx: int
    offset_bytes: int
    data: memoryview
    header: pb.LayerHeader | None


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ProtocolError("malformed chunk: truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def encode_chunk(layer_idx: int, offset_bytes: int, data: memoryview, header: pb.LayerHeader | None) -> bytes:
    fields = [b"\x08", _varint(layer_idx), b"\x10", _varint(offset_bytes)]
    if header is not None:
        header_bytes = header.SerializeToString()
        fields += [b"\x22", _varint(len(header_bytes)), header_bytes]
    fields += [b"\x1a", _varint(len(data))]
    prefix = b"".join(fields)
    body_len = len(prefix) + len(data)
    return b"".join((bytes([KV_MESSAGE_CHUNK_TAG]), _varint(body_len), prefix, data))


def serialize_message(message: Any) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def _decode_chunk(body: memoryview) -> RawChunk:
    layer_idx = offset_bytes = 0
    data: memoryview = memoryview(b"")
    header = None
    pos = 0
    while pos < len(body):
        tag, pos = _read_varint(body, pos)
        field, wire_type = tag >> 3, tag & 7
        if wire_type == _VARINT:
            value, pos = _read_varint(body, pos)
            if field == 1:
                layer_idx = value
            elif field == 2:
                offset_bytes = value
        elif wire_type == _LENGTH_DELIMITED:
            length, pos = _read_varint(body, pos)
            if pos + length > len(body):
                raise ProtocolError("malformed chunk: a field overruns the message")
            if field == 3:
                data = body[pos : pos + length]
            elif field == 4:
                header = pb.LayerHeader.FromString(bytes(body[pos : pos + length]))
            pos += length
        else:
            raise ProtocolError(f"malformed chunk: wire type {wire_type} of field {field}")
    return RawChunk(layer_idx, offset_bytes, data, header)


def deserialize_message(data: bytes) -> pb.KVMessage | RawChunk:
    """A chunk as a `RawChunk` (not copied), anything else as `pb.KVMessage`; ProtocolError if malformed."""
    buf = memoryview(data)
    if len(buf) and buf[0] == KV_MESSAGE_CHUNK_TAG:
        length, pos = _read_varint(buf, 1)
        if pos + length == len(buf):  # one field: the chunk (protobuf writes a oneof as its only field)
            return _decode_chunk(buf[pos:])
    try:
        return pb.KVMessage.FromString(data)
    except DecodeError as e:
        raise ProtocolError(f"malformed message: {e}") from None
