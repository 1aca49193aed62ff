"""The contract checker every kind's `validate` is built from: reading config.json and the weights'
header, key rules (`contract_rules.KeyRule`), tensor rules over a `FormatContract`, and the skeleton
`check_folder` that runs a kind's checks and reports every violation at once.

The tables encode docs/engines.md (§2.2-2.4 for vLLM, §3.1-3.2 for SGLang). The engines are
fail-silent on many of these rules (a missing EAGLE-3 tensor stays uninitialised, a misnamed one
is dropped), so every export is checked before it is renamed into place.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, is_dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open

from specheads.export.contract_rules import (
    CONFIG_FILE,
    DTYPE_NAMES,
    ENGINE_NAMES,
    FLOAT_DTYPES,
    FORBIDDEN_TENSORS,
    META_FILE,
    VOCAB_MAP_FIX,
    WEIGHTS_FILE,
    ContractError,
    FormatContract,
    Violation,
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
def is_int(v) -> bool:
    """An int that is not a bool (JSON integers)."""
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
    "positive_int": (lambda v, r: is_int(v) and v > 0, lambda r: "a positive integer"),
    "number": (lambda v, r: is_int(v) or isinstance(v, float), lambda r: "a number"),
    "str": (lambda v, r: isinstance(v, str) and bool(v), lambda r: "a non-empty string"),
    "dict": (lambda v, r: isinstance(v, dict), lambda r: "a JSON object"),
    "not_true": (lambda v, r: v is not True, lambda r: "false or absent"),
    "rope": (lambda v, r: _rope_ok(v), lambda r: "rope_parameters.rope_theta (or legacy rope_theta)"),
    "one_of": (lambda v, r: v in r.value, lambda r: " or ".join(json.dumps(x) for x in r.value)),
}


def found_text(value) -> str:
    """A config value as a violation reports it found ("no key" when absent)."""
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
            found = "no RoPE keys" if rule.check == "rope" else found_text(value)
            out.append(Violation(f"{CONFIG_FILE}: {key or 'RoPE keys'}", expected(rule), found,
                                 rule.fix or "re-run the export"))
    return out


def aux_ids(cfg: dict, contract: FormatContract):
    return get_key(cfg, contract.aux_ids_key)


# --- tensors ----------------------------------------------------------------------------------
def config_dims(cfg: dict, contract: FormatContract) -> dict[str, int]:
    """Symbolic dims (Hd, H, nh, kvh, hd, I, V, Vd, n_aux) from config.json; unknown ones are left out."""
    layer = layer_config(cfg, contract)
    keys = {"Hd": "hidden_size", "nh": "num_attention_heads", "kvh": "num_key_value_heads",
            "hd": "head_dim", "I": "intermediate_size", "V": "vocab_size"}
    dims = {sym: layer.get(key) for sym, key in keys.items()}
    dims.update(Vd=cfg.get("draft_vocab_size"), H=cfg.get("target_hidden_size", dims["Hd"]))
    dims = {k: v for k, v in dims.items() if is_int(v)}
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
