"""Load one export with vLLM 0.33's own code on a CPU and record what the engine made of it.

Runs under the ENGINE's Python (`<vllm venv>/bin/python probe_vllm.py ...`), never specheads' (the
engine pins its own torch / transformers), so it imports nothing from specheads. It parses the
folder as `vllm serve` does (EngineArgs -> create_engine_config), builds the target with the model
loader, builds and loads the draft with the V2 model runner's spec-decode loaders (embedding and
lm_head sharing included), then runs the target and the draft module forward in float32.

Stages (each recorded in result.json; a failing stage keeps the engine's own exception text):
  config   the speculative config vLLM derives (method, k, draft architecture, vocab sizes, aux ids)
  weights  every draft parameter pre-filled with a sentinel (NaN / -7777) before the loader runs;
           every tensor name the loader receives; which ones reached a parameter's weight_loader;
           the warnings vLLM logs while loading the draft
  layers   the target hidden states vLLM taps for the draft (EAGLE-3: its aux layers; EAGLE-1 and
           MTP: the state the target returns), written as `aux_hidden`
  forward  the draft module's logits on the first draft pass (`draft_logits`, scattered to the full
           vocabulary as compute_logits does) and a greedy chain of k tokens (`chain`); DFlash: the
           block logits at each anchor of the inputs (`draft_logits` [n_anchors * k, V]) and the
           last block's greedy tokens (`chain`), see probe_vllm_dflash.py

Only `Attention.forward` is replaced (the CPU platform's attention kernels need a KV cache and
scheduler metadata): the replacement is a plain causal softmax over the layer's own q / k / v.
DFlash also needs its context K/V precompute's two fused ops and cache write (probe_vllm_dflash.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # the probe's sibling modules (never specheads)
import probe_cpu  # noqa: E402
import probe_vllm_dspark as dspark  # noqa: E402
from probe_kinds import KINDS  # noqa: E402
from probe_vllm_dflash import block_attention, file_context_kv, native_custom_ops, run_blocks  # noqa: E402

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

INT_SENTINEL = -7777
_ACTIVE = {"probe": None, "distributed": False, "loader_patched": False, "cpu": None}  # process-wide (--jobs)
REPLACED = ("vllm.model_executor.layers.attention.Attention.forward -> a plain causal softmax over the "
            "layer's own q/k/v (float32): vLLM's CPU attention kernels need a KV cache, block tables and "
            "scheduler metadata that only a running engine builds; projections, RoPE, norms, MLP, fc, "
            "lm_head and the vocabulary scatter are vLLM's own code")


def parse_args(argv=None):
    """One export; or `--jobs FILE.json`: a list of {target, draft, kind, inputs, out, k} run in turn."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--kind", required=True, choices=sorted(KINDS))
    p.add_argument("--inputs", required=True, help="safetensors with input_ids [1, T], next_token [1]")
    p.add_argument("--out", required=True)
    p.add_argument("--k", type=int, default=3)
    return p.parse_args(argv)


class Stop(Exception):
    """A stage failed; the error is already recorded."""


