"""Tiny random targets of the MTP families (DeepSeek-V3, Qwen3-Next, Qwen3.5), faithful to the released configs.

Each is the family's released config.json with only its sizes scaled down: every switch the engines
read (DeepSeek-V3's `topk_method: noaux_tc`, `scoring_func: sigmoid`, `moe_layer_freq`, `ep_size`,
yarn RoPE, ...) keeps its released value, because vLLM and SGLang build different modules from them
(vLLM creates `gate.e_score_correction_bias` only for noaux_tc; SGLang reads `moe_layer_freq`).
Used by the tests and by the engine-check matrix (`specheads.engines.matrix`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

FAMILIES = ("deepseek_v3", "qwen3_next", "qwen3_5", "qwen3_5_moe")
CONTEXT = 96  # Qwen families: max_position_embeddings of the tiny copies

# deepseek-ai/DeepSeek-V3 config.json: every key but the sizes (and its fp8 quantization_config: the
# tiny copy is stored in float32)
DEEPSEEK_V3_RELEASED = dict(
    topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1, ep_size=1, routed_scaling_factor=2.5,
    norm_topk_prob=True, hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
    attention_dropout=0.0, bos_token_id=0, eos_token_id=1, max_position_embeddings=163840,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                     "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                     "mscale": 1.0, "mscale_all_dim": 1.0},
)
DEEPSEEK_V3_TINY_SIZES = dict(
    hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
    first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
    v_head_dim=8, num_nextn_predict_layers=0, initializer_range=0.1,
)


def deepseek_v3_config(vocab: int):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(vocab_size=vocab, **DEEPSEEK_V3_TINY_SIZES, **DEEPSEEK_V3_RELEASED)


def build_family_model(family: str, vocab: int):
    """A random HF causal LM of `family` (see FAMILIES)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                  num_attention_heads=4, max_position_embeddings=CONTEXT, initializer_range=0.1)
    if family == "deepseek_v3":
        from transformers import DeepseekV3ForCausalLM

        return DeepseekV3ForCausalLM(deepseek_v3_config(vocab))
    if family in ("qwen3_5", "qwen3_5_moe"):  # text-only Qwen3.5 (gated DeltaNet + gated attention)
        return _qwen3_5(family, common)
    if family == "qwen3_next":
        cfg = Qwen3NextConfig(**common, num_hidden_layers=4, num_key_value_heads=2, head_dim=8,
                              shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                              linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                              linear_value_head_dim=8)
        cfg.full_attention_interval = 4  # in the released config, read by SGLang; matches layer_types here
        return Qwen3NextForCausalLM(cfg)
    raise ValueError(f"family '{family}': expected one of {', '.join(FAMILIES)}")


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
    cfg.full_attention_interval = 4  # in the released configs, read by SGLang; matches layer_types here
    return AutoModelForCausalLM.from_config(cfg)


def save_family_target(folder: Path, family: str, vocab: int, tokenizer_dir: Path | None = None,
                       seed: int = 0) -> Path:
    """A tiny random `family` target saved as an HF folder (the tokenizer files copied from `tokenizer_dir`)."""
    torch.manual_seed(seed)
    model = build_family_model(family, vocab)
    model.save_pretrained(folder)
    for path in (Path(tokenizer_dir).iterdir() if tokenizer_dir else []):
        if path.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy2(path, Path(folder) / path.name)
    return Path(folder)
