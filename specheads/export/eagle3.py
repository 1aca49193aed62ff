"""EAGLE-3 writers, contract check and loader: the tensors and config.json each format needs, built
from a trained head, the check of such a folder against its engine's loader, and its load-back.

"vllm" is the speculators format (`vllm serve DIR`), "vllm-native" the plain HF EAGLE-3 config
vLLM reads through `--speculative-config`, "sglang" SGLang's `LlamaForCausalLMEagle3`
(docs/engines.md §2.2, §2.3, §3.1).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from specheads.engine_facts import AUX_LAYER_OFFSET, PEAGLE_SPECULATORS_DROPS, REFUSED_OPTIONS, RESIDUAL_DEFAULT, SGLANG
from specheads.export.checkpoint import load_strict
from specheads.export.contract import (
    MISSING,
    aux_ids,
    check_files,
    check_folder,
    check_key_rules,
    check_tensors,
    config_dims,
    found_text,
    get_key,
    is_int,
    is_parallel,
    layer_config,
)
from specheads.export.contract_rules import (
    CONFIG_FILE,
    EAGLE3_LAYER_KEYS,
    ENGINE_NAMES,
    WEIGHTS_FILE,
    FormatContract,
    Violation,
    contract_for,
)
from specheads.export.eagle31 import (
    EAGLE31_OPTIONS,
    NATIVE_ARCHITECTURE,
    check_options,
    check_options_against_head,
    engine_options,
    option_keys,
    option_tensors,
)
from specheads.export.keys import (
    REQUIRED,
    Field,
    check_decoder,
    check_rope,
    llama_layer_keys,
    read_decoder,
    speculators_block,
    trained_fields,
)
from specheads.export.load import ExportMeta, read_json, read_weights
from specheads.export.plan import ExportRefused, cast, head_plan
from specheads.export.readme import Readme
from specheads.heads.eagle3 import Eagle3Config, Eagle3Head
from specheads.heads.vocab import t2d_from_d2t
from specheads.protocols import ExportPlan, ExportRequest

KIND = "eagle3"
FORMATS_WRITTEN = ("vllm", "vllm-native", "sglang")
LAYER_PREFIX = {"vllm": "layers.0.", "vllm-native": "layers.0.", "sglang": "midlayer."}
# the head's own top-level config.json keys (every format), beside the decoder keys of keys.DECODER_FIELDS
# (in the layer config); the default is what the engines assume when the key is absent
HEAD_FIELDS = (Field("draft_vocab_size"), Field("target_hidden_size", lambda node: node["hidden_size"]))


def check_exportable(config: Eagle3Config, fmt: str, weights: dict) -> None:
    """Refuse heads an engine would load but run differently from training."""
    if fmt == "sglang" and config.parallel_drafting:
        raise ExportRefused(
            f"this is a P-EAGLE head (parallel_drafting: true), and {REFUSED_OPTIONS[('sglang', 'parallel_drafting')]} "
            "(no mask_hidden, no parallel drafting). Export it with --format vllm (speculators peagle) "
            "or --format vllm-native (method eagle3 + parallel_drafting).")
    if fmt == "sglang" and config.qk_norm:
        raise ExportRefused(
            f"this head has a Qwen3-style draft layer (qk_norm: true), and {REFUSED_OPTIONS[('sglang', 'qk_norm')]}. "
            "Export it with --format vllm or --format vllm-native (vLLM's Eagle3Qwen3ForCausalLM), or retrain "
            "with head.qk_norm: false.")
    dropped = [o for o in PEAGLE_SPECULATORS_DROPS if fmt == "vllm" and config.parallel_drafting and getattr(config, o)]
    if dropped:
        raise ExportRefused(
            f"this P-EAGLE head was trained with {dropped[0]}: true, but {PEAGLE_SPECULATORS_DROPS[dropped[0]]}. "
            "Export it with --format vllm-native (method eagle3 + parallel_drafting reads it from config.json).")
    if fmt == "sglang" and config.norm_before_residual:
        raise ExportRefused(
            f"this head was trained with norm_before_residual: true, but "
            f"{REFUSED_OPTIONS[('sglang', 'norm_before_residual')]}, so it would run a different layer. Export it with "
            "--format vllm or --format vllm-native instead."
        )
    if config.hidden_size != config.target_hidden_size and "embed_tokens.weight" not in weights:
        raise ExportRefused(
            f"the head's hidden size {config.hidden_size} differs from the target's "
            f"{config.target_hidden_size}, so the engines need the draft's own embed_tokens.weight, "
            "which this checkpoint does not hold. Train the head with the target's hidden size."
        )


def export_tensors(weights: dict[str, torch.Tensor], fmt: str, dtype: str | None = None) -> dict[str, torch.Tensor]:
    """Head state-dict tensors under the format's names, in the checkpoint's dtype unless `dtype`
    is given; only floating tensors are cast (d2t / t2d never)."""
    out = {}
    for name, tensor in without_full_vocab_map(weights).items():
        if name.startswith("layers.0."):
            name = LAYER_PREFIX[fmt] + name[len("layers.0."):]
        out[name] = cast(tensor, dtype)
    return out  # fc.weight [Hd, n_aux*H], ..., lm_head.weight [Vd, Hd], d2t [Vd] int64, t2d [V] bool (Vd < V)


def without_full_vocab_map(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A head whose draft vocabulary is the whole target vocabulary (Vd == V) ships no d2t / t2d:
    vLLM has no draft_id_to_target_id then and rejects a d2t. lm_head rows move to target order."""
    d2t, t2d, lm_head = weights.get("d2t"), weights.get("t2d"), weights.get("lm_head.weight")
    if d2t is None or t2d is None or lm_head is None or lm_head.shape[0] != t2d.shape[0]:
        return weights  # a reduced vocabulary (Vd < V): the engines need the map
    out = {n: t for n, t in weights.items() if n not in ("d2t", "t2d")}
    target_ids = torch.arange(d2t.numel()) + d2t.long()  # [Vd]: a permutation of 0..V-1
    if bool(d2t.any()):
        if not torch.equal(torch.sort(target_ids).values, torch.arange(d2t.numel())):
            raise ValueError("d2t of a full-vocabulary head is not a permutation of the target ids; "
                             "the checkpoint's vocabulary map is corrupt")
        reordered = torch.empty_like(lm_head)
        reordered[target_ids] = lm_head  # row of draft id i -> row of target id i + d2t[i]
        out["lm_head.weight"] = reordered
    return out


