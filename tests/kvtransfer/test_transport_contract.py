"""The contract every KV transport keeps, run against each: gRPC (two threads of this process, loopback),
shared memory (two threads, a Unix socket and memfd segments), both again into a `shm+grpc` decode rank's
`PairedReceiver` (its two listeners over one set of reservations) and torch.distributed (gloo, two
processes). The scenarios and what each role records are in `tests/kvtransfer/contract.py`; the
assertions here are the same for every transport, except where the
transports differ by design: torch.distributed has no return path, so only a gRPC or shm sender's `flush`
learns what decode refused (`REPORTS_DECODE_ERRORS`)."""

from __future__ import annotations

import re

import pytest
import torch

from pdcluster.kernels.kv_quant import quantize_kv_int8
from tests.kvtransfer.contract import HANDOFFS, SCENARIOS, WAIT_S
from tests.kvtransfer.contract_pairs import run_dist_pair, run_grpc_pair, run_paired_pair, run_shm_pair

TRANSPORTS = ("grpc", "shm", "shm+grpc:shm", "shm+grpc:grpc", "dist")
REPORTS_DECODE_ERRORS = {"grpc": True, "shm": True, "dist": False}  # a return path from receiver to sender


@pytest.fixture(scope="module", params=TRANSPORTS)
def results(request, tmp_path_factory) -> dict:
    if request.param == "grpc":
        got = run_grpc_pair()
    elif request.param == "shm":
        got = run_shm_pair()
    elif request.param.startswith("shm+grpc:"):
        got = run_paired_pair(request.param.split(":")[1])
    else:
        got = run_dist_pair(tmp_path_factory.mktemp("dist_kv"))
    for role in ("sender", "receiver"):
        assert "traceback" not in got[role], got[role]["traceback"]
    got["transport"] = request.param.rpartition(":")[2]  # a paired receiver keeps its sender's contract
    return got


def sender_failure(results, name: str) -> str | None:
    """What the sender's flush reported for `name` (None: nothing)."""
    flush = results["sender"][name]["flush"]
    assert set(flush) <= {name}, flush
    return flush.get(name)


def assert_decode_error_reported(results, name: str, errors: tuple[str, ...], text: str = "") -> None:
    """A gRPC sender learns decode's error (one of the classes `errors`, its message holding `text`); a
    torch.distributed one does not."""
    failure = sender_failure(results, name)
    if REPORTS_DECODE_ERRORS[results["transport"]]:
        assert failure is not None and failure.startswith(errors) and text in failure, failure
    else:
        assert failure is None


def test_five_layer_handoff_arrives_bit_exact_with_extras(results):
    got = results["receiver"]["bitexact"]
    assert got["bit_exact"]  # layers sent in the order 4, 0, 3, 1, 2; extras compared in the receiver
    # decode's paged writes got every (float) layer unverified and returned its CRC, checked afterwards
    assert got["layers_returned"] == 0 and got["unverified_when_written"] == [0, 1, 2, 3, 4]
    meta = HANDOFFS["bitexact"]
    assert got["num_wire_bytes"] == 5 * meta.num_tokens * meta.kv_dim * 2  # bfloat16: 72,000 B
    assert sender_failure(results, "bitexact") is None


def test_two_handoffs_in_flight_at_once(results):
    assert results["receiver"]["concurrent"]["bit_exact"] == [True, True]
    assert results["sender"]["concurrent"]["flush"] == {}


def test_send_layer_returns_before_delivery(results):
    assert results["sender"]["overlap"]["send_returned_before_delivery"]
    assert results["receiver"]["overlap"] == {
        "bit_exact": True,
        "layers_returned": 0,
        "num_wire_bytes": 5 * 37 * 24 * 2,
    }


def test_corrupted_byte_is_a_checksum_mismatch_naming_the_layer(results):
    got = results["receiver"]["corrupt"]
    assert got["raised"] == "ChecksumMismatch" and "checksum mismatch on layer 3" in got["message"]
    assert 3 in got["unverified_when_written"]  # caught by the CRC decode's write returned, after the write
    assert_decode_error_reported(results, "corrupt", ("ChecksumMismatch",), "layer 3")


def test_sender_that_stalls_after_two_layers_times_out_within_the_lease(results):
    got = results["receiver"]["stall"]
    assert got["raised"] == "TransferTimeout"
    assert "lease of 1 s expired with 2/5 layers arrived" in got["message"]
    assert got["elapsed_s"] < WAIT_S  # the lease fired, not the wait's own timeout
    # gRPC: the call ends at the lease, cut by the server or by the client's deadline, whichever is first
    assert_decode_error_reported(results, "stall", ("SenderLost", "TransferTimeout"))


def test_explicit_abort(results):
    got = results["receiver"]["abort"]
    assert got["raised"] == "TransferAborted" and "prefill instance draining" in got["message"]
    assert sender_failure(results, "abort") is None  # the abort itself was delivered
    assert "no open handoff" in results["sender"]["send_after_abort"]


