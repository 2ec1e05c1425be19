"""The control-plane path the simulator adds (`planner.control_plane`): exact arithmetic of one request
through the simulator, the derivation from measured requests, and the calibration round trip. Times are
sums of a few binary floats: compared with a 1e-9 s tolerance (rounding, not modelling)."""

from __future__ import annotations

import json

import pytest

from pdcluster.entrypoints.bench_client import RequestResult
from pdcluster.planner.calibration import FORMAT
from pdcluster.planner.control_plane import (
    ControlPlane,
    control_plane_from_calibration,
    cpu_share,
    derive,
    point_from_result,
)
from pdcluster.planner.simulator import SimOptions, simulate
from pdcluster.planner.trace import TraceRequest
from tests.planner.test_simulator import LinearModel, sizing, topology

TOL_S = 1e-9


def _one_request(control_plane: ControlPlane | None):
    result = simulate(
        topology(),
        [TraceRequest(0.0, 100, 5)],
        SimOptions(LinearModel(0.010, handoff_s=0.003), LinearModel(0.002), control_plane=control_plane),
        prefill_sizing=sizing(),
        decode_sizing=sizing(),
    )
    (r,) = result.results
    assert r.ok
    return r


def test_one_request_pays_each_control_plane_cost_once_where_the_live_path_does():
    bare = _one_request(None)
    # the first token streams from the prefill reply: TTFT is the prefill step; the handoff (3 ms) and
    # 4 decode steps for tokens 2..5 follow
    assert bare.ttft_s == pytest.approx(0.010, abs=TOL_S)
    assert bare.tpot_s == pytest.approx((0.003 + 4 * 0.002) / 4, abs=TOL_S)
    cp = ControlPlane(dispatch_s=0.004, first_token_extra_s=0.002, handoff_extra_s=0.004,
                      first_decode_step_extra_s=0.003, decode_step_extra_s=0.001)  # fmt: skip
    r = _one_request(cp)
    # route + reserve before the prefill is queued, then prefill and the first-token extra (its reply)
    assert r.ttft_s == pytest.approx(0.004 + 0.010 + 0.002, abs=TOL_S)
    # decode admits it after the modelled handoff and the handoff extra; the first decode step pays both
    # extras, the next three the per-step one
    decode_s = (0.002 + 0.001 + 0.003) + 3 * (0.002 + 0.001)
    assert r.phases == pytest.approx(
        {"queue_s": 0.004, "prefill_s": 0.010, "kv_transfer_s": 0.003 + 0.004, "decode_s": decode_s},
        abs=TOL_S,
    )
    assert r.e2e_s == pytest.approx(sum(r.phases.values()), abs=TOL_S)
    assert r.tpot_s == pytest.approx((0.004 + 0.010 + 0.007 + decode_s - r.ttft_s) / 4, abs=TOL_S)
    # a reply slower than the handoff and the first decode step: decode admits the request without a token
    # (the reply streams it), so the first token the client sees comes with that step's delta
    late = _one_request(ControlPlane(first_token_extra_s=0.050))
    assert late.ttft_s == pytest.approx(0.010 + 0.003 + 0.002, abs=TOL_S)
    assert late.tpot_s == pytest.approx(3 * 0.002 / 4, abs=TOL_S) and late.e2e_s >= late.ttft_s
    # the prefill instance stays busy for the per-request extra after sampling the first token: the call
    # (prefill_s) and the handoff move, the first token does not
    held = _one_request(ControlPlane(prefill_extra_s=0.005, first_token_extra_s=0.002))
    assert held.phases["prefill_s"] == pytest.approx(0.015, abs=TOL_S)
    assert held.ttft_s == pytest.approx(0.010 + 0.002, abs=TOL_S)
    assert held.phases["kv_transfer_s"] == pytest.approx(0.003, abs=TOL_S)


