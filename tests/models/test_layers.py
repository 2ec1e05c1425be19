"""Model pieces on their own: the DeepSeekMoE layer against a per-token loop, the MTP module, batching."""

from __future__ import annotations

import pytest
import torch

from pdcluster.models.deepseek_v3 import DeepseekV3MoE
from tests.conftest import random_ids, tiny_model


@pytest.fixture(autouse=True)
def _seed_torch() -> None:
    """Tests in this file that draw from torch's global generator draw the same numbers on every run."""
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=7, n_group=4, topk_group=2, num_experts_per_tok=3)


def test_moe_layer_equals_per_token_loop(model) -> None:
    moe = model.main_layers[1].mlp
    assert isinstance(moe, DeepseekV3MoE)
    hidden = torch.randn(11, model.config.hidden_size)
    with torch.no_grad():
        out = moe(hidden)
        topk_weights, topk_ids = moe.gate(hidden)
        want = torch.zeros_like(hidden)
        for t in range(hidden.shape[0]):
            x = hidden[t : t + 1]
            want[t] = moe.shared_experts(x)[0]
            for e, w in zip(topk_ids[t].tolist(), topk_weights[t], strict=True):
                want[t] += w * moe.experts[e](x)[0]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert moe.last_expert_load.tolist() == torch.bincount(topk_ids.flatten(), minlength=8).tolist()


def test_batch_rows_are_independent(model) -> None:
    ids = random_ids(model.config, batch=3, seq_len=10, seed=8)
    with torch.no_grad():
        batched = model(ids)
        for b in range(3):
            torch.testing.assert_close(batched[b : b + 1], model(ids[b : b + 1]), rtol=1e-5, atol=1e-5)


def test_causality(model) -> None:
    ids = random_ids(model.config, batch=1, seq_len=10, seed=9)
    changed = ids.clone()
    changed[0, 6] = (ids[0, 6] + 1) % model.config.vocab_size
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :6], b[:, :6], rtol=0, atol=1e-6)
    assert (a[:, 6:] - b[:, 6:]).abs().amax(-1).min() > 1e-3


# ---- MTP --------------------------------------------------------------------------------------------


def mtp_inputs(model, batch: int = 2, seq_len: int = 8, seed: int = 10):
    ids = random_ids(model.config, batch=batch, seq_len=seq_len + 1, seed=seed)
    with torch.no_grad():
        prev_hidden = model.hidden_states(ids[:, :-1])
    return prev_hidden, ids[:, 1:]


def test_mtp_forward_shapes(model) -> None:
    prev_hidden, next_ids = mtp_inputs(model)
    with torch.no_grad():
        hidden, logits = model.mtp_forward(prev_hidden, next_ids)
        absorbed_hidden, absorbed_logits = model.mtp_forward(prev_hidden, next_ids, absorbed=True)
    assert hidden.shape == (2, 8, model.config.hidden_size)
    assert logits.shape == (2, 8, model.config.vocab_size) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, model.lm_head(hidden))  # the head is the main model's
    # the returned hidden state is post `shared_head.norm`: unit RMS once its weight is divided out
    norm_weight = model.mtp_layers[0].shared_head.norm.weight
    rms = (hidden / norm_weight).pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(absorbed_logits, logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(absorbed_hidden, hidden, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("which", ["prev_hidden", "next_ids"])
def test_mtp_forward_depends_on_both_inputs_causally(model, which) -> None:
    """Changing either input at position 4 changes the outputs from position 4 on, and nothing before."""
    prev_hidden, next_ids = mtp_inputs(model)
    prev_changed, next_changed = prev_hidden.clone(), next_ids.clone()
    if which == "prev_hidden":
        prev_changed[:, 4] += torch.randn(model.config.hidden_size)
    else:
        next_changed[:, 4] = (next_ids[:, 4] + 1) % model.config.vocab_size
    with torch.no_grad():
        _, before = model.mtp_forward(prev_hidden, next_ids)
        _, after = model.mtp_forward(prev_changed, next_changed)
    torch.testing.assert_close(after[:, :4], before[:, :4], rtol=0, atol=1e-6)
    assert (after[:, 4:] - before[:, 4:]).abs().amax(-1).min() > 1e-3


def test_mtp_eh_proj_takes_embedding_first_then_hidden(model) -> None:
    """Public `eh_proj` layout: columns [0, H) read enorm(embedding), [H, 2H) read hnorm(previous hidden)."""
    prev_hidden, next_ids = mtp_inputs(model)
    other_hidden = torch.randn_like(prev_hidden)
    other_ids = (next_ids + 1) % model.config.vocab_size
    size = model.config.hidden_size
    mtp = model.mtp_layers[0]
    saved = mtp.eh_proj.weight.detach().clone()
    try:
        with torch.no_grad():
            mtp.eh_proj.weight[:, size:] = 0  # keep only the embedding half
            a = model.mtp_forward(prev_hidden, next_ids)[1]
            # The zeroed half contributes exact zeros, but the two calls' buffers may round apart in the
            # matmul (kernel choice by alignment); the `not allclose` below shows the other half matters.
            torch.testing.assert_close(model.mtp_forward(other_hidden, next_ids)[1], a, rtol=0, atol=1e-6)
            assert not torch.allclose(model.mtp_forward(prev_hidden, other_ids)[1], a)
            mtp.eh_proj.weight.copy_(saved)
            mtp.eh_proj.weight[:, :size] = 0  # keep only the hidden half
            b = model.mtp_forward(prev_hidden, next_ids)[1]
            torch.testing.assert_close(model.mtp_forward(prev_hidden, other_ids)[1], b, rtol=0, atol=1e-6)
            assert not torch.allclose(model.mtp_forward(other_hidden, next_ids)[1], b)
    finally:
        with torch.no_grad():
            mtp.eh_proj.weight.copy_(saved)


def test_mtp_forward_without_mtp_module() -> None:
    model = tiny_model(num_nextn_predict_layers=0)
    assert model.mtp_layers == []
    with pytest.raises(ValueError, match="no MTP module"):
        model.mtp_forward(torch.zeros(1, 2, 32), torch.zeros(1, 2, dtype=torch.long))
