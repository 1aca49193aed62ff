"""MTP export: the trained modules written into a copy of the target checkpoint, where the engines
read the target family's own MTP layers (docs/engines.md §2.6, §3.3).

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
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specheads.engine_facts import SGLANG, VLLM
from specheads.export.contract_rules import (
    CONFIG_FILE,
    META_FILE,
    MTP_SGLANG_MAX_LAYERS,
    MTP_SHAPES,
    ContractError,
    Violation,
)
from specheads.export.keys import trained_fields
from specheads.export.plan import DTYPES, ExportRefused, target_folder
from specheads.export.readme import Readme, target_ref
from specheads.heads.mtp import ZERO_FIRST_EMBEDDING, MtpConfig, MtpHead, target_config_dict
from specheads.heads.mtp_checkpoint import (
    INDEX_FILE,
    MTP_LAYOUTS,
    block_prefix,
    layout_of,
    load_modules,
    meta_model,
    mtp_names,
    own_names,
    read_tensors,
    weight_map,
)
from specheads.protocols import ExportPlan, ExportRequest

FORMATS_WRITTEN = ("vllm", "sglang")
MTP_FILE = "model-mtp.safetensors"


# --- layout ------------------------------------------------------------------------------------
def family(config: MtpConfig | dict) -> tuple[str, str]:
    """(layout, count key) of the target family, or ExportRefused naming the families that have one."""
    cfg = config.target_config if isinstance(config, MtpConfig) else config
    model_type = cfg.get("model_type")
    if model_type not in MTP_LAYOUTS:
        arch = (cfg.get("architectures") or ["?"])[0]
        raise ExportRefused(
            f"target family '{model_type}' ({arch}) has no MTP draft class in {VLLM} or {SGLANG}, so "
            f"neither engine can serve MTP modules for it. Families with one: {', '.join(MTP_LAYOUTS)}. "
            "For this target train an EAGLE-3 head or a draft model (recipes/eagle3, recipes/draft)")
    return layout_of(cfg)


def check_exportable(config: MtpConfig, fmt: str, weights=None) -> None:
    layout, _ = family(config)
    if layout == "qwen3_next" and config.num_layers != 1:
        raise ExportRefused(f"the `mtp.*` layout (Qwen3-Next, Qwen3.5) has one fc and one set of norms for all "
                            f"layers; this head has "
                            f"{config.num_layers} modules. Train it with head.num_layers: 1")
    if fmt == "sglang" and config.num_layers > MTP_SGLANG_MAX_LAYERS[layout]:
        raise ExportRefused(f"{SGLANG} asserts num_nextn_predict_layers == 1 for this family; this head has "
                            f"{config.num_layers} modules. Export it with --format vllm, or train head.num_layers: 1")


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


# --- writing ------------------------------------------------------------------------------------
def checkpoint_files(src: Path, tensors: dict[str, torch.Tensor], config: dict, count: tuple[str, int],
                     layout: str, L: int) -> dict:
    """The target folder `src` with `tensors` as its MTP modules (stale ones removed), as ExportPlan
    fields: its files linked unchanged, the shards that held stale MTP tensors rewritten without them,
    the index and config.json."""
    wm = weight_map(src)
    stale = set(mtp_names(wm, layout, L))
    dirty = {wm[n] for n in stale}
    ours = {INDEX_FILE, CONFIG_FILE, META_FILE, "README.md", MTP_FILE} | dirty
    links = {path.name: path for path in sorted(src.iterdir()) if path.is_file() and path.name not in ours}
    rewrite = {shard: _without(src, [n for n, f in wm.items() if f == shard and n not in stale])
               for shard in sorted(dirty)}
    new_map = {n: f for n, f in wm.items() if n not in stale} | dict.fromkeys(tensors, MTP_FILE)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": size + _size_without(src, wm, stale)},
             "weight_map": dict(sorted(new_map.items()))}
    return {"config": {**config, count[0]: count[1]}, "tensors": tensors, "weights_file": MTP_FILE, "links": links,
            "written": rewrite, "json_files": {INDEX_FILE: index}}


def _without(src: Path, keep: list[str]):
    """Writes a shard of `src` holding only `keep` (read when written: one shard in memory at a time)."""
    return lambda path: save_file(read_tensors(src, keep), str(path), metadata={"format": "pt"})


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


def plan(request: ExportRequest) -> ExportPlan:
    """A copy of the target checkpoint with the trained MTP modules, in the target's dtype unless
    `dtype` is given; the serve commands name the target folder."""
    ckpt, cfg = request.ckpt, request.head.config
    layout, count_key = family(cfg)
    src = target_folder(ckpt, request.verifier, "an MTP export is a copy of the target checkpoint")
    config = json.loads((src / CONFIG_FILE).read_text())
    _check_same_target(config, cfg, src)
    wm = weight_map(src)
    lm_name = "lm_head.weight" if "lm_head.weight" in wm else "model.embed_tokens.weight"
    lm_head = read_tensors(src, [lm_name])[lm_name]
    dtype = DTYPES[request.dtype] if request.dtype else lm_head.dtype
    tensors = {n: t.to(dtype) for n, t in to_checkpoint(request.head, lm_head).items()}
    files = checkpoint_files(src, tensors, config, (count_key, cfg.num_layers), layout, cfg.num_target_layers)
    return ExportPlan(**files, target=target_ref(ckpt.provenance, ckpt.recipe, request.verifier or str(src)))


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
        problems.append(Violation(f"{CONFIG_FILE}: {count_key}", "1", str(D), f"{SGLANG} asserts one NextN layer"))
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
TRAINED = ("ttt_steps", "step_decay", "init")  # training-only: from specheads.json


def load_export(meta, attn_implementation: str = "sdpa", check: bool = True):
    """An MTP export -> (head in eval mode, meta), rebuilt from the folder's config.json and tensors."""
    from transformers import AutoConfig

    if check:
        validate(meta.folder, meta.format)
    cfg = json.loads((meta.folder / CONFIG_FILE).read_text())
    _, count_key = family(cfg)
    hf = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != count_key})
    config = MtpConfig(
        target_config=target_config_dict(hf), num_layers=cfg[count_key], num_target_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"], vocab_size=cfg["vocab_size"],
        zero_first_embedding=cfg["model_type"] in ZERO_FIRST_EMBEDDING, **trained_fields(meta.head_config, TRAINED))
    head = MtpHead(config, attn_implementation=attn_implementation)
    load_modules(head, meta.folder)
    return head.eval(), meta


def readme_lines(fmt: str, head: dict) -> list[str]:
    """The README's Head section."""
    return [f"- {head['num_layers']} MTP module(s) after target layer {head['num_target_layers'] - 1}, "
            f"trained for {head['ttt_steps']} draft step(s); the target's weights are unchanged"]


README = Readme("MTP modules inside the target checkpoint", readme_lines)
