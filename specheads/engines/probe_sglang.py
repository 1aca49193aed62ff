"""Load an export with SGLang 0.5.23's own code on a CPU and report what SGLang made of it.

Runs under the SGLang virtualenv's python (never imports specheads): parses the folder the way
`launch_server` does (ServerArgs -> ModelConfig), builds target and draft with SGLang's model
loader, shares embedding / lm_head through the draft worker's own methods, captures the target
hidden states SGLang hands the draft, runs the draft module forward and a greedy chain.
Writes OUT/result.json and OUT/tensors.safetensors (aux_hidden, draft_logits, chain).

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
from types import SimpleNamespace

ENGINE = "sglang"
ALGORITHMS = {"eagle3": "EAGLE3", "eagle": "EAGLE", "draft": "STANDALONE", "mtp": "NEXTN",
              "medusa": "MEDUSA", "medusa2": "MEDUSA", "dflash": "DFLASH", "peagle": "PEAGLE"}
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

    mtp = args.kind == "mtp"
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


# --- attention without CUDA -------------------------------------------------------------------
class KVStore:
    """Keys and values each RadixAttention layer has seen since the last reset (a plain KV cache)."""

    def __init__(self):
        self.kv: dict[int, tuple] = {}

    def reset(self) -> None:
        self.kv.clear()


KV = KVStore()


def causal_attention(self, q, k, v, forward_batch, save_kv_cache=True, **kwargs):
    """Causal softmax attention over this layer's own cached and new q/k/v (replaces the kernel).

    q: [N, nh*hd], k: [N, kvh*hd], v: [N, kvh*vd] -> [N, nh*vd]. Rows are one sequence, appended
    after whatever this layer cached since KV.reset().
    """
    import torch

    nh, kvh, hd, vd = self.tp_q_head_num, self.tp_k_head_num, self.qk_head_dim, self.v_head_dim
    q = q.reshape(-1, nh, hd)
    k, v = k.reshape(-1, kvh, hd), v.reshape(-1, kvh, vd)
    past_k, past_v = KV.kv.get(id(self), (k[:0], v[:0]))
    k, v = torch.cat([past_k, k]), torch.cat([past_v, v])  # [P+N, kvh, *]
    KV.kv[id(self)] = (k, v)
    n, total = q.shape[0], k.shape[0]
    rep = nh // kvh
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # [P+N, nh, *]
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * self.scaling  # [nh, N, P+N]
    if getattr(self, "logit_cap", 0) and self.logit_cap > 0:
        scores = self.logit_cap * torch.tanh(scores / self.logit_cap)
    rows = torch.arange(total - n, total).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(total).unsqueeze(0) > rows, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float())  # [N, nh, vd]
    return out.reshape(n, nh * vd).to(q.dtype)


def replace_attention_kernel() -> None:
    from sglang.srt.layers.radix_attention import RadixAttention

    RadixAttention.forward = causal_attention
    REPLACED.append("RadixAttention.forward: plain causal softmax over the layer's own q/k/v (SGLang's "
                    "attention kernels need CUDA and a paged KV pool); projections, RoPE, norms, MLP, "
                    "fc and lm_head are SGLang's own modules")


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
    draft_path = None if args.kind == "mtp" else str(args.draft)
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
class LoadRecorder:
    """Pre-fills a model's parameters with NaN and records, per name the loader receives, whether
    any parameter changed while the engine handled it (stored) or not (dropped)."""

    def __init__(self, model):
        import torch

        self.params = dict(model.named_parameters())
        with torch.no_grad():
            for p in self.params.values():
                if p.is_floating_point():
                    p.fill_(float("nan"))
        self.snap = {n: p.detach().clone() for n, p in self.params.items()}
        self.received: list[tuple[str, list[int]]] = []
        self.pending: dict = {}  # name -> tensor, for names that wrote nothing on arrival
        self.stored: dict[str, list[str]] = {}
        self.current: str | None = None

    def changed(self) -> list[str]:
        import torch

        out = []
        for n, p in self.params.items():
            old = self.snap[n]
            if old.shape != p.shape or not torch.equal(torch.nan_to_num(old, nan=1.5e38), torch.nan_to_num(p.detach(), nan=1.5e38)):
                out.append(n)
                self.snap[n] = p.detach().clone()
        return out

    def wrap(self, weights):
        for name, tensor in weights:
            self.current = name
            self.received.append((name, list(tensor.shape)))
            yield name, tensor
            changed = self.changed()
            self.stored[name] = list(changed)
            if not changed:
                self.pending[name] = tensor
            self.credit_pending(changed)
        self.current = None

    def credit_pending(self, changed: list[str]) -> None:
        """Credit earlier names that wrote nothing when they arrived but whose exact values now sit
        in a changed parameter (loaders that buffer a tensor until its partner arrives, e.g. the
        fused q_a / kv_a projection of DeepSeek)."""
        for name, tensor in list(self.pending.items()):
            hits = [p for p in changed if holds_block(self.params[p].detach(), tensor)]
            if hits:
                self.stored[name] = hits
                del self.pending[name]

    def settle(self) -> list[str]:
        """Parameters written after the last name arrived (deferred loads)."""
        late = self.changed()
        self.credit_pending(late)
        return late


def holds_block(param, tensor) -> bool:
    """Whether `tensor` [n, ...] equals a block of consecutive rows of `param` [m, ...]."""
    import torch

    if tensor.dim() != param.dim() or tensor.shape[1:] != param.shape[1:] or tensor.shape[0] > param.shape[0]:
        return False
    t = tensor.to(param.dtype)
    n = t.shape[0]
    return any(torch.equal(param[i:i + n], t) for i in range(param.shape[0] - n + 1))


def load_model(model_cfg):
    """get_model as the model runner calls it on a CPU (after its unaligned-TP config adjustment)."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.update_config import adjust_config_with_unaligned_cpu_tp
    from sglang.srt.model_loader import get_model

    load_cfg = LoadConfig(load_format="auto")
    model_cfg = adjust_config_with_unaligned_cpu_tp(model_cfg, load_cfg, 1)
    return get_model(model_config=model_cfg, load_config=load_cfg, device_config=DeviceConfig("cpu", 0))


