"""What the writers and their load-backs share, whatever the kind: the HF decoder keys of a draft
config (written from, read back into and compared with a head config through one field table), the
speculators `speculators_config` block, the training-only fields a load-back takes from
specheads.json, and t2d rebuilt from d2t.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from specheads.export.contract import MISSING, config_rope, found_text
from specheads.export.contract_rules import CONFIG_FILE, Violation

DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}  # a config with no RoPE keys (transformers' default)
REQUIRED = object()  # a Field without a default: the key must be there


@dataclass(frozen=True)
class Field:
    """A head-config field as config.json carries it: the same key in every format (relative to where
    the format keeps its decoder keys). `default`: what the engines assume when the key is absent
    (REQUIRED: none; a callable: computed from the config node); `compare`: checked against the
    trained head by the contract."""

    name: str
    default: object = REQUIRED
    compare: bool = True

    def read(self, node: dict):
        """The field's value in `node`, the default when the key is absent."""
        if self.name in node and node[self.name] is not None:
            return node[self.name]
        if self.default is REQUIRED:
            return node[self.name]  # KeyError: the contract check reports it first
        return self.default(node) if callable(self.default) else self.default


# the decoder dims of a Llama / Qwen3-style draft stack, in the order decoder_keys writes them
# (num_hidden_layers is written after hidden_size: the kind says how many layers it has)
DECODER_FIELDS = (
    Field("vocab_size"),
    Field("hidden_size"),
    Field("num_attention_heads"),
    Field("num_key_value_heads", lambda node: node["num_attention_heads"]),
    Field("head_dim", lambda node: node["hidden_size"] // node["num_attention_heads"]),
    Field("intermediate_size"),
    Field("hidden_act", "silu", compare=False),
    Field("rms_norm_eps", 1e-5),
    Field("max_position_embeddings", compare=False),  # the contract checks it as a lower bound
)


def decoder_fields(**defaults) -> tuple[Field, ...]:
    """DECODER_FIELDS with a kind's own defaults (a kind whose engine assumes another value)."""
    return tuple(Field(f.name, defaults.get(f.name, f.default), f.compare) for f in DECODER_FIELDS)


def rope_keys(config) -> dict:
    """rope_parameters plus the legacy rope_theta / rope_scaling mirrors older readers use."""
    params = dict(config.rope_parameters)
    scaling = None
    if params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return {"rope_parameters": params, "rope_theta": params.get("rope_theta", 10000.0), "rope_scaling": scaling}


def decoder_keys(config, model_type: str, num_layers: int, table: tuple[Field, ...] = DECODER_FIELDS) -> dict:
    """The HF decoder keys (dims, activation, norm eps, RoPE) of a draft stack: `table`'s fields."""
    dims = {f.name: getattr(config, f.name) for f in table}
    return {"model_type": model_type, "vocab_size": dims.pop("vocab_size"), "hidden_size": dims.pop("hidden_size"),
            "num_hidden_layers": num_layers, **dims, **rope_keys(config), "attention_bias": False}


def llama_layer_keys(config, dtype: str, **extra) -> dict:
    """The keys of a one-layer Llama-style draft (EAGLE-1, EAGLE-3): `extra` after mlp_bias."""
    return {**decoder_keys(config, "llama", 1), "mlp_bias": False, **extra, "dtype": dtype}


def read_decoder(node: dict, table: tuple[Field, ...] = DECODER_FIELDS) -> dict:
    """The head-config values of `table`'s fields plus rope_parameters, read back from `node`."""
    return {**{f.name: f.read(node) for f in table}, "rope_parameters": config_rope(node) or dict(DEFAULT_ROPE)}


def check_decoder(node: dict, head: dict, at: str = "", table: tuple[Field, ...] = DECODER_FIELDS) -> list[Violation]:
    """The compared fields of `table` agree with the trained head (`at`: the node's dotted path + ".")."""
    out = []
    for f in table:
        found = node.get(f.name, MISSING)
        if f.compare and found is not MISSING and found != head[f.name]:
            out.append(Violation(f"{CONFIG_FILE}: {at}{f.name}", f"{head[f.name]} (the trained head's)",
                                 found_text(found), "export again from the checkpoint this head came from"))
    return out


def check_rope(node: dict, head: dict, at: str = "") -> list[Violation]:
    """The RoPE settings in `node` (if any) are the trained head's (= the target's)."""
    if config_rope(node) in (None, head["rope_parameters"]):
        return []
    return [Violation(f"{CONFIG_FILE}: {at}rope_parameters", json.dumps(head["rope_parameters"]),
                      json.dumps(config_rope(node)), "copy the head's (= the target's) RoPE settings")]


def speculators_block(algorithm: str, k: int, verifier: str, verifier_archs: list[str]) -> dict:
    """config.json's speculators_config (vLLM's speculators reader): one greedy proposal of k tokens."""
    return {
        "algorithm": algorithm,
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k,
                              "verifier_accept_k": 1, "accept_tolerance": 0.0}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": verifier, "architectures": list(verifier_archs)},
    }


def speculative_tokens(cfg: dict):
    """k as a speculators config.json proposes it (None: not a speculators config, or no k)."""
    methods = (cfg.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return methods[0].get("speculative_tokens")


def trained_fields(trained: dict | None, names: tuple[str, ...]) -> dict:
    """The training-only fields `names` (config.json does not carry them) from the export's own record
    (specheads.json head_config); a field the record lacks keeps the head config's default."""
    trained = trained or {}
    return {name: trained[name] for name in names if name in trained}

