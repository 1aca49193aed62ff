"""Load an export with SGLang 0.5.23's own code on a CPU and report what SGLang made of it.

Runs under the SGLang virtualenv's python (never imports specheads): parses the folder the way
`launch_server` does (ServerArgs -> ModelConfig), builds target and draft with SGLang's model
loader, shares embedding / lm_head through the draft worker's own methods, captures the target
hidden states SGLang hands the draft, runs the draft module forward and a greedy chain.
Writes OUT/result.json and OUT/tensors.safetensors (aux_hidden, draft_logits, chain) in the protocol
of specheads/engines/check.py. SGLang specifics in result.json:
  config.aux_layer_ids            SGLang's numbering (eagle_config ids: it captures the input of decoder
                                  layer id + 1); aux_layer_ids_specheads gives ours (HF hidden_states[k])
  weights.dropped                 names received but written nowhere; `consumed` (d2t -> hot_token_id)
                                  and `ignored_by_design` (t2d; NextN's shared_head.head / embed_tokens,
                                  replaced by the target's) are listed apart
  warnings                        what SGLang does silently with a vocabulary map it cannot use as meant

Only what has no CPU path is replaced, and each replacement is listed in `replaced_kernels`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # the probe's sibling modules (never specheads)
import probe_cpu  # noqa: E402
import probe_sglang_dspark as dspark  # noqa: E402
from probe_kinds import KINDS  # noqa: E402
from probe_sglang_dflash import KV_NOTE, mask_token_id, run_blocks  # noqa: E402
from probe_sglang_forward import (  # noqa: E402
    STANDALONE_NOTE,
    replace_attention_kernel,
    run_draft,
    run_target,
    standalone_chain_as_served,
)
from probe_sglang_weights import (  # noqa: E402
    draft_vocab,
    load_draft_recorded,
    load_model,
    share_with_target,
    synchronous_weight_loading,
    vocab_warnings,
    weights_report,
)

ENGINE = "sglang"
SGL_KERNEL_NOTE = ("run in sgl_kernel ops; the installed sgl_kernel is the CUDA build (stubbed here), so "
                   "they have no CPU path and the forward is not attempted")
MTP_FORWARD_SKIP = {  # target model_type -> why the MTP module's forward is not run on a CPU
    "deepseek_v3": f"DeepSeek-V3 NextN: MLA attention and the fused MoE {SGL_KERNEL_NOTE}",
    "glm4_moe": f"GLM-4 MoE NextN: the fused MoE {SGL_KERNEL_NOTE}",
    "qwen3_next": f"Qwen3-Next MTP: the fused MoE and the hybrid-attention target {SGL_KERNEL_NOTE}",
    "qwen3_5_text": f"Qwen3.5 MTP: the gated-DeltaNet (linear attention) target layers {SGL_KERNEL_NOTE}",
    "qwen3_5_moe_text": f"Qwen3.5 MoE MTP: the fused MoE and gated-DeltaNet layers {SGL_KERNEL_NOTE}",
}
CPU_OPS_READ_AT_IMPORT = ("fused_sigmoid_mul_cpu", "fused_qk_gemma_rmsnorm_cpu",
                          "fused_qk_gemma_rmsnorm_with_gate_cpu", "fused_qkvzba_split_reshape_cat_contiguous_cpu")
REPLACED = []  # what was replaced and why (reported as replaced_kernels)


class StageError(Exception):
    """A stage failed; carries the stage name and the engine's own exception text."""

    def __init__(self, stage: str, exc: BaseException | None = None, type_: str = "", message: str = ""):
        super().__init__(message or str(exc))
        self.stage = stage
        self.type = type_ or type(exc).__name__
        self.message = message or engine_message(exc)
        self.where = engine_frames(exc) if exc is not None else []


def engine_frames(exc: BaseException, n: int = 4) -> list[str]:
    """The last `n` frames of the engine's traceback, as 'file:line: code' (for the report)."""
    frames = traceback.extract_tb(exc.__traceback__)[-n:] if exc.__traceback__ else []
    return [f"{short_path(f.filename)}:{f.lineno}: {f.line}" for f in frames]


