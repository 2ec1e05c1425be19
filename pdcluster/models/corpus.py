"""The tiny model's corpus: the running interpreter's standard library source, with a fixed held-out split.

Every machine with Python has this text offline. Files are read in sorted order, so the split and the
token stream are reproducible for a given interpreter version (recorded in the model card).

Held out (never trained on): the modules in `HELD_OUT_MODULES`. Demo and benchmark prompts are cut from
them. Excluded from both splits: the test suite, GUI/IDLE code, vendored tools and generated data
(`EXCLUDED_DIRS`), so the corpus is ordinary library code.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

HELD_OUT_MODULES: tuple[str, ...] = (
    "argparse.py",
    "bisect.py",
    "calendar.py",
    "colorsys.py",
    "csv.py",
    "difflib.py",
    "fractions.py",
    "graphlib.py",
    "heapq.py",
    "json",
    "shlex.py",
    "statistics.py",
    "string.py",
    "textwrap.py",
)
EXCLUDED_DIRS: frozenset[str] = frozenset(
    {
        "test",
        "tests",
        "idlelib",
        "tkinter",
        "turtledemo",
        "lib2to3",
        "site-packages",
        "dist-packages",
        "__pycache__",
        "ensurepip",
        "pydoc_data",
        "encodings",
    }
)


def stdlib_dir() -> Path:
    """The running interpreter's pure-Python standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def _is_held_out(rel: Path) -> bool:
    return rel.parts[0] in HELD_OUT_MODULES


def corpus_files(split: str, root: Path | None = None) -> list[Path]:
    """Sorted `.py` files of one split.

    Args:
        split: `"train"` or `"heldout"`.
        root: the standard library directory (default: `stdlib_dir()`).

    Raises:
        ValueError: unknown split.
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    root = root or stdlib_dir()
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]) or rel.parts[0].startswith("config-"):
            continue
        if _is_held_out(rel) == (split == "heldout"):
            out.append(path)
    return out


def read_documents(split: str, root: Path | None = None) -> list[str]:
    """The split's files as text, in `corpus_files` order (undecodable bytes replaced)."""
    return [p.read_text(encoding="utf-8", errors="replace") for p in corpus_files(split, root)]


def corpus_digest(split: str, root: Path | None = None) -> str:
    """sha256 over the split's relative paths and contents: identifies the exact text a figure is for."""
    root = root or stdlib_dir()
    h = hashlib.sha256()
    for p in corpus_files(split, root):
        h.update(str(p.relative_to(root)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()
