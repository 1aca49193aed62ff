"""Draft-model export: an ordinary HF folder (config.json, model.safetensors, the target's tokenizer
files) that AutoModelForCausalLM, vLLM (`method: draft_model`) and SGLang (`STANDALONE`) load.

Both engines require the target's vocabulary size and tokenizer (docs/engines.md §2.7,
§3.4); the check compares the exported tokenizer with the training fingerprint.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specheads.export.contract import check_key_rules, read_config, read_tensor_specs
from specheads.export.contract_rules import (
    CONFIG_FILE,
    DRAFT_KEYS,
    META_FILE,
    WEIGHTS_FILE,
    ContractError,
    Violation,
)
from specheads.export.keys import trained_fields
from specheads.export.plan import cast, float_dtype, target_folder
from specheads.export.readme import Readme
from specheads.heads.draft import DraftConfig, DraftHead
from specheads.protocols import ExportPlan, ExportRequest
from specheads.target import tokenizer_hash

FORMATS_WRITTEN = ("vllm", "sglang")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "tokenizer.model", "generation_config.json")


def check_exportable(config: DraftConfig, fmt: str, weights=None) -> None:
    """Every engine loads a plain Llama LM: nothing to refuse beyond the format itself."""


def model_tensors(head: DraftHead, dtype: str | None) -> dict[str, torch.Tensor]:
    """HF names (model.layers.*, lm_head.weight) -> tensors, optionally cast."""
    return {name: cast(t, dtype) for name, t in head.model.state_dict().items()}


def plan(request: ExportRequest) -> ExportPlan:
    """The draft LM as an HF folder: its weights, a Llama config.json and the target's tokenizer files."""
    src = target_folder(request.ckpt, request.verifier, "a draft model ships the target's tokenizer")
    tensors = model_tensors(request.head, request.dtype)
    config = {**request.head.config.model_config, "architectures": ["LlamaForCausalLM"], "dtype": float_dtype(tensors)}
    return ExportPlan(config=config, tensors=tensors,
                      copies={name: src / name for name in TOKENIZER_FILES if (src / name).is_file()})


# --- the contract -------------------------------------------------------------------------------
def validate(folder, fmt: str, expected=None) -> None:
    """Config keys, every tensor of the config's model with its shape, the target's vocabulary and
    tokenizer (vs specheads.json); raise ContractError listing every violation."""
    folder, problems = Path(folder), []
    cfg = read_config(folder, problems)
    specs = read_tensor_specs(folder / WEIGHTS_FILE, problems)
    record = _record(folder)
    if cfg is not None:
        problems += check_key_rules(cfg, DRAFT_KEYS)
        problems += _check_target(cfg, record)
        problems += _check_tokenizer(folder, record)
    if cfg is not None and specs is not None and not problems:
        problems += _check_tensors(cfg, specs)
    if problems:
        raise ContractError(folder, fmt, problems)


def _record(folder: Path) -> dict:
    try:
        return json.loads((folder / META_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _check_target(cfg: dict, record: dict) -> list[Violation]:
    target = record.get("target") or {}
    if "vocab_size" in target and cfg.get("vocab_size") != target["vocab_size"]:
        return [Violation(f"{CONFIG_FILE}: vocab_size", f"{target['vocab_size']} (the target's)", str(cfg.get("vocab_size")),
                          "vLLM and SGLang refuse a draft whose vocabulary size differs from the target's")]
    return []


def _check_tokenizer(folder: Path, record: dict) -> list[Violation]:
    """The shipped tokenizer loads and is the target's (same token -> id map)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError) as err:
        return [Violation("tokenizer files", "the target's tokenizer", f"none that loads ({str(err)[:80]})",
                          "copy the target's tokenizer files into the folder")]
    want = (record.get("target") or {}).get("tokenizer_sha256")
    if want and tokenizer_hash(tok) != want:
        return [Violation("tokenizer files", "the target's tokenizer (training fingerprint)", "a different vocabulary",
                          "both engines need the target's tokenizer; copy the target's files")]
    return []


def _check_tensors(cfg: dict, specs: dict) -> list[Violation]:
    """Exactly the parameters of the config's LlamaForCausalLM, with their shapes, in one float dtype."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}))
    want = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    out = []
    for name in sorted(set(want) | set(specs)):
        got = specs.get(name)
        if name not in want:
            out.append(Violation(f"{WEIGHTS_FILE}: {name}", "no such tensor", str(got[1]), "not a parameter of this model"))
        elif got is None or got[1] != want[name]:
            out.append(Violation(f"{WEIGHTS_FILE}: {name}", f"shape {list(want[name])}", str(got and list(got[1])),
                                 "the weights and config.json disagree; export again"))
    floats = {d for d, _ in specs.values()}
    if len(floats) > 1 or not floats <= {"F32", "BF16", "F16"}:
        out.append(Violation(WEIGHTS_FILE, "one floating dtype", ", ".join(sorted(floats)), "export with one dtype"))
    return out


# --- loading back -------------------------------------------------------------------------------
TRAINED = ("ttt_steps", "init_from_target")  # training-only: from specheads.json


def load_export(meta, attn_implementation: str = "sdpa", check: bool = True):
    """A draft-model folder -> (DraftHead in eval mode, meta), through AutoModelForCausalLM."""
    from transformers import AutoModelForCausalLM

    if check:
        validate(meta.folder, meta.format)
    model = AutoModelForCausalLM.from_pretrained(meta.folder, dtype=torch.float32,
                                                 attn_implementation=attn_implementation)
    cfg = json.loads((meta.folder / CONFIG_FILE).read_text())
    config = DraftConfig(model_config={k: v for k, v in cfg.items() if k not in ("architectures", "dtype")},
                         vocab_size=cfg["vocab_size"], **trained_fields(meta.head_config, TRAINED))
    return DraftHead(config, model=model).eval(), meta


def readme_lines(fmt: str, head: dict) -> list[str]:
    """The README's Head section."""
    m = head["model_config"]
    return [f"- Llama draft: {m['num_hidden_layers']} layer(s), hidden size {m['hidden_size']}, "
            f"the target's tokenizer and vocabulary ({head['vocab_size']} tokens)"]


README = Readme("Draft model", readme_lines)
