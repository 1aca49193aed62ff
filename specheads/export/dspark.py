"""DSpark writers, contract check and loader: the speculators `dspark` format (vLLM 0.33), vLLM's
native `Qwen3DSparkModel` (`method: dspark`) and SGLang 0.5.23 (`DSPARK`). docs/dspark_format.md.

The folder is a DFlash folder (export/dflash.py writes its backbone: Qwen3 stack keys, `fc`,
`hidden_norm`, `layers.*`, `norm`, no embedding) with `architectures: ["Qwen3DSparkModel"]`, the
engines' block size G (the drafted tokens) and the Markov / confidence heads under the engines' bare
names (`markov_head.*`, `confidence_head.*`, the latter float32). The readers' defaults disagree
(sample_from_anchor: true for vLLM native and SGLang, false for speculators; confidence_head_with_markov),
so every field is written; `sample_from_anchor` says the head's layout (heads/dspark.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specheads.engine_facts import DSPARK_REFUSED, SGLANG, VLLM
from specheads.export import dflash
from specheads.export.checkpoint import load_strict
from specheads.export.contract import MISSING, check_key_rules, found_text, get_key, is_int
from specheads.export.contract_rules import CONFIG_FILE, FLOAT_DTYPES, WEIGHTS_FILE, KeyRule, Violation
from specheads.export.load import read_json, read_weights
from specheads.export.plan import ExportRefused, cast, float_dtype
from specheads.export.readme import Readme
from specheads.heads.dspark import HEAD_FIELDS, MARKOV_TYPES, DSparkConfig, DSparkHead
from specheads.protocols import ExportPlan, ExportRequest

FORMATS_WRITTEN = ("vllm", "vllm-native", "sglang")
ARCHITECTURE = "Qwen3DSparkModel"
BACKBONE = "dflash."  # the DFlash part's prefix in the head's state dict (not in the folder)
MARKOV, CONFIDENCE = "markov_head.", "confidence_head."
VANILLA_FORMATS = ("vllm", "vllm-native")  # vLLM builds only the vanilla Markov head


def check_exportable(config: DSparkConfig, fmt: str, weights: dict) -> None:
    """vLLM: the vanilla Markov head only; SGLang: the target's vocabulary only (engine_facts.DSPARK_REFUSED)."""
    if fmt in VANILLA_FORMATS and config.markov_head_type != "vanilla":
        raise ExportRefused(f"this DSpark head has a '{config.markov_head_type}' Markov head: "
                            + DSPARK_REFUSED[(fmt, "markov_head_type")])
    if fmt == "sglang" and config.own_lm_head:
        raise ExportRefused(f"this DSpark head has its own reduced vocabulary ({config.draft_vocab_size} of "
                            f"{config.vocab_size} tokens): " + DSPARK_REFUSED[("sglang", "draft_vocab_size")])


def export_tensors(weights: dict[str, torch.Tensor], fmt: str, dtype: str | None = None) -> dict[str, torch.Tensor]:
    """The backbone as DFlash writes it (the `dflash.` prefix stripped), the Markov head in `dtype`,
    the confidence head in float32 (both engines hold it so)."""
    backbone = {name[len(BACKBONE):]: t for name, t in weights.items() if name.startswith(BACKBONE)}
    heads = {name: cast(t, "float32" if name.startswith(CONFIDENCE) else dtype)
             for name, t in weights.items() if not name.startswith(BACKBONE)}
    return {**dflash.export_tensors(backbone, fmt, dtype), **heads}


def dspark_keys(config: DSparkConfig) -> dict:
    """The DSpark fields every format writes at the top level."""
    return {
        "block_size": config.block_size,  # G drafted tokens (the engines' block_size / gamma)
        "mask_token_id": config.dflash.mask_token_id,
        "markov_rank": config.markov_rank,
        "markov_head_type": config.markov_head_type,
        "enable_confidence_head": bool(config.enable_confidence_head),
        "confidence_head_with_markov": bool(config.confidence_head_with_markov),
        "sample_from_anchor": bool(config.sample_from_anchor),  # the head's block layout
    }


def native_config(config: DSparkConfig, dtype: str) -> dict:
    """vLLM native and SGLang: DFlash's native config as Qwen3DSparkModel, ids also at the top level."""
    base = dflash.native_config(config.dflash, dtype)
    return {**base, "architectures": [ARCHITECTURE], **dspark_keys(config),
            "target_layer_ids": list(config.dflash.target_layer_ids), "logit_scale": 1.0,
            "dflash_config": {**base["dflash_config"], "block_size": config.block_size,
                              "sample_from_anchor": bool(config.sample_from_anchor)}}


