"""DeepSeek-V3 architecture (MLA, DeepSeekMoE, MTP), checkpoint loading, and the bundled tiny checkpoint."""

from __future__ import annotations

from pathlib import Path


def bundled_checkpoint_dir() -> Path:
    """The bundled tiny checkpoint's directory (written by `python -m pdcluster.models.train_tiny`)."""
    return Path(__file__).resolve().parent / "tiny"