def layer_keys(config: Eagle3Config, dtype: str) -> dict:
    """The decoder-layer keys every format carries (one layer; model_type qwen3 for a Qwen3-style one)."""
    keys = llama_layer_keys(config, dtype, num_aux_hidden_states=len(config.aux_layers))
    return {**keys, "model_type": "qwen3"} if config.qk_norm else keys


def head_fields(config: Eagle3Config) -> dict:
    """HEAD_FIELDS' values, as config.json carries them at its top level."""
    return {f.name: getattr(config, f.name) for f in HEAD_FIELDS}


def head_keys(config: Eagle3Config) -> dict:
    """EAGLE-3 keys vLLM reads at the top level (both vLLM formats); numbering = our aux_layers."""
    return {
        **head_fields(config),
        "eagle_aux_hidden_state_layer_ids": list(config.aux_layers),
        "norm_before_residual": bool(config.norm_before_residual),
        **option_keys(config),
        **({"parallel_drafting": True, "mask_token_id": config.mask_token_id} if config.parallel_drafting else {}),
    }


def speculators_config(config: Eagle3Config, k: int, verifier: str, verifier_archs: list[str],
                       dtype: str) -> dict:
    """docs/engines.md §2.3: no top-level model_type; layer keys in transformer_layer_config.
    P-EAGLE: type peagle (vLLM turns it into eagle3 + parallel_drafting) with mask_token_id."""
    keys = head_keys(config)
    keys.pop("parallel_drafting", None)
    return {
        "architectures": ["PEagleSpeculator" if config.parallel_drafting else "Eagle3Speculator"],
        "speculators_model_type": "peagle" if config.parallel_drafting else "eagle3",
        **keys,
        "transformer_layer_config": layer_keys(config, dtype),
        "speculators_config": speculators_block("peagle" if config.parallel_drafting else "eagle3", k, verifier,
                                                verifier_archs),
    }


