"""Many concurrent streams against the HTTP edge: `python -m bench.load_streams [--json]` (`make load-test`).

Deploys a topology (`--cluster`, default `clusters/local.yaml`: the Ray cluster behind the OpenAI API on
127.0.0.1, a free port), then a separate client process opens `--num-streams` streaming completions at
once over loopback (httpx, one connection each) and classifies every one:

    completed              HTTP 200, a chunk with finish_reason, then `data: [DONE]`, no error event
    refused                HTTP 429 or 503 with a `Retry-After` header: refused before the stream started
    refused_unclean        any other status, or a 429/503 without `Retry-After`
    killed_mid_stream      HTTP 200, then an error event, or the stream broke or ended before its finish
    no_response            no status line (connection refused or reset, or the deadline passed first)

Bounded: each request asks `--max-tokens` tokens (greedy, ignore_eos, so exactly that many), every
request ends by `--deadline-s` after the first was sent (then it is counted where it stood), the client
process is killed 60 s after that. Traffic goes to 127.0.0.1 only.

The run is clean when every stream either completed or was refused (and none was killed mid-stream).
Reported: the counts, e2e and TTFT p50/p99 of the completed (milliseconds, the client's clock; e2e starts
when the client sends, so it includes the burst's connection setup), the median of the server's own
phases (`pdcluster.phases`: from the edge's admission), how fast refusals came, refusal statuses, a few
examples of anything unclean, the edge's limit (`api.max_concurrent_requests`, derived
from the decode pool unless `--max-concurrent-requests` sets it), and whether the cluster held nothing
once the client was done (decode blocks, reservations, open handoffs).

`--client-url URL` runs only the client against a server already up (what the deploying process runs in
its child), printing the same `results` object.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import ssl
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx

PROMPT = "def fibonacci(n):\n"
CLIENT_GRACE_S = 60.0  # the client process is killed this long after its deadline
KINDS = ("completed", "refused", "refused_unclean", "killed_mid_stream", "no_response")


@dataclass(frozen=True)
class StreamOutcome:
    """What happened to one stream. `e2e_s`: seconds from sending it to its end (completed) or to the
    refusal's status (refused); `ttft_s`: to the first text (completed)."""

    kind: str
    status: int | None = None
    e2e_s: float | None = None
    ttft_s: float | None = None
    detail: str | None = None
    phases: dict[str, float] | None = None  # the server's `pdcluster.phases` (completed ones)


async def _one_stream(
    client: httpx.AsyncClient, body: dict[str, Any], deadline: float, headers: dict[str, str]
) -> StreamOutcome:
    sent = time.perf_counter()
    status: int | None = None
    started = False  # a 200's status line arrived: from here a failure is a stream killed mid-way
    try:
        async with asyncio.timeout_at(deadline):
            async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
                status = r.status_code
                if status != 200:
                    await r.aread()
                    clean = status in (429, 503) and "retry-after" in r.headers
                    kind = "refused" if clean else "refused_unclean"
                    return StreamOutcome(kind, status, time.perf_counter() - sent, detail=r.text[:200])
                started = True
                ttft_s = None
                phases = None
                finished = done = False
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    if data == "[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        return StreamOutcome("killed_mid_stream", status, detail=json.dumps(event)[:200])
                    choice = event["choices"][0]
                    if ttft_s is None and choice.get("text"):
                        ttft_s = time.perf_counter() - sent
                    if choice.get("finish_reason") is not None:
                        finished = True
                        phases = event.get("pdcluster", {}).get("phases")
                if finished and done:
                    return StreamOutcome(
                        "completed", status, time.perf_counter() - sent, ttft_s, phases=phases
                    )
                return StreamOutcome(
                    "killed_mid_stream", status, detail=f"ended: finish={finished} done={done}"
                )
    except TimeoutError:
        kind = "killed_mid_stream" if started else "no_response"
        return StreamOutcome(kind, status, detail="the deadline passed")
    except httpx.HTTPError as exc:
        kind = "killed_mid_stream" if started else "no_response"
        return StreamOutcome(kind, status, detail=f"{type(exc).__name__}: {exc}"[:200])


