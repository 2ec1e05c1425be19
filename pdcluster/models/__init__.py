"""DeepSeek-V3 architecture (MLA, DeepSeekMoE, MTP), checkpoint loading, and the bundled tiny checkpoint.

Importing this package is cheap (no torch); import the submodules for the model itself.
"""

from __future__ import annotations

from pathlib import Path


def bundled_checkpoint_dir() -> Path:
    """Directory of the bundled tiny checkpoint (`config.json`, `model.safetensors`, `tokenizer.json`).

    It sits inside the installed `pdcluster.models` package (`pdcluster/models/tiny/`) and is written
    by `python -m pdcluster.models.train_tiny`; the directory may not exist on a checkout where that has not
    run yet.
    """
    return Path(__file__).resolve().parent / "tiny"