def load_draft_recorded(draft_cfg):
    """The draft through SGLang's loader, with a LoadRecorder around its load_weights call."""
    from sglang.srt.model_loader.loader import DefaultModelLoader

    original = DefaultModelLoader.load_weights_only
    box = {}

    def recorded(model, weights, target_device):
        box["rec"] = rec = LoadRecorder(model)
        try:
            original(model, rec.wrap(weights), target_device)
        except Exception as exc:
            box["failed_on"] = rec.current
            raise exc
        box["late"] = rec.settle()

    DefaultModelLoader.load_weights_only = staticmethod(recorded)
    synchronous_weight_loading()
    try:
        model = load_model(draft_cfg)
    except Exception as exc:
        name = box.get("failed_on")
        text = engine_message(exc)
        raise StageError("weights", exc, message=f"{text} (while loading '{name}')" if name else text) from exc
    finally:
        DefaultModelLoader.load_weights_only = original
    return model, box["rec"], box.get("late", [])


def synchronous_weight_loading() -> None:
    """Loaders that copy host tensors from a thread pool (DeepSeek, LongCat) do it inline instead,
    so every write happens while its tensor name is being handled (same values, same order)."""
    for module in list(sys.modules.values()):
        if getattr(module, "should_async_load", None) is not None and \
                getattr(module, "__name__", "").startswith("sglang."):
            module.should_async_load = lambda weight: False
    note = ("should_async_load -> False: thread-pool weight copies run inline, so each write is "
            "attributed to the tensor name being loaded")
    if note not in REPLACED:
        REPLACED.append(note)


