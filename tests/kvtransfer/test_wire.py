"""Wire format and receiver bookkeeping without a transport: encode/decode, checksums, validation."""

from __future__ import annotations

import time

import msgpack
import pytest
import torch

from pdcluster.kernels.kv_quant import dequantize_kv_int8, quantize_kv_int8
from pdcluster.kvtransfer.base import (
    HANDOFF_SECRET_NUM_BYTES,
    ChecksumMismatch,
    FailureLog,
    HandoffMeta,
    HandoffRefused,
    KVTransferError,
    ProtocolError,
    TransferTimeout,
    new_handoff_secret,
    resolve_wire_dtype,
)
from pdcluster.kvtransfer.reservations import Reservations
from pdcluster.kvtransfer.wire import (
    COPY_CHUNK_BYTES,
    LayerHeader,
    check_layer,
    checksum,
    copy_with_checksum,
    decode_layer,
    encode_layer,
    extras_from_dict,
    extras_to_dict,
    meta_from_dict,
    meta_to_dict,
    verify_layer,
)
from tests.kvtransfer.conftest import assert_extras_equal, bits_equal, make_extras, make_handoff, make_layers


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_float_wire_round_trip_is_bit_exact_including_special_values(dtype):
    meta = make_handoff(dtype=dtype, wire_dtype=dtype)
    latent = make_layers(meta)[0]
    latent[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    layer = encode_layer(meta, 2, latent)
    assert layer.header.num_bytes == meta.num_tokens * meta.kv_dim * latent.dtype.itemsize
    verify_layer(layer.header, layer.payload)
    assert bits_equal(decode_layer(layer.header, layer.payload).latent, latent)


def test_int8_cache_bytes_go_through_an_int8_wire_as_they_are():
    """An int8 KV cache's layer (int8 + scales) on an int8 wire: the payload is those bytes, and a
    passthrough receiver hands back exactly them; on a float wire it travels dequantized."""
    meta = make_handoff(wire_dtype="int8")
    values, scales = quantize_kv_int8(make_layers(meta)[0])
    layer = encode_layer(meta, 1, values, scales)
    assert bits_equal(layer.payload, torch.cat([values.view(-1).view(torch.uint8), scales.view(torch.uint8)]))
    got = decode_layer(layer.header, layer.payload, int8_passthrough=True)
    assert bits_equal(got.latent, values) and bits_equal(got.scale, scales)
    float_meta = make_handoff()  # bfloat16 wire
    got = decode_layer(*encode_layer(float_meta, 1, values, scales))
    assert got.scale is None and bits_equal(got.latent, dequantize_kv_int8(values, scales, torch.bfloat16))


def test_check_layer_names_what_is_wrong_with_an_int8_layer():
    meta = make_handoff(wire_dtype="int8")
    values, scales = quantize_kv_int8(make_layers(meta)[0])
    check_layer(meta, 0, values, scales)
    with pytest.raises(ValueError, match=r"latent_kv must be \[37, 24\] bfloat16"):
        check_layer(meta, 0, values)  # int8 without its scales
    with pytest.raises(ValueError, match=r"latent_kv must be \[37, 24\] int8"):
        check_layer(meta, 0, make_layers(meta)[0], scales)
    with pytest.raises(ValueError, match=r"scale must be \[37\] float32"):
        check_layer(meta, 0, values, scales[:-1])


def test_wire_dtype_auto_is_the_dtype_decodes_cache_stores():
    assert resolve_wire_dtype("auto", "bfloat16", "auto") == "bfloat16"
    assert resolve_wire_dtype("auto", "float32", "int8") == "int8"
    assert resolve_wire_dtype("int8", "bfloat16", "auto") == "int8"
    with pytest.raises(ValueError, match="wire_dtype"):
        resolve_wire_dtype("fp8", "bfloat16", "auto")


def test_every_single_byte_corruption_is_detected():
    meta = make_handoff(num_tokens=3, kv_dim=8)  # 48-byte payload: try every position and several values
    layer = encode_layer(meta, 0, make_layers(meta)[0])
    for position in range(layer.header.num_bytes):
        for flip in (0x01, 0x80, 0xFF, 0x5A):
            corrupted = layer.payload.clone()
            corrupted[position] ^= flip
            with pytest.raises(ChecksumMismatch, match="layer 0"):
                verify_layer(layer.header, corrupted)
    with pytest.raises(ChecksumMismatch, match="payload is 47 B"):
        verify_layer(layer.header, layer.payload[:-1])


def test_header_and_extras_survive_msgpack_and_corrupted_extras_are_caught():
    meta = make_handoff()
    header = encode_layer(meta, 1, make_layers(meta)[1]).header
    assert LayerHeader.from_dict(msgpack.unpackb(msgpack.packb(header.to_dict()))) == header
    extras = make_extras(meta, with_probs=True)
    record = msgpack.unpackb(msgpack.packb(extras_to_dict(extras), use_bin_type=True), raw=False)
    assert_extras_equal(extras_from_dict(meta.request_id, record), extras)
    record["draft_token_ids"][0] += 1
    with pytest.raises(ChecksumMismatch, match="extras"):
        extras_from_dict(meta.request_id, record)
    record["draft_token_ids"][0] -= 1
    record["logprobs"][1] -= 0.5  # the first token's logprob
    with pytest.raises(ChecksumMismatch, match="extras"):
        extras_from_dict(meta.request_id, record)


def test_wire_bytes_come_from_itemsize():
    v3 = dict(num_tokens=2048, kv_dim=576, num_layers=62)  # 61 layers + the MTP layer
    assert HandoffMeta("a", **v3, dtype="bfloat16", wire_dtype="bfloat16").layer_wire_bytes == 2048 * 1152
    assert HandoffMeta("a", **v3, dtype="bfloat16", wire_dtype="int8").layer_wire_bytes == 2048 * 580
    assert HandoffMeta("a", **v3, dtype="float32", wire_dtype="float32").total_wire_bytes == 62 * 2048 * 2304


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(num_layers=0), "num_layers"),
        (dict(num_tokens=-1), "num_tokens"),
        (dict(dtype="int8", wire_dtype="int8"), "dtype"),
        (dict(wire_dtype="float16"), "wire_dtype"),
        (dict(lease_s=0.0), "lease_s"),
        (dict(request_id=""), "request_id"),
    ],
)
def test_handoff_validation_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        make_handoff(**overrides)


