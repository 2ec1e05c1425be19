"""`pdcluster deploy`, `validate` and `generate` on what users get wrong (issue 12, finding 8): every bad
YAML file, checkpoint and environment is one line per problem and exit code 2, before Ray starts where it
can be checked before; `validate --for-deploy` says what deploy will refuse.

Everything here runs `main(argv)` in this process with Ray made to fail if anything starts it (`no_ray`),
except two subprocesses: a FIFO as the YAML path (the real process must not block) and one end-to-end
`pdcluster deploy clusters/local.yaml` (its eager copy, `tests.conftest.eager_topology_file`) that is sent
SIGTERM (the only test that starts Ray).
"""

from __future__ import annotations

import asyncio
import errno
import functools
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from pdcluster.entrypoints.cli import main
from pdcluster.kvtransfer.ports import free_ports
from pdcluster.models.loader import SINGLE_FILE
from tests.conftest import eager_topology_file

REPO = Path(__file__).resolve().parents[2]


# ---- helpers -----------------------------------------------------------------------------------------
class RayStarted(AssertionError):
    pass


@pytest.fixture
def no_ray(monkeypatch):
    """Make connecting to or starting Ray fail the test: these errors must come before it."""
    import ray

    import pdcluster.driver.deployment

    def refuse(*_args, **_kwargs):
        raise RayStarted("Ray was started; the error should have been found before")

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(pdcluster.driver.deployment, "init_local_ray", refuse)


def run_cli(capsys, *argv: str | Path) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def free_port() -> int:
    return free_ports("127.0.0.1", 1)[0]


def topology_file(tmp_path: Path, checkpoint: Path, extra: str = "", port: int | None = None) -> Path:
    """A deployable topology (1 cpu node of 4 devices, 1 prefill + 1 decode) over `checkpoint`, + `extra`."""
    text = textwrap.dedent(
        f"""\
        name: errors
        hardware:
          accelerator: cpu
          devices_per_node: 4
        model:
          path: {checkpoint}
        api:
          host: 127.0.0.1
          port: {free_port() if port is None else port}
        """
    ) + textwrap.dedent(extra)
    path = tmp_path / "topo.yaml"
    path.write_text(text)
    return path


def line_of(path: Path, needle: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if needle in line)


def assert_one_error_line(err: str, command: str, expected: str) -> None:
    """`err` is exactly one `pdcluster COMMAND: error: ...` line that contains `expected`."""
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"pdcluster {command}: error: ") and expected in lines[0], err


@pytest.fixture
def checkpoint(tmp_path, random_checkpoint) -> Path:
    """A private copy of the random test checkpoint, to break."""
    return Path(shutil.copytree(random_checkpoint, tmp_path / "ckpt"))


# ---- the file `validate` called ok, which deploy refused with a traceback ----------------------------
def test_tensor_parallel_is_refused_by_deploy_before_ray_and_noted_by_validate(
    capsys, tmp_path, checkpoint, no_ray
):
    path = topology_file(
        tmp_path, checkpoint, "prefill:\n  devices_per_instance: 2\n  tensor_parallel_size: 2\n"
    )
    where = f"{path}:{line_of(path, 'tensor_parallel_size')}: "
    reason = (
        "prefill.tensor_parallel_size: tensor-parallel attention (prefill: 2 devices, TP2) is not supported "
        "by `pdcluster deploy`"
    )

    code, out, err = run_cli(capsys, "deploy", path)
    assert code == 2 and out == ""
    assert_one_error_line(err, "deploy", where + reason)

    code, out, err = run_cli(capsys, "validate", path)  # a valid plan, with a note saying deploy refuses it
    assert code == 0 and out.startswith(f"{path}: ok")
    assert err.startswith(where + "note: " + reason) and "--for-deploy refuses it" in err

    code, out, err = run_cli(capsys, "validate", "--for-deploy", path)
    assert code == 1 and out == "" and err.startswith(where + reason)


