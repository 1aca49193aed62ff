"""Load any exported folder (speculators, native vLLM, SGLang) back into a head.

The verifier and the evaluation load exports, not training checkpoints, so what is tested is
what users serve. The head is rebuilt from config.json alone (as the engines do); specheads.json
only adds training-only fields and the target fingerprint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from specheads.export.checkpoint import load_strict
from specheads.export.contract import aux_ids, config_rope, layer_config, validate
from specheads.export.contract_rules import (
    CONFIG_FILE, META_FILE, WEIGHTS_FILE, ContractError, Violation, contract_for, detect_format,
)
from specheads.heads.eagle3 import Eagle3Config, Eagle3Head

# engine default for norm_before_residual when config.json omits it (vllm_contract.md §3.1, §7.2)
RESIDUAL_DEFAULT = {"vllm": True, "vllm-native": False, "sglang": False}


@dataclass
class ExportMeta:
    """What an export says about itself: format, the target it was trained for, how to serve it."""

    folder: Path
    format: str
    kind: str
    target: dict | None  # the training target's fingerprint (Target.fingerprint), None if unrecorded
    head_config: dict | None
    num_speculative_tokens: int | None
    serve_commands: list[str] = field(default_factory=list)
    record: dict = field(default_factory=dict)  # the whole specheads.json

    def check_target(self, target) -> None:
        """Refuse a loaded `Target` whose vocabulary or embedding differs from the training target's."""
        from specheads.target import TargetError, check_fingerprint

        if self.target is None:
            raise TargetError(f"{self.folder}: no target fingerprint recorded ({META_FILE} missing); "
                              "export the head again with specheads to record it")
        check_fingerprint(self.target, target, f"the head exported at {self.folder}")


def _read_json(path: Path, fmt: str = "?") -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ContractError(path.parent, fmt, [Violation(str(path), "a readable JSON file", str(err),
                                                         "point at an export folder written by specheads")]) from None


def read_export_meta(folder: str | Path) -> ExportMeta:
    """The folder's format (detected from config.json) and its specheads.json record, if any."""
    folder = Path(folder)
    try:
        fmt = detect_format(_read_json(folder / CONFIG_FILE))
    except ValueError as err:
        if isinstance(err, ContractError):
            raise
        raise ValueError(f"{folder / CONFIG_FILE}: {err}; pass a folder written by `specheads export`") from None
    record = _read_json(folder / META_FILE, fmt) if (folder / META_FILE).is_file() else {}
    return ExportMeta(
        folder=folder, format=fmt, kind=record.get("kind", "eagle3"), target=record.get("target"),
        head_config=record.get("head_config"), num_speculative_tokens=record.get("num_speculative_tokens"),
        serve_commands=list(record.get("serve_commands") or []), record=record,
    )


def config_from_export(cfg: dict, fmt: str, trained: dict | None = None) -> Eagle3Config:
    """Rebuild the head config from config.json in `fmt` (aux ids back to specheads numbering).
    `trained` (specheads.json head_config) supplies only the training-only fields."""
    contract, trained = contract_for(fmt, "eagle3"), trained or {}
    layer = layer_config(cfg, contract)
    hidden, heads = layer["hidden_size"], layer["num_attention_heads"]
    k = cfg.get("speculators_config", {}).get("proposal_methods", [{}])[0].get("speculative_tokens")
    return Eagle3Config(
        hidden_size=hidden,
        target_hidden_size=cfg.get("target_hidden_size", hidden),
        intermediate_size=layer["intermediate_size"],
        num_attention_heads=heads,
        num_key_value_heads=layer.get("num_key_value_heads", heads),
        head_dim=layer.get("head_dim") or hidden // heads,
        vocab_size=layer["vocab_size"],
        draft_vocab_size=cfg["draft_vocab_size"],
        aux_layers=[i - contract.aux_offset for i in aux_ids(cfg, contract)],
        max_position_embeddings=layer["max_position_embeddings"],
        rms_norm_eps=layer.get("rms_norm_eps", 1e-5),
        rope_parameters=config_rope(layer) or {"rope_type": "default", "rope_theta": 10000.0},
        norm_before_residual=bool(cfg.get("norm_before_residual", RESIDUAL_DEFAULT[fmt])),
        ttt_steps=trained.get("ttt_steps", k or 3),
        step_decay=trained.get("step_decay", 0.8),
        hidden_act=layer.get("hidden_act", "silu"),
    )


def head_weights(weights: dict[str, torch.Tensor], config: Eagle3Config) -> dict[str, torch.Tensor]:
    """Export names -> head state-dict names (midlayer. -> layers.0.). embed_tokens.weight is the
    engines' business (the head takes embeddings as input); a missing t2d is rebuilt from d2t."""
    head = {}
    for name, tensor in weights.items():
        if name.startswith("midlayer."):
            name = "layers.0." + name[len("midlayer."):]
        if name != "embed_tokens.weight":
            head[name] = tensor
    if "t2d" not in head and "d2t" in head:
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)  # [V]
        t2d[torch.arange(config.draft_vocab_size) + head["d2t"]] = True
        head["t2d"] = t2d
    return head


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise ContractError(path.parent, "?", [Violation(str(path), "a readable safetensors file", str(err),
                                                         "the file is truncated or corrupt; export again")]) from None


def load_with_meta(folder: str | Path, attn_implementation: str = "sdpa",
                   check: bool = True) -> tuple[Eagle3Head, ExportMeta]:
    """An export folder -> (head in eval mode, its ExportMeta). `check` validates the contract first."""
    meta = read_export_meta(folder)
    if meta.kind != "eagle3":
        raise ValueError(f"{meta.folder}: head kind '{meta.kind}' cannot be loaded by this specheads version")
    if check:
        validate(meta.folder, meta.format, meta.kind)
    config = config_from_export(_read_json(meta.folder / CONFIG_FILE), meta.format, meta.head_config)
    head = Eagle3Head(config, attn_implementation=attn_implementation)
    tensors = head_weights(read_weights(meta.folder / WEIGHTS_FILE), config)
    load_strict(head, tensors, str(meta.folder / WEIGHTS_FILE))
    return head.eval(), meta


def load(folder: str | Path, attn_implementation: str = "sdpa", check: bool = True) -> Eagle3Head:
    """An export folder -> the head (see `load_with_meta` for the target fingerprint)."""
    return load_with_meta(folder, attn_implementation, check)[0]