class SampledEarly(LinearModel):
    """A prefill step whose first tokens are sampled `tail_s` before its end (the MTP pass after them)."""

    def __init__(self, base_s: float, tail_s: float, handoff_s: float = 0.0) -> None:
        super().__init__(base_s, handoff_s=handoff_s)
        self.tail_s = tail_s

    def first_token_s(self, step) -> float:  # noqa: ANN001
        return self.step_time_s(step) - self.tail_s


def test_the_first_token_comes_before_the_prefill_mtp_pass_and_the_derivation_follows():
    prefill = SampledEarly(0.010, 0.004, handoff_s=0.003)
    cp = ControlPlane(prefill_extra_s=0.005, first_token_extra_s=0.002)
    options = SimOptions(prefill, LinearModel(0.002), control_plane=cp)
    result = simulate(
        topology(), [TraceRequest(0.0, 100, 5)], options, prefill_sizing=sizing(), decode_sizing=sizing()
    )
    (r,) = result.results
    # sampled 4 ms before the modelled step's end; the call holds the MTP pass and the per-request extra
    assert r.ttft_s == pytest.approx(0.010 - 0.004 + 0.002, abs=TOL_S)
    assert r.phases["prefill_s"] == pytest.approx(0.010 + 0.005, abs=TOL_S)
    measured = RequestResult(0, 64, 9, 0.0, ok=True, num_output_tokens=9, ttft_s=0.040, tpot_s=0.008,
                             acceptance_rate=0.5, phases={"route_s": 0.001, "reserve_s": 0.002})  # fmt: skip
    point = point_from_result(measured, 1, {"prefill_s": 0.020, "sampled_s": 0.015, "decode_s": 0.004})
    assert point["first_token_extra_s"] == pytest.approx(0.040 - 0.003 - 0.015, abs=TOL_S)


def test_derive_subtracts_the_modelled_engine_time_from_the_measured_phases():
    result = RequestResult(0, 64, 9, 0.0, ok=True, num_output_tokens=9, ttft_s=0.050, tpot_s=0.008,
                           acceptance_rate=0.5,
                           phases={"route_s": 0.001, "reserve_s": 0.002, "kv_transfer_s": 0.040,
                                   "admit_s": 0.001, "first_decode_step_s": 0.010})  # fmt: skip
    modelled = {"prefill_s": 0.020, "kv_handoff_s": 0.005, "decode_s": 0.004}
    point = point_from_result(result, 1, modelled)
    steps = 8 / 1.5  # 8 tokens after the first at 1 + 0.5 x 1 per step
    assert point["dispatch_s"] == pytest.approx(0.003, abs=TOL_S)
    assert point["first_token_extra_s"] == pytest.approx(0.050 - 0.003 - 0.020, abs=TOL_S)
    assert point["handoff_extra_s"] == pytest.approx(0.040 + 0.001 - 0.020 - 0.005, abs=TOL_S)
    assert point["first_decode_step_extra_s"] == pytest.approx(0.010 - 0.004, abs=TOL_S)
    # the client's decode time less the gap from its first token to the admission (3 + 40 + 1 - 50 ms:
    # none here, the reply came after the admission)
    assert point["decode_step_extra_s"] == pytest.approx((0.064 - 0.010) / (steps - 1) - 0.004, abs=TOL_S)
    early_reply = RequestResult(0, 64, 9, 0.0, ok=True, num_output_tokens=9, ttft_s=0.030, tpot_s=0.008,
                                acceptance_rate=0.5, phases=dict(result.phases))  # fmt: skip
    early = point_from_result(early_reply, 1, modelled)
    gap = 0.003 + 0.040 + 0.001 - 0.030
    assert early["decode_step_extra_s"] == pytest.approx(
        (0.064 - gap - 0.010) / (steps - 1) - 0.004, abs=TOL_S
    )
    # with the measured prefill call (30 ms at half speed): its excess over the modelled step is the busy
    # extra at full speed; the handoff is timed from the call's end, the reply from the sampling
    called = RequestResult(0, 64, 9, 0.0, ok=True, num_output_tokens=9, ttft_s=0.050, tpot_s=0.008,
                           acceptance_rate=0.5, phases={**result.phases, "prefill_s": 0.030})  # fmt: skip
    with_call = point_from_result(called, 1, modelled, prefill_rate=0.5)
    assert with_call["prefill_extra_s"] == pytest.approx((0.030 - 0.020) * 0.5, abs=TOL_S)
    assert with_call["first_token_extra_s"] == pytest.approx(0.050 - 0.003 - 0.020, abs=TOL_S)
    assert with_call["handoff_extra_s"] == pytest.approx(0.040 + 0.001 - 0.030 - 0.005, abs=TOL_S)
    n, rest_s, modelled_s = point["later_steps"]
    expected = (steps - 1, 0.064 - 0.010, (steps - 1) * 0.004)  # the later steps, measured and modelled
    assert (n, rest_s, modelled_s) == pytest.approx(expected, abs=TOL_S)
    # a model slower than the live path adds nothing
    slower = dict(point, decode_step_extra_s=-0.5, later_steps=(n, rest_s, rest_s + 0.5 * n))
    assert derive([slower]).decode_step_extra_s == 0.0
    with pytest.raises(ValueError, match="no measured request"):
        derive([])


