"""EAGLE-1 writers, contract check and loader: vLLM 0.33 (`method: eagle`) and SGLang 0.5.23
(`LlamaForCausalLMEagle`), docs/engines.md §2.4 and §3.2.

Both read a Llama config and bare `fc.*` / `layers.0.*` names, no input norm on layer 0, no final
norm, no lm_head. They differ on the fc bias: vLLM builds fc without one (a trained bias would be
dropped silently, so such heads are refused), SGLang requires one (a head trained without it
gets an exact zero bias).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from specheads.engine_facts import REFUSED_OPTIONS
from specheads.export.checkpoint import load_strict
from specheads.export.contract import check_files, check_folder, check_key_rules, check_tensors, config_dims
from specheads.export.contract_rules import (
    CONFIG_FILE,
    EAGLE1_FORBIDDEN,
    LAYER_KEYS,
    WEIGHTS_FILE,
    Violation,
    contract_for,
)
from specheads.export.keys import check_decoder, check_rope, llama_layer_keys, read_decoder, trained_fields
from specheads.export.load import read_json, read_weights
from specheads.export.plan import ExportRefused, cast, head_plan
from specheads.export.readme import Readme
from specheads.heads.eagle1 import EagleConfig, EagleHead
from specheads.protocols import ExportPlan, ExportRequest

FORMATS_WRITTEN = ("vllm", "sglang")
ARCHITECTURES = {"vllm": ["LlamaForCausalLM"], "sglang": ["LlamaForCausalLMEagle"]}


def check_exportable(config: EagleConfig, fmt: str, weights: dict) -> None:
    """Refuse formats that would drop trained weights."""
    if fmt == "vllm" and "fc.bias" in weights:
        raise ExportRefused(
            f"this EAGLE-1 head was trained with fc_bias: true, but {REFUSED_OPTIONS[('vllm', 'fc_bias')]}. "
            "Export it with --format sglang, or retrain with "
            "head.fc_bias: false for vLLM.")


def export_tensors(weights: dict[str, torch.Tensor], fmt: str, dtype: str | None = None) -> dict[str, torch.Tensor]:
    """Head tensors under the engines' names; SGLang gets an exact zero fc.bias when there is none."""
    out = dict(weights)
    if fmt == "sglang" and "fc.bias" not in out:
        out["fc.bias"] = torch.zeros(out["fc.weight"].shape[0], dtype=out["fc.weight"].dtype)  # [H]
    return {n: cast(t, dtype) for n, t in out.items()}


def config_json(config: EagleConfig, fmt: str, k: int, verifier: str, verifier_archs: list[str],
                dtype: str) -> dict:
    """A Llama config.json (one decoder layer) under the engine's EAGLE-1 architecture name."""
    return {"architectures": list(ARCHITECTURES[fmt]), **llama_layer_keys(config, dtype), "tie_word_embeddings": False}


def plan(request: ExportRequest) -> ExportPlan:
    """The tensors and config.json of an EAGLE-1 export (export() writes and checks them)."""
    return head_plan(request, export_tensors, config_json)


# --- contract check ----------------------------------------------------------------------------
def check_keys(cfg: dict, contract) -> list[Violation]:
    """The format's key rules plus the Llama decoder-layer keys, all at the top level."""
    return check_key_rules(cfg, contract.keys + LAYER_KEYS)


def check_forbidden(specs: dict) -> list[Violation]:
    """EAGLE-1-specific names that must not be shipped (reported with the reason)."""
    return [Violation(f"{WEIGHTS_FILE}: {name}", "no such tensor", "an unexpected tensor", why)
            for name in sorted(specs) for pat, why in EAGLE1_FORBIDDEN if re.search(pat, name)]


def check_against_head(cfg: dict, head: dict) -> list[Violation]:
    """Sizes and RoPE agree with the trained head's config."""
    return check_decoder(cfg, head) + check_rope(cfg, head)


def validate(folder: str | Path, fmt: str, expected=None) -> None:
    """Check an EAGLE-1 export folder against its engine's loader; raise ContractError listing all."""
    contract = contract_for(fmt, "eagle")
    check_folder(Path(folder), fmt, WEIGHTS_FILE, expected, files=check_files,
                 keys=lambda cfg: check_keys(cfg, contract),
                 against_head=lambda cfg, head: check_against_head(cfg, head),
                 tensors=lambda specs, cfg: _check_tensors(specs, cfg, contract))


def _check_tensors(specs: dict, cfg: dict, contract) -> list[Violation]:
    """The forbidden tensors, then the contract's tensors (a forbidden one reported once)."""
    forbidden = check_forbidden(specs)
    named = {v.where for v in forbidden}
    return forbidden + [v for v in check_tensors(specs, config_dims(cfg, contract), contract) if v.where not in named]


# --- load back ---------------------------------------------------------------------------------
TRAINED = ("fc_bias", "ttt_steps", "step_decay", "cls_weight", "noise")  # training-only: from specheads.json


def config_from_export(cfg: dict, trained: dict | None = None) -> EagleConfig:
    """Rebuild the head config from config.json; `trained` supplies only training-only fields."""
    return EagleConfig(**read_decoder(cfg), **trained_fields(trained, TRAINED))


def load_export(meta, attn_implementation: str = "sdpa", check: bool = True) -> tuple[EagleHead, object]:
    """An EAGLE-1 export folder -> (head in eval mode, meta). A zero SGLang fc.bias is dropped
    again when the head was trained without one."""
    if check:
        validate(meta.folder, meta.format)
    config = config_from_export(read_json(meta.folder / CONFIG_FILE, meta.format), meta.head_config)
    tensors = read_weights(meta.folder / WEIGHTS_FILE)
    bias = tensors.get("fc.bias")
    if bias is not None and not config.fc_bias:
        if bool(bias.any()):
            config.fc_bias = True  # a bias the engine will use: keep it
        else:
            tensors.pop("fc.bias")
    tensors.pop("embed_tokens.weight", None)  # the target's embedding is used
    head = EagleHead(config, attn_implementation=attn_implementation)
    load_strict(head, tensors, str(meta.folder / WEIGHTS_FILE))
    return head.eval(), meta


def readme_lines(fmt: str, head: dict) -> list[str]:
    """The README's Head section."""
    bias = "trained with an fc bias" if head["fc_bias"] else (
        "no fc bias (SGLang gets an exact zero `fc.bias`)" if fmt == "sglang" else "no fc bias")
    return [f"- EAGLE-1: fc over [embedding ; final-normed target state], one decoder layer without "
            f"input norm, the target's lm_head; {bias}",
            f"- hidden size {head['hidden_size']}, trained for {head['ttt_steps']} draft step(s)"]


README = Readme("EAGLE-1 draft", readme_lines)