def test_int8_wire_is_within_the_quantizers_bound_in_half_the_bytes(results):
    got = results["receiver"]["int8"]
    assert got["within_bound"] and got["dtypes"] == ["torch.float32"]
    assert got["unverified_when_written"] == []  # an int8 wire is verified before decode's write
    # 37 tokens x 24 values: float32 3,552 B per layer; int8 888 B values + 148 B scales = 1,036 B
    assert got["num_wire_bytes"] == 5 * (37 * 24 + 37 * 4)


def test_int8_cache_layers_are_sent_as_they_are(results):
    """int8 values + scales given to send_layer (an int8 KV cache's bytes) arrive as exactly those: this
    receiver (no passthrough) dequantizes them once, so it hands out dequantize(int8, scales) bit-exact."""
    got = results["receiver"]["int8-cache"]
    assert got["bit_exact"] and got["num_wire_bytes"] == 5 * (37 * 24 + 37 * 4)


def test_handoff_that_disagrees_with_the_reservation_is_refused(results):
    got = results["receiver"]["mismatch"]
    assert got["raised"] == "ProtocolError" and "num_tokens=38" in got["message"]
    assert_decode_error_reported(results, "mismatch", ("ProtocolError",), "num_tokens=38")


def test_data_without_a_reservation_is_refused(results):
    assert_decode_error_reported(results, "unexpected", ("HandoffRefused",), "no reservation")
    assert "unexpected" not in results["receiver"]["receiver_pending"]


def test_forged_handoffs_for_a_live_id_are_refused_and_the_victim_completes(results):
    """Handoffs with a wrong, a missing and an empty secret (each with a junk layer and a forged first
    token) are refused before any of their data is recorded: the reservation still waits, then the real
    sender's handoff arrives bit-exact with the real extras (compared in the receiver)."""
    got = results["receiver"]["forged"]
    assert got["still_waiting_after_forgeries"] and got["bit_exact"]
    assert sender_failure(results, "forged") is None
    if results["transport"] == "grpc":  # each rogue sender is told, without any secret in the message
        refusals = results["sender"]["rogue_failures"][:3]
        assert refusals[0].startswith("HandoffRefused") and "wrong handoff secret" in refusals[0]
        assert all("UNAUTHENTICATED" in r and "no handoff credentials" in r for r in refusals[1:]), refusals
        assert not any(re.search("[0-9a-f]{64}", r) for r in refusals)
    if results["transport"] == "shm":  # told on the socket: the real sender's way and bare records
        refusals = results["sender"]["rogue_failures"][:3]
        assert refusals[0].startswith("HandoffRefused") and "wrong handoff secret" in refusals[0]
        assert all("HandoffRefused" in r and "missing or wrong" in r for r in refusals[1:]), refusals


def test_replayed_begins_are_refused_and_the_transfer_in_progress_is_unaffected(results):
    """A second sender's begin mid-transfer, with the real secret (a replay) and with another one."""
    got = results["receiver"]["replayed"]
    assert got["bit_exact"] and got["layers_returned"] == 0
    assert sender_failure(results, "replayed") is None
    if results["transport"] in ("grpc", "shm"):
        replays = results["sender"]["rogue_failures"][3:]
        assert len(replays) == 2 and all(r.startswith("HandoffRefused") for r in replays), replays
    if results["transport"] == "grpc":
        # 3 forged + 2 replayed + the unexpected handoff: refused before any of their data was read
        assert results["receiver"]["num_refused_streams"] == 6


def test_release_waits_for_a_running_callback_and_later_layers_are_refused(results):
    got = results["receiver"]["release-midway"]
    assert got == {"release_blocked_during_callback": True, "released": True, "layers_delivered": 1}
    assert_decode_error_reported(results, "release-midway", ("ProtocolError",), "no reservation")


def test_sender_closing_mid_handoff_fails_it_with_sender_lost(results):
    got = results["receiver"]["lost"]
    assert got["raised"] == "SenderLost" and "sender lost with 1/5 layers arrived" in got["message"]
    assert got["elapsed_s"] < WAIT_S  # long before the 60 s lease


def test_no_leaked_state_on_either_side(results):
    assert results["receiver"]["receiver_pending"] == []
    assert results["sender"]["sender_pending_after_close"] == []
    for name in SCENARIOS:
        if name != "lost":
            assert results["sender"][name]["pending"] == [], name
    if results["transport"] == "shm":  # every sender closed: each connection's segments unmapped
        assert results["receiver"]["num_segments_after_close"] == 0


def test_int8_tolerance_is_the_quantizers_own_bound():
    """The bound the int8 scenario checks is quantize_kv_int8's (a check of the oracle, not a transport)."""
    x = torch.randn(37, 24) * torch.logspace(-2, 2, 37)[:, None]
    q, scale = quantize_kv_int8(x)
    assert bool(((q.float() * scale[:, None] - x).abs() <= scale[:, None] / 2 * (1 + 1e-6)).all())
