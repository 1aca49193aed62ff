"""Folders other trainers wrote (speculators, SpecForge / SGLang, plain vLLM): third-party EAGLE-3
drafts with no specheads.json, read the way their engine reads them (docs/engines.md §2.2, §2.3,
§3.1), speculators' own DFlash / DSpark checkpoints and SpecForge's DFlash folders (SGLang's
DFlashDraftModel layout); every option the head cannot run is refused by name.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from specheads.engine_facts import RESIDUAL_DEFAULT
from specheads.export import dflash, dspark
from specheads.export.checkpoint import load_strict
from specheads.export.contract_rules import CONFIG_FILE, WEIGHTS_FILE, ContractError, contract_for
from specheads.export.eagle3 import KIND, head_weights
from specheads.export.eagle31 import engine_options
from specheads.export.keys import DEFAULT_ROPE, speculative_tokens
from specheads.export.load import ExportMeta, read_json, read_weights
from specheads.heads.dspark import HEAD_FIELDS
from specheads.heads.eagle3 import Eagle3Config, Eagle3Head, default_aux_layers

LEGACY_NAMES = (("midlayer.", "layers.0."), ("aux_norm_low.", "fc_norm.0."),
                ("aux_norm_mid.", "fc_norm.1."), ("aux_norm_high.", "fc_norm.2."))
DROPPED = {"embed_tokens.weight", "t2d", "verifier_norm.weight", "verifier_lm_head.weight"}
INDEX_FILE = "model.safetensors.index.json"


class ForeignDraftError(ValueError):
    """A third-party EAGLE-3 folder this head cannot run as its engine would; says what and why."""

    def __init__(self, folder: Path, what: str):
        super().__init__(f"{folder}: {what}")


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
        offset = contract_for("sglang", KIND).aux_offset  # SGLang numbering (docs/engines.md §1)
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
    if cfg.get("bias"):
        raise ForeignDraftError(folder, "bias: true (a bias on fc): the head's fc has no bias")
    flags = {
        **{k: v for k, v in engine_options(cfg, contract_for(fmt, KIND)).items() if k != "qk_norm"},
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
    k = speculative_tokens(cfg)
    rope = dict(getattr(layer, "rope_parameters", None) or DEFAULT_ROPE)
    return Eagle3Config(
        hidden_size=hidden, target_hidden_size=target_hidden, intermediate_size=layer.intermediate_size,
        num_attention_heads=layer.num_attention_heads,
        num_key_value_heads=layer.num_key_value_heads or layer.num_attention_heads,
        head_dim=getattr(layer, "head_dim", None) or hidden // layer.num_attention_heads,
        vocab_size=layer.vocab_size, draft_vocab_size=int(vd),
        aux_layers=_foreign_aux(cfg, fmt, num_target_layers, folder),
        max_position_embeddings=layer.max_position_embeddings, rms_norm_eps=layer.rms_norm_eps,
        rope_parameters=rope, hidden_act=layer.hidden_act, **({"ttt_steps": k} if k else {}),
        **_foreign_flags(cfg, fmt, folder),
    )


def read_foreign_weights(folder: Path) -> dict[str, torch.Tensor]:
    """model.safetensors, or every shard a model.safetensors.index.json names (never a pickle)."""
    if (folder / WEIGHTS_FILE).is_file() or not (folder / INDEX_FILE).is_file():
        return read_weights(folder / WEIGHTS_FILE)
    shards = sorted(set(read_json(folder / INDEX_FILE).get("weight_map", {}).values()))
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
                 num_target_layers: int | None = None) -> tuple[torch.nn.Module, ExportMeta]:
    """A speculators / SpecForge / plain-vLLM EAGLE-3 folder (or speculators' DFlash / DSpark,
    SpecForge's DFlash) -> (head in eval mode, meta)."""
    if meta.kind in BLOCK_KINDS:
        return load_foreign_block(meta, attn_implementation, num_target_layers)
    config = foreign_config(read_json(meta.folder / CONFIG_FILE), meta.format, meta.folder, num_target_layers)
    head = Eagle3Head(config, attn_implementation=attn_implementation)
    tensors = foreign_weights(read_foreign_weights(meta.folder), config, meta.folder)
    load_strict(head, tensors, str(meta.folder))
    meta.head_config = asdict(config)
    meta.num_speculative_tokens = meta.num_speculative_tokens or config.ttt_steps
    return head.eval(), meta


# --- speculators' DFlash / DSpark checkpoints ------------------------------------------------------
BLOCK_KINDS = ("dflash", "dspark")


def block_view(cfg: dict, kind: str, folder: Path) -> dict:
    """speculators' own dflash / dspark config.json as specheads' reader of that format takes it.
    Its trainer's block_size counts the query slots: G + 1 in the fill-in layout, G with
    sample_from_anchor (its DSpark default); its proposal's speculative_tokens (the default chain)
    is at most G. specheads' reader takes G."""
    if cfg.get("sample_from_anchor") and kind == "dflash":
        raise ForeignDraftError(folder, "sample_from_anchor: true on a DFlash head (the anchor's own slot drafts the "
                                "first token): vLLM refuses it for DFlash and this verifier runs DFlash's fill-in "
                                "layout [anchor, mask x G]; train it with sample_from_anchor false")
    view = {**cfg, "sliding_window_non_causal": not block_is_causal(cfg, folder)}
    if kind == "dspark":
        block = cfg.get("block_size")
        from_anchor = cfg.get("sample_from_anchor") is True
        tokens = speculative_tokens(cfg)
        drafted = block - (0 if from_anchor else 1) if isinstance(block, int) else tokens
        if not isinstance(drafted, int) or drafted < 1:
            raise ForeignDraftError(folder, f"{CONFIG_FILE}: block_size {block!r} and no speculative_tokens: "
                                    "the number of drafted tokens is unknown")
        if tokens and tokens > drafted:
            layout = "anchor-as-first: G = block_size" if from_anchor else "fill-in: G = block_size - 1"
            raise ForeignDraftError(folder, f"{CONFIG_FILE}: speculative_tokens {tokens} but block_size {block} "
                                    f"drafts {drafted} ({layout}); the proposal and the block disagree")
        view["block_size"] = drafted
    return view


def block_is_causal(cfg: dict, folder: Path) -> bool:
    """In-block masking as speculators' trainer applies it: its full-attention layers are always
    bidirectional in the block, its sliding-window layers causal unless sliding_window_non_causal.
    (The window itself only matters past its length of context; the head attends to all of it.)"""
    types = (cfg.get("transformer_layer_config") or {}).get("layer_types") or []
    if not types:  # not the trainer's layout: vLLM's reading (causal = not sliding_window_non_causal)
        return not cfg.get("sliding_window_non_causal", True)
    sliding = {t == "sliding_attention" for t in types}
    if sliding == {True, False} and not cfg.get("sliding_window_non_causal"):
        raise ForeignDraftError(folder, f"layer_types {types}: causal sliding-window layers beside bidirectional "
                                "full-attention ones; the head masks every layer alike")
    return sliding == {True} and not cfg.get("sliding_window_non_causal", False)


def load_foreign_block(meta: ExportMeta, attn_implementation: str = "sdpa",
                       num_target_layers: int | None = None):
    """A speculators dflash / dspark checkpoint folder, or SpecForge's DFlash folder -> (head in eval
    mode, meta)."""
    cfg = read_json(meta.folder / CONFIG_FILE)
    target = {"num_target_layers": num_target_layers} if num_target_layers else {}
    meta.head_config = {"dflash": target} if meta.kind == "dspark" else target
    loader = dspark if meta.kind == "dspark" else dflash
    view = block_view if meta.format == "vllm" else sglang_block_view
    head, meta = loader.load_config(meta, view(cfg, meta.kind, meta.folder), attn_implementation)
    meta.head_config = asdict(head.config)
    meta.num_speculative_tokens = speculative_tokens(cfg)
    return head, meta


# --- SpecForge's DFlash / DSpark folders (SGLang's DFlashDraftModel layout) -------------------------
SGLANG_BLOCK_ARCHITECTURES = {"DFlashDraftModel": "dflash", "DSparkDraftModel": "dspark"}
# dflash_config keys of SpecForge's other DFlash-family heads (a logits head after the backbone,
# shifted labels): a DFlashDraftModel folder naming one is not a DFlash head
OTHER_FAMILY_KEYS = ("projector_type", "shift_label")


def sglang_block_kind(cfg: dict) -> str | None:
    """"dflash" / "dspark" for a Qwen3 DFlashDraftModel / DSparkDraftModel folder with a dflash_config
    (what SpecForge's HF exporter writes for its DFlash family), else None."""
    archs = cfg.get("architectures") or []
    if len(archs) != 1 or not isinstance(cfg.get("dflash_config"), dict):
        return None
    return SGLANG_BLOCK_ARCHITECTURES.get(archs[0])


def sglang_block_view(cfg: dict, kind: str, folder: Path) -> dict:
    """SpecForge's DFlash / DSpark folder as specheads' "sglang" reader takes it. Its conventions:
    target_layer_ids in DFlash numbering (output of layer t), the mask token id in dflash_config, and
    full-attention layers bidirectional in the block (its training mask), which it does not write:
    causal false unless the folder says otherwise. DFlash: block_size = anchor + G (slot j of
    [anchor, mask x G] is supervised with the token at anchor + j). DSpark (`sglang_dspark_view`)."""
    method = cfg["dflash_config"]
    if kind == "dspark":
        cfg, method = sglang_dspark_view(cfg, method, folder)
    refuse_sglang_dflash(cfg, method, folder)
    causal = method.get("causal", cfg.get("is_causal", False))
    return {**cfg, "dflash_config": {**method, "causal": bool(causal)}}


def sglang_dspark_view(cfg: dict, method: dict, folder: Path) -> tuple[dict, dict]:
    """SpecForge's DSparkDraftModel folder as SGLang's DSPARK worker reads it: the layout is
    sample_from_anchor (SGLang's default when unwritten; SpecForge 0.2.0 trains no other: block slot j
    is supervised with the token at anchor + 1 + j), gamma G = block_size, and the Markov / confidence
    fields at the top level (SpecForge keeps them in dflash_config; SGLang's loader reads the top)."""
    method = dict(method)
    if method.get("projector_type") not in (None, "dspark"):
        raise ForeignDraftError(folder, f"dflash_config.projector_type {method['projector_type']!r}: a DSpark "
                                "folder's projector is 'dspark'")
    method.pop("projector_type", None)
    heads = {key: cfg.get(key, method.get(key)) for key in HEAD_FIELDS}
    if not isinstance(heads["markov_rank"], int) or heads["markov_rank"] < 1:
        raise ForeignDraftError(folder, f"markov_rank {heads['markov_rank']!r} (top level or dflash_config): "
                                "SGLang requires a Markov head of rank > 0")
    heads["markov_head_type"] = heads["markov_head_type"] or "vanilla"
    heads["enable_confidence_head"] = bool(heads["enable_confidence_head"])
    heads["confidence_head_with_markov"] = bool(heads["confidence_head_with_markov"])
    from_anchor = cfg.get("sample_from_anchor", True) is True
    drafted = cfg.get("dspark_block_size", cfg.get("block_size"))
    if not isinstance(drafted, int) or drafted < 1:
        raise ForeignDraftError(folder, f"{CONFIG_FILE}: block_size {drafted!r}: the number of drafted tokens "
                                "(SGLang's gamma) is unknown")
    method.pop("sample_from_anchor", None)
    view = {**cfg, **heads, "sample_from_anchor": from_anchor, "block_size": drafted}
    return view, {**method, "block_size": drafted}


def refuse_sglang_dflash(cfg: dict, method: dict, folder: Path) -> None:
    """Name what a DFlashDraftModel folder asks for that the head cannot run."""
    if method.get("sample_from_anchor"):
        raise ForeignDraftError(folder, "dflash_config.sample_from_anchor: true on a DFlash head (the anchor's own "
                                "slot drafts the first token): vLLM refuses it for DFlash and this verifier runs "
                                "DFlash's fill-in layout [anchor, mask x G]")
    other = [k for k in OTHER_FAMILY_KEYS if method.get(k)]
    if other:
        raise ForeignDraftError(folder, f"dflash_config.{other[0]}: {method[other[0]]!r}: another DFlash-family "
                                "head (a logits head or shifted labels after the backbone), not DFlash")
    types = cfg.get("layer_types") or []
    if cfg.get("use_sliding_window") or method.get("use_swa") or "sliding_attention" in types:
        raise ForeignDraftError(folder, f"sliding-window layers (layer_types {types}): SpecForge masks them causally "
                                "in the block and windows the context; the head attends bidirectionally to all of it")
    if cfg.get("attention_bias"):
        raise ForeignDraftError(folder, "attention_bias: true: the head's attention has no biases")
    if not isinstance(method.get("mask_token_id"), int):
        raise ForeignDraftError(folder, "dflash_config.mask_token_id is missing: SpecForge resolves it from the "
                                "tokenizer while training; write the id it trained with into dflash_config")
    if not method.get("target_layer_ids"):
        raise ForeignDraftError(folder, "dflash_config.target_layer_ids is missing: the target layers the draft "
                                "reads are unknown")


def detect_eagle3_format(cfg: dict) -> str:
    """Which EAGLE-3 export format a config.json is: speculators ("vllm"), native vLLM, or SGLang."""
    if "speculators_model_type" in cfg or "speculators_config" in cfg:
        return "vllm"
    archs = cfg.get("architectures") or []
    if "LlamaForCausalLMEagle3" in archs:
        return "sglang"
    if "eagle_aux_hidden_state_layer_ids" in cfg or "draft_vocab_size" in cfg:
        return "vllm-native"
    raise ValueError(f"architectures {archs} without EAGLE-3 keys: not an export format specheads knows")


def read_foreign_meta(folder: Path) -> ExportMeta:
    """The ExportMeta of a folder without specheads.json: an EAGLE-3 draft in the format its
    config.json is written in, speculators' DFlash / DSpark checkpoint, or SpecForge's DFlash / DSpark
    folder (SGLang's DFlashDraftModel layout, read as the "sglang" format)."""
    cfg = read_json(folder / CONFIG_FILE)
    if cfg.get("speculators_model_type") in BLOCK_KINDS:
        return ExportMeta(folder=folder, format="vllm", kind=cfg["speculators_model_type"], target=None,
                          head_config=None, num_speculative_tokens=None)
    if kind := sglang_block_kind(cfg):
        return ExportMeta(folder=folder, format="sglang", kind=kind, target=None, head_config=None,
                          num_speculative_tokens=None)
    try:
        fmt = detect_eagle3_format(cfg)
    except ValueError as err:
        if isinstance(err, ContractError):
            raise
        raise ValueError(f"{folder / CONFIG_FILE}: {err}; pass a folder written by `specheads export`") from None
    return ExportMeta(folder=folder, format=fmt, kind=KIND, target=None, head_config=None, num_speculative_tokens=None)