def short_path(filename: str) -> str:
    """A frame's file relative to site-packages (engine code) or its base name (this probe)."""
    return filename.split("site-packages/")[-1] if "site-packages/" in filename else Path(filename).name


def engine_message(exc: BaseException) -> str:
    """The exception's own text; for a bare `assert` (empty text), the engine's failing line."""
    text = str(exc)
    if text or exc.__traceback__ is None:
        return text or repr(exc)
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    where = short_path(frame.filename)
    return f"{type(exc).__name__} at {where}:{frame.lineno}: {frame.line}"


# --- running SGLang on a CPU ------------------------------------------------------------------
def setup_cpu_engine() -> None:
    """SGLang's CPU engine switches; sgl_kernel (CUDA-only) stubbed by SGLang's own test helper."""
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    from sglang.test.test_utils import maybe_stub_sgl_kernel

    maybe_stub_sgl_kernel()
    import torch

    torch.cuda.empty_cache = lambda *a, **k: None  # the embed/head sharing calls these after swapping
    torch.cuda.synchronize = lambda *a, **k: None
    REPLACED.append("sgl_kernel: stubbed by sglang.test.test_utils.maybe_stub_sgl_kernel (CUDA-only "
                    "extension; none of its kernels runs on the paths probed here)")
    REPLACED.append("torch.cuda.empty_cache / synchronize: no-ops (called by set_embed_and_head on a CPU)")
    accelerator_module = torch.get_device_module
    torch.get_device_module = lambda device=None: torch.cpu if device is None else accelerator_module(device)
    REPLACED.append("torch.get_device_module() without a device -> torch.cpu (the CUDA torch build SGLang "
                    "pins names CUDA as the accelerator even on a machine without one)")
    for op in CPU_OPS_READ_AT_IMPORT:
        setattr(torch.ops.sgl_kernel, op, missing_op(op))
    REPLACED.append(f"torch.ops.sgl_kernel.{{{', '.join(CPU_OPS_READ_AT_IMPORT)}}}: placeholders that raise if "
                    "called (SGLang's Qwen3.5 model file reads these sgl_kernel CPU ops at import; the CUDA "
                    "sgl_kernel installed has none, so the model class would not register)")


def missing_op(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel CPU op '{name}' is not installed (placeholder from the probe)")
    return op


def server_args(args, algorithm: str):
    """The ServerArgs `launch_server` would build for this export (float32, CPU, no CUDA graphs)."""
    from sglang.srt.server_args import ServerArgs

    mtp = KINDS[args.kind].inside_target  # served as the target folder itself, its MTP layers the draft
    # hybrid (Mamba-style) targets: the default extra_buffer cache needs a GPU platform's snapshots
    platform = {"mamba_radix_cache_strategy": "no_buffer", "disable_overlap_schedule": True} if mtp else {}
    return ServerArgs(**platform,
        model_path=str(args.draft if mtp else args.target), device="cpu", dtype="float32",
        attention_backend="torch_native", disable_cuda_graph=True, skip_server_warmup=True,
        speculative_algorithm=algorithm,
        speculative_draft_model_path=None if mtp else str(args.draft),
        speculative_num_steps=args.k, speculative_eagle_topk=1, speculative_num_draft_tokens=args.k + 1,
    )


def init_runtime(sa) -> None:
    """Publish the config the way a scheduler process does and build a world-1 gloo group."""
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context

    reset_context()
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=0))
    store = Path(tempfile.mkdtemp(prefix="sglang-probe-")) / "rendezvous"
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"file://{store}")
    initialize_model_parallel(backend="gloo")


