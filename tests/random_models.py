"""Tiny random targets and EAGLE-3 heads for verifier tests (float64: argmax ties cannot flip)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specheads.heads.eagle3 import Eagle3Head, Eagle3Options
from specheads.target import Target

VOCAB, CTX = 96, 96


def make_target(attn: str = "sdpa", seed: int = 0, dtype=torch.float64) -> Target:
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
    """A tiny random DeepSeek-V3 (MLA + MoE), Qwen3-Next or Qwen3.5 (hybrid attention; dense or MoE) HF folder."""
    import shutil

    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                  num_attention_heads=4, max_position_embeddings=CTX, initializer_range=0.1)
    if family == "deepseek_v3":
        cfg = DeepseekV3Config(**common, num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=4,
                               num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                               q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                               v_head_dim=8, n_shared_experts=1, num_nextn_predict_layers=0)
        model = DeepseekV3ForCausalLM(cfg)
    elif family in ("qwen3_5", "qwen3_5_moe"):  # text-only Qwen3.5 (gated DeltaNet + gated attention)
        model = _qwen3_5(family, common)
    else:
        cfg = Qwen3NextConfig(**common, num_hidden_layers=4, num_key_value_heads=2, head_dim=8,
                              shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                              linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                              linear_value_head_dim=8)
        model = Qwen3NextForCausalLM(cfg)
    model.save_pretrained(folder)
    for path in (tokenizer_dir.iterdir() if tokenizer_dir else []):
        if path.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy2(path, folder / path.name)
    return folder


def _qwen3_5(family: str, common: dict):
    """Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM from the text configs: 3 linear-attention + 1 full layer."""
    from transformers import AutoModelForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    linear = dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=8, linear_num_value_heads=4,
                  linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
    if family == "qwen3_5":
        cfg = Qwen3_5TextConfig(**{k: v for k, v in common.items() if k != "moe_intermediate_size"}, **linear)
    else:
        cfg = Qwen3_5MoeTextConfig(**{k: v for k, v in common.items() if k != "intermediate_size"}, **linear,
                                   shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
    return AutoModelForCausalLM.from_config(cfg)