def test_a_weight_dtype_other_than_the_model_dtype_is_refused_by_deploy_and_noted_by_validate(
    capsys, tmp_path, checkpoint, no_ray
):
    path = topology_file(tmp_path, checkpoint)  # cpu: model.dtype auto is float32
    path.write_text(path.read_text().replace("  path:", "  weight_dtype: int8\n  path:"))
    where = f"{path}:{line_of(path, 'weight_dtype')}: "
    reason = (
        "model.weight_dtype: int8 is not the dtype the engine runs: it loads the checkpoint's weights in "
        "model.dtype, float32 (auto on cpu), and int8 weights are a planning assumption only (set "
        "weight_dtype: auto or float32 to deploy)"
    )
    code, out, err = run_cli(capsys, "validate", "--for-deploy", path)
    assert code == 1 and out == "" and err == where + reason + "\n"
    code, out, err = run_cli(capsys, "deploy", path)
    assert code == 2 and out == ""
    assert_one_error_line(err, "deploy", where + reason)
    code, out, err = run_cli(capsys, "validate", path)  # a valid plan, with a note
    assert code == 0 and err.startswith(where + "note: " + reason)

    path.write_text(path.read_text().replace("weight_dtype: int8", "weight_dtype: float32"))
    code, out, err = run_cli(capsys, "validate", "--for-deploy", path)  # the engine's own dtype, spelled out
    assert code == 0 and out.endswith("(deployable here)\n") and err == ""


def test_api_host_256_1_1_1_is_a_validation_error(capsys, tmp_path, checkpoint, no_ray):
    path = topology_file(tmp_path, checkpoint)
    path.write_text(path.read_text().replace("host: 127.0.0.1", "host: 256.1.1.1"))
    expected = f"{path}:{line_of(path, 'host:')}: api.host: '256.1.1.1' is not a valid IPv4 address"
    code, _, err = run_cli(capsys, "validate", path)
    assert code == 1 and err.startswith(expected)
    code, _, err = run_cli(capsys, "deploy", path)
    assert code == 2
    assert_one_error_line(err, "deploy", expected)


def test_a_port_in_use_is_refused_before_ray(capsys, tmp_path, checkpoint, no_ray):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        path = topology_file(tmp_path, checkpoint, port=port)
        expected = f"{path}:{line_of(path, 'port:')}: api.port: 127.0.0.1:{port} is already in use"

        code, _, err = run_cli(capsys, "deploy", path)
        assert code == 2
        assert_one_error_line(err, "deploy", expected)

        code, out, err = run_cli(capsys, "validate", "--for-deploy", path)
        assert code == 1 and out == "" and err.startswith(expected)
        code, out, err = run_cli(capsys, "validate", path)  # a plan: the environment is not checked
        assert code == 0 and err == ""

        other = topology_file(
            tmp_path, checkpoint
        )  # a free port in the file, the busy one on the command line
        code, _, err = run_cli(capsys, "deploy", other, "--port", str(port))
        assert code == 2
        assert_one_error_line(err, "deploy", f"{other}: --port {port}: 127.0.0.1:{port} is already in use")


def test_a_host_that_is_not_this_machines_is_refused_before_ray(capsys, tmp_path, checkpoint, no_ray):
    path = topology_file(tmp_path, checkpoint)
    path.write_text(path.read_text().replace("host: 127.0.0.1", "host: 192.0.2.1"))  # TEST-NET-1
    code, _, err = run_cli(capsys, "deploy", path)
    assert code == 2
    assert_one_error_line(err, "deploy", "api.host: 192.0.2.1 is not an address of this machine")


# ---- broken checkpoints: one line naming the file, before Ray (deploy) or before loading (generate) ---
def truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def drop_tokenizer(ckpt: Path) -> None:
    (ckpt / "tokenizer.json").unlink()


def mismatch_a_shape(ckpt: Path) -> None:
    from tests.models.conftest import read_checkpoint, write_checkpoint

    config, tensors = read_checkpoint(ckpt)
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].clone()
    write_checkpoint(ckpt, config, tensors)


