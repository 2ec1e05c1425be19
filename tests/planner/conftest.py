"""One `pdcluster profile clusters/local.yaml --quick` per test session, shared by the profile CLI test
(what the calibration holds) and the live-vs-simulated fidelity test (which simulates with it): the
profile deploys the live cluster and times both pools' engines, tens of seconds a run. Both run the file's
eager copy (`eager_local_yaml`), so the calibration and the live cluster are the same engines and neither
compiles at load."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import NamedTuple

import pytest

from pdcluster.orchestrator.cli import main
from tests.conftest import eager_topology_file

ROOT = Path(__file__).resolve().parents[2]


class QuickCalibration(NamedTuple):
    path: Path  # the calibration JSON (its .txt summary beside it)
    stdout: str  # what the command printed


@pytest.fixture(scope="session")
def eager_local_yaml(tmp_path_factory) -> Path:
    """clusters/local.yaml with `decode.compile: false` (`tests.conftest.eager_topology_file`)."""
    return eager_topology_file(ROOT / "clusters" / "local.yaml", tmp_path_factory.mktemp("eager"))


@pytest.fixture(scope="session")
def quick_calibration(tmp_path_factory, eager_local_yaml) -> QuickCalibration:
    out = tmp_path_factory.mktemp("calibration") / "local.calibration.json"
    argv = [
        "profile",
        str(eager_local_yaml),
        "--quick",
        "--no-progress",
        "--output",
        str(out),
    ]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(argv)
    assert code == 0, stdout.getvalue()
    return QuickCalibration(out, stdout.getvalue())
