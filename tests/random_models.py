"""Tiny random targets and EAGLE-3 heads for verifier tests (float64: argmax ties cannot flip)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specheads.attention import register
from specheads.heads.eagle3 import Eagle3Head, Eagle3Options
from specheads.target import Target

VOCAB, CTX = 96, 96


def make_target(attn: str = "sdpa", seed: int = 0, dtype=torch.float64) -> Target:
    """A random 8-layer GQA Llama; "sdpa" becomes our GQA kernel, as `Target.load` makes it (so
    ragged batches run packed, `attention.packed`)."""
    attn = register() if attn == "sdpa" else attn
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CTX,
                      initializer_range=0.1)
    cfg._attn_implementation = attn
    return Target(LlamaForCausalLM(cfg).to(dtype), None, Path("random-llama"))


def make_head(target: Target, attn: str = "sdpa", seed: int = 1) -> Eagle3Head:
    """A random head with a non-trivial draft vocabulary (64 of the 96 ids, scattered)."""
    torch.manual_seed(seed)
    head = Eagle3Head.for_target(Eagle3Options(ttt_steps=3, draft_vocab_size=64), target.config,
                                 attn_implementation=attn)
    used = torch.sort(torch.randperm(VOCAB)[:64]).values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[used] = True
    head.set_vocab_map(used - torch.arange(64), t2d)
    return head.to(target.dtype).eval()


def save_family_target(folder: Path, family: str, vocab: int, tokenizer_dir: Path | None = None,
                       seed: int = 0) -> Path:
    """A tiny random DeepSeek-V3 (MLA + MoE), Qwen3-Next or Qwen3.5 HF folder, faithful to the released config."""
    from specheads.builtin.family_targets import save_family_target as save

    return save(folder, family, vocab, tokenizer_dir, seed)


def overfit(head, inputs: dict, opt, steps: int = 60):
    """`steps` optimizer steps on one batch; returns (the first loss, the last forward's result)."""
    first = None
    for _ in range(steps):
        res = head(**inputs)
        first = first if first is not None else res.loss.item()
        opt.zero_grad()
        res.loss.backward()
        opt.step()
    return first, res