def break_config(ckpt: Path) -> None:
    (ckpt / "config.json").write_text('{"model_type": "deepseek_v3", ')


@pytest.mark.parametrize(
    ("breakage", "expected"),
    [
        (lambda c: truncate(c / SINGLE_FILE), f"{SINGLE_FILE}: truncated: its header declares"),
        (drop_tokenizer, "tokenizer.json: no tokenizer.json in the checkpoint directory"),
        (mismatch_a_shape, "tensor(s) with unexpected shape: model.norm.weight: expected (32,), got (31,)"),
    ],
    ids=["truncated-safetensors", "no-tokenizer", "shape-mismatch"],
)
def test_a_broken_checkpoint_is_one_line_at_deploy_and_generate(
    capsys, tmp_path, checkpoint, no_ray, breakage, expected
):
    path = topology_file(tmp_path, checkpoint)
    breakage(checkpoint)
    code, _, err = run_cli(capsys, "deploy", path)
    assert code == 2
    assert_one_error_line(err, "deploy", f"{path}:{line_of(path, 'path:')}: model.path: ")
    assert expected in err

    code, out, err = run_cli(capsys, "generate", "--model", checkpoint, "--prompt", "x", "--max-tokens", "1")
    assert code == 2 and out == ""
    assert_one_error_line(err, "generate", "cannot load the checkpoint: ")
    assert expected in err


def test_config_json_that_does_not_parse_is_one_line(capsys, tmp_path, checkpoint, no_ray):
    path = topology_file(tmp_path, checkpoint)
    break_config(checkpoint)
    code, _, err = run_cli(capsys, "deploy", path)
    assert code == 2
    assert_one_error_line(err, "deploy", f"model.path: {checkpoint / 'config.json'}: invalid JSON at line 1")


def test_a_long_list_of_missing_tensors_is_still_one_line(capsys, tmp_path, checkpoint):
    from tests.models.conftest import read_checkpoint, write_checkpoint

    config, tensors = read_checkpoint(checkpoint)
    write_checkpoint(checkpoint, config, {k: v for k, v in tensors.items() if "layers.1." not in k})
    code, _, err = run_cli(capsys, "generate", "--model", checkpoint, "--prompt", "x")
    assert code == 2
    assert_one_error_line(err, "generate", "tensor(s) missing from the checkpoint: model.layers.1.")
    assert len(err) < 1000


# ---- files that are not topologies, through deploy ---------------------------------------------------
def test_deploy_of_non_utf8_or_absurdly_nested_yaml_is_one_line(capsys, tmp_path, no_ray):
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(b"name: caf\xe9\n")
    code, _, err = run_cli(capsys, "deploy", latin1)
    assert code == 2
    assert_one_error_line(err, "deploy", f"{latin1}:1: not valid UTF-8 (byte 0xe9 at offset 9)")

    deep = tmp_path / "deep.yaml"
    deep.write_text("name: x\nrouter: " + "[" * 50_000 + "]" * 50_000 + "\n")
    code, _, err = run_cli(capsys, "deploy", deep)
    assert code == 2
    assert_one_error_line(err, "deploy", f"{deep}:2: invalid YAML: nested deeper than")


def test_a_fifo_as_the_yaml_path_does_not_block_the_real_process(tmp_path):
    fifo = tmp_path / "topo.yaml"
    os.mkfifo(fifo)
    for command in (["validate"], ["deploy"]):
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "pdcluster.entrypoints.cli", *command, str(fifo)],
                capture_output=True,
                text=True,
                timeout=120,
                env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"pdcluster {command[0]} blocked on a FIFO for 120 s")
        assert "Traceback" not in proc.stderr
        assert proc.stderr.strip().endswith(f"{fifo}: not a regular file"), proc.stderr
        assert proc.returncode == (1 if command == ["validate"] else 2)


