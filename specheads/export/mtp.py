"""MTP export: the trained modules written into a copy of the target checkpoint, where the engines
read the target family's own MTP layers (vllm_contract.md §6, sglang_contract.md §4 / C).

DeepSeek-V3 / GLM-4 MoE: `model.layers.{L+k}.{enorm,hnorm,eh_proj,shared_head.norm,shared_head.head}`
plus the decoder block under the target's own layer names, counted by `num_nextn_predict_layers`.
Qwen3-Next and Qwen3.5: `mtp.{fc,pre_fc_norm_embedding,pre_fc_norm_hidden,norm}` and `mtp.layers.{k}.*`,
counted by `num_nextn_predict_layers` (Qwen3-Next) or `mtp_num_hidden_layers` (Qwen3.5).
The target's shards are linked (or copied) unchanged except those holding stale MTP tensors; the
modules go to `model-mtp.safetensors` and the index is rewritten. The same folder serves vLLM
(`method: mtp`) and SGLang (NEXTN); the formats differ in their checks and serve commands.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specheads.export.contract_rules import (
    CONFIG_FILE, META_FILE, MTP_FAMILIES, MTP_NAMES, MTP_SGLANG_MAX_LAYERS, MTP_SHAPES, ContractError,
    Violation,
)
from specheads.export.eagle3 import DTYPES, ExportRefused
from specheads.heads.mtp import ZERO_FIRST_EMBEDDING, MtpConfig, MtpHead, target_config_dict

FORMATS = ("vllm", "sglang")
INDEX_FILE = "model.safetensors.index.json"
MTP_FILE = "model-mtp.safetensors"
REFUSED = {f: "an MTP head lives inside the target checkpoint; export it with --format vllm or --format sglang"
           for f in ("vllm-native", "vllm-0.32", "medusa")}


# --- layout ------------------------------------------------------------------------------------
def family(config: MtpConfig | dict) -> tuple[str, str]:
    """(layout, count key) of the target family, or ExportRefused naming the families that have one."""
    cfg = config.target_config if isinstance(config, MtpConfig) else config
    model_type = cfg.get("model_type")
    if model_type not in MTP_FAMILIES:
        arch = (cfg.get("architectures") or ["?"])[0]
        raise ExportRefused(
            f"target family '{model_type}' ({arch}) has no MTP draft class in vLLM 0.33 or SGLang 0.5.23, so "
            f"neither engine can serve MTP modules for it. Families with one: {', '.join(MTP_FAMILIES)}. "
            "For this target train an EAGLE-3 head or a draft model (recipes/eagle3, recipes/draft)")
    return MTP_FAMILIES[model_type]


def check_exportable(config: MtpConfig, fmt: str, weights=None) -> None:
    layout, _ = family(config)
    if layout == "qwen3_next" and config.num_layers != 1:
        raise ExportRefused(f"the `mtp.*` layout (Qwen3-Next, Qwen3.5) has one fc and one set of norms for all "
                            f"layers; this head has "
                            f"{config.num_layers} modules. Train it with head.num_layers: 1")
    if fmt == "sglang" and config.num_layers > MTP_SGLANG_MAX_LAYERS[layout]:
        raise ExportRefused(f"SGLang 0.5.23 asserts num_nextn_predict_layers == 1 for this family; this head has "
                            f"{config.num_layers} modules. Export it with --format vllm, or train head.num_layers: 1")


def block_prefix(layout: str, L: int, k: int) -> str:
    return f"model.layers.{L + k}." if layout == "deepseek" else f"mtp.layers.{k}."


def own_names(layout: str, L: int, k: int) -> dict[str, str]:
    """Head module tensors (enorm, hnorm, eh_proj, norm) -> checkpoint names for module k."""
    p = block_prefix(layout, L, k)
    return {part: name.format(p=p) for part, name in MTP_NAMES[layout].items()}


def meta_model(config: MtpConfig):
    """The target's model class on the meta device: only its weight-conversion rules are used."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config.hf_config())


