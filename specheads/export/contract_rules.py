"""The loader contracts of the engines in `engine_facts` as data: tensors, config keys, per format.

Encodes docs/engines.md (§2.2-2.5 for vLLM, §3.1-3.2 for SGLang). `specheads.export.contract`
checks a folder against them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from specheads.engine_facts import AUX_LAYER_OFFSET, ENGINES, LEGACY_VLLM, SGLANG

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
META_FILE = "specheads.json"
ENGINE_NAMES = {key: engine.name for key, engine in ENGINES.items()}
FLOAT_DTYPES = {"F32", "BF16", "F16"}
DTYPE_NAMES = {"float": "floating (F32/BF16/F16)", "int64": "I64 (int64)", "bool": "BOOL"}


class ContractError(ValueError):
    """An export folder that an engine would reject or load wrongly; lists every violation."""

    def __init__(self, folder: Path, fmt: str, violations: list[Violation]):
        self.folder, self.format, self.violations = Path(folder), fmt, list(violations)
        lines = "\n".join(f"  - {v}" for v in self.violations)
        super().__init__(
            f"{folder}: does not meet the '{fmt}' loader contract ({len(self.violations)} "
            f"violation(s)):\n{lines}"
        )


@dataclass(frozen=True)
class Violation:
    """One broken rule: where (file + tensor or key), what was expected, what was found, what to do."""

    where: str
    expected: str
    found: str
    fix: str

    def __str__(self) -> str:
        return f"{self.where}: expected {self.expected}, found {self.found}; {self.fix}"


@dataclass(frozen=True)
class TensorRule:
    """A tensor the format defines. `{layer}` is the format's layer prefix; shapes use symbolic dims
    (Hd draft hidden, H target hidden, nh, kvh, hd, I, V, Vd, n_aux; products with '*')."""

    name: str
    shape: tuple[str, ...]
    dtype: str = "float"  # float | int64 | bool
    need: str = "required"  # required | optional | if_hidden_differs
    vocab_map: bool = False  # only with a reduced draft vocabulary (Vd < V); forbidden when Vd == V


@dataclass(frozen=True)
class KeyRule:
    """A config.json key (dotted path; list items by index) and the check it must pass."""

    key: str
    check: str  # absent | equals | bool | positive_int | number | str | dict | not_true | rope
    value: object = None
    fix: str = ""


@dataclass(frozen=True)
class FormatContract:
    """Everything one engine's loader needs for one head kind."""

    name: str
    engine: str
    kind: str
    layer_prefix: str  # spelling of the draft layer's tensors
    layer_keys_at: str  # where the decoder-layer keys live ("" = top level)
    aux_ids_key: str  # dotted path of the aux-layer id list, in the engine's numbering
    aux_offset: int  # engine id = specheads aux_layers id + aux_offset
    min_aux_id: int
    keys: tuple[KeyRule, ...]
    tensors: tuple[TensorRule, ...]


# docs/engines.md §2.2, §3.1. Names are bare (no `model.`).
EAGLE3_TENSORS = (
    TensorRule("fc.weight", ("Hd", "n_aux*H")),
    TensorRule("{layer}self_attn.q_proj.weight", ("nh*hd", "2*Hd")),
    TensorRule("{layer}self_attn.k_proj.weight", ("kvh*hd", "2*Hd")),
    TensorRule("{layer}self_attn.v_proj.weight", ("kvh*hd", "2*Hd")),
    TensorRule("{layer}self_attn.o_proj.weight", ("Hd", "nh*hd")),
    TensorRule("{layer}mlp.gate_proj.weight", ("I", "Hd")),
    TensorRule("{layer}mlp.up_proj.weight", ("I", "Hd")),
    TensorRule("{layer}mlp.down_proj.weight", ("Hd", "I")),
    TensorRule("{layer}input_layernorm.weight", ("Hd",)),
    TensorRule("{layer}hidden_norm.weight", ("Hd",)),
    TensorRule("{layer}post_attention_layernorm.weight", ("Hd",)),
    TensorRule("norm.weight", ("Hd",)),
    TensorRule("lm_head.weight", ("Vd", "Hd")),
    # only with a reduced draft vocabulary (Vd < V): vLLM creates draft_id_to_target_id only when
    # draft_vocab_size != vocab_size and raises on a d2t otherwise (llama_eagle3.py, vllm_contract.md §3.2)
    TensorRule("d2t", ("Vd",), dtype="int64", vocab_map=True),
    TensorRule("t2d", ("V",), dtype="bool", need="optional", vocab_map=True),
    TensorRule("embed_tokens.weight", ("V", "Hd"), need="if_hidden_differs"),
    TensorRule("mask_hidden", ("n_aux*H",), need="if_parallel"),  # P-EAGLE only (vLLM: required with it)
)

