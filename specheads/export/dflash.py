"""DFlash writers, contract check and loader: vLLM 0.33 native (`method: dflash`,
`DFlashDraftModel`), the speculators `dflash` format, and SGLang 0.5.23 (`DFLASH`).

docs/engines.md §2.9 and §3.6, checked against
the engines' own code (vLLM `models/qwen3_dflash.py`, `configs/speculators/algos.py`; SGLang
`models/dflash.py`, `speculative/dflash_utils.py`). Native vLLM and SGLang read the same folder:
a Qwen3 config with `dflash_config`, bare tensor names, no embedding (the target's) and, unless the
vocabulary is reduced, no lm_head (the target's). SGLang has no draft-vocabulary mapping, so a
head trained with a reduced vocabulary exports to vLLM only.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specheads.engine_facts import DFLASH_SPECULATORS_OFFSET, SGLANG, VLLM
from specheads.export.checkpoint import load_strict
from specheads.export.contract import (
    KEY_CHECKS,
    MISSING,
    check_files,
    check_folder,
    check_key_rules,
    expected_shape,
    found_text,
    get_key,
    is_int,
)
from specheads.export.contract_rules import (
    CONFIG_FILE,
    DECODER_DIM_KEYS,
    DTYPE_NAMES,
    FLOAT_DTYPES,
    ROPE_KEY,
    WEIGHTS_FILE,
    KeyRule,
    TensorRule,
    Violation,
)
from specheads.export.keys import (
    REQUIRED,
    check_decoder,
    check_rope,
    decoder_fields,
    decoder_keys,
    read_decoder,
    speculators_block,
    trained_fields,
)
from specheads.export.load import read_json, read_weights
from specheads.export.plan import ExportRefused, cast, head_plan
from specheads.export.readme import Readme
from specheads.heads.dflash import DFlashConfig, DFlashHead
from specheads.heads.vocab import t2d_from_d2t
from specheads.protocols import ExportPlan, ExportRequest

FORMATS_WRITTEN = ("vllm", "vllm-native", "sglang")
ARCHITECTURE = "DFlashDraftModel"
# the Qwen3 stack's decoder keys; the engines read them without defaults but for rms_norm_eps (Qwen3's)
FIELDS = decoder_fields(num_key_value_heads=REQUIRED, head_dim=REQUIRED, rms_norm_eps=1e-6)


def check_exportable(config: DFlashConfig, fmt: str, weights: dict) -> None:
    """SGLang 0.5.23 drafts with the target's lm_head and has no d2t: refuse a reduced vocabulary."""
    if fmt == "sglang" and config.own_lm_head:
        raise ExportRefused(
            f"this DFlash head has its own reduced vocabulary ({config.draft_vocab_size} of "
            f"{config.vocab_size} tokens), but {SGLANG} always drafts with the target's lm_head "
            "and reads no d2t map. Export it with --format vllm or --format vllm-native, or retrain "
            "with head.draft_vocab_size: null for SGLang.")


def export_tensors(weights: dict[str, torch.Tensor], fmt: str, dtype: str | None = None) -> dict[str, torch.Tensor]:
    """Head tensors under their own (= the engines') names; floating ones cast to `dtype`."""
    # fc.weight [H, K*H], hidden_norm / norm [H], layers.{i}.*, (lm_head [Vd, H], d2t, t2d)
    return {name: cast(t, dtype) for name, t in weights.items()}


def layer_keys(config: DFlashConfig, dtype: str) -> dict:
    """The Qwen3 decoder-stack keys every format carries."""
    return {
        **decoder_keys(config, "qwen3", config.num_hidden_layers, FIELDS),
        "use_sliding_window": False,
        "layer_types": ["full_attention"] * config.num_hidden_layers,
        "tie_word_embeddings": False,
        "dtype": dtype,
    }


def native_config(config: DFlashConfig, dtype: str) -> dict:
    """vLLM native and SGLang: DFlashDraftModel, ids in DFlash numbering inside dflash_config."""
    return {
        "architectures": [ARCHITECTURE],
        **layer_keys(config, dtype),
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.hidden_size,
        "block_size": config.block_size,
        "num_target_layers": config.num_target_layers,
        "is_causal": bool(config.causal),  # both engines read it before their own defaults
        "dflash_config": {
            "mask_token_id": config.mask_token_id,
            "target_layer_ids": list(config.target_layer_ids),
            "block_size": config.block_size,
            "causal": bool(config.causal),
            "sample_from_anchor": False,
            "use_swa": False,
        },
    }