class Probe:
    def __init__(self, args):
        self.args = args
        self.kind = KINDS[args.kind]  # what the kind asks of the engine (probe_kinds.py)
        self.result = {
            "engine": "vllm", "version": None, "config": {},
            "weights": {"created": [], "loaded": [], "never_written": [], "dropped": [], "shape_mismatch": []},
            "layers": "not_run: an earlier stage failed", "forward": "not_run: an earlier stage failed",
            "replaced_kernels": [], "error": None, "cpu": _ACTIVE.get("cpu"),
        }
        self.tensors = {}

    # --- bookkeeping -----------------------------------------------------------------------
    def fail(self, stage: str, err: BaseException):
        self.result["error"] = {"stage": stage, "type": type(err).__name__, "message": str(err),
                                "traceback_tail": traceback.format_exc()[-3000:]}
        raise Stop()

    def write(self):
        out = Path(self.args.out)
        out.mkdir(parents=True, exist_ok=True)
        if self.tensors:
            from safetensors.torch import save_file

            save_file({k: v.detach().float().contiguous() if v.is_floating_point() else v.contiguous()
                       for k, v in self.tensors.items()}, str(out / "tensors.safetensors"))
        (out / "result.json").write_text(json.dumps(self.result, indent=2, default=str) + "\n")

    # --- stages ------------------------------------------------------------------------------
    def run(self):
        try:
            import vllm

            self.result["version"] = vllm.__version__
            self.config_stage()
            self.weights_stage()
            self.layers_stage()
            self.forward_stage()
        except Stop:
            pass
        finally:
            _ACTIVE["probe"] = None
            getattr(self, "_undo_runner", lambda: None)()
            if getattr(self, "_ctx", None) is not None:
                self._ctx.__exit__(None, None, None)
        self.write()

    def spec_config(self) -> dict:
        args = self.args
        spec = {"method": self.kind.vllm_method, "model": args.draft, "num_speculative_tokens": args.k}
        if self.kind.inside_target:
            spec.pop("model")  # `vllm serve EXPORT --speculative-config '{"method": "mtp", ...}'`
        if self.kind.drafts == "parallel":  # P-EAGLE: EAGLE-3 drafting all k tokens in one forward
            spec["parallel_drafting"] = True
        return spec

    def config_stage(self):
        from vllm.engine.arg_utils import EngineArgs

        self._undo_runner = dspark.v2_runner(self.kind.drafts == "markov", self.result["replaced_kernels"])  # for the whole job
        try:
            engine_args = EngineArgs(
                model=self.args.target, tokenizer=self.args.target, dtype="float32", enforce_eager=True,
                compilation_config={"custom_ops": ["none"]}, speculative_config=self.spec_config(), seed=0,
                max_num_seqs=1)
            self.vc = engine_args.create_engine_config()
        except Exception as err:  # noqa: BLE001 - the engine's own refusal is the finding
            self.fail("config", err)
        sc = self.vc.speculative_config
        hf = sc.draft_model_config.hf_config
        cfg = {
            "method": sc.method,
            "num_speculative_tokens": sc.num_speculative_tokens,
            "draft_architecture": (list(getattr(hf, "architectures", None) or []) or [None])[0],
            "draft_model_type": getattr(hf, "model_type", None),
            "vocab_size": self.vc.model_config.get_vocab_size(),
            "draft_vocab_size": getattr(hf, "draft_vocab_size", None) or sc.draft_model_config.get_vocab_size(),
            "target_architecture": self.vc.model_config.architectures[0],
            "draft_path": sc.draft_model_config.model,
            "aux_layer_ids": None,
        }
        if self.kind.reads == "aux":  # DFlash and DSpark tap the target as EAGLE-3 does
            from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

            ids = get_eagle3_aux_layers_from_config(sc)
            cfg["aux_layer_ids"] = list(ids) if ids else None
            cfg["aux_layer_ids_source"] = "draft config" if ids else "target default"
            for key in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "target_hidden_size"):
                cfg[key] = getattr(hf, key, None)
        if self.kind.block:
            from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id

            cfg["mask_token_id"] = get_parallel_drafting_token_id(hf)
        if self.kind.drafts == "markov":
            cfg.update(dspark.config_fields(hf))
        if self.kind.inside_target:
            cfg["n_predict"] = getattr(hf, "n_predict", None)
        cfg["parallel_drafting"] = bool(getattr(sc, "parallel_drafting", False))
        self.result["config"] = cfg

    def weights_stage(self):
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.distributed.parallel_state import (
            destroy_model_parallel,
            ensure_model_parallel_initialized,
            init_distributed_environment,
            model_parallel_is_initialized,
        )

        self.draft_config = self.vc.speculative_config.draft_model_config
        self._instrument_loader()
        if self.kind.inside_target:  # MTP targets: MoE and MLA layers without a CPU packing path
            self._skip_moe_prepack()
            self._skip_amx_mla_packing()
        try:
            self._ctx = set_current_vllm_config(self.vc)
            self._ctx.__enter__()
            if not _ACTIVE["distributed"]:  # once per process (a batch of jobs shares it)
                init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                             distributed_init_method=f"file://{tempfile.mkdtemp()}/dist")
                _ACTIVE["distributed"] = True
            if model_parallel_is_initialized():  # groups depend on the model (MoE: an expert-parallel group)
                destroy_model_parallel()
            ensure_model_parallel_initialized(1, 1)
            from vllm.model_executor.model_loader import get_model

            self.target = get_model(vllm_config=self.vc)
            self.draft = self._load_draft()
        except Exception as err:  # noqa: BLE001
            self._record_weights()
            self.fail("weights", err)
        self._record_weights(self.draft)
        torch.set_grad_enabled(False)

    def _load_draft(self):
        loader = DRAFT_LOADERS.get(self.vc.speculative_config.method, load_eagle)
        return loader(self.vc, self.target)

    def _instrument_loader(self):
        """Sentinel-fill the draft's parameters and record what its loader receives and consumes."""
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        self.received, self.consumed, self.created, self.mismatch = [], set(), [], []
        self.load_warnings, self.buffers = [], {}
        _ACTIVE["probe"] = self
        if _ACTIVE["loader_patched"]:  # once per process; the patch reports to the active probe
            return
        _ACTIVE["loader_patched"] = True
        original = DefaultModelLoader.load_weights
        state = {"current": None, "by_ptr": {}, "alive": []}

        def source(weight):
            """The received name this tensor came from: by its data pointer (loaders may buffer
            every tensor before loading), else the name received last."""
            return state["by_ptr"].get(weight.data_ptr(), state["current"])

        def recording(probe, name, param, loader):
            def weight_loader(*args, **kw):  # loaders are called positionally or by keyword
                weight = args[1] if len(args) > 1 else kw.get("loaded_weight")
                src = source(weight) if weight is not None else state["current"]
                if src is not None:
                    probe.consumed.add(src)
                if len(args) == 2 and not kw and loader is default_weight_loader and args[0].shape != weight.shape:
                    probe.mismatch.append(f"{src} {list(weight.shape)} -> {name} {list(args[0].shape)}")
                return loader(*args, **kw)
            return weight_loader

        def load_weights(loader_self, model, model_config):
            probe = _ACTIVE["probe"]
            if probe is None or model_config is not probe.draft_config:
                return original(loader_self, model, model_config)
            state.update(current=None, by_ptr={}, alive=[])
            probe.created = [n for n, _ in model.named_parameters()]
            for name, param in model.named_parameters():
                fill_sentinel(param)
                param.weight_loader = recording(probe, name, param,
                                                getattr(param, "weight_loader", default_weight_loader))
            get_all = loader_self.get_all_weights

            def get_all_weights(mc, m):
                for name, tensor in get_all(mc, m):
                    state["current"] = name
                    state["by_ptr"][tensor.data_ptr()] = name
                    state["alive"].append(tensor)  # keeps data pointers unique while loading
                    if name == "mask_hidden":  # copied into a buffer, not through a weight_loader
                        probe.buffers[name] = tensor
                    probe.received.append(name)
                    yield name, tensor
                state["current"] = None
            loader_self.get_all_weights = get_all_weights
            handler = WarningsTo(probe.load_warnings)
            logging.getLogger("vllm").addHandler(handler)
            try:
                return original(loader_self, model, model_config)
            finally:
                logging.getLogger("vllm").removeHandler(handler)
                del loader_self.get_all_weights
                state.update(current=None, by_ptr={}, alive=[])
        DefaultModelLoader.load_weights = load_weights

    def _skip_moe_prepack(self):
        """The CPU MoE experts repack their weights for a kernel (`torch.ops._C.prepack_moe_weight`) that
        the PyPI wheel does not build; the MoE forward is not run here, so the weights stay as loaded."""
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

        CPUUnquantizedExperts.process_weights_after_loading = lambda experts, layer: None
        self.result["replaced_kernels"].append(
            "CPUUnquantizedExperts.process_weights_after_loading (repacking MoE weights for "
            "torch.ops._C.prepack_moe_weight, absent from the PyPI wheel) -> a no-op: the weights stay as "
            "loaded; the MoE forward is not run")

    def _skip_amx_mla_packing(self):
        """On a CPU with AMX, vLLM serves MLA (DeepSeek-V3) with its AMX backend, which VNNI-packs W_UK / W_UV
        after loading with `torch.ops._C.convert_weight_packed`; the PyPI wheel has no CPU `_C` ops, so the
        loader fails on AMX machines only. The packed copies feed only the AMX prefill kernel, never run
        here; the engine's code runs unchanged wherever the op exists."""
        import torch
        from vllm.v1.attention.backends.mla.amx_mla import AMXMLAImpl

        if hasattr(torch.ops._C, "convert_weight_packed"):
            return

        def skip_packing(impl, act_dtype):
            replaced = _ACTIVE["probe"].result["replaced_kernels"]
            if AMX_MLA_NOTE not in replaced:
                replaced.append(AMX_MLA_NOTE)

        AMXMLAImpl.process_weights_after_loading = skip_packing

    def _record_weights(self, draft=None):
        w = self.result["weights"]
        w["created"], w["loaded"] = list(self.created), list(self.received)
        w["dropped"] = [n for n in self.received if n not in self.consumed]
        w["shape_mismatch"] = list(self.mismatch)
        w["warnings"] = list(self.load_warnings)  # what vLLM logged while loading the draft
        if draft is not None:
            w["never_written"] = [n for n, p in draft.named_parameters() if holds_sentinel(p)]
            import torch

            for name, tensor in self.buffers.items():  # P-EAGLE's mask_hidden: a buffer the loader copies into
                buf = getattr(draft, name, None)
                if buf is not None and torch.equal(buf.flatten().float(), tensor.flatten().float()):
                    w["dropped"] = [n for n in w["dropped"] if n != name]

    # --- layers and forward -------------------------------------------------------------------
    def _inputs(self):
        import torch
        from safetensors.torch import load_file

        t = load_file(self.args.inputs)
        ids = t["input_ids"].reshape(-1).to(torch.long)  # [T]
        self.anchors = [int(a) for a in t["anchors"].tolist()] if "anchors" in t else [ids.numel()]
        return ids, int(t["next_token"].reshape(-1)[0])

    def _plain_attention(self):
        import torch
        from vllm.model_executor.layers.attention.attention import Attention

        def forward(layer, query, key, value, output_shape=None, output_dtype=None):
            T = query.shape[0]
            q = query.reshape(T, layer.num_heads, layer.head_size).transpose(0, 1).float()  # [nh, T, hd]
            k = key.reshape(T, layer.num_kv_heads, layer.head_size).transpose(0, 1).float()
            v = value.reshape(T, layer.num_kv_heads, layer.head_size_v).transpose(0, 1).float()
            rep = layer.num_heads // layer.num_kv_heads
            k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
            scale = getattr(layer.impl, "scale", None) or 1.0 / math.sqrt(layer.head_size)
            scores = (q @ k.transpose(1, 2)) * scale  # [nh, T, T]
            causal = torch.ones(T, T, dtype=torch.bool).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
            out = scores.softmax(-1) @ v  # [nh, T, hdv]
            return out.transpose(0, 1).reshape(T, layer.num_heads * layer.head_size_v).to(query.dtype)

        Attention.forward = forward
        if REPLACED not in self.result["replaced_kernels"]:
            self.result["replaced_kernels"].append(REPLACED)

    def _target_forward(self, ids):
        import torch
        from vllm.forward_context import set_forward_context

        positions = torch.arange(ids.numel())
        with set_forward_context(None, self.vc):
            out = self.target(input_ids=ids, positions=positions)
        return out

    def layers_stage(self):
        import torch

        if self.kind.standalone:
            self.result["layers"] = "not_run: a draft model reads no target hidden states"
            return
        if self.kind.inside_target:
            self.result["layers"] = f"not_run: {self._mtp_reason()}"
            return
        ids, _ = self._inputs()
        try:
            self._plain_attention()
            if self.kind.reads == "aux":
                from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import set_eagle3_aux_hidden_state_layers

                set_eagle3_aux_hidden_state_layers(self.target, self.vc.speculative_config)
                self.result["config"]["aux_layer_ids_used"] = list(self._aux_layers_in_use())
                hidden, aux = self._target_forward(ids)
                self.tensors["aux_hidden"] = torch.cat(list(aux), dim=-1)  # [T, n_aux*H], the engine's order
            else:
                hidden = self._target_forward(ids)
                self.tensors["aux_hidden"] = hidden  # [T, H]: what the target returns to the proposer
            self.target_hidden = self.tensors["aux_hidden"]
            self.tensors["target_logits"] = self.target.compute_logits(hidden)  # [T, V]
        except Exception as err:  # noqa: BLE001
            self.result["layers"] = f"failed: {type(err).__name__}: {err}"
            self.result["forward"] = "not_run: the target forward failed"
            self.fail("layers", err)
        self.result["layers"] = "ok"

    def _mtp_reason(self) -> str:
        model_type = getattr(self.vc.model_config.hf_config, "model_type", "?")
        return MTP_NO_CPU.get(model_type, f"{model_type}: no CPU path for its MTP kernels in vLLM 0.33")

    def _aux_layers_in_use(self):
        for module in self.target.modules():
            layers = getattr(module, "aux_hidden_state_layers", None)
            if layers:
                return layers
        return ()

    def forward_stage(self):
        if self.kind.inside_target:
            self.result["forward"] = f"not_run: {self._mtp_reason()}"
            return
        forward = (self._forward_draft_model if self.kind.standalone
                   else self._forward_dflash if self.kind.block else self._forward_eagle)
        try:
            forward()
        except Exception as err:  # noqa: BLE001
            self.result["forward"] = f"failed: {type(err).__name__}: {err}"
            self.fail("forward", err)
        self.result["forward"] = "ok"

    def _draft_pass(self, ids, positions, hidden):
        from vllm.forward_context import set_forward_context

        with set_forward_context(None, self.vc):
            return self.draft(input_ids=ids, positions=positions, hidden_states=hidden)

    def _forward_eagle(self):
        """First draft pass over the prompt (token t+1 with the target state at t, RoPE position t),
        then k greedy steps, each re-running the growing sequence (what a KV cache computes)."""
        import torch

        ids, next_token = self._inputs()
        T = ids.numel()
        shifted = torch.cat([ids[1:], ids.new_tensor([next_token])])  # x_1 .. x_T
        states = self.target_hidden
        if self.kind.reads == "aux":
            states = self.draft.combine_hidden_states(states)  # [T, Hd]: fc over the aux states
        out, carried = self._draft_pass(shifted, torch.arange(T), states)
        self.tensors["draft_logits"] = self.draft.compute_logits(out)  # [T, V]
        if self.kind.drafts == "parallel":  # later depths read mask rows in one forward: no sequential chain
            return
        tokens, seq, hid = [], shifted, states
        for _ in range(self.args.k):
            out, carried = self._draft_pass(seq, torch.arange(seq.numel()), hid)
            token = int(self.draft.compute_logits(out[-1:]).argmax(-1))
            tokens.append(token)
            seq = torch.cat([seq, seq.new_tensor([token])])
            hid = torch.cat([hid, carried[-1:]])
        self.tensors["chain"] = torch.tensor(tokens, dtype=torch.long)

    def _forward_dflash(self):
        """The engine's own context precompute and block forward at every anchor of the inputs."""
        ids, next_token = self._inputs()
        for note in (native_custom_ops(), file_context_kv(self.draft), block_attention()):
            if note not in self.result["replaced_kernels"]:
                self.result["replaced_kernels"].append(note)
        if self.kind.drafts == "markov":
            if dspark.MARKOV_NOTE not in self.result["replaced_kernels"]:
                self.result["replaced_kernels"].append(dspark.MARKOV_NOTE)
            logits, tokens, confidence = dspark.run_dspark_blocks(self.vc, self.draft, self.target_hidden, ids,
                                                                  next_token, self.anchors, self.args.k)
            self.result["config"]["confidence_head"] = self.draft.model.confidence_head is not None
            if confidence is not None:
                self.tensors["confidence"] = confidence
        else:
            logits, tokens, _ = run_blocks(self.vc, self.draft, self.target_hidden, ids, next_token,
                                           self.anchors, self.args.k)
        self.tensors["draft_logits"], self.tensors["chain"] = logits, tokens
        self.result["config"]["anchors"] = list(self.anchors)

    def _forward_draft_model(self):
        import torch
        from vllm.forward_context import set_forward_context

        ids, next_token = self._inputs()
        self._plain_attention()

        def logits(seq):
            with set_forward_context(None, self.vc):
                hidden = self.draft(input_ids=seq, positions=torch.arange(seq.numel()))
            return self.draft.compute_logits(hidden)  # [T, V]

        self.tensors["draft_logits"] = logits(ids)
        seq, tokens = torch.cat([ids, ids.new_tensor([next_token])]), []
        for _ in range(self.args.k):
            token = int(logits(seq)[-1].argmax())
            tokens.append(token)
            seq = torch.cat([seq, seq.new_tensor([token])])
        self.tensors["chain"] = torch.tensor(tokens, dtype=torch.long)