# ---- errors after Ray started: one line too -----------------------------------------------------------
def ray_task_error(exc: Exception, function_name: str = "PrefillWorker.__init__"):
    """A RayTaskError built as Ray builds one in the worker: the exception and its formatted traceback."""
    import traceback

    from ray.exceptions import RayTaskError

    try:
        raise exc
    except Exception:  # noqa: BLE001 - formatting it, as Ray does
        formatted = traceback.format_exc()
    return RayTaskError(
        function_name,
        formatted,
        exc,
        proctitle=f"ray::{function_name}",
        pid=4242,
        ip="10.0.0.7",
        actor_repr="<workers.prefill.PrefillWorker object at 0x7f>",
        actor_id="ab" * 14,
    )


def test_actor_errors_are_the_exception_raised_inside_on_one_line():
    from ray.exceptions import ActorDiedError, RayActorError

    from pdcluster.driver.cluster import actor_error_message
    from pdcluster.models.loader import CheckpointError

    shapes = "model.norm.weight: expected (32,), got (31,)"
    broken = CheckpointError(
        "/ckpt: tensor(s) with unexpected shape:\n  model.norm.weight: expected (32,), got (31,)"
    )
    expected = "CheckpointError: /ckpt: tensor(s) with unexpected shape: " + shapes
    # What `ray.get(actor.ready.remote())` raises in Ray 2.60 when the actor's __init__ raised: an
    # ActorDiedError that keeps only the text (checked against a real local Ray when this was written).
    assert actor_error_message(ActorDiedError(cause=ray_task_error(broken))) == expected
    # A task's exception, raised by Ray as the dual RayTaskError(CheckpointError) with its cause.
    assert actor_error_message(ray_task_error(broken).as_instanceof_cause()) == expected
    # A worker that died: Ray's reason, without the lines naming the actor, its pid and node.
    died = RayActorError(
        actor_id="ab" * 14,
        error_msg="The actor died unexpectedly before finishing this task.\n\tclass_name: DecodeWorker\n"
        "\tactor_id: abab\n\tpid: 4242\n\tip: 10.0.0.7\n"
        "The actor is dead because its worker process has died.",
    )
    message = actor_error_message(died)
    assert message == (
        "RayActorError: The actor died unexpectedly before finishing this task.; "
        "The actor is dead because its worker process has died."
    )


def test_an_actor_that_fails_to_start_is_one_line_and_exit_2(capsys, tmp_path, checkpoint, monkeypatch):
    from ray.exceptions import ActorDiedError

    import pdcluster.entrypoints.serve
    from pdcluster.driver.cluster import DeployError, actor_error_message

    def deploy(*_args, **_kwargs):  # what Cluster.deploy raises when prefill-0's weights do not load
        exc = ActorDiedError(cause=ray_task_error(MemoryError("cannot allocate 40 GB")))
        raise DeployError(f"prefill-0 failed to start: {actor_error_message(exc)}")

    monkeypatch.setattr(pdcluster.entrypoints.serve.Cluster, "deploy", deploy)
    code, _, err = run_cli(capsys, "deploy", topology_file(tmp_path, checkpoint))
    assert code == 2
    assert_one_error_line(err, "deploy", "prefill-0 failed to start: MemoryError: cannot allocate 40 GB")


class _FakeCluster:
    """What `serve` needs of a deployed cluster to start its HTTP server, without Ray."""

    model_name = "fake"
    max_model_len = 64

    def __init__(self) -> None:
        self.shut_down = False

    @functools.cached_property
    def tokenizer(self):  # the edge builds the chat template from it
        from pdcluster.models import bundled_checkpoint_dir
        from pdcluster.models.tokenizer import Tokenizer

        return Tokenizer.from_dir(bundled_checkpoint_dir())

    def stats(self):
        return {}

    def shutdown(self):
        self.shut_down = True