def native_config(config: Eagle3Config, dtype: str) -> dict:
    """docs/engines.md §2.2: a LlamaForCausalLM (Qwen3ForCausalLM with qk_norm) config with the EAGLE-3
    keys at top level; vLLM prefixes Eagle3 to the architecture."""
    return {"architectures": [NATIVE_ARCHITECTURE[config.qk_norm]], **layer_keys(config, dtype), **head_keys(config),
            "tie_word_embeddings": False}


def sglang_config(config: Eagle3Config, dtype: str) -> dict:
    """docs/engines.md §3.1: LlamaForCausalLMEagle3, ids in SGLang numbering inside eagle_config."""
    ids = [a + AUX_LAYER_OFFSET["sglang"] for a in config.aux_layers]
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **layer_keys(config, dtype),
        **head_fields(config),
        "tie_word_embeddings": False,
        "norm_before_residual": False,  # documentary: SGLang has no such option (refused when true)
        **option_keys(config),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
    }


def config_json(config: Eagle3Config, fmt: str, k: int, verifier: str, verifier_archs: list[str],
                dtype: str) -> dict:
    """The config.json for `fmt`."""
    if fmt == "vllm":
        return speculators_config(config, k, verifier, verifier_archs, dtype)
    if fmt == "vllm-native":
        return native_config(config, dtype)
    return sglang_config(config, dtype)


def plan(request: ExportRequest) -> ExportPlan:
    """The tensors and config.json of an EAGLE-3 export (export() writes and checks them)."""
    return head_plan(request, export_tensors, config_json)


# --- contract check (docs/engines.md §2.2, §2.3, §3.1; the tables in contract_rules.py) ----------


def check_keys(cfg: dict, contract: FormatContract) -> list[Violation]:
    """Every format key rule, then the decoder-layer keys wherever this format keeps them."""
    layer_rules = EAGLE3_LAYER_KEYS[contract.engine]
    return (check_key_rules(cfg, contract.keys) + check_key_rules(cfg, layer_rules, at=contract.layer_keys_at)
            + check_options(cfg, contract))


def check_aux_ids(cfg: dict, contract: FormatContract) -> list[Violation]:
    """The aux-layer id list: present in the engine's place, well formed, consistent with its count."""
    ids, where = aux_ids(cfg, contract), f"{CONFIG_FILE}: {contract.aux_ids_key}"
    numbering = f"{ENGINE_NAMES[contract.engine]} numbering (first valid id {contract.min_aux_id})"
    if ids is MISSING:
        return [Violation(where, f"the aux-layer ids in {numbering}", "no key",
                          "without it the engine taps its default layers, not the trained ones")]
    if not (isinstance(ids, list) and ids and all(is_int(i) for i in ids)
            and ids == sorted(set(ids)) and ids[0] >= contract.min_aux_id):
        return [Violation(where, f"distinct ascending integer ids in {numbering}", found_text(ids),
                          "write the head's aux_layers converted to this engine's numbering")]
    num_key = ".".join(p for p in (contract.layer_keys_at, "num_aux_hidden_states") if p)
    num = get_key(cfg, num_key)
    if num is MISSING and len(ids) != 3 and contract.engine == "vllm":
        return [Violation(f"{CONFIG_FILE}: {num_key}", str(len(ids)), "no key",
                          "vLLM's Llama EAGLE-3 sizes fc for 3 aux states unless told otherwise")]
    if num is not MISSING and num != len(ids):
        return [Violation(f"{CONFIG_FILE}: {num_key}", f"{len(ids)} (the number of aux ids)", found_text(num),
                          "make the count match the id list")]
    return []


def check_parallel(cfg: dict, contract: FormatContract) -> list[Violation]:
    """A P-EAGLE config names its mask token (vLLM: mask_token_id, or pard_token natively) inside V."""
    if contract.engine != "vllm" or not is_parallel(cfg):
        return []
    mask = cfg.get("mask_token_id", MISSING if contract.layer_keys_at else cfg.get("pard_token", MISSING))
    V = layer_config(cfg, contract).get("vocab_size")
    if not is_int(mask):
        return [Violation(f"{CONFIG_FILE}: mask_token_id", "the mask token id (an integer)", found_text(mask),
                          "vLLM fills the parallel-drafting slots with it and refuses to start without it")]
    if is_int(V) and not 0 <= mask < V:
        return [Violation(f"{CONFIG_FILE}: mask_token_id", f"< vocab_size {V}", str(mask),
                          "the mask token is embedded with the target's table; pick an id inside it")]
    return []


