"""What `pip install` puts on sys.path: one top-level package, `pdcluster`.

A generic top-level name shadows or overwrites another distribution's module of that name: our old
`kernels/` hid Hugging Face's `kernels`, which transformers (a test oracle here) imports, and every
transformers-backed test failed with an ImportError (CI at 931e4e7, transformers 5.2x).
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import sysconfig
import tomllib
from pathlib import Path

import pytest
from setuptools import find_namespace_packages, find_packages

REPO = Path(__file__).resolve().parents[1]


def test_the_package_list_holds_only_pdcluster_and_its_subpackages() -> None:
    """The same search the build runs (setuptools' `packages.find`, namespaces on by default)."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    find = find_namespace_packages if config.get("namespaces", True) else find_packages
    packages = find(where=str(REPO), include=config["include"])
    assert "pdcluster" in packages and "pdcluster.entrypoints.cli" in packages
    assert {name.split(".")[0] for name in packages} == {"pdcluster"}


def test_the_installed_distribution_declares_one_top_level_name() -> None:
    """Read from site-packages, not from a `pdcluster.egg-info` a build left in the checkout (first on
    sys.path when tests run from the repository root)."""
    (dist,) = importlib.metadata.distributions(name="pdcluster", path=[sysconfig.get_paths()["purelib"]])
    top_level = dist.read_text("top_level.txt")
    assert top_level is not None, "setuptools writes top_level.txt for regular and editable installs"
    assert top_level.split() == ["pdcluster"]
    (script,) = [ep for ep in dist.entry_points if ep.group == "console_scripts"]
    assert script.value == "pdcluster.entrypoints.cli:main"


def test_no_other_package_or_module_at_the_repository_root() -> None:
    """Tests and benchmarks run with the repository root on sys.path: a package or module there shadows
    any installed one of its name the same way. Only `bench` and `tests` (never installed) may sit there."""
    roots = {path.parent.name for path in REPO.glob("*/__init__.py")}
    assert roots == {"pdcluster", "bench", "tests"}
    assert not list(REPO.glob("*.py"))


def test_transformers_imports_with_the_repository_root_on_sys_path() -> None:
    """The failure itself: transformers' DeepSeek-V3 imports its `kernels` dependency, which must be the
    installed one, not a directory of ours."""
    pytest.importorskip("transformers")
    spec = importlib.util.find_spec("kernels")
    if spec is not None:  # transformers < 5 does not depend on it
        site_packages = Path(sysconfig.get_paths()["purelib"]).resolve()
        assert spec.origin is not None and Path(spec.origin).resolve().is_relative_to(site_packages)
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3ForCausalLM

    assert DeepseekV3ForCausalLM.__name__ == "DeepseekV3ForCausalLM"


def test_the_package_imports_nothing_that_is_not_installed() -> None:
    """`bench` and `tests` sit at the repository root but are never installed: an import of either from
    the package works in the tests (run from the root) and fails for a user (`pdcluster profile` once
    died so, importing `bench.kv_transfer`). Every import statement of the package, lazy ones included."""
    offending = []
    for path in sorted((REPO / "pdcluster").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            offending += [
                f"{path.relative_to(REPO)}:{node.lineno}: {name}"
                for name in names
                if name.split(".")[0] in ("bench", "tests")
            ]
    assert offending == []