def to_checkpoint(head: MtpHead, lm_head: torch.Tensor) -> dict[str, torch.Tensor]:
    """Head weights -> checkpoint names, the block in the target's on-disk format (fused experts undone)."""
    from transformers.core_model_loading import revert_weight_conversion

    cfg, (layout, _) = head.config, family(head.config)
    L, model, out = cfg.num_target_layers, meta_model(cfg), {}
    for k, module in enumerate(head.layers):
        for part, name in own_names(layout, L, k).items():
            out[name] = getattr(module, part).weight.detach()
        idx = f"model.layers.{L + k}."
        block = {idx + n: t.detach() for n, t in module.block.state_dict().items()}
        for name, t in revert_weight_conversion(model, block).items():
            out[block_prefix(layout, L, k) + name[len(idx):]] = t
        if layout == "deepseek":
            out[f"{idx}shared_head.head.weight"] = lm_head.clone()  # vLLM's strict loader wants it (then uses the target's)
    return {n: t.cpu().contiguous() for n, t in out.items()}


def block_from_checkpoint(module, tensors: dict[str, torch.Tensor], where: str, model) -> None:
    """Checkpoint-named block tensors (prefix stripped) -> module.block, stacking per-expert weights
    the way transformers fuses them, then checking the round trip reproduces every tensor exactly."""
    from transformers.core_model_loading import revert_weight_conversion

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
        raise ContractError(Path(where), "mtp", [Violation(where, "every tensor of the target's decoder layer",
                            f"missing {missing[:4]}, wrong shape {bad[:4]}", "export the MTP layers again")])
    module.block.load_state_dict({n: state[n].to(own[n].dtype) for n in own})
    idx = "model.layers.0."  # conversion rules match full parameter names
    back = revert_weight_conversion(model, {idx + n: t for n, t in module.block.state_dict().items()})
    back = {n[len(idx):]: t for n, t in back.items()}
    if set(back) != set(tensors) or any(not torch.equal(back[n].to(tensors[n].dtype), tensors[n]) for n in back):
        raise ContractError(Path(where), "mtp", [Violation(where, "block tensors that load losslessly",
                            "a layout this version cannot convert", "report the target family")])


# --- reading a checkpoint folder ------------------------------------------------------------------
def weight_map(folder: Path) -> dict[str, str]:
    """tensor name -> shard file, from the index or the single model.safetensors."""
    if (folder / INDEX_FILE).is_file():
        return dict(json.loads((folder / INDEX_FILE).read_text())["weight_map"])
    single = folder / "model.safetensors"
    if not single.is_file():
        raise ExportRefused(f"{folder}: no {INDEX_FILE} and no model.safetensors; pass the target's HF folder")
    with safe_open(str(single), "pt") as fh:
        return {n: single.name for n in fh.keys()}


def read_tensors(folder: Path, names) -> dict[str, torch.Tensor]:
    wm, out = weight_map(folder), {}
    for name in names:
        with safe_open(str(folder / wm[name]), "pt") as fh:
            out[name] = fh.get_tensor(name)
    return out


def mtp_names(wm: dict[str, str], layout: str, L: int) -> list[str]:
    """Every tensor name that belongs to MTP modules in this layout."""
    pat = re.compile(r"^mtp\." if layout == "qwen3_next" else r"^model\.layers\.(\d+)\.")
    return [n for n in wm if (m := pat.match(n)) and (layout == "qwen3_next" or int(m[1]) >= L)]


