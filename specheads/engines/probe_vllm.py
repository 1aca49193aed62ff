"""Load one export with vLLM 0.33's own code on a CPU and record what the engine made of it.

Runs under the ENGINE's Python (`<vllm venv>/bin/python probe_vllm.py ...`), never specheads' (the
engine pins its own torch / transformers), so it imports nothing from specheads. It parses the
folder as `vllm serve` does (EngineArgs -> create_engine_config), builds the target with the model
loader, builds and loads the draft with the V2 model runner's spec-decode loaders (embedding and
lm_head sharing included), then runs the target and the draft module forward in float32.

Stages (each recorded in result.json; a failing stage keeps the engine's own exception text):
  config   the speculative config vLLM derives (method, k, draft architecture, vocab sizes, aux ids)
  weights  every draft parameter pre-filled with a sentinel (NaN / -7777) before the loader runs;
           every tensor name the loader receives; which ones reached a parameter's weight_loader
  layers   the target hidden states vLLM taps for the draft (EAGLE-3: its aux layers; EAGLE-1 and
           MTP: the state the target returns), written as `aux_hidden`
  forward  the draft module's logits on the first draft pass (`draft_logits`, scattered to the full
           vocabulary as compute_logits does) and a greedy chain of k tokens (`chain`)

Only `Attention.forward` is replaced (the CPU platform's attention kernels need a KV cache and
scheduler metadata): the replacement is a plain causal softmax over the layer's own q / k / v.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import traceback
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

KINDS = ("eagle3", "eagle", "draft", "mtp", "medusa", "dflash", "peagle")
METHODS = {"eagle3": "eagle3", "eagle": "eagle", "draft": "draft_model", "mtp": "mtp", "medusa": "medusa",
           "dflash": "dflash", "peagle": "eagle3"}
INT_SENTINEL = -7777
REPLACED = ("vllm.model_executor.layers.attention.Attention.forward -> a plain causal softmax over the "
            "layer's own q/k/v (float32): vLLM's CPU attention kernels need a KV cache, block tables and "
            "scheduler metadata that only a running engine builds; projections, RoPE, norms, MLP, fc, "
            "lm_head and the vocabulary scatter are vLLM's own code")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--kind", required=True, choices=KINDS)
    p.add_argument("--inputs", required=True, help="safetensors with input_ids [1, T], next_token [1]")
    p.add_argument("--out", required=True)
    p.add_argument("--k", type=int, default=3)
    return p.parse_args(argv)


class Stop(Exception):
    """A stage failed; the error is already recorded."""


class Probe:
    def __init__(self, args):
        self.args = args
        self.result = {
            "engine": "vllm", "version": None, "config": {},
            "weights": {"created": [], "loaded": [], "never_written": [], "dropped": [], "shape_mismatch": []},
            "layers": "not_run: an earlier stage failed", "forward": "not_run: an earlier stage failed",
            "replaced_kernels": [], "error": None,
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
        self.write()

    def spec_config(self) -> dict:
        kind, args = self.args.kind, self.args
        spec = {"method": METHODS[kind], "model": args.draft, "num_speculative_tokens": args.k}
        if kind == "mtp":
            spec.pop("model")  # `vllm serve EXPORT --speculative-config '{"method": "mtp", ...}'`
        return spec

    def config_stage(self):
        from vllm.engine.arg_utils import EngineArgs

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
        if sc.method == "eagle3":
            from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

            ids = get_eagle3_aux_layers_from_config(sc)
            cfg["aux_layer_ids"] = list(ids) if ids else None
            cfg["aux_layer_ids_source"] = "draft config" if ids else "target default"
            for key in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "target_hidden_size"):
                cfg[key] = getattr(hf, key, None)
        if sc.method == "mtp":
            cfg["n_predict"] = getattr(hf, "n_predict", None)
        self.result["config"] = cfg

    def weights_stage(self):
        import torch

        from vllm.config import set_current_vllm_config
        from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment

        self.draft_config = self.vc.speculative_config.draft_model_config
        self._instrument_loader()
        try:
            self._ctx = set_current_vllm_config(self.vc)
            self._ctx.__enter__()
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"file://{tempfile.mkdtemp()}/dist")
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
        method = self.vc.speculative_config.method
        if method == "draft_model":
            import torch

            from vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator import StandaloneARSpeculator

            return StandaloneARSpeculator(self.vc, torch.device("cpu")).load_draft_model(self.target, set())
        from vllm.v1.worker.gpu.spec_decode.eagle.utils import load_eagle_model

        return load_eagle_model(self.target, self.vc)

    def _instrument_loader(self):
        """Sentinel-fill the draft's parameters and record what its loader receives and consumes."""
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        probe, original = self, DefaultModelLoader.load_weights
        self.received, self.consumed, self.created, self.mismatch = [], set(), [], []
        state = {"current": None, "by_ptr": {}, "alive": []}

        def source(weight):
            """The received name this tensor came from: by its data pointer (loaders may buffer
            every tensor before loading), else the name received last."""
            return state["by_ptr"].get(weight.data_ptr(), state["current"])

        def recording(name, param, loader):
            def weight_loader(p, weight, *rest, **kw):
                src = source(weight)
                if src is not None:
                    probe.consumed.add(src)
                if not rest and not kw and loader is default_weight_loader and tuple(p.shape) != tuple(weight.shape):
                    probe.mismatch.append(f"{src} {list(weight.shape)} -> {name} {list(p.shape)}")
                return loader(p, weight, *rest, **kw)
            return weight_loader

        def load_weights(loader_self, model, model_config):
            if model_config is not probe.draft_config:
                return original(loader_self, model, model_config)
            probe.created = [n for n, _ in model.named_parameters()]
            for name, param in model.named_parameters():
                fill_sentinel(param)
                param.weight_loader = recording(name, param, getattr(param, "weight_loader", default_weight_loader))
            get_all = loader_self.get_all_weights

            def get_all_weights(mc, m):
                for name, tensor in get_all(mc, m):
                    state["current"] = name
                    state["by_ptr"][tensor.data_ptr()] = name
                    state["alive"].append(tensor)  # keeps data pointers unique while loading
                    probe.received.append(name)
                    yield name, tensor
                state["current"] = None
            loader_self.get_all_weights = get_all_weights
            try:
                return original(loader_self, model, model_config)
            finally:
                del loader_self.get_all_weights
                probe.loaded_draft = model
        DefaultModelLoader.load_weights = load_weights

    def _record_weights(self, draft=None):
        w = self.result["weights"]
        w["created"], w["loaded"] = list(self.created), list(self.received)
        w["dropped"] = [n for n in self.received if n not in self.consumed]
        w["shape_mismatch"] = list(self.mismatch)
        if draft is not None:
            w["never_written"] = [n for n, p in draft.named_parameters() if holds_sentinel(p)]

    # --- layers and forward -------------------------------------------------------------------
    def _inputs(self):
        import torch
        from safetensors.torch import load_file

        t = load_file(self.args.inputs)
        ids = t["input_ids"].reshape(-1).to(torch.long)  # [T]
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

        method = self.vc.speculative_config.method
        if method == "draft_model":
            self.result["layers"] = "not_run: a draft model reads no target hidden states"
            return
        if self.args.kind == "mtp":
            self.result["layers"] = f"not_run: {MTP_NO_CPU}"
            return
        ids, _ = self._inputs()
        try:
            self._plain_attention()
            if method == "eagle3":
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

    def _aux_layers_in_use(self):
        for module in self.target.modules():
            layers = getattr(module, "aux_hidden_state_layers", None)
            if layers:
                return layers
        return ()

    def forward_stage(self):
        kind = self.args.kind
        if kind == "mtp":
            self.result["forward"] = f"not_run: {MTP_NO_CPU}"
            return
        try:
            if kind == "draft":
                self._forward_draft_model()
            else:
                self._forward_eagle()
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
        if self.vc.speculative_config.method == "eagle3":
            states = self.draft.combine_hidden_states(states)  # [T, Hd]: fc over the aux states
        out, carried = self._draft_pass(shifted, torch.arange(T), states)
        self.tensors["draft_logits"] = self.draft.compute_logits(out)  # [T, V]
        tokens, seq, hid = [], shifted, states
        for _ in range(self.args.k):
            out, carried = self._draft_pass(seq, torch.arange(seq.numel()), hid)
            token = int(self.draft.compute_logits(out[-1:]).argmax(-1))
            tokens.append(token)
            seq = torch.cat([seq, seq.new_tensor([token])])
            hid = torch.cat([hid, carried[-1:]])
        self.tensors["chain"] = torch.tensor(tokens, dtype=torch.long)

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


MTP_NO_CPU = ("the MTP targets (DeepSeek-V3: MLA attention and fused MoE; Qwen3-Next / Qwen3.5: gated "
              "DeltaNet linear attention and fused MoE) run kernels vLLM 0.33 has only for CUDA")


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
    args = parse_args(argv)
    Probe(args).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