# EAGLE 3.1 / Qwen3-layer tensors, each only with its option on (the engines build the module only then:
# vLLM drops an input_norm.* without norm_before_fc, and leaves a missing q_norm / k_norm at ones)
EAGLE31_TENSORS = {
    "norm_before_fc": (TensorRule("input_norm.weight", ("n_aux*H",)),),
    "fc_norm": (TensorRule("fc_norm.{j}.weight", ("H",)),),  # one per aux feature, j < n_aux
    "qk_norm": (TensorRule("{layer}self_attn.q_norm.weight", ("hd",)),
                TensorRule("{layer}self_attn.k_norm.weight", ("hd",))),
}

VOCAB_MAP_FIX = ("the draft vocabulary is the whole target vocabulary (draft_vocab_size == vocab_size), so vLLM "
                 "builds no draft_id_to_target_id and rejects the folder (\"There is no module or parameter "
                 "named 'draft_id_to_target_id'\"); leave d2t and t2d out (re-export)")

# Names no engine should see: (pattern, why + what to do). The first match is reported.
FORBIDDEN_TENSORS = (
    (r"^model\.lm_head\.", "lm_head nested under `model.`: SGLang silently drops it; write top-level `lm_head.weight`"),
    (r"^model\.", "`model.`-prefixed name: the engines add the prefix themselves; write bare names"),
    (r"\.bias$", "bias tensor: the head has no biases (vLLM silently drops `*.bias`); remove it"),
    (r"rotary_emb\.", "RoPE buffer: the engines recompute it; remove it"),
)

NOT_TRUE_FIX = "specheads heads are trained without this option; set it to false or remove it"
OPTION_FIX = "write it explicitly (true or false), as the head was trained"
DECODER_DIM_KEYS = (  # the decoder dimensions every Llama/Qwen3-style draft config carries
    KeyRule("num_attention_heads", "positive_int"),
    KeyRule("num_key_value_heads", "positive_int"),
    KeyRule("head_dim", "positive_int"),
    KeyRule("intermediate_size", "positive_int"),
    KeyRule("vocab_size", "positive_int", fix="must be the target's vocabulary size V"),
    KeyRule("rms_norm_eps", "number"),
    KeyRule("max_position_embeddings", "positive_int", fix="copy the target's value"),
    KeyRule("hidden_act", "equals", "silu"),
    KeyRule("attention_bias", "not_true", fix="the head has no attention biases"),
)
ROPE_KEY = KeyRule("", "rope", fix="copy the target's RoPE settings (rope_parameters, rope_theta)")
_LAYER_SHAPE_KEYS = (
    KeyRule("hidden_size", "positive_int"),
    KeyRule("num_hidden_layers", "equals", 1, "specheads exports single-layer EAGLE-3 heads"),
    *DECODER_DIM_KEYS,
    ROPE_KEY,
)
LAYER_KEYS = (KeyRule("model_type", "equals", "llama", "the draft layer is Llama-style (no q/k norm)"),
              *_LAYER_SHAPE_KEYS)
