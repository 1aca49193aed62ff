"""EAGLE 3.1 options (norm_before_fc, fc_norm, norm_output) and the Qwen3-style layer (qk_norm) in an
EAGLE-3 export: the keys written, how each engine reads them back, the checks of a folder that carries
them and the tensors each option adds (docs/engines.md §2.2, §2.3, §3.1).
"""

from __future__ import annotations

import json
from dataclasses import replace

from specheads.engine_facts import PEAGLE_SPECULATORS_DROPS
from specheads.export.contract import MISSING, config_dims, found_text, is_parallel, layer_config
from specheads.export.contract_rules import CONFIG_FILE, EAGLE31_TENSORS, ENGINE_NAMES, FormatContract, TensorRule, Violation

EAGLE31_OPTIONS = ("norm_before_fc", "fc_norm", "norm_output")  # top-level bools, false when absent
NATIVE_ARCHITECTURE = {False: "LlamaForCausalLM", True: "Qwen3ForCausalLM"}  # by qk_norm (vLLM: Eagle3 + it)


def option_keys(config) -> dict:
    """The EAGLE 3.1 flags, at config.json's top level (where every engine reads them)."""
    return {name: bool(getattr(config, name)) for name in EAGLE31_OPTIONS}


def engine_options(cfg: dict, contract: FormatContract) -> dict[str, bool]:
    """The EAGLE 3.1 flags and qk_norm as the format's engine reads config.json (absent = false):
    vLLM native and SGLang let eagle_config.norm_before_fc win over the top-level key, SGLang also
    reads fc_norm's legacy name use_aux_norm; the layer is Qwen3-style when vLLM builds
    Eagle3Qwen3ForCausalLM (speculators: transformer_layer_config.model_type qwen3; native: the
    Qwen3ForCausalLM architecture)."""
    eagle = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    speculators = bool(contract.layer_keys_at)
    before_fc = cfg.get("norm_before_fc", False) if speculators else eagle.get(
        "norm_before_fc", cfg.get("norm_before_fc", False))
    legacy = cfg.get("use_aux_norm", False) if contract.engine == "sglang" else False
    qwen3 = (layer_config(cfg, contract).get("model_type") == "qwen3" if speculators
             else contract.engine == "vllm" and cfg.get("architectures") == [NATIVE_ARCHITECTURE[True]])
    flags = {"norm_before_fc": before_fc is True, "fc_norm": (cfg.get("fc_norm") or legacy) is True,
             "norm_output": cfg.get("norm_output", False) is True, "qk_norm": qwen3}
    if speculators and is_parallel(cfg):
        flags.update(dict.fromkeys(PEAGLE_SPECULATORS_DROPS, False))
    return flags


def option_where(name: str, contract: FormatContract) -> str:
    """The config.json key that carries option `name` in this format."""
    if name != "qk_norm":
        return f"{CONFIG_FILE}: {name}"
    return f"{CONFIG_FILE}: {contract.layer_keys_at}.model_type" if contract.layer_keys_at else f"{CONFIG_FILE}: architectures"


def check_options(cfg: dict, contract: FormatContract) -> list[Violation]:
    """Options the engine would run differently: both fc norms, fc_norm / norm_output where the
    speculators peagle reader drops them, a native config whose model_type and architecture disagree."""
    out = []
    if cfg.get("norm_before_fc") is True and cfg.get("fc_norm") is True:
        out.append(Violation(f"{CONFIG_FILE}: norm_before_fc, fc_norm", "at most one of them true", "both true",
                             "the engines would apply both norms, the head trains one: export again"))
    if contract.layer_keys_at and is_parallel(cfg):
        out += [Violation(f"{CONFIG_FILE}: {o}", "false or absent", "true", f"{why}; export with --format vllm-native")
                for o, why in PEAGLE_SPECULATORS_DROPS.items() if cfg.get(o) is True]
    if not contract.layer_keys_at and contract.engine == "vllm":
        qwen3_arch = cfg.get("architectures") == [NATIVE_ARCHITECTURE[True]]
        if (cfg.get("model_type") == "qwen3") != qwen3_arch:
            out.append(Violation(f"{CONFIG_FILE}: model_type", json.dumps("qwen3" if qwen3_arch else "llama")
                                 + " (to match architectures)", found_text(cfg.get("model_type", MISSING)),
                                 "Qwen3ForCausalLM goes with model_type qwen3, LlamaForCausalLM with llama"))
    return out


def option_tensors(cfg: dict, contract: FormatContract) -> tuple[TensorRule, ...]:
    """The tensor rules of the options the engine reads as on (fc_norm: one per aux feature)."""
    flags, n_aux = engine_options(cfg, contract), config_dims(cfg, contract)["n_aux"]
    rules = []
    for name, templates in EAGLE31_TENSORS.items():
        if flags[name]:
            rules += [replace(r, name=r.name.replace("{j}", str(j))) for r in templates
                      for j in (range(n_aux) if "{j}" in r.name else (0,))]
    return tuple(rules)


def check_options_against_head(cfg: dict, contract: FormatContract, head: dict) -> list[Violation]:
    """Each option as the engine reads this config equals the trained head's."""
    return [Violation(option_where(name, contract), f"{name} {json.dumps(bool(head.get(name)))} (the trained head's)",
                      f"{name} {json.dumps(value)} as {ENGINE_NAMES[contract.engine]} reads this config",
                      "the draft would compute a different layer; export again from the checkpoint")
            for name, value in engine_options(cfg, contract).items() if value != bool(head.get(name, False))]