# --- stage 1: config --------------------------------------------------------------------------
def load_configs(args, sa):
    """Target and draft ModelConfig as the scheduler builds them, plus the aux-capture config."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        resolve_spec_aux_hidden_state_config,
    )
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    algo = SpeculativeAlgorithm.from_string(sa.speculative_algorithm)
    target = ModelConfig.from_server_args(sa)
    draft_path = None if KINDS[args.kind].inside_target else str(args.draft)
    draft = ModelConfig.from_server_args(sa, model_path=draft_path, is_draft_model=True,
                                         context_length=target.context_len)
    aux = resolve_spec_aux_hidden_state_config(server_args=sa, model_config=target, spec_algorithm=algo,
                                               is_draft_worker=False)
    return algo, target, draft, aux


def config_report(sa, algo, draft_cfg, aux) -> dict:
    hf = draft_cfg.hf_config
    return {
        "method": algo.name,  # what SGLang resolved the algorithm to (NEXTN -> EAGLE)
        "algorithm": sa.speculative_algorithm,
        "num_speculative_tokens": sa.speculative_num_steps,
        "k": sa.speculative_num_steps,
        "topk": sa.speculative_eagle_topk,
        "num_draft_tokens": sa.speculative_num_draft_tokens,
        "draft_architecture": (getattr(hf, "architectures", None) or [None])[0],
        "vocab_size": draft_cfg.vocab_size,
        "context_length": draft_cfg.context_len,
        "use_aux_hidden_state": bool(aux.eagle_use_aux_hidden_state),
        "aux_layer_ids_configured": aux.eagle_aux_hidden_state_layer_ids,
        "num_nextn_predict_layers": draft_cfg.num_nextn_predict_layers,
    }


# --- stage 2: weights -------------------------------------------------------------------------
def weights_failure(report: dict) -> StageError | None:
    problems = []
    if report["dropped"]:
        problems.append(f"SGLang's loader received {report['dropped']} and stored them nowhere (no error)")
    if report["never_written"]:
        problems.append(f"parameters {report['never_written']} still hold the NaN sentinel after loading "
                        "and sharing: SGLang would serve them uninitialised")
    if not problems:
        return None
    return StageError("weights", type_="SilentlyNotLoaded", message="; ".join(problems))


# --- the probe --------------------------------------------------------------------------------
def engine_version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # noqa: BLE001 - a version we cannot read is reported as unknown
        return "unknown"


def allow_dflash_on_cpu() -> str:
    """SGLang's CPU platform declares no DFLASH support (it serves DFLASH on CUDA/NPU/XPU only), which
    stops its server-argument resolution; while SGLang's own DFLASH argument handler runs, the platform
    declares support, so the rest of that handler, its config parsing and its loader run unchanged."""
    from sglang.srt.arg_groups import speculative_hook
    from sglang.srt.platforms import current_platform

    handler = speculative_hook._handle_dflash

    def handle_dflash_declaring_support(server_args):
        names = ("is_out_of_tree", "supports_speculative_algorithm", "get_default_speculative_draft_attention_backend",
                 "supports_speculative_draft_attention_backend")
        saved = [getattr(current_platform, n, None) for n in names]
        current_platform.is_out_of_tree = lambda: True
        current_platform.supports_speculative_algorithm = lambda name: name == "DFLASH" or saved[1](name)
        current_platform.get_default_speculative_draft_attention_backend = lambda *a, **k: "torch_native"
        current_platform.supports_speculative_draft_attention_backend = lambda algo, backend: backend == "torch_native"
        try:
            return handler(server_args)
        finally:
            for n, v in zip(names, saved):
                setattr(current_platform, n, v)

    speculative_hook._handle_dflash = handle_dflash_declaring_support
    return ("SGLang's DFLASH argument handler runs with the CPU platform declaring DFLASH support and the "
            "torch_native draft attention backend (SGLang serves DFLASH only on CUDA/NPU/XPU); config parsing "
            "and the weight loader are SGLang's own code")


def new_result() -> dict:
    return {"engine": ENGINE, "version": engine_version(), "config": {}, "weights": {},
            "layers": "not_run: an earlier stage failed", "forward": "not_run: an earlier stage failed",
            "replaced_kernels": REPLACED, "warnings": [], "error": None}


def stage_config(args, result: dict):
    """Stage 1: SGLang parses the folder; returns what later stages need."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    kind = KINDS[args.kind]
    algorithm = kind.sglang_algorithm
    try:
        SpeculativeAlgorithm.from_string(algorithm)  # the engine's own refusal for unknown methods
    except Exception as exc:
        why = f" ({kind.sglang_refusal})" if kind.sglang_refusal else ""
        raise StageError("config", exc, message=f"{engine_message(exc)}{why}") from exc
    try:
        REPLACED.append(replace_attention_kernel())
        if kind.drafts == "block":
            REPLACED.append(allow_dflash_on_cpu())
        if kind.drafts == "markov":
            REPLACED.extend(n for n in (dspark.allow_dspark_on_cpu(), dspark.confidence_mode(args.draft)) if n)
        sa = server_args(args, algorithm)
        init_runtime(sa)
        algo, target_cfg, draft_cfg, aux = load_configs(args, sa)
        from sglang.srt.model_loader import get_model_architecture

        get_model_architecture(draft_cfg)  # the model class SGLang picks for the folder (or its refusal)
    except Exception as exc:
        raise StageError("config", exc) from exc
    result["config"] = config_report(sa, algo, draft_cfg, aux)
    if kind.drafts == "block":
        try:
            result["config"]["mask_token_id"] = mask_token_id(draft_cfg, target_cfg)
        except Exception as exc:
            raise StageError("config", exc) from exc
    if kind.drafts == "markov":
        try:
            result["config"].update(dspark.runtime(draft_cfg, target_cfg, result["config"]["num_draft_tokens"]))
        except Exception as exc:
            raise StageError("config", exc) from exc
    return algo, target_cfg, draft_cfg, aux