def share_with_target(kind: str, algo, target_model, draft_model, target_cfg):
    """The draft worker's own init_token_map / init_lm_head, run on the two loaded models."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker
    from sglang.srt.speculative.standalone_worker_v2 import StandaloneDraftWorker

    worker_cls = StandaloneDraftWorker if kind == "draft" else EagleDraftWorker
    runner = SimpleNamespace(model=target_model, model_config=target_cfg, load_config=LoadConfig(load_format="auto"))
    worker = SimpleNamespace(speculative_algorithm=algo, hot_token_id=None,
                             target_worker=SimpleNamespace(model_runner=runner),
                             draft_runner=SimpleNamespace(model=draft_model))
    worker._resolve_shared_embed_and_head = lambda: worker_cls._resolve_shared_embed_and_head(worker)
    worker_cls.init_token_map(worker)
    worker_cls.init_lm_head(worker)
    return worker.hot_token_id


def module_names(kind: str, name: str, target_hf) -> bool:
    """Whether a checkpoint name belongs to the draft (MTP folders also hold the whole target)."""
    if kind != "mtp":
        return True
    first = getattr(target_hf, "num_hidden_layers", 0)
    return name.startswith(("mtp.", f"model.layers.{first}.")) or any(
        name.startswith(f"model.layers.{first + i}.") for i in range(1, 4))


def weights_report(kind, rec: LoadRecorder, late: list[str], draft_model, target_hf) -> dict:
    """created / loaded / never_written / dropped / shape_mismatch, after the sharing step."""
    import torch

    params = dict(draft_model.named_parameters())
    never = sorted(n for n, p in params.items() if p.is_floating_point() and bool(torch.isnan(p).any()))
    consumed, ignored, dropped, skipped = {}, [], [], 0
    for name, _ in rec.received:
        if rec.stored.get(name):
            continue
        if kind == "eagle3" and "d2t" in name and getattr(draft_model, "hot_token_id", None) is not None:
            consumed[name] = "hot_token_id (d2t + arange)"
        elif not module_names(kind, name, target_hf):
            skipped += 1  # a target tensor in an MTP folder: the NextN loader reads only its layer
        elif kind == "eagle3" and "t2d" in name:
            ignored.append(name)  # LlamaForCausalLMEagle3.load_weights skips t2d by design
        elif kind == "mtp" and ("shared_head.head" in name or "embed_tokens" in name):
            ignored.append(name)  # the NextN loader skips these and shares the target's
        else:
            dropped.append(name)
    return {
        "created": sorted(rec.params),
        "loaded": [n for n, _ in rec.received if module_names(kind, n, target_hf)],
        "shapes": {"created": {n: list(p.shape) for n, p in rec.params.items()},
                   "loaded": {n: s for n, s in rec.received if module_names(kind, n, target_hf)}},
        "stored_into": {n: v for n, v in rec.stored.items() if v},
        "written_after_loading": late,
        "never_written": never,
        "dropped": dropped,
        "consumed": consumed,
        "ignored_by_design": ignored,
        "target_tensors_not_for_the_draft": skipped,
        "shape_mismatch": [],
    }


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


# --- stage 3 / 4: forward passes --------------------------------------------------------------
def forward_batch(ids, positions, mode, capture, hidden=None):
    """A one-sequence ForwardBatch: every position of `ids` [N] new, at `positions` [N]."""
    import torch
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

    n = ids.shape[0]
    end = int(positions[-1]) + 1
    return ForwardBatch(
        forward_mode=getattr(ForwardMode, mode), batch_size=1, input_ids=ids,
        req_pool_indices=torch.zeros(1, dtype=torch.int64), seq_lens=torch.tensor([end]),
        out_cache_loc=positions.clone(), seq_lens_sum=end, seq_lens_cpu=torch.tensor([end]),
        positions=positions, extend_num_tokens=n, extend_seq_lens=torch.tensor([n]),
        extend_prefix_lens=torch.tensor([end - n]), extend_start_loc=torch.zeros(1, dtype=torch.int64),
        extend_seq_lens_cpu=[n], extend_prefix_lens_cpu=[end - n], extend_logprob_start_lens_cpu=[n],
        capture_hidden_mode=getattr(CaptureHiddenMode, capture), return_logprob=False,
        spec_info=None if hidden is None else SimpleNamespace(hidden_states=hidden),
    )


def run_target(target_model, ids):
    """Target prefill in EXTEND mode, capturing hidden states for the draft as the worker does.
    ids [T] -> (hidden for the draft [T, n_aux*H or H], next token id)."""
    import torch

    KV.reset()
    fb = forward_batch(ids, torch.arange(ids.shape[0]), "EXTEND", "FULL")
    out = target_model.forward(ids, fb.positions, fb)
    return out.hidden_states, int(out.next_token_logits[-1].argmax())


def draft_step(draft_model, ids, positions, hidden):
    """One draft forward with SGLang's module: -> (logits [N, Vd], carried hidden [N, H])."""
    from sglang.srt.layers.logits_processor import LogitsMetadata

    fb = forward_batch(ids, positions, "EXTEND", "LAST", hidden)
    out = draft_model.model(ids, positions, fb)
    if isinstance(out, tuple):  # EAGLE-3: (normed for logits, [carried])
        to_logits, carried = out[0], out[1][0]
    else:
        to_logits = carried = out
    logits = draft_model.logits_processor._get_logits(to_logits, draft_model.lm_head,
                                                      LogitsMetadata.from_forward_batch(fb))
    return logits, carried