def _layer_path(contract: FormatContract) -> str:
    return f"{contract.layer_keys_at}." if contract.layer_keys_at else ""


def check_against_head(cfg: dict, contract: FormatContract, head: dict) -> list[Violation]:
    """Sizes, RoPE, residual rule, context length and aux ids agree with the trained head's config."""
    layer, at = layer_config(cfg, contract), _layer_path(contract)
    out = check_decoder(layer, head, at)
    for f in HEAD_FIELDS:  # an absent key is the engine's default, computed for the trained head
        found = cfg.get(f.name, MISSING if f.default is REQUIRED else f.default(head))
        if found is not MISSING and found != head[f.name]:
            out.append(Violation(f"{CONFIG_FILE}: {f.name}", f"{head[f.name]} (the trained head's)",
                                 found_text(found), "export again from the checkpoint this head came from"))
    out += check_rope(layer, head, at)
    out += _check_residual(cfg, contract, head)
    out += check_options_against_head(cfg, contract, head)
    if is_parallel(cfg) != bool(head.get("parallel_drafting", False)):
        out.append(Violation(f"{CONFIG_FILE}: parallel_drafting", json.dumps(bool(head.get("parallel_drafting"))),
                             json.dumps(is_parallel(cfg)), "P-EAGLE heads draft in parallel, EAGLE-3 heads do "
                             "not: export again from the checkpoint"))
    mpe = layer.get("max_position_embeddings")
    if is_int(mpe) and mpe < head["max_position_embeddings"]:
        out.append(Violation(f"{CONFIG_FILE}: {at}max_position_embeddings",
                             f">= {head['max_position_embeddings']} (the target's)", str(mpe),
                             "a shorter draft context makes SGLang refuse to start and caps vLLM's; "
                             "write the target's value"))
    return out + _check_aux_against_head(cfg, contract, head)


def _check_residual(cfg: dict, contract: FormatContract, head: dict) -> list[Violation]:
    nbr = cfg.get("norm_before_residual", MISSING)
    if contract.engine == "sglang" and head["norm_before_residual"]:
        return [Violation(f"{CONFIG_FILE}: norm_before_residual", "a head trained with false", "a head trained "
                          "with true", f"{SGLANG} always uses the raw fc output as the residual; "
                          "serve this head with vLLM")]
    if contract.engine == "vllm" and isinstance(nbr, bool) and nbr != head["norm_before_residual"]:
        return [Violation(f"{CONFIG_FILE}: norm_before_residual", json.dumps(head["norm_before_residual"]),
                          json.dumps(nbr), "it must match training or the draft computes a different layer")]
    return []


def _check_aux_against_head(cfg: dict, contract: FormatContract, head: dict) -> list[Violation]:
    ids = aux_ids(cfg, contract)
    want = [a + contract.aux_offset for a in head["aux_layers"]]
    if ids is MISSING or ids == want:
        return []
    other_fmt, other = ("sglang", "SGLang") if contract.engine != "sglang" else ("vllm", "vLLM")
    other_offset = contract_for(other_fmt, contract.kind).aux_offset
    engine = ENGINE_NAMES[contract.engine]
    swapped = ids == [a + other_offset for a in head["aux_layers"]]
    hint = f"these are the ids in {other} numbering; " if swapped else ""
    return [Violation(f"{CONFIG_FILE}: {contract.aux_ids_key}",
                      f"{want} (trained aux_layers {head['aux_layers']} in {engine} numbering)",
                      found_text(ids), f"{hint}write the trained layers converted to {engine} numbering")]


