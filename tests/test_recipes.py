"""Every real-target recipe validates, names its launch command, and trains + exports on a tiny
random model of its target's architecture family with its own settings scaled down."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from specheads.config import load_recipe, to_dict
from specheads.export import export
from specheads.train import train

ROOT = Path(__file__).resolve().parent.parent
# recipe folders for real targets (demo.yaml files are the tiny demos)
REAL = ("eagle3", "medusa", "mtp", "dflash", "dspark", "peagle")
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
FAMILIES = {  # recipe -> (transformers config class, extra tiny-size kwargs)
    "eagle3/llama3.1-8b-instruct.yaml": ("LlamaConfig", {}),
    "eagle3/llama3.3-70b-instruct.yaml": ("LlamaConfig", {}),
    "eagle3/qwen3-8b.yaml": ("Qwen3Config", {"head_dim": 16}),
    "eagle3/qwen3-30b-a3b.yaml": ("Qwen3MoeConfig", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                                     "moe_intermediate_size": 32}),
    "eagle3/smollm2-135m-cpu.yaml": ("LlamaConfig", {}),
    "eagle3/gpt-oss-20b.yaml": ("GptOssConfig", {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                                                 "sliding_window": 16}),
    "medusa/vicuna-7b.yaml": ("LlamaConfig", {}),
    "dflash/qwen3-8b.yaml": ("Qwen3Config", {"head_dim": 16}),
    "dflash/llama3.1-8b-instruct.yaml": ("LlamaConfig", {}),
    "dflash/smollm2-135m-cpu.yaml": ("LlamaConfig", {}),
    "dspark/smollm2-135m-cpu.yaml": ("LlamaConfig", {}),
    "peagle/qwen3-8b.yaml": ("Qwen3Config", {"head_dim": 16}),
    "mtp/deepseek-v3.yaml": ("DeepseekV3Config", {"num_key_value_heads": 4,
        "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": 32,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16}),
}


def _real_recipes() -> list[str]:
    return sorted(str(p.relative_to(ROOT / "recipes")) for d in REAL for p in (ROOT / "recipes" / d).glob("*.yaml")
                  if p.name != "demo.yaml")


def test_every_real_recipe_has_a_family():
    assert _real_recipes() == sorted(FAMILIES)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_recipe_validates_and_names_its_launch_command(name):
    path = ROOT / "recipes" / name
    recipe = load_recipe(path)
    header = "".join(line for line in path.read_text().splitlines(keepends=True) if line.startswith("#"))
    if name.endswith("-cpu.yaml"):  # CPU recipes: a single-process launch, fp32, the choices explained
        assert f"specheads train recipes/{name}" in header and "Choices" in header
        assert recipe.target.dtype == "float32" and recipe.train.mixed_precision == "no"
        return
    assert f"-m specheads.train \\\n#       recipes/{name}" in header, "launch command missing from the header"
    config_file = header.split("--config_file ")[1].split()[0]
    assert (ROOT / config_file).is_file()
    assert "Memory" in header and "Hyper-parameters" in header
    assert recipe.train.mixed_precision == "bf16" and recipe.target.dtype == "bfloat16"


def _tiny_target(family: str, extra: dict, tokenizer_dir: Path, out: Path) -> Path:
    """A random model of the family, sized like the test target, saved with its tokenizer."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = getattr(transformers, family)(**{**TINY, **extra, "vocab_size": len(tok)})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _scaled(recipe, target: Path, data: Path, out: Path) -> list[str]:
    """The recipe's own head, schedule and loss settings; sizes, steps and precision for a CPU."""
    head = to_dict(recipe.head)
    over = {"target.path": target, "target.dtype": "float32", "data.train": f"[{data / 'train.jsonl'}]",
            "data.max_length": 64, "train.output_dir": out, "train.max_steps": 2, "train.batch_size": 2,
            "train.grad_accum": min(2, recipe.train.grad_accum), "train.warmup_steps": 1,
            "train.log_every": 1, "train.save_every": 2, "train.val_samples": 4, "train.val_every": 2,
            "train.mixed_precision": "no", "train.report_to": "[]", "train.progress": "false"}
    if head.get("draft_vocab_size"):
        over["head.draft_vocab_size"] = 256
    if head.get("intermediate_size"):
        over["head.intermediate_size"] = TINY["intermediate_size"]
    for key in ("mask_token_id", "target_layer_ids"):  # real-target ids do not exist in the tiny model
        if head.get(key) is not None:
            over[f"head.{key}"] = "null"
    if head.get("init") == "shipped":  # a random model ships no MTP layers to fine-tune
        over["head.init"] = "last_layer"
    return [f"{k}={v}" for k, v in over.items()]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_recipe_smoke_trains_and_exports(name, tiny_target_dir, demo_data_dir, tmp_path):
    family, extra = FAMILIES[name]
    target = _tiny_target(family, extra, tiny_target_dir, tmp_path / "target")
    path = ROOT / "recipes" / name
    recipe = load_recipe(path, _scaled(load_recipe(path), target, demo_data_dir, tmp_path / "run"))
    ckpt = train(recipe)
    assert ckpt.name == "checkpoint-000002"
    assert "val_tau" in yaml.safe_load((ckpt / "trainer_state.json").read_text())
    for fmt in recipe.export.formats:
        assert (export(ckpt, fmt, tmp_path / "export" / fmt) / "config.json").is_file()
