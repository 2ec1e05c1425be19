"""What `pip install` puts on sys.path: one top-level package, `pdcluster`.

A generic top-level name shadows or overwrites another distribution's module of that name: our old
`kernels/` hid Hugging Face's `kernels`, which transformers (a test oracle here) imports, and every
transformers-backed test failed with an ImportError (CI at 931e4e7, transformers 5.2x).
"""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

from setuptools import find_packages

REPO = Path(__file__).resolve().parents[1]


def test_the_package_list_holds_only_pdcluster_and_its_subpackages() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = find_packages(where=str(REPO), include=config["include"])
    assert "pdcluster" in packages and "pdcluster.orchestrator.cli" in packages
    assert {name.split(".")[0] for name in packages} == {"pdcluster"}


def test_the_installed_distribution_declares_one_top_level_name() -> None:
    dist = importlib.metadata.distribution("pdcluster")
    top_level = dist.read_text("top_level.txt")
    assert top_level is not None, "setuptools writes top_level.txt for regular and editable installs"
    assert top_level.split() == ["pdcluster"]
    (script,) = [ep for ep in dist.entry_points if ep.group == "console_scripts"]
    assert script.value == "pdcluster.orchestrator.cli:main"


def test_no_other_package_at_the_repository_root() -> None:
    """Tests and benchmarks run with the repository root on sys.path: a package there shadows any
    installed module of its name the same way. Only `bench` and `tests` (never installed) may sit there."""
    roots = {path.parent.name for path in REPO.glob("*/__init__.py")}
    assert roots == {"pdcluster", "bench", "tests"}