def validate(folder: str | Path, fmt: str, expected=None) -> None:
    """Check an EAGLE-3 folder against its engine's loader contract; raise ContractError listing every
    violation. `expected` (the head config; default: the folder's specheads.json) adds the checks
    against the trained head."""
    folder, contract = Path(folder), contract_for(fmt, KIND)
    check_folder(
        folder, fmt, WEIGHTS_FILE, expected, files=check_files,
        keys=lambda cfg: check_keys(cfg, contract) + check_aux_ids(cfg, contract) + check_parallel(cfg, contract),
        against_head=lambda cfg, head: check_against_head(cfg, contract, head),
        tensors=lambda specs, cfg: check_tensors(
            specs, config_dims(cfg, contract), replace(contract, tensors=contract.tensors + option_tensors(cfg, contract))))


# --- load back -----------------------------------------------------------------------------------
TRAINED = ("ttt_steps", "step_decay", "loss", "feature_noise", "feature_noise_scale", "dropout",
           "init_lm_head", "freeze_lm_head")  # training-only
# fields: from specheads.json, never config.json
PARALLEL_TRAINED = ("cod_ratio", "cod_min_ratio")


def config_from_export(cfg: dict, fmt: str, trained: dict | None = None) -> Eagle3Config:
    """Rebuild the head config from config.json in `fmt` (aux ids back to specheads numbering).
    `trained` (specheads.json head_config) supplies only the training-only fields."""
    contract = contract_for(fmt, KIND)
    layer = read_decoder(layer_config(cfg, contract))
    return Eagle3Config(
        **layer, **{f.name: f.read({**layer, **cfg}) for f in HEAD_FIELDS},
        aux_layers=[i - contract.aux_offset for i in aux_ids(cfg, contract)],
        norm_before_residual=bool(cfg.get("norm_before_residual", RESIDUAL_DEFAULT[fmt])),
        **engine_options(cfg, contract),
        **trained_fields(trained, TRAINED),
        **parallel_from_export(cfg, trained or {}),
    )


def parallel_from_export(cfg: dict, trained: dict) -> dict:
    """P-EAGLE fields: parallel when speculators says peagle or the native config says so."""
    if not is_parallel(cfg):
        return {}
    return {"parallel_drafting": True, "mask_token_id": cfg.get("mask_token_id", cfg.get("pard_token")),
            **trained_fields(trained, PARALLEL_TRAINED)}


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
        head["t2d"] = t2d_from_d2t(head["d2t"], config.vocab_size)
    return head


def load_export(meta: ExportMeta, attn_implementation: str = "sdpa",
                check: bool = True) -> tuple[Eagle3Head, ExportMeta]:
    """A specheads EAGLE-3 export (any of its formats) -> (head in eval mode, meta)."""
    if check:
        validate(meta.folder, meta.format)
    config = config_from_export(read_json(meta.folder / CONFIG_FILE), meta.format, meta.head_config)
    head = Eagle3Head(config, attn_implementation=attn_implementation)
    tensors = head_weights(read_weights(meta.folder / WEIGHTS_FILE), config)
    load_strict(head, tensors, str(meta.folder / WEIGHTS_FILE))
    return head.eval(), meta


def readme_lines(fmt: str, head: dict) -> list[str]:
    """The README's Head section (P-EAGLE: an EAGLE-3 head drafting in parallel)."""
    parallel = [f"- P-EAGLE: all {head['ttt_steps']} drafts in one forward (mask token id {head['mask_token_id']}, "
                f"learned `mask_hidden`); vLLM serves it with `parallel_drafting: true`, {SGLANG} cannot"
                ] if head.get("parallel_drafting") else []
    options = [o for o in (*EAGLE31_OPTIONS, "qk_norm") if head.get(o)]
    eagle31 = [f"- EAGLE 3.1 / layer options: {', '.join(options)}"] if options else []
    return parallel + eagle31 + [f"- aux layers (hidden states after k target layers): {head['aux_layers']}",
                       f"- draft vocabulary: {head['draft_vocab_size']} of {head['vocab_size']} tokens",
                       f"- hidden size {head['hidden_size']}, norm_before_residual "
                       f"{str(head['norm_before_residual']).lower()}, trained for {head['ttt_steps']} draft steps"]


README = Readme("EAGLE-3 draft", readme_lines, serve_notes=True)