def load_modules(head: MtpHead, folder: Path) -> None:
    """Fill every module of `head` from the MTP tensors in a checkpoint folder (target or export)."""
    cfg = head.config
    layout, _ = family(cfg)
    L, wm = cfg.num_target_layers, weight_map(folder)
    model = meta_model(cfg)
    for k, module in enumerate(head.layers):
        names = own_names(layout, L, k)
        prefix = block_prefix(layout, L, k)
        block_names = [n for n in wm if n.startswith(prefix) and n not in names.values() and "shared_head" not in n
                       and "embed_tokens" not in n]
        absent = [n for n in names.values() if n not in wm]
        if absent or not block_names:
            raise ExportRefused(f"{folder}: MTP module {k} is not in this checkpoint (missing {absent[:3] or prefix + '*'})")
        own = read_tensors(folder, names.values())
        with torch.no_grad():
            for part, name in names.items():
                getattr(module, part).weight.copy_(own[name])
        block = read_tensors(folder, block_names)
        block_from_checkpoint(module, {n[len(prefix):]: t for n, t in block.items()}, str(folder), model)


def load_shipped_layers(head: MtpHead, target_path) -> None:
    """Start from the MTP layers the target checkpoint ships (head.init: shipped)."""
    load_modules(head, Path(target_path))


# --- writing ------------------------------------------------------------------------------------
def target_folder(ckpt, verifier: str | None) -> Path:
    """The target checkpoint to copy: `verifier` when it is a local folder, else the recipe's target."""
    from specheads.target import resolve_target_path

    if verifier and (Path(verifier).expanduser() / CONFIG_FILE).is_file():
        return Path(verifier).expanduser()
    path = (ckpt.recipe.get("target") or {}).get("path") or ""
    if not path:
        raise ExportRefused("an MTP export is a copy of the target checkpoint: pass --verifier TARGET_FOLDER")
    return resolve_target_path(path)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def write_checkpoint(src: Path, tmp: Path, tensors: dict[str, torch.Tensor], config: dict, count: tuple[str, int],
                     layout: str, L: int) -> None:
    """Copy the target folder into tmp with `tensors` as its MTP modules (stale ones removed)."""
    wm = weight_map(src)
    stale = set(mtp_names(wm, layout, L))
    dirty = {wm[n] for n in stale}
    for path in sorted(src.iterdir()):
        if path.is_file() and path.name not in {INDEX_FILE, CONFIG_FILE, META_FILE, "README.md"} | dirty:
            _link_or_copy(path, tmp / path.name)
    for shard in sorted(dirty):  # rewrite shards that held old MTP tensors, without them
        keep = [n for n, f in wm.items() if f == shard and n not in stale]
        save_file(read_tensors(src, keep), str(tmp / shard), metadata={"format": "pt"})
    save_file(tensors, str(tmp / MTP_FILE), metadata={"format": "pt"})
    new_map = {n: f for n, f in wm.items() if n not in stale} | {n: MTP_FILE for n in tensors}
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": size + _size_without(src, wm, stale)}, "weight_map": dict(sorted(new_map.items()))}
    (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (tmp / CONFIG_FILE).write_text(json.dumps({**config, count[0]: count[1]}, indent=2) + "\n")


def _size_without(src: Path, wm: dict, skip: set) -> int:
    total = 0
    for shard in set(wm.values()):
        with safe_open(str(src / shard), "pt") as fh:
            for n in fh.keys():
                if n not in skip:
                    sl = fh.get_slice(n)
                    total += _numel(sl.get_shape()) * DTYPE_BYTES.get(sl.get_dtype(), 4)
    return total


DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "BOOL": 1, "F8_E4M3": 1, "U8": 1}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def export_folder(ckpt, fmt: str, tmp: Path, out_dir: Path, k: int | None, verifier: str | None, dtype: str | None) -> Path:
    """Write the target checkpoint + trained MTP modules into `tmp`, the atomic folder
    that becomes `out_dir` (export/folder.py); contract-checked."""
    from specheads.export import export_record
    from specheads.export.readme import readme_text, serve_commands, target_ref

    head = ckpt.build_head()
    check_exportable(head.config, fmt)
    layout, count_key = family(head.config)
    src = target_folder(ckpt, verifier)
    config = json.loads((src / CONFIG_FILE).read_text())
    _check_same_target(config, head.config, src)
    wm = weight_map(src)
    lm_name = "lm_head.weight" if "lm_head.weight" in wm else "model.embed_tokens.weight"
    lm_head = read_tensors(src, [lm_name])[lm_name]
    cast = DTYPES[dtype] if dtype else lm_head.dtype
    tensors = {n: t.to(cast) for n, t in to_checkpoint(head, lm_head).items()}
    k = k or head.config.ttt_steps
    target = target_ref(ckpt.provenance, ckpt.recipe, verifier or str(src))
    record = export_record(ckpt, head.config, fmt, k, target, str(cast).removeprefix("torch."))
    record["serve_commands"] = serve_commands(fmt, out_dir, target, k, "mtp")
    write_checkpoint(src, tmp, tensors, config, (count_key, head.config.num_layers), layout,
                     head.config.num_target_layers)
    (tmp / META_FILE).write_text(json.dumps(record, indent=2) + "\n")
    (tmp / "README.md").write_text(readme_text(fmt, out_dir, record["serve_commands"], target, record))
    validate(tmp, fmt, expected=head.config)
    return out_dir


