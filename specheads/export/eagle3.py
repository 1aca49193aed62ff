"""EAGLE-3 writers: the tensors and config.json each format needs, built from a trained head.

"vllm" is the speculators format (`vllm serve DIR`), "vllm-native" the plain HF EAGLE-3 config
vLLM reads through `--speculative-config`, "sglang" SGLang's `LlamaForCausalLMEagle3`
(docs/engines.md §2.2, §2.3, §3.1).
"""

from __future__ import annotations

import torch

from specheads.engine_facts import AUX_LAYER_OFFSET, SGLANG
from specheads.export.contract import validate as check_contract
from specheads.export.load import load_eagle3
from specheads.export.plan import ExportRefused, cast, head_plan
from specheads.heads.eagle3 import Eagle3Config
from specheads.protocols import ExportPlan, ExportRequest
from specheads.export.readme import Readme

FORMATS = ("vllm", "vllm-native", "sglang")
LAYER_PREFIX = {"vllm": "layers.0.", "vllm-native": "layers.0.", "sglang": "midlayer."}


def check_exportable(config: Eagle3Config, fmt: str, weights: dict) -> None:
    """Refuse heads an engine would load but run differently from training."""
    if fmt == "sglang" and config.parallel_drafting:
        raise ExportRefused(
            f"this is a P-EAGLE head (parallel_drafting: true), and {SGLANG} has no P-EAGLE loader "
            "(no mask_hidden, no parallel drafting). Export it with --format vllm (speculators peagle) "
            "or --format vllm-native (method eagle3 + parallel_drafting).")
    if fmt == "sglang" and config.norm_before_residual:
        raise ExportRefused(
            f"this head was trained with norm_before_residual: true, but {SGLANG} always uses the "
            "raw fc output as the residual, so it would run a different layer. Export it with "
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


def rope_keys(config: Eagle3Config) -> dict:
    """rope_parameters plus the legacy rope_theta / rope_scaling mirrors older readers use."""
    params = dict(config.rope_parameters)
    scaling = None
    if params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return {"rope_parameters": params, "rope_theta": params.get("rope_theta", 10000.0), "rope_scaling": scaling}


def decoder_keys(config, model_type: str, num_layers: int) -> dict:
    """The HF decoder keys (dims, activation, norm eps, RoPE) shared by the EAGLE-3 and DFlash configs."""
    return {
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        **rope_keys(config),
        "attention_bias": False,
    }


def layer_keys(config: Eagle3Config, dtype: str) -> dict:
    """The decoder-layer keys every format carries (Llama-style, one layer)."""
    return {
        **decoder_keys(config, "llama", 1),
        "mlp_bias": False,
        "num_aux_hidden_states": len(config.aux_layers),
        "dtype": dtype,
    }


def head_keys(config: Eagle3Config) -> dict:
    """EAGLE-3 keys vLLM reads at the top level (both vLLM formats); numbering = our aux_layers."""
    return {
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(config.aux_layers),
        "norm_before_residual": bool(config.norm_before_residual),
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
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
        "speculators_config": {
            "algorithm": "peagle" if config.parallel_drafting else "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_archs)},
        },
    }


def native_config(config: Eagle3Config, dtype: str) -> dict:
    """docs/engines.md §2.2: a LlamaForCausalLM config with the EAGLE-3 keys at top level."""
    return {"architectures": ["LlamaForCausalLM"], **layer_keys(config, dtype), **head_keys(config),
            "tie_word_embeddings": False}


def sglang_config(config: Eagle3Config, dtype: str) -> dict:
    """docs/engines.md §3.1: LlamaForCausalLMEagle3, ids in SGLang numbering inside eagle_config."""
    ids = [a + AUX_LAYER_OFFSET["sglang"] for a in config.aux_layers]
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **layer_keys(config, dtype),
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "tie_word_embeddings": False,
        "norm_before_residual": False,  # documentary: SGLang has no such option (refused when true)
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


def validate(folder, fmt: str, expected=None) -> None:
    """Check an EAGLE-3 folder against its engine's loader contract (export/contract.py)."""
    check_contract(folder, fmt, "eagle3", expected=expected)


def load_export(meta, attn_implementation: str = "sdpa", check: bool = True):
    """An EAGLE-3 export -> (head in eval mode, meta); the reading lives in export/load.py with
    the reading of other trainers' EAGLE-3 folders."""
    return load_eagle3(meta, attn_implementation, check)


def readme_lines(fmt: str, head: dict) -> list[str]:
    """The README's Head section (P-EAGLE: an EAGLE-3 head drafting in parallel)."""
    parallel = [f"- P-EAGLE: all {head['ttt_steps']} drafts in one forward (mask token id {head['mask_token_id']}, "
                f"learned `mask_hidden`); vLLM serves it with `parallel_drafting: true`, {SGLANG} cannot"
                ] if head.get("parallel_drafting") else []
    return parallel + [f"- aux layers (hidden states after k target layers): {head['aux_layers']}",
                       f"- draft vocabulary: {head['draft_vocab_size']} of {head['vocab_size']} tokens",
                       f"- hidden size {head['hidden_size']}, norm_before_residual "
                       f"{str(head['norm_before_residual']).lower()}, trained for {head['ttt_steps']} draft steps"]


README = Readme("EAGLE-3 draft", readme_lines, serve_notes=True)