def to_target_vocab(logits, hot, vocab: int):
    """Draft-vocab logits [N, Vd] placed at target ids [N, V]: through the hot-token map when SGLang
    has one, else draft id i is target id i (what the worker does without a map)."""
    import torch

    full = torch.full((logits.shape[0], vocab), float("-inf"), dtype=logits.dtype)
    if hot is None:
        full[:, :logits.shape[1]] = logits[:, :vocab]
    else:  # a float map (from a float d2t) is used the way SGLang's embedding uses ids: .long()
        full[:, hot.long()] = logits
    return full


def greedy_token(logits, hot):
    """The worker's top-1 draft id mapped to a target id (`hot_token_id[topk_index]`), as the
    0-d tensor the worker feeds to the next step (a float map stays float, as in SGLang)."""
    idx = logits[-1].argmax()
    return hot[idx] if hot is not None else idx


def run_draft(kind, draft_model, ids, hidden, next_token, hot, vocab: int, k: int):
    """Draft logits at every prompt position [T, V] and the greedy chain [k] after the prompt.

    EAGLE drafts read token x_{t+1} and the target state at t (SGLang's draft extend shifts the ids
    and appends the target's next token x_T), so row T-1 proposes chain[0] = x_{T+1}; the chain then
    feeds each proposal back with the carried draft state. A standalone draft model reads the prompt
    itself (row t predicts x_{t+1}), then x_T at position T, then its own proposals."""
    import torch

    KV.reset()
    t = ids.shape[0]
    if kind == "draft":
        logits, _ = draft_step(draft_model, ids, torch.arange(t), None)
        chain, carried, tok = [], None, torch.tensor(next_token)
    else:
        shifted = torch.cat([ids[1:], torch.tensor([next_token])])
        logits, carried = draft_step(draft_model, shifted, torch.arange(t), hidden)
        chain = [greedy_token(logits, hot)]
        tok = chain[-1]
    prompt_logits, pos = logits, t
    while len(chain) < k:
        state = None if kind == "draft" else carried[-1:]
        step_logits, carried = draft_step(draft_model, tok.reshape(1), torch.tensor([pos]), state)
        chain.append(greedy_token(step_logits, hot))
        tok, pos = chain[-1], pos + 1
    return to_target_vocab(prompt_logits, hot, vocab), torch.stack(chain).to(torch.int64)


# --- the probe --------------------------------------------------------------------------------
def engine_version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # noqa: BLE001 - a version we cannot read is reported as unknown
        return "unknown"