def test_reservation_errors_are_explicit():
    reservations = Reservations()
    meta = make_handoff("r", lease_s=0.05)
    reservations.expect(meta)
    with pytest.raises(ValueError, match="already reserved"):
        reservations.expect(meta)
    with pytest.raises(KeyError):
        reservations.wait("unknown", 0.01)
    with pytest.raises(TransferTimeout, match=r"0/5 layers arrived \(the sender never began\)"):
        reservations.wait("r", 10.0)
    with pytest.raises(TransferTimeout):  # the failure sticks until release
        reservations.wait("r", 10.0)
    reservations.release("r")
    reservations.release("r")  # idempotent
    assert reservations.pending_request_ids() == []
    with pytest.raises(HandoffRefused, match="no reservation"):
        reservations.claim("r", new_handoff_secret())


def test_layer_before_begin_and_duplicate_layers_are_protocol_errors():
    reservations = Reservations()
    meta = make_handoff("dup")
    layer = encode_layer(meta, 0, make_layers(meta)[0])
    reservations.expect(meta)
    with pytest.raises(ProtocolError, match="before begin"):
        reservations.on_layer(layer.header, layer.payload)
    reservations.release("dup")
    bound = reservations.expect(meta)
    reservations.claim("dup", bound.secret)
    reservations.on_begin(meta)
    reservations.on_layer(layer.header, layer.payload)
    with pytest.raises(ProtocolError, match="layer 0 received twice"):
        reservations.on_layer(layer.header, layer.payload)
    with pytest.raises(ProtocolError, match="received twice"):
        reservations.wait("dup", 1.0)
    reservations.release("dup")
    assert reservations.pending_request_ids() == []


