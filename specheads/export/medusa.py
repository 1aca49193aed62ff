"""Medusa writers, contract check and loader: the original Medusa layout and vLLM <= 0.32's.

"medusa": config.json with medusa_num_heads / medusa_num_layers / base_model_name_or_path and
`medusa_lm_head.safetensors` holding `{k}.{l}.linear.{weight,bias}` (block l of head k) and
`{k}.{L}.weight` (its output layer); the original blocks always carry a bias, so a head trained
without one gets exact zeros. "vllm-0.32": `MedusaModel` (docs/engines.md §2.5) with
`blocks.{k}.layers.{l}.weight` (+ `.bias` with medusa_fc_bias) and `lm_heads.{k}.weight`.
vLLM 0.33 removed Medusa and SGLang 0.5.23 has no Medusa loader: those formats are refused.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from specheads.engine_facts import LEGACY_VLLM, SGLANG, VLLM
from specheads.export.checkpoint import load_strict
from specheads.export.contract import check_float_dtypes, check_folder, check_key_rules, found_text
from specheads.export.contract_rules import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    TensorRule,
    Violation,
    contract_for,
)
from specheads.export.keys import trained_fields
from specheads.export.load import read_json, read_weights
from specheads.export.plan import cast, head_plan
from specheads.export.readme import Readme
from specheads.heads.medusa import MedusaConfig, MedusaHead
from specheads.protocols import ExportPlan, ExportRequest

FORMATS_WRITTEN = ("medusa", "vllm-0.32")
ORIGINAL_FILE = "medusa_lm_head.safetensors"
WEIGHTS_FILES = {"medusa": ORIGINAL_FILE, "vllm-0.32": WEIGHTS_FILE}
ORIGINAL_NAME = re.compile(r"^(\d+)\.(\d+)\.(?:linear\.)?(weight|bias)$")
# format -> the config.json keys of the head's (num_heads, num_layers): written, checked and read back
SHAPE_KEYS = {"medusa": ("medusa_num_heads", "medusa_num_layers"), "vllm-0.32": ("num_heads", "num_hidden_layers")}


def check_exportable(config: MedusaConfig, fmt: str, weights: dict) -> None:
    """Both layouts hold every trained tensor (a missing bias becomes exact zeros): nothing to refuse."""


def export_tensors(weights: dict[str, torch.Tensor], fmt: str, dtype: str | None = None) -> dict[str, torch.Tensor]:
    """Head tensors under the format's names, optionally cast to `dtype`."""
    out = {name: t.detach().cpu() for name, t in weights.items()}
    if fmt == "medusa":
        out = to_original(out)
    return {n: cast(t, dtype) for n, t in out.items()}