def test_the_per_step_extra_is_pooled_over_all_the_probes_steps():
    """Two probes, 3 and 9 later steps with 6 and 18 ms over the model: 24 ms over 12 steps (2 ms a step);
    the median of their per-step figures (2 ms, 2 ms) agrees, a third of 1 step (under the minimum) is out,
    and a probe with more steps weighs more: (3 + 27) ms over 12 steps, not the mean of its 1 and 3 ms."""
    points = [{"later_steps": (3, 0.018, 0.012)}, {"later_steps": (9, 0.054, 0.036)},
              {"later_steps": (1, 0.050, 0.004)}]  # fmt: skip
    assert derive(points).decode_step_extra_s == pytest.approx(0.002, abs=TOL_S)
    weighted = [{"later_steps": (3, 0.015, 0.012)}, {"later_steps": (9, 0.063, 0.036)}]
    assert derive(weighted).decode_step_extra_s == pytest.approx(0.030 / 12, abs=TOL_S)


def test_host_cpu_line_background_and_cpu_share():
    # driver CPU = 40 ms per request + 2 ms per decode step, exactly on the line
    points = [{"num_decode_steps": n, "host_cpu_s": 0.040 + 0.002 * n} for n in (4, 30, 4, 30, 12)]
    cp = derive(points, background_cores=1.5)
    assert cp.host_cpu_per_request_s == pytest.approx(0.040, abs=TOL_S)
    assert cp.host_cpu_per_decode_step_s == pytest.approx(0.002, abs=TOL_S)
    assert cp.background_cores == 1.5 and cp.dispatch_s == 0.0  # no phase measured: zero
    same = derive([{"num_decode_steps": 5, "host_cpu_s": 0.05}] * 2)  # no spread in steps: the mean only
    assert (same.host_cpu_per_request_s, same.host_cpu_per_decode_step_s) == (pytest.approx(0.05), 0.0)

    def result(prefill_s, wait_s):
        phases = (
            {"prefill_s": prefill_s}
            if wait_s is None
            else {"prefill_s": prefill_s, "prefill_cpu_wait_s": wait_s}
        )
        return RequestResult(0, 8, 2, 0.0, ok=True, phases=phases)  # fmt: skip

    # median of 1 - wait / prefill over the probes that report a wait
    assert cpu_share([result(0.040, 0.010), result(0.020, 0.010), result(0.030, 0.0), result(0.1, None)]) == (
        pytest.approx(0.75)
    )
    assert cpu_share([result(0.1, None)]) == 1.0


