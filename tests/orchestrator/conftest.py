"""Factories for the orchestrator tests: a throwaway checkpoint that loads in well under a second."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer

from pdcluster.models.config import DeepseekV3Config
from pdcluster.models.corpus import corpus_files
from pdcluster.models.deepseek_v3 import DeepseekV3ForCausalLM
from pdcluster.models.loader import save_checkpoint
from pdcluster.models.tokenizer import EOS_TOKEN
from pdcluster.models.train_tiny import bpe_tokenizer
from tests.conftest import tiny_config

RANDOM_CONTEXT_LEN = 128  # max_position_embeddings of the random checkpoint: small, to reach it in a test


def train_small_tokenizer(vocab_size: int = 320, num_chars: int = 8000) -> HFTokenizer:
    """`models.train_tiny.bpe_tokenizer` on a few KB of stdlib text."""
    files = corpus_files("train")[:3]
    text = "".join(p.read_text(encoding="utf-8", errors="replace") for p in files)[:num_chars]
    return bpe_tokenizer([text], vocab_size)


def random_tiny_config(vocab_size: int) -> DeepseekV3Config:
    """The shared tiny test config (`tests.conftest.tiny_config`) with this tokenizer's vocabulary and a
    128-token context, so tests can reach the end of the context."""
    return tiny_config(vocab_size=vocab_size, max_position_embeddings=RANDOM_CONTEXT_LEN)


@pytest.fixture(scope="session")
def random_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A freshly initialised (untrained) checkpoint directory: config.json, model.safetensors, tokenizer.json.

    The output head's EOS row is zeroed, so EOS's logit is always 0 while the largest of the other ~300
    random logits is positive: greedy decoding never stops early and token counts are exact.
    """
    path = tmp_path_factory.mktemp("random_tiny")
    tok = train_small_tokenizer()
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(random_tiny_config(tok.get_vocab_size()))
    with torch.no_grad():
        model.lm_head.weight[tok.token_to_id(EOS_TOKEN)] = 0
    save_checkpoint(model, path)
    tok.save(str(path / "tokenizer.json"))
    return path