def _check_same_target(config: dict, head: MtpConfig, src: Path) -> None:
    for key, want in (("model_type", head.target_config.get("model_type")), ("num_hidden_layers", head.num_target_layers),
                      ("hidden_size", head.hidden_size), ("vocab_size", head.vocab_size)):
        if config.get(key) != want:
            raise ExportRefused(f"{src / CONFIG_FILE}: {key} is {config.get(key)!r} but the head was trained for "
                                f"{want!r}; pass the target it was trained on with --verifier")


# --- the contract -------------------------------------------------------------------------------
def validate(folder, fmt: str, expected=None) -> None:
    """Check an MTP folder the way vLLM / SGLang load it; raise ContractError listing every violation."""
    folder, problems = Path(folder), []
    try:
        cfg = json.loads((folder / CONFIG_FILE).read_text())
        layout, count_key = family(cfg)
    except (OSError, json.JSONDecodeError, ExportRefused) as err:
        raise ContractError(folder, fmt, [Violation(f"{CONFIG_FILE}", "a target config of a family with an MTP "
                                                    "draft class", str(err)[:200], "export again")]) from None
    D = cfg.get(count_key)
    want_d = (expected.num_layers if isinstance(expected, MtpConfig) else None)
    if not isinstance(D, int) or isinstance(D, bool) or D < 1:
        problems.append(Violation(f"{CONFIG_FILE}: {count_key}", "the number of MTP modules (>= 1)", repr(D),
                                  "without it the engines find no MTP layers"))
        D = want_d or 0
    elif want_d is not None and D != want_d:
        problems.append(Violation(f"{CONFIG_FILE}: {count_key}", str(want_d), str(D), "write the trained module count"))
    if fmt == "sglang" and D > MTP_SGLANG_MAX_LAYERS[layout]:
        problems.append(Violation(f"{CONFIG_FILE}: {count_key}", "1", str(D), "SGLang 0.5.23 asserts one NextN layer"))
    problems += _check_files(folder)
    if not problems or all("index" not in v.where for v in problems):
        problems += _check_tensors(folder, cfg, layout, D)
    if problems:
        raise ContractError(folder, fmt, problems)


def _headers(folder: Path) -> dict[str, dict[str, tuple]]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as fh:
            out[path.name] = {n: (fh.get_slice(n).get_dtype(), tuple(fh.get_slice(n).get_shape())) for n in fh.keys()}
    return out