def speculators_config(config: DSparkConfig, k: int, verifier: str, verifier_archs: list[str], dtype: str) -> dict:
    """speculators `dspark` (vLLM algos.py update_dspark): causality in the layer config, which vLLM
    starts from (its dspark translation reads no sliding_window_non_causal)."""
    base = dflash.speculators_config(config.dflash, k, verifier, verifier_archs, dtype)
    base.pop("sliding_window_non_causal")
    layers = {**base["transformer_layer_config"], "is_causal": bool(config.dflash.causal)}
    return {**base, "architectures": [ARCHITECTURE], "speculators_model_type": "dspark", **dspark_keys(config),
            "use_aux_hidden_state": True, "transformer_layer_config": layers,
            "speculators_config": {**base["speculators_config"], "algorithm": "dspark"}}


def config_json(config: DSparkConfig, fmt: str, k: int, verifier: str, verifier_archs: list[str],
                dtype: str) -> dict:
    return dflash.block_config(fmt, k, config.block_size, lambda: speculators_config(config, k, verifier, verifier_archs,
                                                                                     dtype), lambda: native_config(config, dtype))


def plan(request: ExportRequest) -> ExportPlan:
    """The tensors and config.json of a DSpark export; config.json names the backbone's dtype."""
    tensors = export_tensors(request.ckpt.weights, request.fmt, request.dtype)
    backbone = {name: t for name, t in tensors.items() if not name.startswith(CONFIDENCE)}
    target = request.target
    return ExportPlan(config=config_json(request.head.config, request.fmt, request.k, target.config_name,
                                         target.architectures, float_dtype(backbone)), tensors=tensors)


# --- contract --------------------------------------------------------------------------------
def _markov_rules(fmt: str) -> tuple[KeyRule, ...]:
    vanilla = fmt in VANILLA_FORMATS
    return (
        KeyRule("architectures", "equals", [ARCHITECTURE], fix="both engines register Qwen3DSparkModel"),
        KeyRule("block_size", "positive_int", fix="G, the drafted tokens per block (SGLang's gamma)"),
        KeyRule("mask_token_id", "nonneg_int", fix="the engines fill masked slots with this id"),
        KeyRule("sample_from_anchor", "bool",
                fix="write the head's layout: vLLM native and SGLang default to true (anchor-as-first), "
                    "speculators to false (the fill-in layout [anchor, mask x G])"),
        KeyRule("markov_rank", "positive_int", fix="both engines refuse markov_rank <= 0"),
        KeyRule("markov_head_type", "one_of", ("vanilla",) if vanilla else MARKOV_TYPES,
                fix=f"{VLLM} runs the vanilla Markov head only" if vanilla else
                f"{SGLANG} requires markov_head_type when markov_rank > 0"),
        KeyRule("enable_confidence_head", "bool", fix="write it explicitly (vLLM: default false)"),
        KeyRule("confidence_head_with_markov", "bool",
                fix="write it explicitly: vLLM defaults to false, SGLang to markov_rank > 0"),
    )


def _without(rules, keys) -> tuple[KeyRule, ...]:
    return tuple(r for r in rules if r.key not in keys)


NATIVE_KEYS = {fmt: _without(dflash.NATIVE_KEYS, ("architectures", "block_size", "dflash_config.sample_from_anchor"))
    + _markov_rules(fmt) + (
    KeyRule("target_layer_ids", "id_list", 0, "DFlash numbering, the same list as dflash_config.target_layer_ids"),
    KeyRule("dflash_config.block_size", "positive_int", fix="SGLang takes gamma from it: write G"),
    KeyRule("logit_scale", "equals", 1.0, fix="vLLM scales the base logits and the Markov bias by it"),
) for fmt in ("vllm-native", "sglang")}
SPECULATORS_KEYS = _without(dflash.SPECULATORS_KEYS, (
    "speculators_model_type", "sliding_window_non_causal", "sample_from_anchor")) + _markov_rules("vllm") + (
    KeyRule("speculators_model_type", "equals", "dspark"),
    KeyRule("transformer_layer_config.is_causal", "bool",
            fix="vLLM's dspark translation reads no sliding_window_non_causal: state the block attention here"),
)


