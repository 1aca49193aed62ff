"""The SGLang probe's weight checks: SGLang's loader run with every draft parameter pre-filled with
NaN and every tensor name it receives recorded, then the draft worker's own embed / head sharing.

A sibling of probe_sglang.py, run under the SGLang virtualenv's python; never imports specheads.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace


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
            same = old.shape == p.shape and torch.equal(torch.nan_to_num(old, nan=1.5e38),
                                                        torch.nan_to_num(p.detach(), nan=1.5e38))
            if not same:
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
    try:
        model = load_model(draft_cfg)
    except Exception as exc:
        exc.failed_on = box.get("failed_on")  # the tensor name being loaded when the engine raised
        raise
    finally:
        DefaultModelLoader.load_weights_only = original
    return model, box["rec"], box.get("late", [])


def synchronous_weight_loading() -> str:
    """Loaders that copy host tensors from a thread pool (DeepSeek, LongCat) do it inline instead,
    so every write happens while its tensor name is being handled (same values, same order)."""
    for module in list(sys.modules.values()):
        if getattr(module, "should_async_load", None) is not None and \
                getattr(module, "__name__", "").startswith("sglang."):
            module.should_async_load = lambda weight: False
    return ("should_async_load -> False: thread-pool weight copies run inline, so each write is "
            "attributed to the tensor name being loaded")


def share_with_target(kind, algo, target_model, draft_model, target_cfg):
    """The draft worker's own init_token_map / init_lm_head, run on the two loaded models. DFLASH's
    worker shares nothing into the draft: it reads the target's embedding and lm_head at run time."""
    if kind.block:  # DSPARK: attach_shared_modules at run time (probe_sglang_dspark.py)
        return None
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker
    from sglang.srt.speculative.standalone_worker_v2 import StandaloneDraftWorker

    worker_cls = StandaloneDraftWorker if kind.standalone else EagleDraftWorker
    runner = SimpleNamespace(model=target_model, model_config=target_cfg, load_config=LoadConfig(load_format="auto"))
    worker = SimpleNamespace(speculative_algorithm=algo, hot_token_id=None,
                             target_worker=SimpleNamespace(model_runner=runner),
                             draft_runner=SimpleNamespace(model=draft_model))
    worker._resolve_shared_embed_and_head = lambda: worker_cls._resolve_shared_embed_and_head(worker)
    worker_cls.init_token_map(worker)
    worker_cls.init_lm_head(worker)
    return worker.hot_token_id


def module_names(kind, name: str, target_hf) -> bool:
    """Whether a checkpoint name belongs to the draft (MTP folders also hold the whole target)."""
    if not kind.inside_target:
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
        if kind.vocab_map and "d2t" in name and getattr(draft_model, "hot_token_id", None) is not None:
            consumed[name] = "hot_token_id (d2t + arange)"
        elif not module_names(kind, name, target_hf):
            skipped += 1  # a target tensor in an MTP folder: the NextN loader reads only its layer
        elif kind.vocab_map and "t2d" in name:
            ignored.append(name)  # LlamaForCausalLMEagle3.load_weights skips t2d by design
        elif kind.inside_target and ("shared_head.head" in name or "embed_tokens" in name):
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


def draft_vocab(draft_model, hot) -> int | None:
    """Rows of the draft's output layer in token ids (hot vocab, else the unpadded head size)."""
    if hot is not None:
        return int(hot.shape[0])
    head = getattr(draft_model, "lm_head", None)
    if head is None:  # DFLASH: no head of its own, the target's lm_head is read at run time
        return None
    return int(getattr(head, "org_vocab_size", head.weight.shape[0]))