def stage_weights(args, result: dict, algo, target_cfg, draft_cfg, aux):
    """Stage 2: build and load target and draft with SGLang's loader, then share embed / head."""
    from sglang.srt.model_executor.model_runner_components.attention_backend_setup import (
        configure_aux_hidden_state_capture,
    )

    try:
        target_model = load_model(target_cfg)
    except Exception as exc:
        raise StageError("weights", exc, message=f"target: {engine_message(exc)}") from exc
    REPLACED.append(synchronous_weight_loading())
    try:
        draft_model, rec, late = load_draft_recorded(draft_cfg)
    except Exception as exc:
        text, name = engine_message(exc), getattr(exc, "failed_on", None)
        raise StageError("weights", exc, message=f"{text} (while loading '{name}')" if name else text) from exc
    try:
        hot = share_with_target(KINDS[args.kind], algo, target_model, draft_model, target_cfg)
        configure_aux_hidden_state_capture(
            model=target_model, eagle_use_aux_hidden_state=aux.eagle_use_aux_hidden_state,
            eagle_aux_hidden_state_layer_ids=aux.eagle_aux_hidden_state_layer_ids,
            dflash_use_aux_hidden_state=aux.dflash_use_aux_hidden_state,
            dflash_target_layer_ids=aux.dflash_target_layer_ids, is_dspark=aux.is_dspark)
    except Exception as exc:
        raise StageError("weights", exc) from exc
    report = weights_report(KINDS[args.kind], rec, late, draft_model, target_cfg.hf_config)
    result["weights"] = report
    cfg = result["config"]
    cfg["draft_vocab_size"] = draft_vocab(draft_model, hot) or int(target_cfg.vocab_size)  # None: target's head
    ours = aux_layer_ids(KINDS[args.kind], target_model, target_cfg)
    cfg["aux_layer_ids_specheads"] = ours
    # SGLang's numbering (eagle_config ids): it captures the input of layer id + 1
    cfg["aux_layer_ids"] = [a - 1 for a in ours] if eagle_taps(KINDS[args.kind]) else None
    result["warnings"] = vocab_warnings(hot, cfg["draft_vocab_size"], int(target_cfg.vocab_size))
    failure = weights_failure(report)
    if failure is not None:
        raise failure
    return target_model, draft_model, hot