def _check_files(folder: Path) -> list[Violation]:
    """The index names every shard, each listed tensor is in its shard, and no tensor is in two shards."""
    if not (folder / INDEX_FILE).is_file():
        return [Violation(INDEX_FILE, "an index listing every shard", "no file", "the MTP shard would not be loaded")]
    wm, headers, out = json.loads((folder / INDEX_FILE).read_text()).get("weight_map", {}), _headers(folder), []
    for name, shard in wm.items():
        if name not in headers.get(shard, {}):
            out.append(Violation(f"{INDEX_FILE}: {name}", f"the tensor in {shard}", "not there", "export again"))
    seen: dict[str, str] = {}
    for shard, names in headers.items():
        if shard not in set(wm.values()):
            out.append(Violation(shard, "a shard named by the index", "an unlisted file", "remove it"))
        for n in names:
            if n in seen:
                out.append(Violation(f"{shard}: {n}", "one copy of each tensor", f"also in {seen[n]}",
                                     "a stale copy can overwrite the trained one at load time; export again"))
            seen[n] = shard
    return out


def _check_tensors(folder: Path, cfg: dict, layout: str, D: int) -> list[Violation]:
    """Per module: the own tensors with [H] / [H, 2H] shapes, a block shaped like a target layer."""
    L, H, V = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    specs = {n: s for names in _headers(folder).values() for n, s in names.items()}
    dims, out = {"H": H, "2*H": 2 * H}, []
    ref = _reference_layer(cfg, L)
    ref_block = {n[len(ref):]: s for n, s in specs.items() if n.startswith(ref)}
    for k in range(D):
        names, prefix = own_names(layout, L, k), block_prefix(layout, L, k)
        extra = {"head": (f"{prefix}shared_head.head.weight", (V, H))} if layout == "deepseek" else {}
        for part, name in list(names.items()) + [(p, n) for p, (n, _) in extra.items()]:
            want = extra[part][1] if part in extra else tuple(dims[d] for d in MTP_SHAPES[part])
            got = specs.get(name)
            if got is None or got[1] != want or got[0] not in ("F32", "BF16", "F16"):
                out.append(Violation(name, f"a float tensor of shape {list(want)}", str(got), "export again"))
        block = {n[len(prefix):]: s for n, s in specs.items() if n.startswith(prefix) and n not in names.values()
                 and "shared_head" not in n and "embed_tokens" not in n}
        if {n: s[1] for n, s in block.items()} != {n: s[1] for n, s in ref_block.items()}:
            diff = sorted(set(block) ^ set(ref_block))[:4]
            out.append(Violation(f"{prefix}*", f"the tensors of target layer {ref}* (names and shapes)",
                                 f"a different set (e.g. {diff})", "the engine builds its MTP block like a target layer"))
    beyond = block_prefix(layout, L, D)
    if any(n.startswith(beyond) for n in specs):
        out.append(Violation(f"{beyond}*", f"no module beyond the {D} counted", "tensors", "remove them or count them"))
    return out


def _reference_layer(cfg: dict, L: int) -> str:
    """The last target layer shaped like an MTP block (full attention, the last MoE layer)."""
    types = cfg.get("layer_types") or ["full_attention"] * L
    last = max(i for i, t in enumerate(types[:L]) if t == "full_attention")
    return f"model.layers.{last}."


# --- loading back -------------------------------------------------------------------------------
def load_export(meta, attn_implementation: str = "sdpa", check: bool = True):
    """An MTP export -> (head in eval mode, meta), rebuilt from the folder's config.json and tensors."""
    from transformers import AutoConfig

    if check:
        validate(meta.folder, meta.format)
    cfg = json.loads((meta.folder / CONFIG_FILE).read_text())
    _, count_key = family(cfg)
    trained = meta.head_config or {}
    hf = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != count_key})
    config = MtpConfig(
        target_config=target_config_dict(hf), num_layers=cfg[count_key], num_target_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"], vocab_size=cfg["vocab_size"], ttt_steps=trained.get("ttt_steps", cfg[count_key]),
        step_decay=trained.get("step_decay", 0.8), zero_first_embedding=cfg["model_type"] in ZERO_FIRST_EMBEDDING,
        init=trained.get("init", "last_layer"))
    head = MtpHead(config, attn_implementation=attn_implementation)
    load_modules(head, meta.folder)
    return head.eval(), meta