def test_calibration_round_trip_and_bad_values(tmp_path):
    assert control_plane_from_calibration(None) == ControlPlane()
    path = tmp_path / "cal.json"
    doc = {"format": FORMAT, "accelerator": "cpu", "factors": {}}
    path.write_text(json.dumps(doc))
    assert control_plane_from_calibration(path) == ControlPlane()  # written before it was measured
    values = {"dispatch_s": 0.01, "first_token_extra_s": 0.02, "first_decode_step_extra_s": 0.0,
              "decode_step_extra_s": 0.004}  # fmt: skip
    path.write_text(json.dumps({**doc, "control_plane": {"values": values, "points": []}}))
    assert control_plane_from_calibration(path) == ControlPlane(**values)
    path.write_text(json.dumps({**doc, "control_plane": {"values": {"route_ms": 1.0}}}))
    with pytest.raises(ValueError, match="control_plane.values"):
        control_plane_from_calibration(path)
    with pytest.raises(ValueError, match="dispatch_s must be a finite number >= 0"):
        ControlPlane(dispatch_s=-1.0)


@pytest.mark.parametrize("idle_cores", [None, 0.1])
def test_the_simulator_replays_a_lone_probe_as_it_was_measured(idle_cores):
    """The derivation inverts the simulator: one probe's control plane, replayed alone on the node's cores
    with its core sharing, gives back the probe's TTFT and TPOT (the probe's load is counted once), whether
    the demand beside the prefill is all steady background or (a measured idle load) mostly co-runners."""
    import dataclasses
    from pathlib import Path

    from pdcluster.config import load_topology
    from pdcluster.planner.control_plane import derive_from_probes

    local = load_topology(Path(__file__).resolve().parents[2] / "clusters" / "local.yaml")  # one node, k=1
    prefill, decode = LinearModel(0.012, 0.0001, handoff_s=0.002), LinearModel(0.006, 0.0002)
    probe = RequestResult(0, 48, 13, 0.0, ok=True, num_output_tokens=13, ttft_s=0.045, tpot_s=0.011,
                          acceptance_rate=0.0,
                          phases={"route_s": 0.001, "reserve_s": 0.006, "prefill_s": 0.025,
                                  "prefill_cpu_wait_s": 0.005, "kv_transfer_s": 0.040, "admit_s": 0.001,
                                  "first_decode_step_s": 0.016})  # fmt: skip
    cores = 2.0
    # the driver spent 30 ms of CPU: more than a core over the prefill step, so the step's driver demand is
    # one core, and the prefill rank's 80% share leaves 2 / 0.8 - 1 - 1 = 0.5 cores of background
    derived = derive_from_probes(
        [{"result": dataclasses.asdict(probe), "prompt_len": 48, "host_cpu_s": 0.030}],
        prefill, decode, 1, cores, idle_cores,
    )  # fmt: skip
    cp = ControlPlane(**derived["values"])
    steady = 0.5 if idle_cores is None else idle_cores
    assert cp.background_cores == pytest.approx(steady, abs=TOL_S)
    assert cp.prefill_corunner_cores == pytest.approx(0.5 - steady, abs=TOL_S)
    assert derived["lone_rates"]["prefill"] == pytest.approx(0.8, abs=TOL_S)
    options = SimOptions(prefill, decode, (0.0,), control_plane=cp, cores_per_node=cores)
    result = simulate(
        local, [TraceRequest(0.0, 48, 13)], options, prefill_sizing=sizing(), decode_sizing=sizing()
    )
    (r,) = result.results
    assert r.ok and r.num_output_tokens == 13
    assert r.ttft_s == pytest.approx(probe.ttft_s, abs=TOL_S)
    # the derivation prices every decode step with its draft; the simulated last step has none (one
    # query token less: 0.2 ms over the 12 tokens after the first)
    assert r.tpot_s == pytest.approx(probe.tpot_s, abs=0.0002 / 12 + TOL_S)


