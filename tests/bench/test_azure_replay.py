"""Smoke tests of `bench.azure_replay` without vLLM: the real `pdcluster deploy clusters/local.yaml` (Ray,
two actors, gRPC KV) and the colocated server as child processes, a 3-request replay, the JSON's shape,
every request completed at its full length, and nothing left running afterwards. No timing is asserted.
Both servers run the file's eager copy (`tests.conftest.eager_topology_file`): they load in seconds."""

from __future__ import annotations

import json
import re
import stat

from bench import azure_replay
from bench.server_procs import port_in_use
from pdcluster.config import DEFAULT_TOPOLOGY_PATH
from tests.conftest import eager_topology_file

FIGURES = {
    "ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "num_requests", "num_ok", "num_failed",
    "num_wrong_output_length", "errors", "mean_kv_transfer_ms", "mean_acceptance_rate", "phases_p50_ms",
    "duration_s",
}  # fmt: skip
# what each of our servers reports of a request's way (`pdcluster.phases`), by name
PHASES = {
    "disaggregated": {"route_ms", "reserve_ms", "queue_ms", "prefill_ms", "kv_transfer_ms", "admit_ms"},
    "colocated": {"queue_ms", "prefill_ms"},
}
SMALL = ["--no-vllm", "--num-requests", "3", "--warmup-requests", "1", "--rounds", "1"]


def test_replay_completes_and_stops_cleanly(capsys, tmp_path):
    topology = eager_topology_file(DEFAULT_TOPOLOGY_PATH, tmp_path / "cluster")
    argv = [*SMALL, "--topology", str(topology), "--json", "--log-dir", str(tmp_path)]
    assert azure_replay.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["benchmark"] == "azure_replay"
    assert set(result["rounds"]) == set(result["median_over_rounds"]) == {"disaggregated", "colocated"}
    for name, (row,) in result["rounds"].items():
        assert set(row) == FIGURES
        assert (row["num_requests"], row["num_ok"], row["num_failed"], row["num_wrong_output_length"]) == (
            3, 3, 0, 0,
        ), name  # fmt: skip
        assert row["ttft_p50_ms"] > 0 and row["tpot_p50_ms"] > 0
        assert result["warmup"][name]["num_ok"] == 1
        assert PHASES[name] <= set(row["phases_p50_ms"]) and all(
            v >= 0 for v in row["phases_p50_ms"].values()
        )
        median = result["median_over_rounds"][name]["phases_p50_ms"]  # of one round: its figures, rounded
        assert median == {k: round(v, 3) for k, v in row["phases_p50_ms"].items()}
    assert result["rounds"]["disaggregated"][0]["mean_kv_transfer_ms"] > 0  # the KV went over gRPC
    assert result["num_failed"] == 0
    targets = result["targets"]
    col = result["median_over_rounds"]["colocated"]["ttft_p50_ms"]
    dis = result["median_over_rounds"]["disaggregated"]["ttft_p50_ms"]
    assert targets["disagg_minus_colocated_ttft_p50_ms"] == round(dis - col, 3)
    assert (
        targets["met_colocated_vs_vllm_default"] is None
        and targets["met_disaggregated_vs_vllm_default"] is None
    )
    assert result["clean_shutdown"] is True
    for name, server in result["servers"].items():
        assert server["stop"] == {"exit_code": 0, "killed": False, "leaked_pids": [], "port_in_use": False}
        port = int(server["command"].rsplit("--port ", 1)[1].split()[0])
        assert not port_in_use(port), name
    assert {"load_average_before", "load_average_after", "command", "kv_transport"} <= result["config"].keys()


def test_failed_server_start_names_it_and_stops_the_others(capsys, tmp_path):
    """A 'vLLM venv' whose python fails at once: the error names the server and its log tail, the two of
    ours (still starting) are stopped, and no process of theirs is left."""
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\necho 'no vllm here: simulated failure' >&2\nexit 3\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    argv = [*SMALL[1:], "--vllm-venv", str(tmp_path / "venv"), "--log-dir", str(tmp_path / "logs")]
    argv += ["--topology", str(eager_topology_file(DEFAULT_TOPOLOGY_PATH, tmp_path / "cluster"))]
    assert azure_replay.main(argv) == 1
    err = capsys.readouterr().err
    assert "server 'vllm_default' exited with code 3 before it served" in err
    assert "no vllm here: simulated failure" in err  # its log tail
    stops = re.findall(r"azure_replay: stopping (\w+): (\{.*\})", err)
    assert [name for name, _ in stops] == ["vllm_default", "colocated", "disaggregated"]
    for name, text in stops:
        assert "'leaked_pids': []" in text and "'port_in_use': False" in text, (name, text)


def test_a_missing_trace_fails_before_any_server_starts(capsys, tmp_path):
    assert azure_replay.main(["--no-vllm", "--trace", str(tmp_path / "nosuch.csv")]) == 1
    err = capsys.readouterr().err
    assert "trace file not found" in err and "nosuch.csv" in err
    assert "starting" not in err and "stopping" not in err  # no server was started


def test_targets_against_vllm_default_are_differences_in_ms():
    """Issue 39's targets: colocated TTFT p50 <= vllm_default's, disaggregated <= it + 3 ms."""
    from bench.azure_replay import targets

    ours = {"colocated": {"ttft_p50_ms": 16.0}, "disaggregated": {"ttft_p50_ms": 21.5}}
    got = targets(ours | {"vllm_default": {"ttft_p50_ms": 17.0}})
    assert got["colocated_minus_vllm_default_ttft_p50_ms"] == -1.0 and got["met_colocated_vs_vllm_default"]
    assert got["disaggregated_minus_vllm_default_ttft_p50_ms"] == 4.5
    assert got["met_disaggregated_vs_vllm_default"] is False
    assert targets(ours)["met_colocated_vs_vllm_default"] is None and targets({})["met_vs_colocated"] is None