def test_the_http_port_is_held_while_the_actors_load(tmp_path, checkpoint, monkeypatch):
    """`serve` binds the HTTP address before `Cluster.deploy` and keeps it until the server listens on that
    same socket: while the actors load, a plain bind of the port fails and a connection is refused (not
    queued); then the service answers on it, and after the service stops the port is free again."""
    import pdcluster.entrypoints.serve
    from pdcluster.config import load_topology

    port = free_port()
    seen_while_loading: list[str] = []
    cluster = _FakeCluster()

    def deploy(*_args, **_kwargs):
        for reuse in (0, 1):  # held without SO_REUSEADDR: not even a socket with it can bind the port
            with socket.socket() as other, pytest.raises(OSError) as taken:
                other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, reuse)
                other.bind(("127.0.0.1", port))
            seen_while_loading.append(errno.errorcode[taken.value.errno])
        with socket.socket() as client, pytest.raises(ConnectionRefusedError):
            client.connect(("127.0.0.1", port))
        seen_while_loading.append("refused")
        return cluster

    monkeypatch.setattr(pdcluster.entrypoints.serve.Cluster, "deploy", deploy)
    topology = load_topology(topology_file(tmp_path, checkpoint, port=port))
    with pdcluster.entrypoints.serve.serve(topology) as service:
        assert service.url == f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(f"{service.url}/v1/models", timeout=10) as response:
            assert json.loads(response.read())["data"][0]["id"] == "fake"
    assert seen_while_loading == ["EADDRINUSE", "EADDRINUSE", "refused"] and cluster.shut_down
    with socket.socket() as again:
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))


def test_a_port_another_server_listens_on_first_is_one_line_and_the_cluster_is_shut_down(
    tmp_path, checkpoint, monkeypatch
):
    """Where the port could only be held with SO_REUSEADDR (here: another socket bound it with SO_REUSEADDR
    and does not listen yet; in life, connections of an earlier server in TIME_WAIT), another server that
    binds it with SO_REUSEADDR too and listens first wins: `serve` then fails in one line naming the
    address and the reason, after shutting the cluster down."""
    import pdcluster.entrypoints.serve
    from pdcluster.config import load_topology
    from pdcluster.driver.cluster import DeployError

    cluster = _FakeCluster()
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", 0))
        port = other.getsockname()[1]

        def deploy(*_args, **_kwargs):  # the other server starts listening while the actors load
            other.listen()
            return cluster

        monkeypatch.setattr(pdcluster.entrypoints.serve.Cluster, "deploy", deploy)
        topology = load_topology(topology_file(tmp_path, checkpoint, port=port))
        with pytest.raises(DeployError, match=rf"^the HTTP server cannot serve on 127.0.0.1:{port}: Address"):
            with pdcluster.entrypoints.serve.serve(topology):
                pass
    assert cluster.shut_down


def test_a_taken_port_fails_before_the_actors_start_and_a_failed_deploy_frees_it(
    tmp_path, checkpoint, monkeypatch
):
    """The port taken between the preflight and `serve`: one line, and Ray is never started. A deploy that
    fails after the bind releases the port."""
    import pdcluster.entrypoints.serve
    from pdcluster.config import load_topology
    from pdcluster.driver.cluster import DeployError

    deploys: list[int] = []

    def deploy(*_args, **_kwargs):
        deploys.append(1)
        raise DeployError("prefill-0 failed to start: MemoryError")

    monkeypatch.setattr(pdcluster.entrypoints.serve.Cluster, "deploy", deploy)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        topology = load_topology(topology_file(tmp_path, checkpoint, port=port))
        with pytest.raises(DeployError, match=rf"^the HTTP server cannot bind 127.0.0.1:{port}: Address"):
            with pdcluster.entrypoints.serve.serve(topology):
                pass
    assert deploys == []

    with pytest.raises(DeployError, match="prefill-0 failed to start"):
        with pdcluster.entrypoints.serve.serve(topology):
            pass
    assert deploys == [1]
    with socket.socket() as again:
        again.bind(("127.0.0.1", port))  # no SO_REUSEADDR: nothing of ours holds it any more