AMX_MLA_NOTE = ("AMXMLAImpl.process_weights_after_loading (VNNI-packing W_UK / W_UV for the AMX MLA prefill "
                "kernel with torch.ops._C.convert_weight_packed, absent from the PyPI wheel; vLLM picks this "
                "backend only on CPUs with AMX) -> a no-op: the packed copies are not made; the MLA forward is not run")
# --- the engine's own draft loaders, by its method name ------------------------------------------
def load_standalone(vc, target):
    import torch
    from vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator import StandaloneARSpeculator

    return StandaloneARSpeculator(vc, torch.device("cpu")).load_draft_model(target, set())


def load_dflash(vc, target):
    """The V2 runner's DFlash loader (its own attention config, embed / head sharing)."""
    from vllm.v1.worker.gpu.spec_decode.dflash.utils import load_dflash_model

    return load_dflash_model(target, vc)


def load_dspark(vc, target):
    """The V2 runner's DSpark loader (DFlash's attention config, embed / head sharing)."""
    from vllm.v1.worker.gpu.spec_decode.dspark.utils import load_dspark_model

    return load_dspark_model(target, vc)


def load_eagle(vc, target):
    """EAGLE-1 / EAGLE-3 / P-EAGLE / MTP: the EAGLE loader."""
    from vllm.v1.worker.gpu.spec_decode.eagle.utils import load_eagle_model

    return load_eagle_model(target, vc)


