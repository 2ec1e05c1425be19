"""The README's Python snippets work as printed: every import resolves, and the offline-engine snippet runs.

(The move under `pdcluster/` left `from models import ...` in two snippets; nothing ran them.)
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SNIPPET_TIMEOUT_S = (
    300  # load (~2 s) + 48 tokens here; a bound for a loaded 2-core machine, not a speed check
)


def _python_snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)


def test_every_import_in_the_readme_snippets_resolves() -> None:
    snippets = _python_snippets()
    assert len(snippets) >= 2
    for snippet in snippets:
        for node in ast.walk(ast.parse(snippet)):
            if isinstance(node, ast.ImportFrom):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    importlib.import_module(alias.name)


@pytest.mark.slow
def test_the_offline_engine_snippet_runs_outside_the_checkout(tmp_path) -> None:
    """Run from another directory, so the package comes from the installation, not the repo root."""
    (snippet,) = [s for s in _python_snippets() if "LLM(" in s]
    result = subprocess.run(
        [sys.executable, "-c", snippet],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=SNIPPET_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert " length " in result.stdout  # finish_reason of 48 tokens with no stop: the snippet's print