def speculators_config(config: DFlashConfig, k: int, verifier: str, verifier_archs: list[str], dtype: str) -> dict:
    """speculators `dflash` (vLLM algos.py): vLLM ids at the top level, no top-level model_type."""
    return {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.hidden_size,
        "aux_hidden_state_layer_ids": [t + DFLASH_SPECULATORS_OFFSET for t in config.target_layer_ids],
        "mask_token_id": config.mask_token_id,
        "block_size": config.block_size,
        "sample_from_anchor": False,
        "sliding_window_non_causal": not config.causal,  # vLLM: causal = not this (default true)
        "transformer_layer_config": layer_keys(config, dtype),
        "speculators_config": speculators_block("dflash", k, verifier, verifier_archs),
    }


def config_json(config: DFlashConfig, fmt: str, k: int, verifier: str, verifier_archs: list[str],
                dtype: str) -> dict:
    return block_config(fmt, k, config.block_size - 1, lambda: speculators_config(config, k, verifier, verifier_archs,
                                                                                  dtype), lambda: native_config(config, dtype))


def block_config(fmt: str, k: int, drafts: int, speculators, native) -> dict:
    """speculators() for the speculators format, else native(); a chain longer than the `drafts`
    tokens a block was trained to draft is refused."""
    if k > drafts:
        raise ValueError(f"num_speculative_tokens {k}: this head was trained on blocks of anchor + {drafts} "
                         f"drafts; use at most {drafts}")
    return speculators() if fmt == "vllm" else native()


def plan(request: ExportRequest) -> ExportPlan:
    """The tensors and config.json of a DFlash export (export() writes and checks them)."""
    return head_plan(request, export_tensors, config_json)


# --- contract --------------------------------------------------------------------------------
def _ids_ok(v, lo: int) -> bool:
    return isinstance(v, list) and bool(v) and all(is_int(i) for i in v) and v == sorted(set(v)) and v[0] >= lo


CHECKS = {**KEY_CHECKS,
          "id_list": (lambda v, r: _ids_ok(v, r.value), lambda r: f"distinct ascending integer ids >= {r.value}"),
          "nonneg_int": (lambda v, r: is_int(v) and v >= 0, lambda r: "an integer >= 0")}
STACK_KEYS = (
    KeyRule("model_type", "equals", "qwen3", "the draft layers are Qwen3-style (q/k norms)"),
    KeyRule("hidden_size", "positive_int"),
    KeyRule("num_hidden_layers", "positive_int"),
    *DECODER_DIM_KEYS,
    KeyRule("use_sliding_window", "not_true", fix="the head was trained with full attention"),
    ROPE_KEY,
)
NATIVE_KEYS = (
    KeyRule("architectures", "equals", [ARCHITECTURE], fix="both engines register DFlashDraftModel"),
    KeyRule("auto_map", "absent", fix="SGLang would try remote code; remove it"),
    KeyRule("draft_vocab_size", "positive_int"),
    KeyRule("block_size", "positive_int", fix="SGLang takes its verify window from it (default 16)"),
    KeyRule("is_causal", "bool", fix="write the trained block attention explicitly (false = bidirectional)"),
    KeyRule("dflash_config", "dict"),
    KeyRule("dflash_config.mask_token_id", "nonneg_int", fix="the engines fill masked slots with this id"),
    KeyRule("dflash_config.target_layer_ids", "id_list", 0, "DFlash numbering: id t = output of layer t"),
    KeyRule("dflash_config.causal", "bool"),
    KeyRule("dflash_config.sample_from_anchor", "not_true",
            fix=f"{VLLM} refuses it for DFlash: the anchor is the bonus token"),
    KeyRule("dflash_config.use_swa", "not_true", fix="the head was trained with full attention"),
    KeyRule("eagle_aux_hidden_state_layer_ids", "absent",
            fix="vLLM reads a top-level list before dflash_config.target_layer_ids; keep one list"),
    KeyRule("mask_hidden", "absent"),
) + STACK_KEYS
SPECULATORS_KEYS = (
    KeyRule("model_type", "absent", fix="a top-level model_type defeats vLLM's speculators detection"),
    KeyRule("speculators_model_type", "equals", "dflash"),
    KeyRule("draft_vocab_size", "positive_int"),
    KeyRule("target_hidden_size", "positive_int"),
    KeyRule("aux_hidden_state_layer_ids", "id_list", 1, "vLLM numbering (= DFlash id + 1); vLLM requires it"),
    KeyRule("mask_token_id", "nonneg_int", fix="vLLM requires it for speculators dflash"),
    KeyRule("sample_from_anchor", "not_true", fix=f"{VLLM} refuses it for DFlash"),
    KeyRule("sliding_window_non_causal", "bool",
            fix="write it explicitly: vLLM sets causal = not this (default true)"),
    KeyRule("transformer_layer_config", "dict"),
    KeyRule("speculators_config.proposal_methods.0.speculative_tokens", "positive_int"),
    KeyRule("speculators_config.default_proposal_method", "str"),
    KeyRule("speculators_config.verifier.name_or_path", "str", fix="name the target"),
) + tuple(KeyRule(f"transformer_layer_config.{r.key}" if r.key else "transformer_layer_config", r.check,
                  r.value, r.fix) for r in STACK_KEYS)