def to_original(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our (= vLLM's) names -> the original layout; blocks without a bias get zeros [H]."""
    out = {}
    num_layers = 1 + max(int(n.split(".")[3]) for n in weights if n.startswith("blocks."))
    for name, t in weights.items():
        parts = name.split(".")
        if parts[0] == "blocks":  # blocks.{k}.layers.{l}.{weight|bias}
            out[f"{parts[1]}.{parts[3]}.linear.{parts[4]}"] = t
            bias = f"blocks.{parts[1]}.layers.{parts[3]}.bias"
            if parts[4] == "weight" and bias not in weights:
                out[f"{parts[1]}.{parts[3]}.linear.bias"] = torch.zeros(t.shape[0], dtype=t.dtype)
        else:  # lm_heads.{k}.weight
            out[f"{parts[1]}.{num_layers}.weight"] = t
    return out


def from_original(tensors: dict[str, torch.Tensor], num_layers: int, bias: bool) -> dict[str, torch.Tensor]:
    """The original layout -> head state-dict names (zero biases dropped when `bias` is false)."""
    out = {}
    for name, t in tensors.items():
        m = ORIGINAL_NAME.match(name)
        if m is None:
            raise ValueError(f"{ORIGINAL_FILE}: tensor '{name}' is not a Medusa head tensor")
        k, layer, what = m.groups()
        if int(layer) == num_layers:
            out[f"lm_heads.{k}.weight"] = t
        elif what == "weight" or bias:
            out[f"blocks.{k}.layers.{layer}.{what}"] = t
    return out


def config_json(config: MedusaConfig, fmt: str, k: int, verifier: str, verifier_archs: list[str],
                dtype: str) -> dict:
    """config.json for `fmt` (K heads; k drafts per step is recorded in specheads.json)."""
    shape = dict(zip(SHAPE_KEYS[fmt], (config.num_heads, config.num_layers)))
    if fmt == "medusa":
        return {**shape, "base_model_name_or_path": verifier, "hidden_size": config.hidden_size,
                "vocab_size": config.vocab_size, "dtype": dtype}
    return {"architectures": ["MedusaModel"], "model_type": "medusa", **shape, "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size, "truncated_vocab_size": config.vocab_size,
            "medusa_fc_bias": bool(config.bias), "original_lm_head": False, "logit_scale": 1.0,
            "dtype": dtype}


def plan(request: ExportRequest) -> ExportPlan:
    """The tensors and config.json of a Medusa export (export() writes and checks them)."""
    return head_plan(request, export_tensors, config_json, weights_file=WEIGHTS_FILES[request.fmt])


# --- contract check ----------------------------------------------------------------------------
def shape_of(cfg: dict, fmt: str) -> tuple[int, int, bool] | None:
    """(num_heads, num_layers, bias) as config.json declares them; None when keys are missing."""
    K, L = (cfg.get(key) for key in SHAPE_KEYS[fmt])
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (K, L)):
        return None
    return K, L, True if fmt == "medusa" else cfg.get("medusa_fc_bias") is True


def tensor_rules(fmt: str, K: int, L: int, bias: bool) -> list[TensorRule]:
    """Every tensor the format needs for K heads of L blocks (shapes over H and V)."""
    rules = []
    for k in range(K):
        for j in range(L):
            stem = f"{k}.{j}.linear." if fmt == "medusa" else f"blocks.{k}.layers.{j}."
            rules.append(TensorRule(stem + "weight", ("H", "H")))
            if bias:
                rules.append(TensorRule(stem + "bias", ("H",)))
        rules.append(TensorRule(f"{k}.{L}.weight" if fmt == "medusa" else f"lm_heads.{k}.weight", ("V", "H")))
    return rules


def check_tensors(specs: dict, cfg: dict, fmt: str) -> list[Violation]:
    """Required names with the config's shapes; nothing else (stray names are dropped or fatal)."""
    file, shape = WEIGHTS_FILES[fmt], shape_of(cfg, fmt)
    if shape is None:
        return []  # the key violations say what is missing
    dims = {"H": cfg.get("hidden_size"), "V": cfg.get("vocab_size")}
    rules, out = {r.name: r for r in tensor_rules(fmt, *shape)}, []
    for name, rule in rules.items():
        if name not in specs:
            out.append(Violation(f"{file}: {name}", "the tensor", "no tensor",
                                 "the loader would leave this head layer uninitialised; re-export"))
            continue
        want = tuple(dims.get(d) for d in rule.shape)
        if None not in want and tuple(specs[name][1]) != want:
            out.append(Violation(f"{file}: {name}", f"shape {list(want)} ({' x '.join(rule.shape)})",
                                 str(list(specs[name][1])), "the weights and config.json disagree; re-export"))
    for name in sorted(set(specs) - set(rules)):
        why = ("a bias while medusa_fc_bias is false: vLLM would fail on it; set medusa_fc_bias: true or "
               "remove it" if name.endswith(".bias") else "not a tensor of this layout: rename or remove it")
        out.append(Violation(f"{file}: {name}", "no such tensor", "an unexpected tensor", why))
    return out + check_float_dtypes(specs)


def check_keys(cfg: dict, fmt: str) -> list[Violation]:
    """The format's config.json key rules."""
    return check_key_rules(cfg, contract_for(fmt, "medusa").keys)


def check_against_head(cfg: dict, fmt: str, head: dict) -> list[Violation]:
    """Heads, blocks, widths and bias as trained."""
    declared = shape_of(cfg, fmt)
    out = []
    if declared is not None and declared[:2] != (head["num_heads"], head["num_layers"]):
        out.append(Violation(f"{CONFIG_FILE}: heads / layers", f"{head['num_heads']} / {head['num_layers']} "
                             "(the trained head's)", f"{declared[0]} / {declared[1]}", "export again"))
    if fmt == "vllm-0.32" and cfg.get("medusa_fc_bias") is not None and cfg.get("medusa_fc_bias") != head["bias"]:
        out.append(Violation(f"{CONFIG_FILE}: medusa_fc_bias", json.dumps(head["bias"]),
                             found_text(cfg.get("medusa_fc_bias")), "it must match training; export again"))
    for key in ("hidden_size", "vocab_size"):
        if key in cfg and cfg[key] != head[key]:
            out.append(Violation(f"{CONFIG_FILE}: {key}", f"{head[key]} (the trained head's)", found_text(cfg[key]),
                                 "export again from the checkpoint these heads came from"))
    return out


def validate(folder: str | Path, fmt: str, expected=None) -> None:
    """Check a Medusa export folder against its loader; raise ContractError listing every problem."""
    contract_for(fmt, "medusa")
    check_folder(Path(folder), fmt, WEIGHTS_FILES[fmt], expected, files=lambda folder: _check_files(folder, fmt),
                 keys=lambda cfg: check_keys(cfg, fmt),
                 against_head=lambda cfg, head: check_against_head(cfg, fmt, head),
                 tensors=lambda specs, cfg: check_tensors(specs, cfg, fmt))


def _check_files(folder: Path, fmt: str) -> list[Violation]:
    """Only the format's weights file: a loader may read any other one instead of the export."""
    return [Violation(str(p), f"only {WEIGHTS_FILES[fmt]} as weights", "an extra weights file",
                      "remove it: the loader may read it instead of the export")
            for p in sorted(folder.iterdir()) if p.name != WEIGHTS_FILES[fmt]
            and (p.suffix in {".safetensors", ".bin", ".pt", ".pth", ".pkl"} or p.name.endswith(".index.json"))]


# --- load back ---------------------------------------------------------------------------------
TRAINED = ("step_decay",)  # training-only: from specheads.json


def load_export(meta, attn_implementation: str = "sdpa", check: bool = True) -> tuple[MedusaHead, object]:
    """A Medusa export folder -> (heads in eval mode, meta); rebuilt from config.json alone."""
    fmt = meta.format
    if check:
        validate(meta.folder, fmt)
    cfg = read_json(meta.folder / CONFIG_FILE, fmt)
    K, L, bias = shape_of(cfg, fmt)
    tensors = read_weights(meta.folder / WEIGHTS_FILES[fmt])
    if fmt == "medusa":
        bias = bool((meta.head_config or {}).get("bias", True)) or any(
            bool(t.any()) for n, t in tensors.items() if n.endswith(".bias"))
        tensors = from_original(tensors, L, bias)
    config = MedusaConfig(hidden_size=cfg["hidden_size"], vocab_size=cfg["vocab_size"], num_heads=K,
                          num_layers=L, bias=bias, **trained_fields(meta.head_config, TRAINED))
    head = MedusaHead(config)
    load_strict(head, tensors, str(meta.folder / WEIGHTS_FILES[fmt]))
    return head.eval(), meta


def readme_lines(fmt: str, head: dict) -> list[str]:
    """The README's Head section."""
    bias = "with" if head["bias"] else "without"
    zeros = " (written as exact zeros: the original layout always has one)" if fmt == "medusa" and not head["bias"] else ""
    return [f"- {head['num_heads']} Medusa heads of {head['num_layers']} residual block(s), {bias} block bias{zeros}",
            f"- each head has its own output layer over the full vocabulary ({head['vocab_size']} tokens)",
            f"- {VLLM} and {SGLANG} cannot load Medusa heads; this layout is for {LEGACY_VLLM} "
            "or the original Medusa code"]


README = Readme("Medusa heads", readme_lines)
