"""Train the bundled tiny DeepSeek-V3 checkpoint on the standard library's source.

    python -m pdcluster.models.train_tiny                    # writes pdcluster/models/tiny/
    python -m pdcluster.models.train_tiny --steps 20 --output /tmp/tiny   # a quick smoke run

Every DeepSeek-V3 feature is on; MTP trains jointly (report section 2.2, eq. 25) and expert load is
balanced without an auxiliary loss (report 2.1.2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import random
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from pdcluster.models.config import DeepseekV3Config
from pdcluster.models.corpus import HELD_OUT_MODULES, corpus_digest, corpus_files, read_documents
from pdcluster.models.deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV3MoE
from pdcluster.models.evaluate import evaluate, heldout_windows
from pdcluster.models.loader import load_checkpoint, save_checkpoint
from pdcluster.models.tokenizer import SPECIAL_TOKENS, Tokenizer

DEFAULT_OUTPUT = Path(__file__).parent / "tiny"
EVAL_SEQ_LEN = 256
EVAL_NUM_WINDOWS = 48


def tiny_config(vocab_size: int) -> DeepseekV3Config:
    bundled = DeepseekV3Config.from_json_file(DEFAULT_OUTPUT / "config.json")
    return dataclasses.replace(bundled, vocab_size=vocab_size)


def bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    """Byte-level BPE trained on `texts`; ids 0 (bos), 1 (eos), 2 (pad)."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def train_tokenizer(vocab_size: int) -> Tokenizer:
    return Tokenizer(bpe_tokenizer(read_documents("train"), vocab_size))


def token_stream(tokenizer: Tokenizer) -> torch.Tensor:
    stream: list[int] = []
    for ids in tokenizer.encode_batch(read_documents("train")):
        stream.extend(ids)
        stream.append(tokenizer.eos_token_id)
    return torch.tensor(stream, dtype=torch.long)


def lr_at(step: int, num_steps: int, peak_lr: float, warmup_steps: int) -> float:
    """Linear warm-up then cosine decay to 10% of the peak."""
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, num_steps - warmup_steps)
    return peak_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def update_routing_bias(model: DeepseekV3ForCausalLM, speed: float) -> None:
    """Auxiliary-loss-free balancing (report 2.1.2): bias += speed * sign(mean load - expert load)."""
    for module in model.modules():
        if isinstance(module, DeepseekV3MoE) and module.last_expert_load is not None:
            load = module.last_expert_load.float()
            module.gate.e_score_correction_bias += speed * torch.sign(load.mean() - load)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m pdcluster.models.train_tiny", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="checkpoint directory to write")
    p.add_argument("--steps", type=int, default=700, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=12, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per training sequence")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--mtp-loss-weight", type=float, default=0.3, help="lambda of the MTP loss (report: 0.3)")
    p.add_argument("--bias-update-speed", type=float, default=0.01, help="gamma of aux-loss-free balancing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--log-every", type=int, default=50)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    t_start = time.perf_counter()

    print(
        f"corpus: {len(corpus_files('train'))} training files; held out: {', '.join(HELD_OUT_MODULES)}",
        flush=True,
    )
    tokenizer = train_tokenizer(args.vocab_size)
    stream = token_stream(tokenizer)
    print(f"tokenizer: vocab {tokenizer.vocab_size}; training stream {stream.numel():,} tokens", flush=True)

    config = tiny_config(tokenizer.vocab_size)
    model = DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2 and "embed_tokens" not in name:
                torch.nn.init.normal_(param, std=0.02)
            elif "embed_tokens" in name:
                torch.nn.init.normal_(param, std=1.0)
        for layer in model.model.layers:  # scale residual branches by depth (GPT-2 style)
            layer.self_attn.o_proj.weight.mul_(1 / math.sqrt(2 * (config.num_hidden_layers + 1)))
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model: {num_params:,} parameters", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(args.seed)
    width = args.seq_len + 2
    log: list[dict[str, float]] = []
    model.train()
    t_train = time.perf_counter()
    for step in range(args.steps):
        starts = torch.randint(0, stream.numel() - width, (args.batch_size,), generator=gen)
        batch = torch.stack([stream[s : s + width] for s in starts.tolist()])
        inputs, targets, targets2 = batch[:, :-2], batch[:, 1:-1], batch[:, 2:]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup_steps)
        hidden = model.hidden_states(inputs)
        main_loss = F.cross_entropy(model.lm_head(hidden).flatten(0, 1).float(), targets.flatten())
        _, mtp_logits = model.mtp_forward(hidden, targets)
        mtp_loss = F.cross_entropy(mtp_logits.flatten(0, 1), targets2.flatten())
        loss = main_loss + args.mtp_loss_weight * mtp_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        with torch.no_grad():
            update_routing_bias(model, args.bias_update_speed)
        if step % args.log_every == 0 or step == args.steps - 1:
            elapsed = time.perf_counter() - t_train
            tokens_per_s = (step + 1) * args.batch_size * args.seq_len / elapsed
            entry = {
                "step": step,
                "loss": main_loss.item(),
                "mtp_loss": mtp_loss.item(),
                "elapsed_s": round(elapsed, 1),
                "tokens_per_s": round(tokens_per_s),
            }
            log.append(entry)
            print(json.dumps(entry), flush=True)
    train_s = time.perf_counter() - t_train

    out = args.output
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model, out, dtype=torch.bfloat16)
    tokenizer._tok.save(str(out / "tokenizer.json"))
    reloaded = load_checkpoint(out)
    metrics = evaluate(reloaded, heldout_windows(tokenizer, EVAL_SEQ_LEN, EVAL_NUM_WINDOWS))
    total_s = time.perf_counter() - t_start
    print(json.dumps({"heldout": metrics}), flush=True)

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "corpus_train_files": len(corpus_files("train")),
        "corpus_heldout_files": len(corpus_files("heldout")),
        "corpus_train_sha256": corpus_digest("train"),
        "corpus_heldout_sha256": corpus_digest("heldout"),
        "train_tokens_in_stream": stream.numel(),
        "train_tokens_seen": args.steps * args.batch_size * args.seq_len,
        "num_parameters": num_params,
        "checkpoint_bytes": (out / "model.safetensors").stat().st_size,
        "tokenizer_bytes": (out / "tokenizer.json").stat().st_size,
        "train_seconds": round(train_s, 1),
        "total_seconds": round(total_s, 1),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "eval": {"seq_len": EVAL_SEQ_LEN, "num_windows": EVAL_NUM_WINDOWS, **metrics},
        "log": log,
    }
    (out / "train_log.json").write_text(json.dumps(info, indent=2) + "\n")
    (out / "MODEL_CARD.md").write_text(model_card(config, info))
    print(f"wrote {out} in {total_s / 60:.1f} min", flush=True)
    return 0