FORBIDDEN = (
    ("mask_hidden", "a P-EAGLE tensor: vLLM's DFlash loader asserts on it; remove it"),
    ("embed_tokens", "the draft embeds with the target's table; remove it"),
    ("rotary_emb.", "RoPE buffer: the engines recompute it; remove it"),
    ("model.", "`model.`-prefixed name: vLLM adds the prefix itself; write bare names"),
)


def stack_of(cfg: dict, fmt: str) -> dict:
    node = cfg.get("transformer_layer_config") if fmt == "vllm" else cfg
    return node if isinstance(node, dict) else {}


def layer_ids(cfg: dict, fmt: str):
    """Target layers in DFlash numbering, from wherever this format keeps them."""
    if fmt == "vllm":
        ids = cfg.get("aux_hidden_state_layer_ids")
        return [i - DFLASH_SPECULATORS_OFFSET for i in ids] if _ids_ok(ids, DFLASH_SPECULATORS_OFFSET) else None
    ids = get_key(cfg, "dflash_config.target_layer_ids")
    return ids if _ids_ok(ids, 0) else None


def tensor_rules(cfg: dict, fmt: str) -> tuple[list[TensorRule], dict]:
    """The tensors this config defines, with its symbolic dims."""
    s = stack_of(cfg, fmt)
    dims = {sym: s.get(key) for sym, key in (("H", "hidden_size"), ("nh", "num_attention_heads"),
            ("kvh", "num_key_value_heads"), ("hd", "head_dim"), ("I", "intermediate_size"), ("V", "vocab_size"))}
    dims["Vd"] = cfg.get("draft_vocab_size", dims["V"])
    dims["K"] = len(layer_ids(cfg, fmt) or [])
    dims = {k: v for k, v in dims.items() if is_int(v)}
    rules = [TensorRule("fc.weight", ("H", "K*H")), TensorRule("hidden_norm.weight", ("H",)),
             TensorRule("norm.weight", ("H",))]
    n_layers = s.get("num_hidden_layers") if is_int(s.get("num_hidden_layers")) else 0
    for i in range(n_layers):
        p = f"layers.{i}."
        rules += [TensorRule(p + "self_attn.q_proj.weight", ("nh*hd", "H")),
                  TensorRule(p + "self_attn.k_proj.weight", ("kvh*hd", "H")),
                  TensorRule(p + "self_attn.v_proj.weight", ("kvh*hd", "H")),
                  TensorRule(p + "self_attn.o_proj.weight", ("H", "nh*hd")),
                  TensorRule(p + "self_attn.q_norm.weight", ("hd",)), TensorRule(p + "self_attn.k_norm.weight", ("hd",)),
                  TensorRule(p + "mlp.gate_proj.weight", ("I", "H")), TensorRule(p + "mlp.up_proj.weight", ("I", "H")),
                  TensorRule(p + "mlp.down_proj.weight", ("H", "I")),
                  TensorRule(p + "input_layernorm.weight", ("H",)), TensorRule(p + "post_attention_layernorm.weight", ("H",))]
    if dims.get("Vd") != dims.get("V"):
        rules += [TensorRule("lm_head.weight", ("Vd", "H")), TensorRule("d2t", ("Vd",), dtype="int64"),
                  TensorRule("t2d", ("V",), dtype="bool", need="optional")]
    return rules, dims


def check_keys(cfg: dict, fmt: str) -> list[Violation]:
    rules = SPECULATORS_KEYS if fmt == "vllm" else NATIVE_KEYS
    return check_key_rules(cfg, rules, checks=CHECKS) + _check_consistency(cfg, fmt)