def test_expect_binds_a_fresh_secret_that_stays_out_of_equality_and_repr():
    reservations = Reservations()
    meta = make_handoff("bound")
    bound = reservations.expect(meta)
    assert len(bound.secret) == HANDOFF_SECRET_NUM_BYTES and bound == meta  # equal apart from the secret
    assert "secret" not in repr(bound) and bound.secret.hex() not in repr(bound)
    other = Reservations().expect(make_handoff("bound"))
    assert other.secret != bound.secret
    with pytest.raises(ValueError, match="already has a secret"):
        Reservations().expect(bound)  # the receiver creates it; a caller cannot choose it
    assert meta_from_dict(meta_to_dict(bound)).secret == bound.secret  # torch.distributed's begin record
    with pytest.raises(ProtocolError) as refused:
        meta_from_dict({**meta_to_dict(bound), "num_layers": 0})
    assert bound.secret.hex() not in str(refused.value) and repr(bound.secret) not in str(refused.value)


def test_claim_admits_one_sender_and_refusals_leave_the_reservation_alone():
    reservations = Reservations()
    bound = reservations.expect(make_handoff("claimed", lease_s=10.0))
    for secret in (b"", new_handoff_secret(), bound.secret[:-1]):
        with pytest.raises(HandoffRefused, match="missing or wrong handoff secret"):
            reservations.claim("claimed", secret)
    with pytest.raises(HandoffRefused, match="not admitted"):
        reservations.on_begin(bound)  # a begin without a claim is refused too, unrecorded
    assert reservations.failure("claimed") is None
    deadline_s = reservations.claim("claimed", bound.secret)
    assert deadline_s > 0
    for secret in (bound.secret, new_handoff_secret()):  # a replay, right secret or not
        with pytest.raises(HandoffRefused):
            reservations.claim("claimed", secret)
    reservations.on_begin(bound)
    with pytest.raises(HandoffRefused, match="already has its sender"):
        reservations.claim("claimed", bound.secret)
    assert reservations.failure("claimed") is None
    with pytest.raises(TransferTimeout, match="wait timed out"):  # still waiting for its layers
        reservations.wait("claimed", 0.01)
    reservations.release("claimed")


def test_claim_after_the_lease_is_refused():
    reservations = Reservations()
    bound = reservations.expect(make_handoff("late", lease_s=0.01))
    time.sleep(2 * bound.lease_s)
    with pytest.raises(HandoffRefused, match="lease of 0.01 s is over"):
        reservations.claim("late", bound.secret)
    reservations.release("late")


def test_failure_log_is_bounded():
    log = FailureLog(max_records=3)
    for i in range(5):
        log.add(f"r{i}", KVTransferError(f"e{i}"))
    assert len(log) == 3
    assert sorted(log.pop_all()) == ["r2", "r3", "r4"]
    assert len(log) == 0


def test_checksum_is_crc32c_and_chains():
    # The CRC-32C check value of the ASCII digits 1..9 (RFC 3720 appendix B.4; Castagnoli's polynomial)
    assert checksum(b"123456789") == 0xE3069283
    assert checksum(b"") == 0
    data = torch.arange(100_000, dtype=torch.int32).view(torch.uint8).numpy()  # past the GIL-release size
    assert checksum(data[40_000:], checksum(data[:40_000])) == checksum(data)
    assert checksum(memoryview(data)) == checksum(data.tobytes())


def test_kept_layers_are_copies_verified_after_copying():
    """copy_kept_layers (the shm receiver, whose segments are reused): wait's layers own their bytes, so a
    later write into the payload buffer changes nothing decode got; a corrupted payload is still refused."""
    reservations = Reservations(copy_kept_layers=True)
    meta = make_handoff("kept", num_layers=2)
    layers = make_layers(meta)
    bound = reservations.expect(meta)
    reservations.claim("kept", bound.secret)
    reservations.on_begin(meta)
    buffer = torch.empty(meta.layer_wire_bytes, dtype=torch.uint8)  # one reused payload buffer
    for layer_idx, latent in enumerate(layers):
        layer = encode_layer(meta, layer_idx, latent)
        buffer.copy_(layer.payload)
        reservations.on_layer(layer.header, buffer)
    buffer.fill_(0xA5)  # the sender's next handoff overwrites the segment
    reservations.on_finish("kept", make_extras(meta))
    received = reservations.wait("kept", 1.0)
    assert len(received.layers) == 2
    for got, sent in zip(received.layers, layers, strict=True):
        assert bits_equal(got.latent, sent)
    reservations.release("kept")
    bound = reservations.expect(meta)
    reservations.claim("kept", bound.secret)
    reservations.on_begin(meta)
    layer = encode_layer(meta, 0, layers[0])
    corrupted = layer.payload.clone()
    corrupted[7] ^= 0x01
    with pytest.raises(ChecksumMismatch, match="layer 0"):
        reservations.on_layer(layer.header, corrupted)
    reservations.release("kept")


