"""Checks an export folder against the loader contracts in `contract_rules` (the engines of `engine_facts`).

The tables encode docs/engines.md (§2.2-2.4 for vLLM, §3.1-3.2 for SGLang). The engines are
fail-silent on many of these rules (a missing EAGLE-3 tensor stays uninitialised, a misnamed one
is dropped), so every export is checked here before it is renamed into place. `validate` reports
every violation at once.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, is_dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open

from specheads.engine_facts import SGLANG
from specheads.export.contract_rules import (  # noqa: F401  (FORMATS, detect_format: re-exported)
    CONFIG_FILE, DTYPE_NAMES, ENGINE_NAMES, FLOAT_DTYPES, FORBIDDEN_TENSORS, FORMATS, LAYER_KEYS,
    META_FILE, VOCAB_MAP_FIX, WEIGHTS_FILE, ContractError, FormatContract, Violation, contract_for, detect_format,
)

# --- reading ---------------------------------------------------------------------------------
MISSING = object()


def get_key(cfg, dotted: str):
    """cfg value at a dotted path ('a.b.0.c'); MISSING when any step is absent."""
    node = cfg
    for part in dotted.split(".") if dotted else []:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return MISSING
    return node


def layer_config(cfg: dict, contract: FormatContract) -> dict:
    """The dict holding the decoder-layer keys (top level, or speculators' transformer_layer_config)."""
    node = get_key(cfg, contract.layer_keys_at)
    return node if isinstance(node, dict) else {}


def read_config(folder: Path, problems: list[Violation]) -> dict | None:
    path = folder / CONFIG_FILE
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        problems.append(Violation(str(path), "a config.json", "no file", "re-run the export"))
        return None
    except json.JSONDecodeError as err:
        problems.append(Violation(str(path), "valid JSON", f"a parse error ({err})", "re-run the export"))
        return None
    return cfg


def read_tensor_specs(path: Path, problems: list[Violation]) -> dict[str, tuple[str, tuple]] | None:
    """name -> (safetensors dtype, shape), read from the header only (nothing is unpickled)."""
    try:
        with safe_open(str(path), "pt") as fh:
            return {n: (fh.get_slice(n).get_dtype(), tuple(fh.get_slice(n).get_shape())) for n in fh.keys()}
    except FileNotFoundError:
        problems.append(Violation(str(path), "the weights file", "no file", "re-run the export"))
    except (SafetensorError, OSError, ValueError) as err:
        problems.append(Violation(str(path), "a readable safetensors file", f"an error ({err})",
                                  "the file is truncated or corrupt; re-run the export"))
    return None


def check_files(folder: Path) -> list[Violation]:
    """Only one safetensors file and no pickles: engines fall back to *.bin / *.pt if they see them."""
    out = []
    for path in sorted(folder.iterdir()):
        if path.suffix in {".bin", ".pt", ".pth", ".pkl"} or (
                path.suffix == ".safetensors" and path.name != WEIGHTS_FILE) or path.name.endswith(".index.json"):
            out.append(Violation(str(path), f"only {WEIGHTS_FILE} as weights", "an extra weights file",
                                 "remove it: the loaders may read it instead of, or as well as, the export"))
    return out


# --- config keys ------------------------------------------------------------------------------
def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _rope_ok(node) -> bool:
    rope = config_rope(node) if isinstance(node, dict) else None
    theta = rope.get("rope_theta") if rope else None
    return isinstance(theta, (int, float)) and not isinstance(theta, bool)


KEY_CHECKS = {  # check -> (passes(value, rule), what was expected)
    "absent": (lambda v, r: v is MISSING, lambda r: "no such key"),
    "equals": (lambda v, r: v is not MISSING and v == r.value and type(v) is type(r.value),
               lambda r: json.dumps(r.value)),
    "bool": (lambda v, r: isinstance(v, bool), lambda r: "true or false"),
    "positive_int": (lambda v, r: _int(v) and v > 0, lambda r: "a positive integer"),
    "number": (lambda v, r: _int(v) or isinstance(v, float), lambda r: "a number"),
    "str": (lambda v, r: isinstance(v, str) and bool(v), lambda r: "a non-empty string"),
    "dict": (lambda v, r: isinstance(v, dict), lambda r: "a JSON object"),
    "not_true": (lambda v, r: v is not True, lambda r: "false or absent"),
    "rope": (lambda v, r: _rope_ok(v), lambda r: "rope_parameters.rope_theta (or legacy rope_theta)"),
    "one_of": (lambda v, r: v in r.value, lambda r: " or ".join(json.dumps(x) for x in r.value)),
}


def _found(value) -> str:
    return "no key" if value is MISSING else json.dumps(value)[:120]


def check_key_rules(cfg: dict, rules, at: str = "", checks: dict = KEY_CHECKS) -> list[Violation]:
    """config.json against key rules (each key under the dotted path `at`); `checks` maps a rule's
    check to (passes(value, rule), what was expected)."""
    out = []
    for rule in rules:
        key = ".".join(p for p in (at, rule.key) if p)
        passes, expected = checks[rule.check]
        value = get_key(cfg, key)
        if not passes(value, rule):
            found = "no RoPE keys" if rule.check == "rope" else _found(value)
            out.append(Violation(f"{CONFIG_FILE}: {key or 'RoPE keys'}", expected(rule), found,
                                 rule.fix or "re-run the export"))
    return out


def check_keys(cfg: dict, contract: FormatContract) -> list[Violation]:
    """Every format key rule, then the decoder-layer keys wherever this format keeps them."""
    return check_key_rules(cfg, contract.keys) + check_key_rules(cfg, LAYER_KEYS, at=contract.layer_keys_at)


def aux_ids(cfg: dict, contract: FormatContract):
    return get_key(cfg, contract.aux_ids_key)


def check_aux(cfg: dict, contract: FormatContract) -> list[Violation]:
    """The aux-layer id list: present in the engine's place, well formed, consistent with its count."""
    ids, where = aux_ids(cfg, contract), f"{CONFIG_FILE}: {contract.aux_ids_key}"
    numbering = f"{ENGINE_NAMES[contract.engine]} numbering (first valid id {contract.min_aux_id})"
    if ids is MISSING:
        return [Violation(where, f"the aux-layer ids in {numbering}", "no key",
                          "without it the engine taps its default layers, not the trained ones")]
    if not (isinstance(ids, list) and ids and all(_int(i) for i in ids)
            and ids == sorted(set(ids)) and ids[0] >= contract.min_aux_id):
        return [Violation(where, f"distinct ascending integer ids in {numbering}", _found(ids),
                          "write the head's aux_layers converted to this engine's numbering")]
    num_key = ".".join(p for p in (contract.layer_keys_at, "num_aux_hidden_states") if p)
    num = get_key(cfg, num_key)
    if num is MISSING and len(ids) != 3 and contract.engine == "vllm":
        return [Violation(f"{CONFIG_FILE}: {num_key}", str(len(ids)), "no key",
                          "vLLM's Llama EAGLE-3 sizes fc for 3 aux states unless told otherwise")]
    if num is not MISSING and num != len(ids):
        return [Violation(f"{CONFIG_FILE}: {num_key}", f"{len(ids)} (the number of aux ids)", _found(num),
                          "make the count match the id list")]
    return []


# --- tensors ----------------------------------------------------------------------------------
def config_dims(cfg: dict, contract: FormatContract) -> dict[str, int]:
    """Symbolic dims (Hd, H, nh, kvh, hd, I, V, Vd, n_aux) from config.json; unknown ones are left out."""
    layer = layer_config(cfg, contract)
    keys = {"Hd": "hidden_size", "nh": "num_attention_heads", "kvh": "num_key_value_heads",
            "hd": "head_dim", "I": "intermediate_size", "V": "vocab_size"}
    dims = {sym: layer.get(key) for sym, key in keys.items()}
    dims.update(Vd=cfg.get("draft_vocab_size"), H=cfg.get("target_hidden_size", dims["Hd"]))
    dims = {k: v for k, v in dims.items() if _int(v)}
    if "hd" not in dims and {"Hd", "nh"} <= dims.keys():
        dims["hd"] = dims["Hd"] // dims["nh"]
    ids = aux_ids(cfg, contract)
    dims["n_aux"] = len(ids) if isinstance(ids, list) else 3
    dims["parallel"] = int(is_parallel(cfg))
    return dims


def is_parallel(cfg: dict) -> bool:
    """P-EAGLE: speculators type peagle (all vLLM reads there), or a native config saying parallel_drafting."""
    if "speculators_model_type" in cfg:
        return cfg["speculators_model_type"] == "peagle"
    return cfg.get("parallel_drafting") is True


def check_parallel(cfg: dict, contract: FormatContract) -> list[Violation]:
    """A P-EAGLE config names its mask token (vLLM: mask_token_id, or pard_token natively) inside V."""
    if contract.engine != "vllm" or not is_parallel(cfg):
        return []
    mask = cfg.get("mask_token_id", MISSING if contract.layer_keys_at else cfg.get("pard_token", MISSING))
    V = layer_config(cfg, contract).get("vocab_size")
    if not _int(mask):
        return [Violation(f"{CONFIG_FILE}: mask_token_id", "the mask token id (an integer)", _found(mask),
                          "vLLM fills the parallel-drafting slots with it and refuses to start without it")]
    if _int(V) and not 0 <= mask < V:
        return [Violation(f"{CONFIG_FILE}: mask_token_id", f"< vocab_size {V}", str(mask),
                          "the mask token is embedded with the target's table; pick an id inside it")]
    return []


def expected_shape(exprs: tuple[str, ...], dims: dict[str, int]) -> tuple[int, ...] | None:
    """('nh*hd', '2*Hd') -> concrete shape; None when a dim is unknown (its key is reported already)."""
    shape = []
    for expr in exprs:
        size = 1
        for factor in expr.split("*"):
            if factor.isdigit():
                size *= int(factor)
            elif factor in dims:
                size *= dims[factor]
            else:
                return None
        shape.append(size)
    return tuple(shape)


def _dtype_ok(rule_dtype: str, found: str) -> bool:
    return found in FLOAT_DTYPES if rule_dtype == "float" else found == {"int64": "I64", "bool": "BOOL"}[rule_dtype]


def check_tensors(specs: dict, dims: dict, contract: FormatContract) -> list[Violation]:
    """Required names present with the config's shapes and the right dtypes; no stray names."""
    allowed = {r.name.format(layer=contract.layer_prefix): r for r in contract.tensors}
    out = []
    reduced = dims.get("Vd") != dims.get("V")
    for name, rule in allowed.items():
        where = f"{WEIGHTS_FILE}: {name}"
        if name in specs and rule.need == "if_parallel" and not dims.get("parallel"):
            out.append(Violation(where, "no such tensor (the config does not draft in parallel)", "a tensor",
                                 "vLLM skips it with a warning unless parallel_drafting is on; remove it "
                                 "or export the head as P-EAGLE"))
            continue
        if rule.vocab_map and not reduced:
            if name in specs:
                out.append(Violation(where, "no such tensor", "the tensor", VOCAB_MAP_FIX))
            continue
        if name not in specs:
            if rule.need == "required" or (rule.need == "if_hidden_differs" and dims.get("Hd") != dims.get("H")) \
                    or (rule.need == "if_parallel" and dims.get("parallel")):
                out.append(Violation(where, "the tensor", "no tensor", f"{ENGINE_NAMES[contract.engine]} does not "
                                     "report missing draft tensors (they stay uninitialised); re-export"))
            continue
        dtype, shape = specs[name]
        if not _dtype_ok(rule.dtype, dtype):
            fix = ("weights are floating point; re-export" if rule.dtype == "float" else
                   "d2t holds integer offsets (target = i + d2t[i]) and t2d a bool mask; never cast them")
            out.append(Violation(where, f"dtype {DTYPE_NAMES[rule.dtype]}", dtype, fix))
        want = expected_shape(rule.shape, dims)
        if want is not None and shape != want:
            out.append(Violation(where, f"shape {list(want)} ({' x '.join(rule.shape)} from config.json)",
                                 str(list(shape)), "the weights and config.json disagree; re-export"))
    return out + check_names(specs, allowed, contract) + check_float_dtypes(specs)


def check_names(specs: dict, allowed: dict, contract: FormatContract) -> list[Violation]:
    """Forbidden spellings, a mixed layer spelling, and any name the format does not define."""
    out = []
    if any(n.startswith("layers.0.") for n in specs) and any(n.startswith("midlayer.") for n in specs):
        out.append(Violation(f"{WEIGHTS_FILE}: layers.0.* and midlayer.*", "one spelling of the draft layer",
                             "both", f"loaders alias one onto the other, so one set silently overwrites the "
                             f"other; keep only {contract.layer_prefix}*"))
    for name in sorted(set(specs) - set(allowed)):
        why = next((w for pat, w in FORBIDDEN_TENSORS if re.search(pat, name)), None)
        why = why or (f"not a tensor of this format (the layer is spelled {contract.layer_prefix}*); "
                      "the engine would fail or silently drop it: rename or remove it")
        out.append(Violation(f"{WEIGHTS_FILE}: {name}", "no such tensor", "an unexpected tensor", why))
    return out


def check_float_dtypes(specs: dict) -> list[Violation]:
    floats = sorted({d for d, _ in specs.values() if d in FLOAT_DTYPES})
    if len(floats) > 1:
        return [Violation(WEIGHTS_FILE, "one floating dtype for all weights", ", ".join(floats),
                          "export with a single dtype")]
    return []


# --- consistency with the trained head --------------------------------------------------------
def config_rope(node: dict) -> dict | None:
    """RoPE settings from a config dict: rope_parameters, or legacy rope_theta (+ rope_scaling)."""
    params = node.get("rope_parameters")
    if isinstance(params, dict):
        return dict(params)
    if "rope_theta" not in node:
        return None
    scaling = node.get("rope_scaling") or {}
    return {"rope_type": scaling.get("rope_type", scaling.get("type", "default")),
            **{k: v for k, v in scaling.items() if k not in ("type", "rope_type")},
            "rope_theta": node["rope_theta"]}


def _layer_path(contract: FormatContract) -> str:
    return f"{contract.layer_keys_at}." if contract.layer_keys_at else ""


def check_against_head(cfg: dict, contract: FormatContract, head: dict) -> list[Violation]:
    """Sizes, RoPE, residual rule, context length and aux ids agree with the trained head's config."""
    layer, at, out = layer_config(cfg, contract), _layer_path(contract), []
    sizes = [(k, layer, at) for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                      "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps")]
    for key, node, prefix in sizes + [("draft_vocab_size", cfg, ""), ("target_hidden_size", cfg, "")]:
        found = node.get(key, head["hidden_size"] if key == "target_hidden_size" else MISSING)
        if found is not MISSING and found != head[key]:
            out.append(Violation(f"{CONFIG_FILE}: {prefix}{key}", f"{head[key]} (the trained head's)",
                                 _found(found), "export again from the checkpoint this head came from"))
    if config_rope(layer) not in (None, head["rope_parameters"]):
        out.append(Violation(f"{CONFIG_FILE}: {at}rope_parameters", json.dumps(head["rope_parameters"]),
                             json.dumps(config_rope(layer)), "copy the head's (= the target's) RoPE settings"))
    out += _check_residual(cfg, contract, head)
    if is_parallel(cfg) != bool(head.get("parallel_drafting", False)):
        out.append(Violation(f"{CONFIG_FILE}: parallel_drafting", json.dumps(bool(head.get("parallel_drafting"))),
                             json.dumps(is_parallel(cfg)), "P-EAGLE heads draft in parallel, EAGLE-3 heads do "
                             "not: export again from the checkpoint"))
    mpe = layer.get("max_position_embeddings")
    if _int(mpe) and mpe < head["max_position_embeddings"]:
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
                      _found(ids), f"{hint}write the trained layers converted to {engine} numbering")]


