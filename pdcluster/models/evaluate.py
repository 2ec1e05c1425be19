"""Held-out evaluation of a checkpoint: next-token loss/perplexity and MTP top-1 accuracy.

The MTP figure is accuracy on the true token i+2, not a greedy speculative acceptance rate.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pdcluster.models.corpus import read_documents
from pdcluster.models.deepseek_v3 import DeepseekV3ForCausalLM
from pdcluster.models.tokenizer import Tokenizer


def heldout_windows(tokenizer: Tokenizer, seq_len: int, num_windows: int) -> torch.Tensor:
    """Non-overlapping windows of the held-out stream: [num_windows, seq_len + 2] int64.

    Raises ValueError if the stream is too short.
    """
    stream: list[int] = []
    for ids in tokenizer.encode_batch(read_documents("heldout")):
        stream.extend(ids)
        stream.append(tokenizer.eos_token_id)
    width = seq_len + 2
    available = len(stream) // width
    if available < num_windows:
        raise ValueError(f"held-out text has {available} windows of {width} tokens, asked for {num_windows}")
    stride = available // num_windows
    data = torch.tensor(stream[: available * width], dtype=torch.long).view(available, width)
    return data[::stride][:num_windows].clone()


@torch.no_grad()
def evaluate(model: DeepseekV3ForCausalLM, windows: torch.Tensor, batch_size: int = 8) -> dict[str, float]:
    """Mean next-token cross-entropy (nats), perplexity and MTP top-1 accuracy on token i+2."""
    total_loss, total_tokens, mtp_correct, mtp_tokens = 0.0, 0, 0, 0
    for start in range(0, windows.shape[0], batch_size):
        batch = windows[start : start + batch_size]
        inputs, targets = batch[:, :-2], batch[:, 1:-1]
        hidden = model.hidden_states(inputs)
        logits = model.lm_head(hidden).float()
        total_loss += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
        total_tokens += targets.numel()
        if model.mtp_layers:
            _, mtp_logits = model.mtp_forward(hidden, targets)
            mtp_correct += (mtp_logits.argmax(-1) == batch[:, 2:]).sum().item()
            mtp_tokens += targets.numel()
    loss = total_loss / total_tokens
    return {
        "loss": loss,
        "perplexity": math.exp(loss),
        "mtp_top1_accuracy": mtp_correct / mtp_tokens if mtp_tokens else float("nan"),
        "num_tokens": total_tokens,
    }