def test_a_callback_that_checksums_is_held_to_the_crc_it_returns():
    """`on_layer_checksums`: the receiver takes the CRC the callback returns (it does not compute its own
    when it has one): a wrong one fails the handoff though the bytes are intact, and the layer does not
    count as arrived; a callback returning no CRC gets the bytes verified after it; a short payload is
    refused before the callback runs; an int8 wire is verified before the callback (which is told so)."""
    meta = make_handoff("cb", num_layers=2)
    layers = make_layers(meta)
    calls: list[tuple[int, bool]] = []

    def receive(returns, payload_of=lambda layer: layer.payload, handoff=meta, latents=layers):
        reservations = Reservations()

        def on_layer(layer_idx, layer):
            calls.append((layer_idx, layer.verified))
            return returns(layer)

        bound = reservations.expect(handoff, on_layer, on_layer_checksums=True)
        reservations.claim(handoff.request_id, bound.secret)
        reservations.on_begin(handoff)
        for layer_idx, latent in enumerate(latents):
            layer = encode_layer(handoff, layer_idx, latent)
            reservations.on_layer(layer.header, payload_of(layer))
        reservations.on_finish(handoff.request_id, make_extras(handoff))
        return reservations.wait(handoff.request_id, 1.0)

    received = receive(lambda layer: checksum(layer.latent.view(torch.uint8).numpy()))
    assert received.layers == [] and calls == [(0, False), (1, False)]
    calls.clear()
    receive(lambda layer: None)  # verified after the callback instead
    receive(lambda layer: "not a crc")  # likewise: nothing escapes on the receive thread
    with pytest.raises(ChecksumMismatch, match="checksum mismatch on layer 0"):
        receive(lambda layer: checksum(layer.latent.view(torch.uint8).numpy()) ^ 1)
    calls.clear()
    with pytest.raises(ChecksumMismatch, match="layer 0 payload is"):
        receive(lambda layer: 0, payload_of=lambda layer: layer.payload[:-2])
    assert calls == []
    int8 = make_handoff("cb8", num_layers=2, dtype="float32", wire_dtype="int8")
    receive(lambda layer: None, handoff=int8, latents=make_layers(int8))
    assert calls == [(0, True), (1, True)]


@pytest.mark.parametrize(
    "num_bytes",
    [0, 1, COPY_CHUNK_BYTES - 1, COPY_CHUNK_BYTES, COPY_CHUNK_BYTES + 1, 3 * COPY_CHUNK_BYTES + 7],
)
def test_copy_with_checksum_copies_and_returns_the_crc32c_of_the_whole(num_bytes):
    """The chunked copy + CRC (both shm sides) gives the bytes and the one-shot CRC-32C of all of them."""
    gen = torch.Generator().manual_seed(num_bytes)
    src = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=gen)
    dst = torch.full((num_bytes,), 0xA5, dtype=torch.uint8)
    crc = copy_with_checksum(dst, src)
    assert torch.equal(dst, src)
    assert crc == checksum(src.numpy())
    assert copy_with_checksum(torch.empty_like(src), memoryview(src.numpy().tobytes())) == crc  # bytes-like
    tail = torch.randint(0, 256, (COPY_CHUNK_BYTES + 3,), dtype=torch.uint8, generator=gen)
    tail_dst = torch.empty_like(tail)
    assert copy_with_checksum(tail_dst, tail, crc) == checksum(torch.cat([src, tail]).numpy())
    with pytest.raises(ValueError, match="into"):
        copy_with_checksum(torch.empty(num_bytes + 1, dtype=torch.uint8), src)
