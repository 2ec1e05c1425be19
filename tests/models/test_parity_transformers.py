"""Parity with transformers' `DeepseekV3ForCausalLM`, an independent implementation used as the oracle.

Each case builds a randomized transformers model, writes it with `save_pretrained`, loads the directory
with our loader and compares float32 logits (max abs diff <= 1e-4; logits are O(1) by construction).
Together the cases cover: q_lora_rank None / set, n_group 1 / > 1, YaRN on / off,
first_k_dense_replace 0 / > 0, rope_interleave True / False, norm_topk_prob False, attention biases and
tied embeddings. The expanded (prefill) and weight-absorbed (decode) MLA paths are both compared.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from pdcluster.models.loader import load_checkpoint
from tests.conftest import random_ids, tiny_config
from tests.models.conftest import save_hf_checkpoint

transformers = pytest.importorskip("transformers")

ATOL = 1e-4

CASES = {
    # name: tiny_config overrides
    "no_q_lora-one_group-all_moe": dict(q_lora_rank=None, n_group=1, topk_group=1, first_k_dense_replace=0),
    "q_lora-4_groups-yarn-one_dense": dict(
        n_group=4, topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1, yarn=True
    ),
    "q_lora-2_groups-not_interleaved-two_dense": dict(
        num_hidden_layers=3, first_k_dense_replace=2, rope_interleave=False, norm_topk_prob=False
    ),
    "no_q_lora-4_groups-yarn-bias-tied": dict(
        q_lora_rank=None,
        n_group=4,
        topk_group=3,
        num_experts_per_tok=4,
        first_k_dense_replace=0,
        yarn=True,
        attention_bias=True,
        tie_word_embeddings=True,
    ),
    "q_lora-one_group-yarn-not_interleaved": dict(
        n_group=1, topk_group=1, first_k_dense_replace=1, yarn=True, rope_interleave=False
    ),
}


def test_cases_cover_acceptance_matrix() -> None:
    configs = [tiny_config(**dict(overrides)) for overrides in CASES.values()]
    assert {c.q_lora_rank is None for c in configs} == {True, False}
    assert {c.n_group > 1 for c in configs} == {True, False}
    assert {c.rope_scaling is not None for c in configs} == {True, False}
    assert {c.first_k_dense_replace > 0 for c in configs} == {True, False}
    assert {c.rope_interleave for c in configs} == {True, False}


@pytest.mark.parametrize("overrides", list(CASES.values()), ids=list(CASES))
def test_logits_match_transformers(tmp_path, caplog, overrides) -> None:
    config = tiny_config(**dict(overrides))
    hf_model = save_hf_checkpoint(config, tmp_path, seed=1)

    with caplog.at_level(logging.WARNING, logger="pdcluster.models.loader"):
        ours = load_checkpoint(tmp_path)
    # transformers writes no MTP tensors: the loader says so and disables MTP; nothing else is ignored.
    assert "MTP disabled" in caplog.text
    assert "ignoring" not in caplog.text
    assert ours.mtp_layers == []
    assert ours.config == dataclasses.replace(
        config, num_nextn_predict_layers=0, torch_dtype=ours.config.torch_dtype
    )

    ids = random_ids(config, batch=2, seq_len=12, seed=2)
    with torch.no_grad():
        expected = hf_model(ids).logits.float()
        expanded = ours(ids)
        absorbed = ours(ids, absorbed=True)

    assert expected.shape == expanded.shape == (2, 12, config.vocab_size)
    assert expected.std() > 0.3, "logits too flat for a 1e-4 comparison to mean anything"
    assert (expanded - expected).abs().max() <= ATOL
    assert (absorbed - expected).abs().max() <= ATOL
    assert (absorbed - expanded).abs().max() <= ATOL


def test_selection_bias_is_exercised(tmp_path) -> None:
    """The randomized `e_score_correction_bias` changes which experts are picked (so parity covers the
    selection-only rule): zeroing it changes transformers' logits, and ours follow both ways."""
    config = tiny_config(**dict(CASES["q_lora-4_groups-yarn-one_dense"]))
    hf_model = save_hf_checkpoint(config, tmp_path, seed=1)
    ours = load_checkpoint(tmp_path)
    ids = random_ids(config, seed=2)
    for model in (hf_model, ours):
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.zero_()
    with torch.no_grad():
        expected_unbiased = hf_model(ids).logits.float()
        ours_unbiased = ours(ids)
    assert (ours_unbiased - expected_unbiased).abs().max() <= ATOL

    ours_biased = load_checkpoint(tmp_path)  # a fresh copy keeps the randomized bias
    with torch.no_grad():
        assert (ours_biased(ids) - ours_unbiased).abs().max() > 1e-2