async def run_streams(
    url: str,
    num_streams: int,
    max_tokens: int,
    deadline_s: float,
    api_key: str | None = None,
    prompt: str = PROMPT,
) -> list[StreamOutcome]:
    """Open `num_streams` streaming completions against `url` at once (one connection each); every one
    ends by `deadline_s` after the start. Returns the outcomes in request order.

    Each stream has its own `httpx.AsyncClient` (one connection, sharing one SSL context): one client's
    pool of 1,000 connections costs O(connections) per event in httpcore, which made this client the
    bottleneck (completed streams seen ~10x later than the server had sent them)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = httpx.Timeout(deadline_s, connect=deadline_s, pool=deadline_s)
    deadline = asyncio.get_running_loop().time() + deadline_s
    ssl_context = ssl.create_default_context()  # unused on http://, but built once instead of per client

    async def one() -> StreamOutcome:
        async with httpx.AsyncClient(base_url=url, timeout=timeout, verify=ssl_context) as client:
            return await _one_stream(client, body, deadline, headers)

    return list(await asyncio.gather(*[one() for _ in range(num_streams)]))


def _percentile_ms(values_s: list[float], q: float) -> float | None:
    """Nearest-rank percentile `q` (0-100) of `values_s`, in milliseconds."""
    if not values_s:
        return None
    ordered = sorted(values_s)
    rank = max(0, min(len(ordered) - 1, -(-len(ordered) * q // 100) - 1))
    return round(ordered[int(rank)] * 1e3, 1)


def summarize(outcomes: list[StreamOutcome], wall_s: float) -> dict[str, Any]:
    """Counts per kind, latency percentiles of the completed, refusal statuses, unclean examples."""
    counts = Counter(o.kind for o in outcomes)
    completed = [o for o in outcomes if o.kind == "completed"]
    e2e = [o.e2e_s for o in completed if o.e2e_s is not None]
    ttft = [o.ttft_s for o in completed if o.ttft_s is not None]
    refusal = [o.e2e_s for o in outcomes if o.kind == "refused" and o.e2e_s is not None]
    unclean = [o for o in outcomes if o.kind not in ("completed", "refused")]
    phase_names = sorted({k for o in completed for k in (o.phases or {}) if k.endswith("_s")})
    phases_ms = {
        name: _percentile_ms([o.phases[name] for o in completed if o.phases and name in o.phases], 50)
        for name in phase_names
    }
    return {
        "num_streams": len(outcomes),
        **{kind: counts.get(kind, 0) for kind in KINDS},
        "clean": not unclean,
        "refusal_statuses": dict(sorted(Counter(o.status for o in outcomes if o.kind == "refused").items())),
        "e2e_ms": {
            "p50": _percentile_ms(e2e, 50),
            "p99": _percentile_ms(e2e, 99),
            "max": _percentile_ms(e2e, 100),
        },
        "ttft_ms": {"p50": _percentile_ms(ttft, 50), "p99": _percentile_ms(ttft, 99)},
        "server_phases_p50_ms": phases_ms,
        "refusal_ms": {"p50": _percentile_ms(refusal, 50), "p99": _percentile_ms(refusal, 99)},
        "wall_s": round(wall_s, 2),
        "refusal_examples": {str(o.status): o.detail for o in reversed(outcomes) if o.kind == "refused"},
        "unclean_examples": [dataclasses.asdict(o) for o in unclean[:5]],
    }


def client_main(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    outcomes = asyncio.run(
        run_streams(args.client_url, args.num_streams, args.max_tokens, args.deadline_s, args.api_key)
    )
    return summarize(outcomes, time.perf_counter() - started)


def _wait_idle(cluster: Any, timeout_s: float) -> tuple[bool, float, dict[str, Any]]:
    """(idle, seconds waited, the last leak report): every decode instance holds no block, reservation,
    unfinished request or open handoff, every prefill instance nothing active."""
    started = time.monotonic()
    while True:
        leaks = cluster.check_no_leaks()
        idle = all(
            r.get("num_used_blocks", 0) == 0
            and r.get("num_reserved", 0) == 0
            and r.get("num_unfinished", 0) == 0
            and r.get("num_active", 0) == 0
            and not r.get("pending_handoffs")
            for r in leaks.values()
        )
        waited = time.monotonic() - started
        if idle or waited > timeout_s:
            return idle, round(waited, 2), leaks
        time.sleep(0.1)


def deploy_main(args: argparse.Namespace) -> dict[str, Any]:
    from bench.common import environment
    from pdcluster.config import load_topology
    from pdcluster.entrypoints.serve import serve

    topo = load_topology(args.cluster)
    if args.max_concurrent_requests is not None:
        topo = dataclasses.replace(
            topo, api=dataclasses.replace(topo.api, max_concurrent_requests=args.max_concurrent_requests)
        )
    topo = dataclasses.replace(topo, api=dataclasses.replace(topo.api, host="127.0.0.1", port=0))

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    with serve(topo, log=log) as service:
        cluster = service.cluster
        command = [
            sys.executable, "-m", "bench.load_streams", "--client-url", service.url,
            "--num-streams", str(args.num_streams), "--max-tokens", str(args.max_tokens),
            "--deadline-s", str(args.deadline_s), "--json",
        ]  # fmt: skip
        if topo.api.api_key:
            command += ["--api-key", topo.api.api_key]
        log(f"client: {args.num_streams} streams x {args.max_tokens} tokens against {service.url}")
        started = time.perf_counter()
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=args.deadline_s + CLIENT_GRACE_S, env=os.environ
        )
        if done.returncode != 0:
            raise RuntimeError(f"the client process failed ({done.returncode}): {done.stderr[-2000:]}")
        results = json.loads(done.stdout)
        client_wall_s = time.perf_counter() - started
        # every request has ended at the client: nothing may stay held (bound: one request's worth)
        idle, idle_after_s, leaks = _wait_idle(cluster, cluster.event_timeout_s)
        decode = topo.decode
        return {
            "config": {
                "cluster": str(args.cluster),
                "num_streams": args.num_streams,
                "max_tokens": args.max_tokens,
                "deadline_s": args.deadline_s,
                "max_concurrent_requests": topo.max_concurrent_requests,
                "decode_instances": decode.num_instances,
                "decode_max_num_seqs": decode.max_num_seqs,
                "client_process_wall_s": round(client_wall_s, 2),
                "load_avg_1min_after_run": round(os.getloadavg()[0], 2),
                **environment(topo.model.checkpoint_dir),
            },
            "results": results,
            "cluster_idle_after_run": idle,
            "cluster_idle_after_s": idle_after_s,
            "cluster_leaks": None if idle else leaks,
        }


def table(report: dict[str, Any]) -> str:
    r = report.get("results", report)
    lines = [
        f"{r['num_streams']} streams: {r['completed']} completed, {r['refused']} refused "
        f"{r['refusal_statuses']}, {r['killed_mid_stream']} killed mid-stream, "
        f"{r['refused_unclean']} unclean refusals, {r['no_response']} without response; clean: {r['clean']}",
        f"completed e2e ms p50 {r['e2e_ms']['p50']} p99 {r['e2e_ms']['p99']} (max {r['e2e_ms']['max']}); "
        f"TTFT ms p50 {r['ttft_ms']['p50']} p99 {r['ttft_ms']['p99']}; wall {r['wall_s']} s",
        f"server phases p50 ms {r['server_phases_p50_ms']}; refusals ms p50 {r['refusal_ms']['p50']} "
        f"p99 {r['refusal_ms']['p99']}",
    ]
    if "config" in report:
        lines.append(
            f"edge limit {report['config']['max_concurrent_requests']} concurrent requests; cluster idle "
            f"after the run: {report['cluster_idle_after_run']} ({report['cluster_idle_after_s']} s)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from bench.common import add_json_option, positive_int

    parser = argparse.ArgumentParser(
        prog="python -m bench.load_streams",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--cluster", default="clusters/local.yaml", help="topology YAML to deploy")
    parser.add_argument("--num-streams", type=positive_int, default=1000)
    parser.add_argument("--max-tokens", type=positive_int, default=8, help="output tokens per request")
    parser.add_argument("--deadline-s", type=float, default=300.0, help="every request ends by then")
    parser.add_argument(
        "--max-concurrent-requests",
        type=positive_int,
        default=None,
        help="overrides api.max_concurrent_requests",
    )
    parser.add_argument("--client-url", default=None, help="run only the client against this server")
    parser.add_argument("--api-key", default=None, help="(with --client-url) the server's API key")
    add_json_option(parser)
    args = parser.parse_args(argv)
    report = client_main(args) if args.client_url else deploy_main(args)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(table(report) + "\n")
    results = report if args.client_url else report["results"]
    clean = results["clean"] and (args.client_url or report["cluster_idle_after_run"])
    return 0 if clean else 1


if __name__ == "__main__":
    raise SystemExit(main())