def dflash_view(cfg: dict, fmt: str) -> dict:
    """config.json as DFlash's reader takes the same backbone: a block of the query slots (anchor + G
    fill-in, G anchor-as-first), and (speculators) causality as `sliding_window_non_causal`."""
    view = dict(cfg)
    if is_int(cfg.get("block_size")):
        view["block_size"] = cfg["block_size"] + (0 if cfg.get("sample_from_anchor") is True else 1)
    causal = get_key(cfg, "transformer_layer_config.is_causal")
    if fmt == "vllm" and isinstance(causal, bool):
        view["sliding_window_non_causal"] = not causal
    return view


def check_keys(cfg: dict, fmt: str) -> list[Violation]:
    rules = SPECULATORS_KEYS if fmt == "vllm" else NATIVE_KEYS[fmt]
    out = check_key_rules(cfg, rules, checks=dflash.CHECKS) + dflash._check_consistency(dflash_view(cfg, fmt), fmt)
    if fmt != "vllm":
        for key in ("target_layer_ids", "mask_token_id", "block_size", "sample_from_anchor"):
            inner = get_key(cfg, f"dflash_config.{key}")
            if cfg.get(key, MISSING) is not MISSING and inner is not MISSING and cfg.get(key) != inner:
                out.append(Violation(f"{CONFIG_FILE}: {key}", f"the same value as dflash_config.{key} ({found_text(inner)})",
                                     found_text(cfg.get(key)), "the engines read one or the other; make them agree"))
    return out


def check_against_head(cfg: dict, fmt: str, head: dict) -> list[Violation]:
    """The backbone as DFlash checks it, then the Markov and confidence fields against the trained head."""
    out = dflash.check_against_head(dflash_view(cfg, fmt), fmt, head["dflash"])
    trained = {**head, "sample_from_anchor": bool(head.get("sample_from_anchor", False))}
    for key in (*HEAD_FIELDS, "sample_from_anchor"):
        value, want = cfg.get(key, MISSING), trained[key]
        if value is not MISSING and value != want:
            out.append(Violation(f"{CONFIG_FILE}: {key}", f"{json.dumps(want)} (the trained head's)",
                                 found_text(value), "export again from the checkpoint this head came from"))
    return out


def head_shapes(cfg: dict, fmt: str) -> dict[str, tuple[tuple[int, ...], str]] | None:
    """Markov / confidence tensor -> (shape, dtype) this config defines; None when a size is unknown."""
    s = dflash.stack_of(cfg, fmt)
    H, V, r = s.get("hidden_size"), s.get("vocab_size"), cfg.get("markov_rank")
    Vd = cfg.get("draft_vocab_size", V)
    if not all(is_int(x) for x in (H, V, r, Vd)):
        return None
    shapes = {MARKOV + "markov_w1.weight": ((V, r), "float"), MARKOV + "markov_w2.weight": ((Vd, r), "float")}
    kind = cfg.get("markov_head_type")
    if kind == "gated":
        shapes.update({MARKOV + "gate_proj.weight": ((r, H + r), "float"), MARKOV + "gate_proj.bias": ((r,), "float")})
    elif kind == "rnn":
        shapes.update({MARKOV + "joint_proj.weight": ((3 * r, 2 * r + H), "float"),
                       MARKOV + "joint_proj.bias": ((3 * r,), "float")})
    if cfg.get("enable_confidence_head") is True:
        width = H + (r if cfg.get("confidence_head_with_markov") is True else 0)
        shapes.update({CONFIDENCE + "proj.weight": ((1, width), "F32"), CONFIDENCE + "proj.bias": ((1,), "F32")})
    return shapes