class _StreamingFakeCluster(_FakeCluster):
    """A `_FakeCluster` whose requests stream nothing and never end until cancelled: one stays in flight."""

    vocab_size = 100

    def __init__(self) -> None:
        super().__init__()
        self.started, self.cancelled = threading.Event(), threading.Event()

    def check_ready(self):
        pass

    async def generate(self, request_id, prompt_token_ids, params):
        self.started.set()
        try:
            await asyncio.Event().wait()
        finally:  # cancelled, or closed by the app when its own task was
            self.cancelled.set()
        yield  # an async generator, as the backend protocol says

    async def abort(self, request_id):
        pass


def test_a_second_ctrl_c_while_draining_cuts_the_requests_and_ends_the_server(
    tmp_path, checkpoint, monkeypatch
):
    """Ctrl-C twice (the second one while the first one's drain waits on a request in flight): `serve`
    re-raises the interrupt only once uvicorn has cut that request and ended, so no thread is left
    serving a cluster that is shut down, and the listening socket is not closed under uvicorn (it used to
    be, and uvicorn's HTTP thread then died in `server.close()` with "Invalid file descriptor: -1")."""
    import pdcluster.entrypoints.serve
    from pdcluster.config import load_topology

    cluster = _StreamingFakeCluster()
    monkeypatch.setattr(pdcluster.entrypoints.serve.Cluster, "deploy", lambda *_a, **_k: cluster)
    thread_errors: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", thread_errors.append)
    port = free_port()
    topology = load_topology(topology_file(tmp_path, checkpoint, port=port))
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 5, "stream": True}).encode()
    main_thread = threading.get_ident()

    def stream() -> None:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=SHUTDOWN_BOUND_S) as response:
                response.read()
        except (OSError, http.client.HTTPException):  # cut: what this test wants
            pass

    with pytest.raises(KeyboardInterrupt):
        with pdcluster.entrypoints.serve.serve(topology, drain_timeout_s=SHUTDOWN_BOUND_S) as service:
            client = threading.Thread(target=stream, daemon=True)
            client.start()
            assert cluster.started.wait(SHUTDOWN_BOUND_S), "the request never reached the cluster"
            server = service.server

            def second_ctrl_c() -> None:  # as soon as the drain has begun
                while not service.server.server.should_exit:
                    time.sleep(0.001)
                signal.pthread_kill(main_thread, signal.SIGINT)

            threading.Thread(target=second_ctrl_c, daemon=True).start()
    # the drain (SHUTDOWN_BOUND_S) was cut: uvicorn has ended and cancelled the request
    assert not server.running and cluster.cancelled.is_set() and cluster.shut_down
    client.join(SHUTDOWN_BOUND_S)
    assert not client.is_alive() and thread_errors == []
    with socket.socket() as again:  # our socket is closed (the cut connection may linger in TIME_WAIT)
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))


def test_deploy_takes_sigint_even_when_started_with_it_ignored():
    """A background job of a non-interactive shell starts with SIGINT ignored; deploy's signal setup puts
    a handler back (SIGTERM's and SIGHUP's too), so `kill -INT` stops it like Ctrl-C. A SIGHUP ignored
    (`nohup`) stays ignored."""
    from pdcluster.entrypoints.cli.deploy import ShutdownSignals

    names = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.getsignal(s) for s in names}
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signals = ShutdownSignals()
        signals.install()
        assert signal.getsignal(signal.SIGINT) is signals and signal.getsignal(signal.SIGTERM) is signals
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        ShutdownSignals().install()
        assert isinstance(signal.getsignal(signal.SIGHUP), ShutdownSignals)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@pytest.mark.parametrize(
    ("phase", "signals", "raised", "logged"),
    [
        # starting: the first signal stops the deploy; nothing interrupts the teardown of what started
        ("starting", [signal.SIGINT, signal.SIGINT, signal.SIGTERM], [True, False, False], 2),
        ("starting", [signal.SIGHUP, signal.SIGINT], [True, False], 1),
        # serving: the first signal drains, Ctrl-C again cuts the drain, then everything is only logged
        (
            "serving",
            [signal.SIGTERM, signal.SIGINT, signal.SIGINT, signal.SIGTERM],
            [True, True, False, False],
            2,
        ),
        ("serving", [signal.SIGINT, signal.SIGINT, signal.SIGINT], [True, True, False], 1),
        # a SIGTERM while draining (a service manager's, after the operator's Ctrl-C) lets the drain finish
        ("serving", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], [True, False, False], 2),
        # after "stopped": Python's shutdown and Ray's atexit run to their end
        ("stopping", [signal.SIGINT], [False], 1),
    ],
)
def test_deploy_signals_stop_then_cut_the_drain_then_are_only_logged(phase, signals, raised, logged, capsys):
    from pdcluster.entrypoints.cli.deploy import ShutdownSignals

    policy = ShutdownSignals()
    policy.phase = phase
    seen = []
    for signum in signals:
        try:
            policy(signum, None)
            seen.append(False)
        except KeyboardInterrupt:
            seen.append(True)
    assert seen == raised
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == logged and all(" already shutting down" in line for line in lines), lines
    assert policy.drain_cut == (phase == "serving" and raised[:2] == [True, True])