def _check_consistency(cfg: dict, fmt: str) -> list[Violation]:
    """Cross-key rules: mask id inside V, ids consistent, causality stated once, SGLang's vocab."""
    s, out = stack_of(cfg, fmt), []
    mask = cfg.get("mask_token_id") if fmt == "vllm" else get_key(cfg, "dflash_config.mask_token_id")
    V = s.get("vocab_size")
    if is_int(mask) and is_int(V) and mask >= V:
        out.append(Violation(f"{CONFIG_FILE}: mask_token_id", f"< vocab_size {V}", str(mask),
                             "the engines embed the mask token with the target's table; pick an id inside it"))
    if fmt != "vllm" and get_key(cfg, "is_causal") is not MISSING and \
            get_key(cfg, "is_causal") != get_key(cfg, "dflash_config.causal"):
        out.append(Violation(f"{CONFIG_FILE}: is_causal", "the same value as dflash_config.causal",
                             found_text(get_key(cfg, "is_causal")), "vLLM reads is_causal first; make them agree"))
    if fmt == "sglang" and cfg.get("draft_vocab_size") != V:
        out.append(Violation(f"{CONFIG_FILE}: draft_vocab_size", f"{V} (vocab_size)",
                             found_text(cfg.get("draft_vocab_size")),
                             f"{SGLANG} drafts with the target's lm_head: no reduced vocabulary"))
    return out


def check_tensors(specs: dict, cfg: dict, fmt: str) -> list[Violation]:
    rules, dims = tensor_rules(cfg, fmt)
    allowed, out = {r.name: r for r in rules}, []
    for name, rule in allowed.items():
        where = f"{WEIGHTS_FILE}: {name}"
        if name not in specs:
            if rule.need == "required":
                out.append(Violation(where, "the tensor", "no tensor", "the engines leave a missing draft tensor "
                                     "uninitialised (or share a wrong one); re-export"))
            continue
        dtype, shape = specs[name]
        ok = dtype in FLOAT_DTYPES if rule.dtype == "float" else dtype == {"int64": "I64", "bool": "BOOL"}[rule.dtype]
        if not ok:
            out.append(Violation(where, f"dtype {DTYPE_NAMES[rule.dtype]}", dtype, "re-export; never cast d2t / t2d"))
        want = expected_shape(rule.shape, dims)
        if want is not None and shape != want:
            out.append(Violation(where, f"shape {list(want)} ({' x '.join(rule.shape)} from config.json)",
                                 str(list(shape)), "the weights and config.json disagree; re-export"))
    for name in sorted(set(specs) - set(allowed)):
        why = next((w for pat, w in FORBIDDEN if name.startswith(pat) or pat in name), None)
        if name.startswith("lm_head") or name in ("d2t", "t2d"):
            why = why or ("a reduced-vocabulary tensor while draft_vocab_size equals vocab_size: the engine would "
                          "use it (or drop it) differently from training; remove it")
        out.append(Violation(f"{WEIGHTS_FILE}: {name}", "no such tensor", "an unexpected tensor",
                             why or "not a DFlash tensor: the engine would fail on it or drop it; remove it"))
    floats = sorted({d for d, _ in specs.values() if d in FLOAT_DTYPES})
    if len(floats) > 1:
        out.append(Violation(WEIGHTS_FILE, "one floating dtype for all weights", ", ".join(floats), "export with one dtype"))
    return out


def check_against_head(cfg: dict, fmt: str, head: dict) -> list[Violation]:
    """Sizes, taps, mask token, block, causality and RoPE agree with the trained head."""
    s = stack_of(cfg, fmt)
    out = check_decoder(s, head, table=FIELDS)
    native = fmt != "vllm"
    found = dict(num_hidden_layers=s.get("num_hidden_layers", MISSING),
                 draft_vocab_size=cfg.get("draft_vocab_size", MISSING), target_layer_ids=layer_ids(cfg, fmt),
                 mask_token_id=get_key(cfg, "dflash_config.mask_token_id" if native else "mask_token_id"),
                 block_size=cfg.get("block_size", MISSING),
                 causal=get_key(cfg, "dflash_config.causal") if native else
                 (not cfg["sliding_window_non_causal"] if "sliding_window_non_causal" in cfg else MISSING))
    for key, value in found.items():
        if value is not MISSING and value is not None and value != head[key]:
            out.append(Violation(f"{CONFIG_FILE}: {key}", f"{json.dumps(head[key])} (the trained head's)",
                                 found_text(value), "export again from the checkpoint this head came from"))
    out += check_rope(s, head)
    mpe = s.get("max_position_embeddings")
    if is_int(mpe) and mpe < head["max_position_embeddings"]:
        out.append(Violation(f"{CONFIG_FILE}: max_position_embeddings", f">= {head['max_position_embeddings']}",
                             str(mpe), "write the target's value"))
    return out