def check_tensors(specs: dict, cfg: dict, fmt: str) -> list[Violation]:
    """The backbone's tensors by DFlash's rules; the heads' names, shapes and dtypes as the engines load them."""
    backbone = {n: v for n, v in specs.items() if not n.startswith((MARKOV, CONFIDENCE))}
    out = dflash.check_tensors(backbone, dflash_view(cfg, fmt), fmt)
    shapes = head_shapes(cfg, fmt)
    if shapes is None:
        return out  # the size keys are reported by check_keys
    floats = {d for d, _ in backbone.values() if d in FLOAT_DTYPES}
    for name, (shape, dtype) in shapes.items():
        where = f"{WEIGHTS_FILE}: {name}"
        if name not in specs:
            out.append(Violation(where, "the tensor", "no tensor", "SGLang refuses a checkpoint without it, vLLM "
                                 "leaves it uninitialised (or drops the confidence head); re-export"))
            continue
        found_dtype, found_shape = specs[name]
        if dtype == "F32" and found_dtype != "F32":
            out.append(Violation(where, "dtype F32", found_dtype, "both engines hold the confidence head in float32"))
        if dtype == "float" and (found_dtype not in FLOAT_DTYPES or (floats and found_dtype not in floats)):
            out.append(Violation(where, f"the backbone's dtype ({', '.join(sorted(floats))})", found_dtype,
                                 "export with one dtype"))
        if tuple(found_shape) != shape:
            out.append(Violation(where, f"shape {list(shape)} (from config.json)", str(list(found_shape)),
                                 "the weights and config.json disagree; re-export"))
    for name in sorted(n for n in specs if n.startswith((MARKOV, CONFIDENCE)) and n not in shapes):
        out.append(Violation(f"{WEIGHTS_FILE}: {name}", "no such tensor", "an unexpected tensor",
                             "not a tensor of this config's heads: SGLang raises 'DSpark unexpected markov weight', "
                             "vLLM fails on it or drops it; remove it"))
    return out


def validate(folder: str | Path, fmt: str, expected=None) -> None:
    """Check a DSpark export folder against its engine's loader; raise ContractError listing all."""
    dflash.check_format(folder, fmt, expected, check_keys, check_against_head, check_tensors)


# --- load back ---------------------------------------------------------------------------------
def config_from_export(cfg: dict, fmt: str, trained: dict | None = None) -> DSparkConfig:
    """Rebuild the head config from config.json; `trained` supplies only training-only fields."""
    trained = trained or {}
    return DSparkConfig(
        dflash=dflash.config_from_export(dflash_view(cfg, fmt), fmt, trained.get("dflash")),
        markov_rank=cfg["markov_rank"], markov_head_type=cfg["markov_head_type"],
        enable_confidence_head=bool(cfg["enable_confidence_head"]),
        confidence_head_with_markov=bool(cfg["confidence_head_with_markov"]),
        confidence_loss_weight=trained.get("confidence_loss_weight", 1.0),
        sample_from_anchor=cfg.get("sample_from_anchor") is True,
    )


def load_export(meta, attn_implementation: str = "sdpa", check: bool = True) -> tuple[DSparkHead, object]:
    """A DSpark export folder -> (head in eval mode, meta)."""
    if check:
        validate(meta.folder, meta.format)
    return load_config(meta, read_json(meta.folder / CONFIG_FILE, meta.format), attn_implementation)


def load_config(meta, cfg: dict, attn_implementation: str = "sdpa") -> tuple[DSparkHead, object]:
    """The head that config.json's dict `cfg` describes, with the folder's weights (see dflash.load_config)."""
    config = config_from_export(cfg, meta.format, meta.head_config)
    tensors = read_weights(meta.folder / WEIGHTS_FILE)
    backbone = dflash.with_t2d(config.dflash, {n: t for n, t in tensors.items() if not n.startswith((MARKOV, CONFIDENCE))})
    head = DSparkHead(config, attn_implementation=attn_implementation)
    state = {**{BACKBONE + n: t for n, t in backbone.items()},
             **{n: t for n, t in tensors.items() if n.startswith((MARKOV, CONFIDENCE))}}
    load_strict(head, state, str(meta.folder / WEIGHTS_FILE))
    return head.eval(), meta


def readme_lines(fmt: str, head: dict) -> list[str]:
    """The README's Head section: DFlash's lines for the backbone, then the DSpark heads."""
    confidence = ("a confidence head (float32" + (", reading the Markov embedding too" if
                  head["confidence_head_with_markov"] else "") + ")") if head["enable_confidence_head"] else \
        "no confidence head"
    from_anchor = bool(head.get("sample_from_anchor", False))
    layout = "anchor-as-first, sample_from_anchor: true" if from_anchor else "fill-in, sample_from_anchor: false"
    drafted = head["dflash"]["block_size"] - (0 if from_anchor else 1)
    line = (f"- DSpark: blocks of {drafted} drafted tokens ({layout}), "
            f"a {head['markov_head_type']} Markov head of rank {head['markov_rank']} and {confidence}")
    return [*dflash.readme_lines(fmt, head["dflash"]), line]


README = Readme("DSpark block drafter", readme_lines)