# ---- SIGTERM: the same clean shutdown as Ctrl-C (the one test here that starts Ray) -------------------
# Bounds from the deploy's own timeouts (pdcluster/driver/deployment.py): placement groups 120 s, actors
# ready 300 s; on this 2-core machine it is up in 20-40 s. Shutdown: the HTTP server's 10 s stop plus the
# actor teardown and ray.shutdown.
DEPLOY_UP_BOUND_S = 120 + 300 + 60
SHUTDOWN_BOUND_S = 120


@pytest.mark.parametrize("to_group", [False, True], ids=["process", "process-group"])
def test_sigterm_shuts_deploy_down_like_ctrl_c(tmp_path, to_group):
    """SIGTERM to deploy, or to its whole process group (systemd's default KillMode, coreutils `timeout`):
    that one also reaches the GCS and raylet `ray.init` started, which exit at once; the teardown then
    skips the Ray calls (they used to block until Ray's core worker ended the process after 60 s, exit
    code 1) and deploy exits 0."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdcluster.entrypoints.cli",
            "deploy",
            str(eager_topology_file(REPO / "clusters" / "local.yaml", tmp_path)),  # loads in seconds
            "--port",
            str(port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
        start_new_session=to_group,  # its own process group, with Ray's processes in it
    )
    try:
        deadline = time.monotonic() + DEPLOY_UP_BOUND_S
        healthy = False
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                    healthy = response.status == 200
            except (OSError, http.client.HTTPException):  # not up yet (refused), or not ours: keep polling
                pass
            if healthy:
                break
            time.sleep(0.5)
        assert healthy, f"deploy not healthy within {DEPLOY_UP_BOUND_S} s (exit code {proc.poll()})"
        if to_group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=SHUTDOWN_BOUND_S)
    finally:
        if proc.poll() is None:  # the test failed: stop it the way a user would, then for sure
            proc.send_signal(signal.SIGINT)
            try:
                proc.communicate(timeout=SHUTDOWN_BOUND_S)
            except subprocess.TimeoutExpired:
                if to_group:  # Ray's processes too
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.kill()
                proc.communicate()
    assert proc.returncode == 0, err
    assert (
        "Traceback" not in err and "SIGTERM received" not in err and "Failed to connect to GCS" not in err
    ), err
    assert ("Ray's GCS is gone" in err) == to_group, err  # the group case takes the new path, and only it
    # deploy's own lines (Ray's log monitor may forward a process's dying words between them: the SIGTERM
    # to the group reaches the autoscaler too, and under load its message can come before "stopped")
    ours = [line for line in out.splitlines() if line.startswith("[pdcluster] ")]
    shutting_down, stopped = ours[-2:]
    assert shutting_down.startswith("[pdcluster] shutting down: new connections refused") and stopped == (
        "[pdcluster] stopped"
    ), out
