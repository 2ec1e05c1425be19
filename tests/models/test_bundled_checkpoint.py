"""The bundled tiny checkpoint: it loads, it has every DeepSeek-V3 feature on, and its held-out loss is the
figure the model card states (recomputed here, within 1%)."""

from __future__ import annotations

import json
import re

import pytest

from pdcluster.models import bundled_checkpoint_dir
from pdcluster.models.corpus import corpus_digest
from pdcluster.models.deepseek_v3 import DeepseekV3ForCausalLM
from pdcluster.models.evaluate import evaluate, heldout_windows
from pdcluster.models.tokenizer import Tokenizer

CKPT = bundled_checkpoint_dir()
MAX_CHECKPOINT_BYTES = 16 * 1024 * 1024


@pytest.fixture(scope="module")
def train_log() -> dict:
    return json.loads((CKPT / "train_log.json").read_text())


@pytest.fixture(scope="module")
def model() -> DeepseekV3ForCausalLM:
    return DeepseekV3ForCausalLM.from_pretrained(CKPT)


def test_checkpoint_fits_the_size_budget():
    total = sum(p.stat().st_size for p in CKPT.iterdir() if p.is_file())
    assert total <= MAX_CHECKPOINT_BYTES, f"bundled checkpoint is {total:,} bytes"


def test_every_architectural_feature_is_on(model):
    cfg = model.config
    assert cfg.q_lora_rank is not None
    assert cfg.n_routed_experts >= 8 and cfg.num_experts_per_tok >= 2
    assert cfg.n_group >= 2 and cfg.n_shared_experts == 1
    assert 1 <= cfg.first_k_dense_replace < cfg.num_hidden_layers
    assert cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "yarn"
    assert len(model.mtp_layers) == 1
    # Aux-loss-free balancing moved the selection bias during training.
    assert model.main_layers[-1].mlp.gate.e_score_correction_bias.abs().sum() > 0


def test_heldout_loss_matches_the_model_card(model, train_log):
    ev = train_log["eval"]
    if corpus_digest("heldout") != train_log["corpus_heldout_sha256"]:
        pytest.skip(
            f"this interpreter's held-out modules differ from the text the card was measured on "
            f"(Python {train_log['python']}); the figure does not apply"
        )
    card = (CKPT / "MODEL_CARD.md").read_text()
    card_loss = float(re.search(r"\| next-token loss \(nats\) \| ([0-9.]+) \|", card).group(1))
    card_mtp = float(re.search(r"\| MTP top-1 accuracy, token after next \| ([0-9.]+) \|", card).group(1))
    tokenizer = Tokenizer.from_dir(CKPT)
    metrics = evaluate(model, heldout_windows(tokenizer, ev["seq_len"], ev["num_windows"]))
    assert metrics["num_tokens"] == ev["num_tokens"]
    assert metrics["loss"] == pytest.approx(card_loss, rel=0.01)
    assert metrics["mtp_top1_accuracy"] == pytest.approx(card_mtp, rel=0.01)