DRAFT_LOADERS = {"draft_model": load_standalone, "dflash": load_dflash, "dspark": load_dspark}

MTP_NO_CPU = {  # target model_type -> why the MTP target / module cannot run forward here
    "deepseek_v3": "DeepSeek-V3 runs MLA attention and fused-MoE kernels that vLLM 0.33 has only for CUDA "
                   "(its CPU MoE kernel is not in the PyPI wheel)",
    "qwen3_next": "Qwen3-Next runs gated-DeltaNet linear attention (Triton) and fused-MoE kernels that vLLM 0.33 "
                  "has only for CUDA",
    "qwen3_5_text": "Qwen3.5 runs gated-DeltaNet linear attention (Triton kernels, CUDA only in vLLM 0.33)",
    "qwen3_5_moe_text": "Qwen3.5-MoE runs gated-DeltaNet linear attention and fused-MoE kernels (CUDA only in "
                        "vLLM 0.33)",
}


class WarningsTo(logging.Handler):
    """Collects the engine's own warnings (e.g. a dtype mismatch) while the draft's weights load."""

    def __init__(self, sink: list):
        super().__init__(logging.WARNING)
        self.sink = sink

    def emit(self, record):
        self.sink.append(record.getMessage())


def fill_sentinel(param):
    import torch

    with torch.no_grad():
        if param.is_floating_point():
            param.fill_(float("nan"))
        elif param.dtype in (torch.int64, torch.int32):
            param.fill_(INT_SENTINEL)


def holds_sentinel(param) -> bool:
    import torch

    if param.is_floating_point():
        return bool(torch.isnan(param).any())
    if param.dtype in (torch.int64, torch.int32):
        return bool((param == INT_SENTINEL).any())
    return False


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _ACTIVE["cpu"] = probe_cpu.apply()  # before vLLM reads the CPU's features (import and model build)
    if argv[:1] == ["--jobs"]:  # a batch: one engine import for many exports (a JSON list of CLI dicts)
        for job in json.loads(Path(argv[1]).read_text()):
            Probe(argparse.Namespace(**{"k": 3, **job})).run()
        return 0
    Probe(parse_args(argv)).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
