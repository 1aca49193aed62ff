"""Where MTP modules live in a target family's checkpoint, and reading them from one.

The same names serve the target checkpoints that ship MTP layers (`head.init: shipped`) and our
exports, which write the trained modules into a copy of the target (export/mtp.py); the layouts
are described in docs/engines.md (MTP). DeepSeek-V3 / GLM-4 MoE: module k is `model.layers.{L+k}.*`
(own tensors enorm, hnorm, eh_proj, shared_head.norm beside the decoder block). Qwen3-Next and
Qwen3.5: one set of `mtp.{fc,pre_fc_norm_embedding,pre_fc_norm_hidden,norm}` and `mtp.layers.{k}.*`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM
from transformers.core_model_loading import revert_weight_conversion

INDEX_FILE = "model.safetensors.index.json"
MTP_LAYOUTS = {  # model_type -> (layout, config key counting the modules)
    "deepseek_v3": ("deepseek", "num_nextn_predict_layers"),
    "glm4_moe": ("deepseek", "num_nextn_predict_layers"),
    "qwen3_next": ("qwen3_next", "num_nextn_predict_layers"),
    "qwen3_5_text": ("qwen3_next", "mtp_num_hidden_layers"),  # Qwen3.5: same `mtp.*` names, its own count key
    "qwen3_5_moe_text": ("qwen3_next", "mtp_num_hidden_layers"),
}
# layout -> head name (layers.{k}.X) -> checkpoint name; {p} = module prefix. Layout "qwen3_next" is the
# `mtp.*` one, shared by Qwen3-Next and Qwen3.5.
MTP_NAMES = {
    "deepseek": {"enorm": "{p}enorm.weight", "hnorm": "{p}hnorm.weight", "eh_proj": "{p}eh_proj.weight",
                 "norm": "{p}shared_head.norm.weight"},
    "qwen3_next": {"enorm": "mtp.pre_fc_norm_embedding.weight", "hnorm": "mtp.pre_fc_norm_hidden.weight",
                   "eh_proj": "mtp.fc.weight", "norm": "mtp.norm.weight"},
}


class MtpCheckpointError(ValueError):
    """A checkpoint folder without the MTP modules a head needs, or in a layout we cannot read."""


def layout_of(config) -> tuple[str, str]:
    """(layout, count key) of an MtpConfig's target family (or of a config.json dict)."""
    cfg = config if isinstance(config, dict) else config.target_config
    model_type = cfg.get("model_type")
    if model_type not in MTP_LAYOUTS:
        raise MtpCheckpointError(f"target family '{model_type}' has no known MTP checkpoint layout; "
                                 f"families with one: {', '.join(MTP_LAYOUTS)}")
    return MTP_LAYOUTS[model_type]


def block_prefix(layout: str, L: int, k: int) -> str:
    return f"model.layers.{L + k}." if layout == "deepseek" else f"mtp.layers.{k}."


def own_names(layout: str, L: int, k: int) -> dict[str, str]:
    """Head module tensors (enorm, hnorm, eh_proj, norm) -> checkpoint names for module k."""
    p = block_prefix(layout, L, k)
    return {part: name.format(p=p) for part, name in MTP_NAMES[layout].items()}


def mtp_names(wm: dict[str, str], layout: str, L: int) -> list[str]:
    """Every tensor name that belongs to MTP modules in this layout."""
    pat = re.compile(r"^mtp\." if layout == "qwen3_next" else r"^model\.layers\.(\d+)\.")
    return [n for n in wm if (m := pat.match(n)) and (layout == "qwen3_next" or int(m[1]) >= L)]


def meta_model(config):
    """An MtpConfig's target model class on the meta device: only its weight-conversion rules are used."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config.hf_config())


# --- reading a checkpoint folder ------------------------------------------------------------------
def weight_map(folder: Path) -> dict[str, str]:
    """tensor name -> shard file, from the index or the single model.safetensors."""
    if (folder / INDEX_FILE).is_file():
        return dict(json.loads((folder / INDEX_FILE).read_text())["weight_map"])
    single = folder / "model.safetensors"
    if not single.is_file():
        raise MtpCheckpointError(f"{folder}: no {INDEX_FILE} and no model.safetensors; pass the target's HF folder")
    with safe_open(str(single), "pt") as fh:
        return dict.fromkeys(fh.keys(), single.name)


def read_tensors(folder: Path, names) -> dict[str, torch.Tensor]:
    wm, out = weight_map(folder), {}
    for name in names:
        with safe_open(str(folder / wm[name]), "pt") as fh:
            out[name] = fh.get_tensor(name)
    return out


def block_from_checkpoint(module, tensors: dict[str, torch.Tensor], where: str, model) -> None:
    """Checkpoint-named block tensors (prefix stripped) -> module.block, stacking per-expert weights
    the way transformers fuses them, then checking the round trip reproduces every tensor exactly."""
    own = module.block.state_dict()
    state = {n: t for n, t in tensors.items() if n in own}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in tensors.items():
        m = re.match(r"^(.*experts)\.(\d+)\.(gate|up|down)_proj\.weight$", name)
        if m:
            experts.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = t
    for prefix, by_id in experts.items():
        ids = sorted(by_id)
        state[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([by_id[e]["gate"], by_id[e]["up"]]) for e in ids])
        state[f"{prefix}.down_proj"] = torch.stack([by_id[e]["down"] for e in ids])
    missing = sorted(set(own) - set(state))
    bad = [n for n in state if n in own and state[n].shape != own[n].shape]
    if missing or bad:
        raise MtpCheckpointError(f"{where}: the MTP block lacks tensors of the target's decoder layer (missing "
                                 f"{missing[:4]}, wrong shape {bad[:4]}); export the MTP layers again")
    module.block.load_state_dict({n: state[n].to(own[n].dtype) for n in own})
    idx = "model.layers.0."  # conversion rules match full parameter names
    back = revert_weight_conversion(model, {idx + n: t for n, t in module.block.state_dict().items()})
    back = {n[len(idx):]: t for n, t in back.items()}
    if set(back) != set(tensors) or any(not torch.equal(back[n].to(tensors[n].dtype), tensors[n]) for n in back):
        raise MtpCheckpointError(f"{where}: the MTP block's tensors do not load losslessly (a layout this "
                                 "version cannot convert); report the target family")


def load_modules(head, folder: Path) -> None:
    """Fill every module of an MtpHead from the MTP tensors in a checkpoint folder (target or export)."""
    cfg = head.config
    layout, _ = layout_of(cfg)
    L, wm = cfg.num_target_layers, weight_map(folder)
    model = meta_model(cfg)
    for k, module in enumerate(head.layers):
        names = own_names(layout, L, k)
        prefix = block_prefix(layout, L, k)
        block_names = [n for n in wm if n.startswith(prefix) and n not in names.values() and "shared_head" not in n
                       and "embed_tokens" not in n]
        absent = [n for n in names.values() if n not in wm]
        if absent or not block_names:
            raise MtpCheckpointError(f"{folder}: MTP module {k} is not in this checkpoint "
                                     f"(missing {absent[:3] or prefix + '*'})")
        own = read_tensors(folder, names.values())
        with torch.no_grad():
            for part, name in names.items():
                getattr(module, part).weight.copy_(own[name])
        block = read_tensors(folder, block_names)
        block_from_checkpoint(module, {n[len(prefix):]: t for n, t in block.items()}, str(folder), model)
