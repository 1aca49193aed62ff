"""Load any exported folder (speculators, native vLLM, SGLang) back into a head.

The verifier and the evaluation load exports, not training checkpoints, so what is tested is
what users serve. The head is rebuilt from config.json alone (as the engines do); specheads.json
only adds training-only fields and the target fingerprint.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from specheads.export.checkpoint import load_strict
from specheads.export.contract import aux_ids, config_rope, is_parallel, layer_config, validate
from specheads.export.contract_rules import (
    CONFIG_FILE, META_FILE, WEIGHTS_FILE, ContractError, Violation, contract_for, detect_format,
)
from specheads.heads.eagle3 import Eagle3Config, Eagle3Head, default_aux_layers
from specheads.target import TargetError, check_fingerprint

# engine default for norm_before_residual when config.json omits it (docs/engines.md §2.2, §2.3)
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

    def check_target(self, target, allow_missing: bool = False) -> bool:
        """Refuse a loaded `Target` whose vocabulary or embedding differs from the training target's.

        The one fingerprint policy of every verb: a specheads export without a recorded
        fingerprint is refused unless `allow_missing` (the CLI's --allow-missing-fingerprint);
        another trainer's folder never has one and is only warned about. -> whether it was checked.
        """
        if self.target is not None:
            check_fingerprint(self.target, target, f"the head exported at {self.folder}")
            return True
        if not (is_foreign(self) or allow_missing):
            raise TargetError(f"{self.folder}: {META_FILE} records no target fingerprint, so nothing shows "
                              "the head was trained for this target; export it again with specheads to "
                              "record one, or pass --allow-missing-fingerprint to use it unchecked")
        why = "was written by another trainer" if is_foreign(self) else "records no target fingerprint"
        logging.getLogger(__name__).warning(
            "%s %s: nothing to check it against the target; the verifier still checks the vocabulary, "
            "width and taps fit", self.folder, why)
        return False


def _read_json(path: Path, fmt: str = "?") -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ContractError(path.parent, fmt, [Violation(str(path), "a readable JSON file", str(err),
                                                         "point at an export folder written by specheads")]) from None


def read_export_meta(folder: str | Path) -> ExportMeta:
    """The folder's format (detected from config.json) and its specheads.json record, if any."""
    folder = Path(folder)
    record = _read_json(folder / META_FILE) if (folder / META_FILE).is_file() else {}
    if record.get("kind", "eagle3") != "eagle3" and record.get("format"):
        fmt = record["format"]  # other kinds: specheads.json names the format
    else:
        fmt = _detect(folder)
    return ExportMeta(
        folder=folder, format=fmt, kind=record.get("kind", "eagle3"), target=record.get("target"),
        head_config=record.get("head_config"), num_speculative_tokens=record.get("num_speculative_tokens"),
        serve_commands=list(record.get("serve_commands") or []), record=record,
    )


def _detect(folder: Path) -> str:
    """The EAGLE-3 format a config.json is written in."""
    try:
        return detect_format(_read_json(folder / CONFIG_FILE))
    except ValueError as err:
        if isinstance(err, ContractError):
            raise
        raise ValueError(f"{folder / CONFIG_FILE}: {err}; pass a folder written by `specheads export`") from None


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
        **parallel_from_export(cfg, trained),
    )


def parallel_from_export(cfg: dict, trained: dict) -> dict:
    """P-EAGLE fields: parallel when speculators says peagle or the native config says so."""
    if not is_parallel(cfg):
        return {}
    return {"parallel_drafting": True, "mask_token_id": cfg.get("mask_token_id", cfg.get("pard_token")),
            **{k: trained[k] for k in ("cod_ratio", "cod_min_ratio") if k in trained}}


def head_weights(weights: dict[str, torch.Tensor], config: Eagle3Config) -> dict[str, torch.Tensor]:
    """Export names -> head state-dict names (midlayer. -> layers.0.). embed_tokens.weight is the
    engines' business (the head takes embeddings as input); a full-vocabulary head (Vd == V) ships no
    d2t (identity offsets); a missing t2d is rebuilt from d2t."""
    head = {}
    for name, tensor in weights.items():
        if name.startswith("midlayer."):
            name = "layers.0." + name[len("midlayer."):]
        if name != "embed_tokens.weight":
            head[name] = tensor
    if "d2t" not in head and config.draft_vocab_size == config.vocab_size:
        head["d2t"] = torch.zeros(config.vocab_size, dtype=torch.int64)  # [V]: identity (none shipped when Vd == V)
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