# vLLM 0.33 also loads a Qwen3-style layer (qwen3_eagle3.py: q_norm / k_norm); SGLang 0.5.23 does not
EAGLE3_LAYER_KEYS = {
    "vllm": (KeyRule("model_type", "one_of", ("llama", "qwen3"),
                     "llama = Llama-style layer, qwen3 = with q/k norms (Eagle3Qwen3ForCausalLM)"), *_LAYER_SHAPE_KEYS),
    "sglang": LAYER_KEYS,
}
VLLM_HEAD_KEYS = (
    KeyRule("draft_vocab_size", "positive_int", fix="write the draft vocabulary size Vd (width of lm_head)"),
    KeyRule("target_hidden_size", "positive_int"),
    KeyRule("norm_before_residual", "bool",
            fix="write it explicitly: speculators defaults to true, native vLLM to false"),
    KeyRule("norm_before_fc", "bool", fix=OPTION_FIX),
    KeyRule("fc_norm", "bool", fix=OPTION_FIX),
    KeyRule("norm_output", "bool", fix=OPTION_FIX),
    KeyRule("eagle_config.eagle_aux_hidden_state_layer_ids", "absent",
            fix="vLLM's default Model Runner V2 ignores this copy; keep only the top-level id list"),
)
SPECULATORS_KEYS = VLLM_HEAD_KEYS + (
    KeyRule("model_type", "absent", fix="a top-level model_type defeats vLLM's speculators detection"),
    KeyRule("speculators_model_type", "one_of", ("eagle3", "peagle"), "peagle = P-EAGLE (parallel drafting)"),
    KeyRule("transformer_layer_config", "dict"),
    KeyRule("speculators_config.proposal_methods.0.speculative_tokens", "positive_int"),
    KeyRule("speculators_config.default_proposal_method", "str"),
    KeyRule("speculators_config.verifier.name_or_path", "str", fix="name the target (a hub id for `vllm serve DIR`)"),
)
NATIVE_KEYS = VLLM_HEAD_KEYS + (
    KeyRule("architectures", "one_of", (["LlamaForCausalLM"], ["Qwen3ForCausalLM"]),
            fix="vLLM renames it to Eagle3LlamaForCausalLM / Eagle3Qwen3ForCausalLM (q/k norms)"),
    KeyRule("tie_word_embeddings", "equals", False),
)
SGLANG_KEYS = (
    KeyRule("architectures", "equals", ["LlamaForCausalLMEagle3"]),
    KeyRule("draft_vocab_size", "positive_int",
            fix="SGLang reads it without a default; write the draft vocabulary size Vd"),
    KeyRule("tie_word_embeddings", "equals", False),
    KeyRule("eagle_config", "dict", fix="SGLang captures target layers only from eagle_config"),
    KeyRule("eagle_config.use_aux_hidden_state", "equals", True),
    KeyRule("norm_output", "bool", fix=OPTION_FIX),
    KeyRule("norm_before_residual", "not_true",
            fix=f"{SGLANG} always uses the raw fc output as the residual; export for vLLM instead"),
    KeyRule("fc_norm", "bool", fix=OPTION_FIX),
    KeyRule("norm_before_fc", "bool", fix=OPTION_FIX),
    KeyRule("use_aux_norm", "absent", fix="SGLang's legacy spelling of fc_norm: write fc_norm only"),
    KeyRule("eagle_aux_hidden_state_layer_ids", "absent",
            fix="SGLang uses a top-level id list only to size fc; keep the ids in eagle_config"),
    KeyRule("parallel_drafting", "not_true", fix=f"{SGLANG} has no P-EAGLE loader; serve it with vLLM"),
)

