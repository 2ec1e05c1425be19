"""`pdcluster deploy FILE`: check FILE before Ray starts, then serve it until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pdcluster.entrypoints.cli.common import CliError, non_negative_float, tcp_port

if TYPE_CHECKING:
    from pdcluster.config import Topology

DEFAULT_DRAIN_TIMEOUT_S = 30.0


def deploy_preflight(path: Path, port: int | None) -> Topology:
    """`path` read and checked as deploy needs it, before Ray; TopologyError lists every reason it refuses."""
    from pdcluster.config import TopologyError, read_topology
    from pdcluster.config.preflight import deploy_issues

    loaded = read_topology(path)
    issues = loaded.locate(deploy_issues(loaded.topology, port=port))
    if issues:
        raise TopologyError(issues)
    return loaded.topology


class ShutdownSignals:
    """SIGINT, SIGTERM and SIGHUP: the first raises KeyboardInterrupt and deploy drains.

    While draining, Ctrl-C again cuts the requests in flight; later signals are only logged, so
    nothing interrupts the teardown. SIGINT is taken even if inherited as ignored; SIGHUP not under `nohup`.
    """

    def __init__(self) -> None:
        self.phase = "starting"  # "serving" (set by the caller), then "draining" or "stopping"
        self.drain_cut = False

    def install(self) -> None:
        import signal

        signal.signal(signal.SIGINT, self)
        signal.signal(signal.SIGTERM, self)
        if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:
            signal.signal(signal.SIGHUP, self)

    def __call__(self, signum: int, frame: object) -> None:
        import signal

        if self.phase in ("starting", "serving"):
            self.phase = "draining" if self.phase == "serving" else "stopping"
            raise KeyboardInterrupt
        if self.phase == "draining" and signum == signal.SIGINT:
            self.phase, self.drain_cut = "stopping", True
            raise KeyboardInterrupt
        name = signal.Signals(signum).name
        hint = " (Ctrl-C to cut the requests in flight)" if self.phase == "draining" else ""
        print(f"[pdcluster] {name}: already shutting down{hint}", flush=True)


def run(args: argparse.Namespace) -> int:
    from pdcluster.config import TopologyError
    from pdcluster.driver.cluster import DeployError
    from pdcluster.entrypoints.serve import serve

    try:
        topology = deploy_preflight(args.file, args.port)
    except TopologyError as exc:
        raise CliError(str(exc)) from exc
    if args.require_accuracy:
        from pdcluster.entrypoints.accuracy_gate import evaluate_topology, format_report

        report = evaluate_topology(topology)
        print(format_report(report), flush=True)
        if not report.passed:
            print(f"pdcluster deploy: accuracy gate failed: {'; '.join(report.failures)}", file=sys.stderr)
            return 1
    signals = ShutdownSignals()
    signals.install()
    try:
        log = lambda m: print(f"[pdcluster] {m}", flush=True)  # noqa: E731
        with serve(topology, port=args.port, log=log, drain_timeout_s=args.drain_timeout_s) as service:
            try:
                signals.phase = "serving"
                print(f"[pdcluster] ready: {service.url}/v1/models — Ctrl-C or SIGTERM to stop", flush=True)
                while True:
                    time.sleep(0.5)
            except KeyboardInterrupt:
                drain = (
                    f"requests in flight get up to {args.drain_timeout_s:g} s to finish "
                    "(Ctrl-C again to cut them)"
                    if args.drain_timeout_s
                    else "requests in flight are cut (--drain-timeout-s 0)"
                )
                print(f"[pdcluster] shutting down: new connections refused; {drain}", flush=True)
        signals.phase = "stopping"
        print("[pdcluster] stopped", flush=True)
    except KeyboardInterrupt:
        if signals.drain_cut:
            print("[pdcluster] interrupted again: the requests still in flight were cut; stopped", flush=True)
        else:
            print("[pdcluster] interrupted; what had started is shut down", flush=True)
    except (TopologyError, DeployError) as exc:
        raise CliError(str(exc)) from exc
    return 0


NAME = "deploy"
HELP = "serve a topology (prefill + decode pools on Ray) behind the OpenAI API until interrupted"
DESCRIPTION = """\
Validate FILE, connect to the Ray cluster in RAY_ADDRESS (or start a local one), create one
placement group per instance, start the prefill and decode actors (progress is logged while
weights load), wire the KV transfer, and serve /v1/completions, /v1/chat/completions,
/v1/models, /health and /metrics on api.host:api.port until Ctrl-C, SIGTERM or SIGHUP (unless
ignored, as under nohup). Each shuts down the same way, also while starting, and exits with code
0: new connections are refused at once, requests in flight get --drain-timeout-s to finish, then
the HTTP server, the actors, the placement groups and Ray (if deploy started it) stop. While it
drains, Ctrl-C again cuts the requests in flight; any other signal from then on is only logged,
so that the teardown runs to its end.

Before Ray starts, FILE is checked as `pdcluster validate --for-deploy FILE` checks it (the
file, the parallelism and weight dtypes the actors can run, the checkpoint, that the address can
be bound); each problem is one FILE:LINE: reason line and the exit code is 2. The address is then
bound and held while the actors load, so that the ports Ray and the actors open cannot take it (nor
another deploy, unless it lingers from an earlier server); connections are refused until the
service is ready. An error after Ray started (an actor that fails to load its weights) is one
line too, exit code 2, after everything started is shut down."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, metavar="FILE", help="topology YAML (see clusters/README.md)")
    parser.add_argument("--port", type=tcp_port, default=None, help="override api.port (0: a free port)")
    parser.add_argument(
        "--require-accuracy",
        action="store_true",
        help="run `pdcluster accuracy FILE` first; below a threshold of its accuracy section, print the "
        "failed metrics and exit 1 without starting Ray",
    )
    parser.add_argument(
        "--drain-timeout-s",
        type=non_negative_float,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        metavar="S",
        help="at Ctrl-C or SIGTERM, new connections are refused at once and requests in flight (streams "
        "included) get up to S seconds to finish before the actors stop; a second Ctrl-C cuts them "
        f"(0: cut at once). Default: {DEFAULT_DRAIN_TIMEOUT_S:g}",
    )
