"""The committed gRPC stubs are what `make protos` generates from pdcluster/protos/kv_transfer.proto."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
STUBS = ("pdcluster/protos/kv_transfer_pb2.py", "pdcluster/protos/kv_transfer_pb2_grpc.py")


def test_committed_stubs_match_a_fresh_protoc_run(tmp_path):
    pytest.importorskip("grpc_tools")
    committed_version = re.search(
        r"GRPC_GENERATED_VERSION = '([^']+)'", (REPO_ROOT / STUBS[1]).read_text()
    ).group(1)
    installed_version = metadata.version("grpcio-tools")
    if installed_version != committed_version:
        pytest.skip(f"stubs come from grpcio-tools {committed_version}; {installed_version} is installed")
    # The documented command (pdcluster/protos/README.md, `make protos`), writing into tmp_path instead of
    # the tree.
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I.", f"--python_out={tmp_path}",
         f"--grpc_python_out={tmp_path}", "pdcluster/protos/kv_transfer.proto"],
        cwd=REPO_ROOT, check=True, capture_output=True, text=True,
    )  # fmt: skip
    for stub in STUBS:
        assert (tmp_path / stub).read_text() == (REPO_ROOT / stub).read_text(), (
            f"{stub} is stale: run make protos"
        )