CONTRACTS = {
    ("vllm", "eagle3"): FormatContract(
        "vllm", "vllm", "eagle3", "layers.0.", "transformer_layer_config", "eagle_aux_hidden_state_layer_ids",
        AUX_LAYER_OFFSET["vllm"], 1, SPECULATORS_KEYS, EAGLE3_TENSORS),
    ("vllm-native", "eagle3"): FormatContract(
        "vllm-native", "vllm", "eagle3", "layers.0.", "", "eagle_aux_hidden_state_layer_ids",
        AUX_LAYER_OFFSET["vllm-native"], 1, NATIVE_KEYS, EAGLE3_TENSORS),
    ("sglang", "eagle3"): FormatContract(
        "sglang", "sglang", "eagle3", "midlayer.", "", "eagle_config.eagle_aux_hidden_state_layer_ids",
        AUX_LAYER_OFFSET["sglang"], 1 + AUX_LAYER_OFFSET["sglang"], SGLANG_KEYS, EAGLE3_TENSORS),
}

# --- EAGLE-1 (docs/engines.md §2.4, §3.2) ------------------------
EAGLE1_TENSORS = (
    TensorRule("fc.weight", ("Hd", "2*Hd")),
    TensorRule("{layer}self_attn.q_proj.weight", ("nh*hd", "Hd")),
    TensorRule("{layer}self_attn.k_proj.weight", ("kvh*hd", "Hd")),
    TensorRule("{layer}self_attn.v_proj.weight", ("kvh*hd", "Hd")),
    TensorRule("{layer}self_attn.o_proj.weight", ("Hd", "nh*hd")),
    TensorRule("{layer}mlp.gate_proj.weight", ("I", "Hd")),
    TensorRule("{layer}mlp.up_proj.weight", ("I", "Hd")),
    TensorRule("{layer}mlp.down_proj.weight", ("Hd", "I")),
    TensorRule("{layer}post_attention_layernorm.weight", ("Hd",)),
)
EAGLE1_FORBIDDEN = (  # names the loaders reject or drop: (pattern, why + what to do)
    (r"^layers\.0\.input_layernorm\.", "layer 0 of an EAGLE-1 draft has no input norm (vLLM raises on it, "
     "SGLang ignores it, so the layer would run differently from training); remove it"),
    (r"^norm\.weight$", "the EAGLE-1 draft has no final norm (vLLM raises on it); remove it"),
    (r"lm_head", "the EAGLE-1 draft uses the target's lm_head (vLLM raises on one, SGLang drops it); remove it"),
)
EAGLE1_COMMON_KEYS = (
    KeyRule("tie_word_embeddings", "equals", False),
    KeyRule("n_predict", "absent", fix="vLLM would take it as num_speculative_tokens and add a divisibility rule"),
)
EAGLE1_VLLM_KEYS = EAGLE1_COMMON_KEYS + (
    KeyRule("architectures", "equals", ["LlamaForCausalLM"], fix="vLLM renames it to EagleLlamaForCausalLM"),
)
EAGLE1_SGLANG_KEYS = EAGLE1_COMMON_KEYS + (
    KeyRule("architectures", "equals", ["LlamaForCausalLMEagle"]),
)

