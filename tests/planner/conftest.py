"""One `pdcluster profile clusters/local.yaml --quick` per test session, shared by the profile CLI test
(what the calibration holds) and the live-vs-simulated fidelity test (which simulates with it): the
profile deploys the live cluster and times both pools' engines, tens of seconds a run. Both run the file's
eager copy (`eager_local_yaml`), so the calibration and the live cluster are the same engines and neither
compiles at load. It runs as a user runs it: the installed `pdcluster` command in a directory outside the
repository (so nothing it imports may live outside the installed package: it once imported `bench/`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.conftest import eager_topology_file

ROOT = Path(__file__).resolve().parents[2]
# the deploy's own bounds (placement groups 120 s, actors ready 300 s) plus the quick grid's timings
PROFILE_TIMEOUT_S = 120 + 300 + 600


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
    command = [
        str(Path(sys.executable).parent / "pdcluster"),  # the venv's console script, as installed
        "profile",
        str(eager_local_yaml),
        "--quick",
        "--no-progress",
        "--output",
        str(out),
    ]
    # its own Ray (not the session's), in a directory where the repository is not importable
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}
    done = subprocess.run(
        command, cwd=out.parent, env=env, capture_output=True, text=True, timeout=PROFILE_TIMEOUT_S
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    return QuickCalibration(out, done.stdout)