def eagle_taps(kind) -> bool:
    """EAGLE-3's taps (the target's `layers_to_capture`); block drafters tap through DFLASH's own config."""
    return kind.reads == "aux" and not kind.block


def aux_layer_ids(kind, target_model, target_cfg):
    """The target states the draft reads, in specheads numbering (k = after k decoder layers = HF
    output_hidden_states[k]). SGLang captures the input of layer i, i.e. id + 1 of its own ids."""
    if kind.standalone:
        return []
    if eagle_taps(kind):
        return [int(i) for i in getattr(target_model.model, "layers_to_capture", [])]
    return [int(target_cfg.num_hidden_layers)]  # EAGLE-1 / NextN: the final (normed) state


def forward_skip_reason(args, target_cfg) -> str | None:
    kind = KINDS[args.kind]
    if kind.inside_target:
        mt = getattr(target_cfg.hf_config, "model_type", "?")
        return MTP_FORWARD_SKIP.get(mt, f"no CPU path for the '{mt}' MTP module")
    if kind.drafts == "parallel":
        return f"the {args.kind} draft forward (parallel drafting) is not probed on a CPU"
    return None


def read_inputs(path: Path):
    """input_ids [1, T] -> [T]; next_token (the target's greedy token after the prompt) if given;
    DFLASH block anchors (default: the block right after the prompt)."""
    from safetensors.torch import load_file

    t = load_file(str(path))
    ids = t["input_ids"].reshape(-1).to("cpu").long()  # [T]
    anchors = [int(a) for a in t["anchors"].tolist()] if "anchors" in t else [ids.shape[0]]
    return ids, int(t["next_token"].reshape(-1)[0]) if "next_token" in t else None, anchors


def stage_forward(args, result: dict, target_model, draft_model, hot, target_cfg) -> dict:
    """Stages 3 and 4: the hidden states SGLang hands the draft, then the draft's logits and chain.
    The chain starts from the given next_token (else SGLang's own target's greedy token)."""
    ids, given_next, anchors = read_inputs(args.inputs)
    kind, tensors = KINDS[args.kind], {}
    try:
        hidden, engine_next = run_target(target_model, ids)
    except Exception as exc:
        raise StageError("layers", exc) from exc
    if kind.standalone:
        result["layers"] = "not_run: a STANDALONE draft reads no target hidden states"
    else:
        tensors["aux_hidden"] = hidden.float().contiguous()  # [T, n_aux*H] (EAGLE-1: [T, H])
        result["layers"] = "ok"
    result["config"]["target_next_token"] = engine_next  # SGLang's target, greedy after the prompt
    next_token = engine_next if given_next is None else given_next
    block_forward = BLOCK_FORWARDS.get(kind.drafts)
    if block_forward is not None:
        return block_forward(args, result, tensors, target_model, draft_model, hidden, ids, next_token, anchors)
    try:
        logits, chain = run_draft(kind.standalone, draft_model, ids, hidden, next_token, hot,
                                  int(target_cfg.vocab_size), args.k)
    except Exception as exc:
        raise StageError("forward", exc) from exc
    tensors["draft_logits"] = logits.float().contiguous()  # [T, V]
    tensors["chain"] = chain  # [k]
    if kind.standalone:
        tensors["chain_as_served"] = standalone_chain_as_served(draft_model, ids, next_token, args.k)
        result["config"]["standalone_prefill"] = STANDALONE_NOTE
    result["forward"] = "ok"
    return tensors