def new_result() -> dict:
    return {"engine": ENGINE, "version": engine_version(), "config": {}, "weights": {},
            "layers": "not_run: an earlier stage failed", "forward": "not_run: an earlier stage failed",
            "replaced_kernels": REPLACED, "warnings": [], "error": None}


def stage_config(args, result: dict):
    """Stage 1: SGLang parses the folder; returns what later stages need."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    algorithm = ALGORITHMS[args.kind] if args.kind != "peagle" else "EAGLE3"
    try:
        SpeculativeAlgorithm.from_string(algorithm)  # the engine's own refusal for unknown methods
        replace_attention_kernel()
        sa = server_args(args, algorithm)
        init_runtime(sa)
        algo, target_cfg, draft_cfg, aux = load_configs(args, sa)
        from sglang.srt.model_loader import get_model_architecture

        get_model_architecture(draft_cfg)  # the model class SGLang picks for the folder (or its refusal)
    except Exception as exc:
        raise StageError("config", exc) from exc
    result["config"] = config_report(sa, algo, draft_cfg, aux)
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
    draft_model, rec, late = load_draft_recorded(draft_cfg)
    try:
        hot = share_with_target(args.kind, algo, target_model, draft_model, target_cfg)
        configure_aux_hidden_state_capture(
            model=target_model, eagle_use_aux_hidden_state=aux.eagle_use_aux_hidden_state,
            eagle_aux_hidden_state_layer_ids=aux.eagle_aux_hidden_state_layer_ids,
            dflash_use_aux_hidden_state=aux.dflash_use_aux_hidden_state,
            dflash_target_layer_ids=aux.dflash_target_layer_ids, is_dspark=aux.is_dspark)
    except Exception as exc:
        raise StageError("weights", exc) from exc
    report = weights_report(args.kind, rec, late, draft_model, target_cfg.hf_config)
    result["weights"] = report
    cfg = result["config"]
    cfg["draft_vocab_size"] = draft_vocab(draft_model, hot)
    ours = aux_layer_ids(args.kind, target_model, target_cfg)
    cfg["aux_layer_ids_specheads"] = ours
    # SGLang's numbering (eagle_config ids): it captures the input of layer id + 1
    cfg["aux_layer_ids"] = [a - 1 for a in ours] if args.kind == "eagle3" else None
    result["warnings"] = vocab_warnings(hot, cfg["draft_vocab_size"], int(target_cfg.vocab_size))
    failure = weights_failure(report)
    if failure is not None:
        raise failure
    return target_model, draft_model, hot


def vocab_warnings(hot, draft_vocab: int, vocab: int) -> list[str]:
    """What SGLang does, without an error, with a draft vocabulary map it cannot use as intended."""
    out = []
    if hot is None and draft_vocab < vocab:
        out.append(f"no hot-token map (d2t) for a {draft_vocab}-token draft head over a {vocab}-token "
                   f"target: SGLang takes draft id i as target id i, without an error")
    if hot is not None and hot.is_floating_point():
        out.append(f"hot_token_id is {hot.dtype} (a floating d2t): SGLang loads it without an error and "
                   "its embedding casts the ids with .long(); ids are exact only while the float holds them")
    return out


def draft_vocab(draft_model, hot) -> int:
    """Rows of the draft's output layer in token ids (hot vocab, else the unpadded head size)."""
    if hot is not None:
        return int(hot.shape[0])
    head = draft_model.lm_head
    return int(getattr(head, "org_vocab_size", head.weight.shape[0]))


def aux_layer_ids(kind: str, target_model, target_cfg):
    """The target states the draft reads, in specheads numbering (k = after k decoder layers = HF
    output_hidden_states[k]). SGLang captures the input of layer i, i.e. id + 1 of its own ids."""
    if kind == "draft":
        return []
    if kind == "eagle3":
        return [int(i) for i in getattr(target_model.model, "layers_to_capture", [])]
    return [int(target_cfg.num_hidden_layers)]  # EAGLE-1 / NextN: the final (normed) state


