"""The OpenAI HTTP edge over a deployed Cluster on a local Ray (what `pdcluster deploy` serves)."""

from __future__ import annotations

import dataclasses
import time

import httpx
import pytest

from orchestrator.api_server import ServerThread, build_app
from orchestrator.cluster import Cluster
from orchestrator.topology import load_topology
from tests.cluster.conftest import call_bound_s, request_bound_s

pytestmark = pytest.mark.slow

ABORTED = 'pdcluster_requests_total{finish_reason="abort"}'


def _topology():
    topo = load_topology("clusters/local.yaml")
    return dataclasses.replace(
        topo,
        # timeout_s 6 -> call_timeout_s 3 s: the abort (one actor call) must land well before the 900 asked
        # tokens could be decoded (>= 5 s at the ~6 ms TPOT of an idle machine, longer under load).
        kv_transfer=dataclasses.replace(topo.kv_transfer, timeout_s=6),
        prefill=dataclasses.replace(topo.prefill, kv_cache_memory_bytes=16 << 20),
        decode=dataclasses.replace(topo.decode, kv_cache_memory_bytes=16 << 20),
    )


def _is_idle(leaks: dict[str, dict]) -> bool:
    prefill, decode = leaks["prefill-0"], leaks["decode-0"]
    return (
        prefill["num_used_blocks"] == 0
        and prefill["num_active"] == 0
        and not prefill["pending_handoffs"]
        and decode["num_used_blocks"] == 0
        and decode["num_reserved"] == 0
        and decode["num_unfinished"] == 0
        and not decode["pending_handoffs"]
    )


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.split(" ")[0] == name:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_client_disconnect_mid_stream_aborts_on_both_pools(ray_session) -> None:
    """A streamed completion (900 tokens asked) whose client closes the connection after the first chunk:
    the edge aborts it in the cluster, which releases it on decode (the running request and its blocks) and
    on prefill (job and handoff); within seconds, long before 900 tokens could be decoded, check_no_leaks
    reports nothing held on either pool, the edge counts one aborted request, and the pair still serves."""
    cluster = Cluster.deploy(_topology())
    try:
        with (
            ServerThread(build_app(cluster)) as server,
            httpx.Client(base_url=server.url, timeout=request_bound_s(cluster)) as client,
        ):
            body = {
                "prompt": "def add(a, b):\n    return",
                "max_tokens": 900,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                running = cluster.check_no_leaks()["decode-0"]
                assert running["num_unfinished"] == 1 and running["num_used_blocks"] > 0, running
            # leaving the block closed the connection after the first chunk

            closed_s = time.monotonic()
            while not _is_idle(leaks := cluster.check_no_leaks()):
                assert time.monotonic() - closed_s < call_bound_s(cluster), leaks  # one abort call
                time.sleep(0.05)
            assert not cluster._active
            assert _metric(client.get("/metrics").text, ABORTED) == 1

            after = client.post("/v1/completions", json={"prompt": "x = ", "max_tokens": 4, "temperature": 0})
            assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4
    finally:
        cluster.shutdown()