def stage_forward_dflash(args, result, tensors, target_model, draft_model, hidden, ids, next_token, anchors):
    """Stage 4 for DFLASH: the worker's context write and the draft block at every anchor."""
    try:
        REPLACED.append(KV_NOTE)
        block_size = int(result["config"]["num_draft_tokens"])  # what ServerArgs resolved, as the worker reads it
        logits, chain, block_size = run_blocks(draft_model, target_model, hidden, ids, next_token, anchors, args.k,
                                               result["config"]["mask_token_id"], block_size)
    except Exception as exc:
        raise StageError("forward", exc) from exc
    tensors["draft_logits"], tensors["chain"] = logits.float().contiguous(), chain.to("cpu").long()
    result["config"].update(block_size=block_size, anchors=list(anchors))
    result["forward"] = "ok"
    return tensors


def stage_forward_dspark(args, result, tensors, target_model, draft_model, hidden, ids, next_token, anchors):
    """Stage 4 for DSPARK: DFLASH's context write and block forward, then the Markov steps at every anchor."""
    try:
        REPLACED.extend((KV_NOTE, dspark.STEP_NOTE))
        cfg = result["config"]
        logits, chain, confidence = dspark.run_blocks(draft_model, target_model, hidden, ids, next_token, anchors,
                                                      args.k, cfg["mask_token_id"], cfg["block_size"],
                                                      cfg["sample_from_anchor"])
    except Exception as exc:
        raise StageError("forward", exc) from exc
    tensors["draft_logits"], tensors["chain"] = logits.float().contiguous(), chain.to("cpu").long()
    if confidence is not None:
        tensors["confidence"] = confidence.float().contiguous()
    result["config"].update(anchors=list(anchors), confidence_head=draft_model.confidence_head is not None)
    result["forward"] = "ok"
    return tensors


BLOCK_FORWARDS = {"block": stage_forward_dflash, "markov": stage_forward_dspark}  # by ProbeKind.drafts


def probe(args) -> tuple[dict, dict]:
    result, tensors = new_result(), {}
    try:
        result["cpu"] = probe_cpu.apply()  # before SGLang reads the CPU's features at import
        setup_cpu_engine()
        algo, target_cfg, draft_cfg, aux = stage_config(args, result)
        target_model, draft_model, hot = stage_weights(args, result, algo, target_cfg, draft_cfg, aux)
        skip = forward_skip_reason(args, target_cfg)
        if skip:
            result["layers"] = result["forward"] = f"not_run: {skip}"
        else:
            tensors = stage_forward(args, result, target_model, draft_model, hot, target_cfg)
    except StageError as err:
        result["error"] = {"stage": err.stage, "type": err.type, "message": err.message, "where": err.where}
        if err.stage == "forward" and result["layers"] == "ok":
            result["forward"] = "not_run: the draft forward raised"
    except Exception as exc:  # noqa: BLE001 - anything else is reported, with where it happened
        result["error"] = {"stage": "probe", "type": type(exc).__name__, "message": str(exc),
                           "traceback": traceback.format_exc()[-4000:]}
    return result, tensors


def read_k(args) -> int:
    if args.k is not None:
        return args.k
    meta = Path(args.draft) / "specheads.json"
    try:
        return int(json.loads(meta.read_text())["num_speculative_tokens"])
    except (OSError, ValueError, KeyError, TypeError):
        return 3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--draft", type=Path, required=True)
    ap.add_argument("--kind", required=True, choices=sorted(KINDS))
    ap.add_argument("--inputs", type=Path, required=True,
                    help="safetensors with input_ids [1, T] int64 (and optionally next_token [1])")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--k", type=int, default=None, help="speculative steps (default: the export's own)")
    args = ap.parse_args(argv)
    args.k = read_k(args)
    result, tensors = probe(args)
    write_outputs(args.out, result, tensors)
    return 0


def write_outputs(out: Path, result: dict, tensors: dict) -> None:
    """result.json and tensors.safetensors, each written to a temp name and renamed into place."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    if tensors:
        tmp = out / ".tensors.safetensors.tmp"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
        os.replace(tmp, out / "tensors.safetensors")
    tmp = out / ".result.json.tmp"
    tmp.write_text(json.dumps(result, indent=2, default=str) + "\n")
    os.replace(tmp, out / "result.json")


if __name__ == "__main__":
    sys.exit(main())