def forward_skip_reason(args, target_cfg) -> str | None:
    if args.kind == "mtp":
        mt = getattr(target_cfg.hf_config, "model_type", "?")
        return MTP_FORWARD_SKIP.get(mt, f"no CPU path for the '{mt}' MTP module")
    if args.kind in ("dflash", "peagle"):
        return f"the {args.kind} draft forward is not probed on a CPU"
    return None


def read_inputs(path: Path):
    """input_ids [1, T] -> [T]; next_token (the target's greedy token after the prompt) if given."""
    from safetensors.torch import load_file

    t = load_file(str(path))
    ids = t["input_ids"].reshape(-1).to("cpu").long()  # [T]
    return ids, int(t["next_token"].reshape(-1)[0]) if "next_token" in t else None


def stage_forward(args, result: dict, target_model, draft_model, hot, target_cfg) -> dict:
    """Stages 3 and 4: the hidden states SGLang hands the draft, then the draft's logits and chain.
    The chain starts from the given next_token (else SGLang's own target's greedy token)."""
    ids, given_next = read_inputs(args.inputs)
    tensors = {}
    try:
        hidden, engine_next = run_target(target_model, ids)
    except Exception as exc:
        raise StageError("layers", exc) from exc
    if args.kind == "draft":
        result["layers"] = "not_run: a STANDALONE draft reads no target hidden states"
    else:
        tensors["aux_hidden"] = hidden.float().contiguous()  # [T, n_aux*H] (EAGLE-1: [T, H])
        result["layers"] = "ok"
    result["config"]["target_next_token"] = engine_next  # SGLang's target, greedy after the prompt
    next_token = engine_next if given_next is None else given_next
    try:
        logits, chain = run_draft(args.kind, draft_model, ids, hidden, next_token, hot,
                                  int(target_cfg.vocab_size), args.k)
    except Exception as exc:
        raise StageError("forward", exc) from exc
    tensors["draft_logits"] = logits.float().contiguous()  # [T, V]
    tensors["chain"] = chain  # [k]
    if args.kind == "draft":
        tensors["chain_as_served"] = standalone_chain_as_served(draft_model, ids, next_token, args.k)
        result["config"]["standalone_prefill"] = STANDALONE_NOTE
    result["forward"] = "ok"
    return tensors


STANDALONE_NOTE = ("SGLang 0.5.23's draft extend after prefill shifts the ids for STANDALONE as for EAGLE: the "
                   "draft model reads x_1..x_T at positions 0..T-1 (x_0 never enters its KV cache); "
                   "`chain` feeds the whole prompt like our verifier, `chain_as_served` feeds it as SGLang does")


def standalone_chain_as_served(draft_model, ids, next_token: int, k: int):
    """The STANDALONE chain with SGLang's shifted prefill: [x_1..x_T] at 0..T-1, then proposals."""
    import torch

    KV.reset()
    t = ids.shape[0]
    logits, _ = draft_step(draft_model, torch.cat([ids[1:], torch.tensor([next_token])]), torch.arange(t), None)
    chain = [logits[-1].argmax()]
    while len(chain) < k:
        logits, _ = draft_step(draft_model, chain[-1].reshape(1), torch.tensor([t - 1 + len(chain)]), None)
        chain.append(logits[-1].argmax())
    return torch.stack(chain).to(torch.int64)


def probe(args) -> tuple[dict, dict]:
    result, tensors = new_result(), {}
    try:
        setup_cpu_engine()
        if args.kind == "medusa":
            from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

            try:
                SpeculativeAlgorithm.from_string("MEDUSA")
            except Exception as exc:
                raise StageError("config", exc, message=f"{exc} (SGLang 0.5.23 has no Medusa loader)") from exc
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
    ap.add_argument("--kind", required=True, choices=sorted(ALGORITHMS))
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
