"""The tiny model's corpus: the interpreter's standard library source, with a fixed held-out split.

`HELD_OUT_MODULES` are never trained on; demo and benchmark prompts come from them.
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
    return Path(sysconfig.get_paths()["stdlib"])


def _is_held_out(rel: Path) -> bool:
    return rel.parts[0] in HELD_OUT_MODULES


def corpus_files(split: str, root: Path | None = None) -> list[Path]:
    """Sorted `.py` files of `split` ("train" or "heldout"); ValueError for another split."""
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
    return [p.read_text(encoding="utf-8", errors="replace") for p in corpus_files(split, root)]


def corpus_digest(split: str, root: Path | None = None) -> str:
    """sha256 over the split's relative paths and contents."""
    root = root or stdlib_dir()
    h = hashlib.sha256()
    for p in corpus_files(split, root):
        h.update(str(p.relative_to(root)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()