def model_card(config: DeepseekV3Config, info: dict) -> str:
    ev = info["eval"]
    a = info["args"]
    return f"""# pdcluster tiny DeepSeek-V3 checkpoint

Written by `python -m pdcluster.models.train_tiny` (every figure below comes from that run; `train_log.json` has
the raw numbers and the loss curve).

## Architecture (DeepSeek-V3 in miniature; `config.json`)
- {config.num_hidden_layers} layers (first {config.first_k_dense_replace} dense, then DeepSeekMoE) + {config.num_nextn_predict_layers} MTP module, hidden {config.hidden_size}, {config.num_attention_heads} heads, vocab {config.vocab_size}
- MLA: q_lora_rank {config.q_lora_rank}, kv_lora_rank {config.kv_lora_rank}, qk_nope_head_dim {config.qk_nope_head_dim}, qk_rope_head_dim {config.qk_rope_head_dim}, v_head_dim {config.v_head_dim}; KV cache {config.kv_cache_dim} values per token per layer
- YaRN RoPE: factor {config.rope_scaling.factor}, original context {config.rope_scaling.original_max_position_embeddings}, max_position_embeddings {config.max_position_embeddings}
- MoE: {config.n_routed_experts} routed experts (moe_intermediate_size {config.moe_intermediate_size}), top-{config.num_experts_per_tok}, n_group {config.n_group}, topk_group {config.topk_group}, {config.n_shared_experts} shared expert, sigmoid scores with e_score_correction_bias, routed_scaling_factor {config.routed_scaling_factor}
- {info["num_parameters"]:,} parameters; weights stored in bfloat16: {info["checkpoint_bytes"]:,} bytes (+ tokenizer {info["tokenizer_bytes"]:,} bytes)

## Corpus and split
- Text: the standard library source of CPython {info["python"]} (`pdcluster/models/corpus.py`), test suite, GUI/IDLE, vendored and generated code excluded.
- Training split: {info["corpus_train_files"]} files, {info["train_tokens_in_stream"]:,} tokens (sha256 `{info["corpus_train_sha256"][:16]}...`).
- Held out, never trained on: {", ".join(HELD_OUT_MODULES)} ({info["corpus_heldout_files"]} files, sha256 `{info["corpus_heldout_sha256"][:16]}...`).
- Tokenizer: byte-level BPE, vocab {config.vocab_size}, trained with `tokenizers` on the training split only.

## Training
- {a["steps"]} steps x {a["batch_size"]} sequences x {a["seq_len"]} tokens = {info["train_tokens_seen"]:,} tokens; AdamW (peak lr {a["lr"]}, warm-up {a["warmup_steps"]}, cosine to 10%), weight decay 0.1, grad clip 1.0, seed {a["seed"]}
- Loss: main CE + {a["mtp_loss_weight"]} x MTP CE; aux-loss-free expert balancing with bias update speed {a["bias_update_speed"]}
- Time: {info["train_seconds"] / 60:.1f} min training, {info["total_seconds"] / 60:.1f} min in all, on {info["threads"]} CPU threads ({info["machine"]}, torch {info["torch"]})

## Held-out evaluation (bfloat16 weights reloaded into float32)
{ev["num_windows"]} windows of {ev["seq_len"]} tokens spread evenly over the held-out stream ({ev["num_tokens"]:,} predicted tokens):

| metric | value |
|---|---|
| next-token loss (nats) | {ev["loss"]:.4f} |
| perplexity | {ev["perplexity"]:.2f} |
| MTP top-1 accuracy, token after next | {ev["mtp_top1_accuracy"]:.4f} |

The MTP figure is accuracy against the held-out text. Greedy speculative decoding accepts a draft when
it matches the main model's own argmax, which happens far more often (see `bench.spec_decode` for the
measured k=1 acceptance), so acceptance is typically well above this figure; it does not predict it.
"""


if __name__ == "__main__":
    sys.exit(main())