def load_eagle3(meta: ExportMeta, attn_implementation: str = "sdpa", check: bool = True) -> tuple[Eagle3Head, ExportMeta]:
    """A specheads EAGLE-3 export (any of its formats) -> (head in eval mode, meta)."""
    if check:
        validate(meta.folder, meta.format, meta.kind)
    config = config_from_export(_read_json(meta.folder / CONFIG_FILE), meta.format, meta.head_config)
    head = Eagle3Head(config, attn_implementation=attn_implementation)
    tensors = head_weights(read_weights(meta.folder / WEIGHTS_FILE), config)
    load_strict(head, tensors, str(meta.folder / WEIGHTS_FILE))
    return head.eval(), meta


# --- folders written by other trainers: speculators, SpecForge / SGLang, plain vLLM ------------
# No specheads.json: the folder is read the way the engines read it (docs/engines.md §2.2,
# §2.3, §3.1), every option the head cannot run is refused by name.
LEGACY_NAMES = (("midlayer.", "layers.0."), ("aux_norm_low.", "fc_norm.0."),
                ("aux_norm_mid.", "fc_norm.1."), ("aux_norm_high.", "fc_norm.2."))
DROPPED = {"embed_tokens.weight", "t2d", "verifier_norm.weight", "verifier_lm_head.weight"}
INDEX_FILE = "model.safetensors.index.json"


class ForeignDraftError(ValueError):
    """A third-party EAGLE-3 folder this head cannot run as its engine would; says what and why."""

    def __init__(self, folder: Path, what: str):
        super().__init__(f"{folder}: {what}")


def is_foreign(meta: ExportMeta) -> bool:
    """True for an EAGLE-3 folder another trainer wrote (it has no specheads.json)."""
    return meta.kind == "eagle3" and not meta.record


def _layer_dict(cfg: dict, fmt: str, folder: Path) -> dict:
    """The decoder-layer keys: speculators' transformer_layer_config, else the top level."""
    if fmt != "vllm":
        return cfg
    if cfg.get("speculators_model_type", "eagle3") != "eagle3":
        raise ForeignDraftError(folder, f"speculators_model_type '{cfg['speculators_model_type']}': only "
                                "EAGLE-3 speculators checkpoints load as EAGLE-3 heads")
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ForeignDraftError(folder, f"{CONFIG_FILE}: transformer_layer_config is missing or not an object")
    return layer


def _resolved_layer(layer: dict, folder: Path):
    """A LlamaConfig with transformers' defaults for the keys a trainer left out (as the engines do)."""
    from transformers import LlamaConfig

    model_type = layer.get("model_type", "llama")
    if model_type != "llama":
        raise ForeignDraftError(folder, f"draft layer model_type '{model_type}': only Llama-style draft layers "
                                "(no q/k norm) load here; a qwen3 layer would run without its q_norm/k_norm")
    resolved = LlamaConfig(**{k: v for k, v in layer.items() if k not in ("model_type", "architectures")})
    if resolved.num_hidden_layers != 1:
        raise ForeignDraftError(folder, f"num_hidden_layers {resolved.num_hidden_layers}: only one-layer "
                                "EAGLE-3 drafts load here")
    if resolved.attention_bias or getattr(resolved, "mlp_bias", False):
        raise ForeignDraftError(folder, "attention_bias / mlp_bias: the head has no biases")
    return resolved


def _foreign_aux(cfg: dict, fmt: str, num_target_layers: int | None, folder: Path) -> list[int]:
    """Aux-layer ids in specheads (= vLLM) numbering; SGLang ids are one lower (docs/engines.md §1)."""
    eagle = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    if fmt == "sglang":
        if eagle.get("use_aux_hidden_state", True) is False:
            raise ForeignDraftError(folder, "eagle_config.use_aux_hidden_state is false: a draft fed only the "
                                    "final hidden state is not an EAGLE-3 head")
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        offset = contract_for("sglang", "eagle3").aux_offset  # SGLang numbering (docs/engines.md §1)
        ids = None if ids is None else [i - offset for i in ids]
    else:
        ids = cfg.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        if num_target_layers is None:
            raise ForeignDraftError(folder, "config.json names no aux layers, so the engine taps its default "
                                    "(vLLM ids [2, L//2, L-3] for an L-layer target; SGLang ids one lower): "
                                    "write them into config.json (eagle_aux_hidden_state_layer_ids; for "
                                    "SGLang inside eagle_config), or pass num_target_layers from Python")
        ids = default_aux_layers(num_target_layers)
    return [int(i) for i in ids]


def _foreign_flags(cfg: dict, fmt: str, folder: Path) -> dict:
    """norm_before_residual / norm_before_fc / fc_norm / norm_output as the engine reads them."""
    eagle = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    if cfg.get("bias"):
        raise ForeignDraftError(folder, "bias: true (a bias on fc): the head's fc has no bias")
    flags = {
        "norm_before_fc": bool(eagle.get("norm_before_fc", cfg.get("norm_before_fc", False))),
        "fc_norm": bool(cfg.get("fc_norm", cfg.get("use_aux_norm", False))),
        "norm_output": bool(cfg.get("norm_output", False)),
        # SGLang has no such option: it always keeps the raw fc output as the residual
        "norm_before_residual": False if fmt == "sglang" else bool(
            cfg.get("norm_before_residual", RESIDUAL_DEFAULT[fmt])),
    }
    if flags["norm_before_fc"] and flags["fc_norm"]:
        raise ForeignDraftError(folder, "norm_before_fc and fc_norm are both set; they exclude each other")
    return flags


