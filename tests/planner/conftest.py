"""One `pdcluster profile clusters/local.yaml --quick` per test session, shared by the profile CLI test
(what the calibration holds) and the live-vs-simulated fidelity test (which simulates with it): the
profile deploys the live cluster and times both pools' engines, tens of seconds a run."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import NamedTuple

import pytest

from orchestrator.cli import main

ROOT = Path(__file__).resolve().parents[2]


class QuickCalibration(NamedTuple):
    path: Path  # the calibration JSON (its .txt summary beside it)
    stdout: str  # what the command printed


@pytest.fixture(scope="session")
def quick_calibration(tmp_path_factory) -> QuickCalibration:
    out = tmp_path_factory.mktemp("calibration") / "local.calibration.json"
    argv = [
        "profile",
        str(ROOT / "clusters" / "local.yaml"),
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