def validate(folder: str | Path, fmt: str, expected=None) -> None:
    """Check a DFlash export folder against its engine's loader; raise ContractError listing all."""
    check_format(folder, fmt, expected, check_keys, check_against_head, check_tensors)


def check_format(folder: str | Path, fmt: str, expected, keys, against_head, tensors) -> None:
    """check_folder with a block-drafter kind's checks, each given the format: keys(cfg, fmt),
    against_head(cfg, fmt, head), tensors(specs, cfg, fmt) (DFlash's, or DSpark's around them)."""
    check_folder(Path(folder), fmt, WEIGHTS_FILE, expected, files=check_files,
                 keys=lambda cfg: keys(cfg, fmt),
                 against_head=lambda cfg, head: against_head(cfg, fmt, head),
                 tensors=lambda specs, cfg: tensors(specs, cfg, fmt))


# --- load back ---------------------------------------------------------------------------------
TRAINED = ("num_anchors", "loss", "loss_decay_gamma", "dpace_alpha")  # training-only: from specheads.json


def config_from_export(cfg: dict, fmt: str, trained: dict | None = None) -> DFlashConfig:
    """Rebuild the head config from config.json; `trained` supplies only training-only fields."""
    trained, s = trained or {}, stack_of(cfg, fmt)
    native = fmt != "vllm"
    causal = get_key(cfg, "dflash_config.causal") if native else not cfg.get("sliding_window_non_causal", True)
    ids = layer_ids(cfg, fmt)
    decoder = read_decoder(s, FIELDS)
    return DFlashConfig(
        **decoder, num_hidden_layers=s["num_hidden_layers"],
        draft_vocab_size=cfg.get("draft_vocab_size") or decoder["vocab_size"], target_layer_ids=ids,
        num_target_layers=cfg.get("num_target_layers") or trained.get("num_target_layers") or max(ids) + 2,
        block_size=cfg.get("block_size") or trained["block_size"],
        mask_token_id=get_key(cfg, "dflash_config.mask_token_id") if native else cfg["mask_token_id"],
        causal=bool(causal), **trained_fields(trained, TRAINED),
    )


def with_t2d(config: DFlashConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A reduced vocabulary's t2d [V] rebuilt from d2t when the folder has none (the engines skip it)."""
    if config.own_lm_head and "t2d" not in tensors:
        tensors["t2d"] = t2d_from_d2t(tensors["d2t"], config.vocab_size)
    return tensors


def load_export(meta, attn_implementation: str = "sdpa", check: bool = True) -> tuple[DFlashHead, object]:
    """A DFlash export folder -> (head in eval mode, meta)."""
    if check:
        validate(meta.folder, meta.format)
    return load_config(meta, read_json(meta.folder / CONFIG_FILE, meta.format), attn_implementation)


def load_config(meta, cfg: dict, attn_implementation: str = "sdpa") -> tuple[DFlashHead, object]:
    """The head that config.json's dict `cfg` describes, with the folder's weights (export/foreign.py
    passes another trainer's config.json as specheads reads it)."""
    config = config_from_export(cfg, meta.format, meta.head_config)
    tensors = with_t2d(config, read_weights(meta.folder / WEIGHTS_FILE))
    head = DFlashHead(config, attn_implementation=attn_implementation)
    load_strict(head, tensors, str(meta.folder / WEIGHTS_FILE))
    return head.eval(), meta


def readme_lines(fmt: str, head: dict) -> list[str]:
    """The README's Head section."""
    return [f"- DFlash: {head['num_hidden_layers']} Qwen3-style layer(s) reading target layers "
            f"{head['target_layer_ids']} (output of layer t) as context keys; blocks of {head['block_size']} "
            f"(anchor + {head['block_size'] - 1} mask token id {head['mask_token_id']}), "
            f"{'causal' if head['causal'] else 'bidirectional'} inside the block",
            f"- draft vocabulary: {head['draft_vocab_size']} of {head['vocab_size']} tokens"
            + (" (the target's lm_head is shared)" if head['draft_vocab_size'] == head['vocab_size'] else ""),
            f"- trained with {head['loss']} loss over {head['num_anchors']} anchors per sequence"]


README = Readme("DFlash block drafter", readme_lines)