# --- Medusa (docs/engines.md §2.5: vLLM <= 0.32; the original Medusa layout) -------------------
# Tensor rules depend on num_heads / num_layers / bias: `export.medusa.tensor_rules` expands them.
MEDUSA_VLLM_KEYS = (
    KeyRule("architectures", "equals", ["MedusaModel"]),
    KeyRule("model_type", "equals", "medusa", fix=f"{LEGACY_VLLM} detects Medusa drafts by model_type"),
    KeyRule("num_heads", "positive_int", fix="the number of Medusa heads K"),
    KeyRule("num_hidden_layers", "positive_int", fix="residual blocks per head"),
    KeyRule("hidden_size", "positive_int"),
    KeyRule("vocab_size", "positive_int", fix="must be the target's vocabulary size V (vLLM defaults to 32001)"),
    KeyRule("medusa_fc_bias", "bool", fix="write whether the blocks have biases; vLLM defaults to false"),
    KeyRule("original_lm_head", "not_true", fix="each head has its own output layer; set it to false"),
    KeyRule("truncated_vocab_size", "positive_int", fix="write V (no token_map is exported)"),
)
MEDUSA_ORIGINAL_KEYS = (
    KeyRule("medusa_num_heads", "positive_int"),
    KeyRule("medusa_num_layers", "positive_int"),
    KeyRule("base_model_name_or_path", "str", fix="name the target the heads were trained on"),
)
CONTRACTS.update({
    ("vllm", "eagle"): FormatContract("vllm", "vllm", "eagle", "layers.0.", "", "", 0, 0,
                                      EAGLE1_VLLM_KEYS, EAGLE1_TENSORS),
    ("sglang", "eagle"): FormatContract("sglang", "sglang", "eagle", "layers.0.", "", "", 0, 0,
                                        EAGLE1_SGLANG_KEYS, EAGLE1_TENSORS + (TensorRule("fc.bias", ("Hd",)),)),
    ("vllm-0.32", "medusa"): FormatContract("vllm-0.32", "vllm-0.32", "medusa", "", "", "", 0, 0,
                                            MEDUSA_VLLM_KEYS, ()),
    ("medusa", "medusa"): FormatContract("medusa", "medusa", "medusa", "", "", "", 0, 0,
                                         MEDUSA_ORIGINAL_KEYS, ()),
})
CONTRACTS.update({(fmt, "medusa2"): replace(CONTRACTS[(fmt, "medusa")], kind="medusa2")  # the same heads
                  for fmt in ("vllm-0.32", "medusa")})

# MTP and draft models: the folder is a whole model (export/mtp.py, export/draft.py check it); these
# entries give the engine of each (format, kind). The MTP layouts per target family (where the modules
# live, the config key counting them, per-module names) are in heads/mtp_checkpoint.py.
for _fmt in ("vllm", "sglang"):
    for _kind in ("mtp", "draft"):
        CONTRACTS[(_fmt, _kind)] = FormatContract(_fmt, _fmt, _kind, "", "", "", 0, 0, (), ())
MTP_SHAPES = {"enorm": ("H",), "hnorm": ("H",), "eh_proj": ("H", "2*H"), "norm": ("H",)}
MTP_SGLANG_MAX_LAYERS = {"deepseek": 1, "qwen3_next": 1}  # SGLang asserts one NextN layer
DRAFT_KEYS = (  # an ordinary HF Llama causal LM (vLLM draft_model, SGLang STANDALONE)
    KeyRule("architectures", "equals", ["LlamaForCausalLM"]),
    KeyRule("model_type", "equals", "llama"),
    KeyRule("vocab_size", "positive_int", fix="must be the target's vocabulary size (both engines check it)"),
    KeyRule("num_hidden_layers", "positive_int"),
    KeyRule("draft_vocab_size", "absent", fix="an EAGLE key: the engines would not treat this as a plain LM"),
    KeyRule("eagle_config", "absent", fix="an EAGLE key: the engines would not treat this as a plain LM"),
    KeyRule("speculators_config", "absent", fix="a speculators key: vLLM would parse it as an EAGLE draft"),
    KeyRule("", "rope", fix="copy the target's RoPE settings"),
)
for _fmt in ("vllm", "vllm-native", "sglang"):  # DFlash: export/dflash.py checks the folder itself
    CONTRACTS[(_fmt, "dflash")] = FormatContract(_fmt, _fmt.split("-")[0], "dflash", "", "", "", 0, 0, (), ())
TOKENIZER_FILES = ("tokenizer_config.json",)  # plus tokenizer.json or a vocab file, checked by loading


def contract_for(fmt: str, kind: str) -> FormatContract:
    """The contract for (format, head kind), or an error naming the formats that exist for that kind."""
    if (fmt, kind) not in CONTRACTS:
        known = [f for f, k in CONTRACTS if k == kind]
        raise ValueError(f"no '{fmt}' export for head kind '{kind}'; formats for it: {known or 'none'}")
    return CONTRACTS[(fmt, kind)]