def foreign_config(cfg: dict, fmt: str, folder: Path, num_target_layers: int | None = None) -> Eagle3Config:
    """Head config for a folder another trainer wrote, with the engine's defaults filled in."""
    layer = _resolved_layer(_layer_dict(cfg, fmt, folder), folder)
    hidden = layer.hidden_size
    target_hidden = cfg.get("target_hidden_size") or hidden
    if target_hidden != hidden:
        raise ForeignDraftError(folder, f"target_hidden_size {target_hidden} differs from the draft's hidden_size "
                                f"{hidden}: such drafts embed tokens with their own table, which this "
                                "verifier does not run")
    vd = cfg.get("draft_vocab_size", layer.vocab_size)
    if vd is None:
        raise ForeignDraftError(folder, "draft_vocab_size is null (the draft shares the target's lm_head); "
                                "write the target's lm_head into the folder and set draft_vocab_size to V")
    methods = (cfg.get("speculators_config") or {}).get("proposal_methods") or [{}]
    k = methods[0].get("speculative_tokens")
    rope = dict(getattr(layer, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
    return Eagle3Config(
        hidden_size=hidden, target_hidden_size=target_hidden, intermediate_size=layer.intermediate_size,
        num_attention_heads=layer.num_attention_heads,
        num_key_value_heads=layer.num_key_value_heads or layer.num_attention_heads,
        head_dim=getattr(layer, "head_dim", None) or hidden // layer.num_attention_heads,
        vocab_size=layer.vocab_size, draft_vocab_size=int(vd),
        aux_layers=_foreign_aux(cfg, fmt, num_target_layers, folder),
        max_position_embeddings=layer.max_position_embeddings, rms_norm_eps=layer.rms_norm_eps,
        rope_parameters=rope, ttt_steps=k or 3, hidden_act=layer.hidden_act, **_foreign_flags(cfg, fmt, folder),
    )


def read_foreign_weights(folder: Path) -> dict[str, torch.Tensor]:
    """model.safetensors, or every shard a model.safetensors.index.json names (never a pickle)."""
    if (folder / WEIGHTS_FILE).is_file() or not (folder / INDEX_FILE).is_file():
        return read_weights(folder / WEIGHTS_FILE)
    shards = sorted(set(_read_json(folder / INDEX_FILE).get("weight_map", {}).values()))
    out: dict[str, torch.Tensor] = {}
    for shard in shards:
        out.update(read_weights(folder / shard))
    return out


def foreign_weights(weights: dict[str, torch.Tensor], config: Eagle3Config,
                    folder: Path) -> dict[str, torch.Tensor]:
    """Third-party tensor names -> head names: `model.` prefix and legacy SpecForge names undone,
    embeddings / t2d / verifier copies dropped, d2t supplied (zeros) when the vocab is not reduced."""
    if "model.lm_head.weight" in weights:
        raise ForeignDraftError(folder, "model.lm_head.weight: SGLang silently drops an lm_head nested under "
                                "`model.`, so this folder serves without its draft head; rename it lm_head.weight")
    head = {}
    for name, tensor in weights.items():
        name = name[len("model."):] if name.startswith("model.") else name
        for old, new in LEGACY_NAMES:
            name = new + name[len(old):] if name.startswith(old) else name
        if name not in DROPPED:
            head[name] = tensor
    if "d2t" not in head:
        if config.draft_vocab_size != config.vocab_size:
            raise ForeignDraftError(folder, f"no d2t tensor but draft_vocab_size {config.draft_vocab_size} < "
                                    f"vocab_size {config.vocab_size}: the draft ids cannot be mapped to target ids")
        head["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.int64)  # [Vd]: identity offsets
    return head_weights(head, config)


def load_foreign(meta: ExportMeta, attn_implementation: str = "sdpa",
                 num_target_layers: int | None = None) -> tuple[Eagle3Head, ExportMeta]:
    """A speculators / SpecForge / plain-vLLM EAGLE-3 folder -> (head in eval mode, meta)."""
    config = foreign_config(_read_json(meta.folder / CONFIG_FILE), meta.format, meta.folder, num_target_layers)
    head = Eagle3Head(config, attn_implementation=attn_implementation)
    tensors = foreign_weights(read_foreign_weights(meta.folder), config, meta.folder)
    load_strict(head, tensors, str(meta.folder))
    meta.head_config = asdict(config)
    meta.num_speculative_tokens = meta.num_speculative_tokens or config.ttt_steps
    return head.eval(), meta