def test_a_request_that_finds_the_cluster_idle_pays_the_idle_extra_on_its_first_token():
    """Arrivals at 0 (idle), 1 ms (the first still in flight) and 10 s (idle again, all done)."""
    requests = [TraceRequest(0.0, 100, 5), TraceRequest(0.001, 100, 5), TraceRequest(10.0, 100, 5)]

    def ttfts(idle_s: float) -> list[float]:
        cp = ControlPlane(first_token_extra_s=0.002, idle_first_token_extra_s=idle_s)
        options = SimOptions(LinearModel(0.010, handoff_s=0.003), LinearModel(0.002), control_plane=cp)
        result = simulate(topology(), requests, options, prefill_sizing=sizing(), decode_sizing=sizing())
        assert all(r.ok for r in result.results)
        return [r.ttft_s for r in result.results]

    # (an extra under the handoff and first decode step: the reply, not that step's delta, brings the token)
    base, woken = ttfts(0.0), ttfts(0.001)
    assert [w - b for w, b in zip(woken, base, strict=True)] == pytest.approx([0.001, 0.0, 0.001], abs=TOL_S)


def test_probes_sent_after_a_pause_give_the_idle_extra_only():
    import dataclasses

    from pdcluster.planner.control_plane import derive_from_probes

    phases = {"route_s": 0.001, "reserve_s": 0.002, "prefill_s": 0.020, "kv_transfer_s": 0.021,
              "admit_s": 0.001, "first_decode_step_s": 0.008}  # fmt: skip

    def probe(ttft_s: float, pause_s: float) -> dict:
        result = RequestResult(0, 48, 9, 0.0, ok=True, num_output_tokens=9, ttft_s=ttft_s, tpot_s=0.008,
                               acceptance_rate=0.0, phases=phases)  # fmt: skip
        return {"result": dataclasses.asdict(result), "prompt_len": 48, "host_cpu_s": 0.0,
                "after_pause_s": pause_s}  # fmt: skip

    model = LinearModel(0.012, handoff_s=0.001)
    in_turn = derive_from_probes([probe(0.030, 0.0)] * 3, model, LinearModel(0.006), 1, 2.0, 0.0)
    both = derive_from_probes(
        [probe(0.030, 0.0)] * 3 + [probe(0.036, 1.0), probe(0.033, 1.0), probe(0.040, 1.0)],
        model, LinearModel(0.006), 1, 2.0, 0.0,
    )  # fmt: skip
    # the paused probes' median first token (36 ms) over the in-turn ones' (30 ms); nothing else moves
    assert both["values"] == pytest.approx(
        {**in_turn["values"], "idle_first_token_extra_s": 0.006}, abs=TOL_S
    )
    assert in_turn["values"]["idle_first_token_extra_s"] == 0.0
    faster = derive_from_probes([probe(0.030, 0.0), probe(0.020, 1.0)], model, LinearModel(0.006), 1, 2.0)
    assert faster["values"]["idle_first_token_extra_s"] == 0.0  # an excess only: never negative


def test_busy_ticks_count_system_time_and_leave_out_nice_idle_and_iowait():
    from pdcluster.planner.control_plane import busy_ticks

    # user 100, nice 50, system 30, idle 1000, iowait 20, irq 5, softirq 5, steal 10 (guest fields after)
    assert busy_ticks("cpu  100 50 30 1000 20 5 5 10 7 0") == 100 + 30 + 5 + 5 + 10
    with pytest.raises(ValueError, match="not a /proc/stat cpu line"):
        busy_ticks("cpu  1 2 3")


@pytest.mark.parametrize("prompt_lens", [(), (48, 0)])
def test_probes_refuse_prompt_lengths_that_are_not_token_counts(prompt_lens):
    from pdcluster.planner.control_plane import probe_control_plane

    model = LinearModel(0.01)
    with pytest.raises(ValueError, match="prompt_lens must be positive token counts"):  # before any request
        probe_control_plane("http://127.0.0.1:9", topology(), model, model, 4, 8, prompt_lens=prompt_lens)