# --- the checker --------------------------------------------------------------------------------
def _head_dict(expected, folder: Path) -> dict | None:
    """The trained head's config: the argument, else the folder's own specheads.json record."""
    if expected is not None:
        return asdict(expected) if is_dataclass(expected) else dict(expected)
    try:
        return json.loads((folder / META_FILE).read_text()).get("head_config")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None


def check_folder(folder: Path, fmt: str, weights_file: str, expected, *, files, keys, against_head,
                 tensors) -> None:
    """The validate skeleton every kind shares: read config.json and the weights' header, run the
    kind's checks (files(folder), keys(cfg), against_head(cfg, head), tensors(specs, cfg)) and raise
    ContractError listing every violation."""
    problems: list[Violation] = []
    cfg = read_config(folder, problems)
    specs = read_tensor_specs(folder / weights_file, problems)
    if folder.is_dir():
        problems += files(folder)
    if cfg is not None:
        problems += keys(cfg)
        head = _head_dict(expected, folder)
        if head is not None:
            problems += against_head(cfg, head)
    if cfg is not None and specs is not None:
        problems += tensors(specs, cfg)
    if problems:
        raise ContractError(folder, fmt, problems)


def validate(folder: str | Path, engine: str, kind: str = "eagle3", expected=None) -> None:
    """Check an export folder against the (format, kind) contract; raise ContractError listing
    every violation. `expected` (the head config; default: the folder's specheads.json) adds the
    checks against the trained head."""
    folder, contract = Path(folder), contract_for(engine, kind)
    check_folder(
        folder, engine, WEIGHTS_FILE, expected, files=check_files,
        keys=lambda cfg: check_keys(cfg, contract) + check_aux(cfg, contract) + check_parallel(cfg, contract),
        against_head=lambda cfg, head: check_against_head(cfg, contract, head),
        tensors=lambda specs, cfg: check_tensors(specs, config_dims(cfg, contract), contract))
