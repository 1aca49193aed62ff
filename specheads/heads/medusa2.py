"""Medusa-2: Medusa heads trained jointly with LoRA adapters on the target (docs/algorithms.md §2).

Loss = the Medusa-1 heads' loss on the *adapted* target's final-normed state
+ distill_weight * KL(target with adapters off || target with adapters on) on the supervised rows
(the self-distillation that keeps the adapted backbone's own predictions where they were).

The adapters are peft LoRA layers (`inject_adapter_in_model`) around the target's attention / MLP
projections. Their A / B matrices and the Medusa heads are this module's only parameters, so the
state dict (what checkpoints save) and the optimizer never see a base weight. The peft wrappers
sit in a side container, never in the target: they are swapped into the target's module tree only
inside `train_forward` and swapped back in a `finally`, so the shared `Target` computes its
original outputs for every other caller (and keeps its module names) outside that call.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from specheads.bounds import bounded
from specheads.heads.losses import HeadOutput, forward_kl, shift
from specheads.heads.medusa import MedusaConfig, MedusaHead

ADAPTER = "default"  # the peft adapter name (what peft writes when saving one adapter)
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class Medusa2Options:
    """Recipe `head:` section for Medusa-2 (heads + LoRA on the target, self-distillation)."""

    kind: str = "medusa2"
    num_heads: int = bounded(4, ge=1)  # K: draft tokens per step
    num_layers: int = bounded(1, ge=1)  # residual blocks per head
    step_decay: float = bounded(0.8, gt=0, le=1)  # loss weight of head k is step_decay ** k
    bias: bool = True
    lora_r: int = bounded(8, ge=1)
    lora_alpha: float = 16.0  # peft scaling = lora_alpha / lora_r
    lora_targets: list[str] = field(default_factory=lambda: list(PROJECTIONS))  # module name suffixes
    distill_weight: float = 1.0  # lambda on the self-distillation KL

    def __post_init__(self):
        if self.num_heads < 1 or self.num_layers < 1 or self.lora_r < 1:
            raise ValueError(f"head.num_heads ({self.num_heads}), head.num_layers ({self.num_layers}) and "
                             f"head.lora_r ({self.lora_r}) must be >= 1")
        if self.distill_weight < 0 or not self.lora_targets:
            raise ValueError("head.distill_weight must be >= 0 and head.lora_targets non-empty "
                             f"(e.g. {PROJECTIONS})")


@dataclass
class Medusa2Config:
    """Medusa heads + the LoRA layout (target module name -> [in_features, out_features])."""

    hidden_size: int
    vocab_size: int
    lora_modules: dict[str, list[int]]
    num_heads: int = 4
    num_layers: int = 1
    bias: bool = True
    step_decay: float = 0.8
    lora_r: int = 8
    lora_alpha: float = 16.0
    distill_weight: float = 1.0
    kind: str = "medusa2"

    @property
    def ttt_steps(self) -> int:
        return self.num_heads

    @property
    def target_hidden_size(self) -> int:
        return self.hidden_size

    @property
    def draft_vocab_size(self) -> int:
        return self.vocab_size

    def medusa_config(self) -> MedusaConfig:
        """The heads alone, as Medusa-1 (what the draft export holds)."""
        return MedusaConfig(hidden_size=self.hidden_size, vocab_size=self.vocab_size, num_heads=self.num_heads,
                            num_layers=self.num_layers, bias=self.bias, step_decay=self.step_decay)


def lora_layout(target_config, targets: list[str]) -> dict[str, list[int]]:
    """Every nn.Linear of the target whose last name part is in `targets` -> [in, out] (meta device)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(target_config)
    out = {name: [m.in_features, m.out_features] for name, m in model.named_modules()
           if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in targets}
    if not out:
        raise ValueError(f"head.lora_targets {targets}: no linear layer of the target "
                         f"({type(model).__name__}) has such a name; use its projection names")
    return out


def module_key(name: str) -> str:
    """A target module path as a ModuleDict key ('.' is not allowed there)."""
    return name.replace(".", "__")


@dataclass
class Medusa2Output(HeadOutput):
    """HeadOutput plus the self-distillation KL on its own (0 while the adapters are a no-op)."""

    distill: torch.Tensor = None  # scalar


class Binding:
    """The peft wrappers built around one target model's layers; never deep-copied (a copy rebinds)."""

    def __init__(self, model=None, wrappers=None, originals=None):
        self.model, self.wrappers, self.originals = model, wrappers or {}, originals or {}

    def __deepcopy__(self, memo):
        return Binding()


class Medusa2Head(nn.Module):
    """Medusa heads + LoRA adapters on the target, trained jointly (Medusa-2)."""

    kind = "medusa2"
    Options = Medusa2Options
    Config = Medusa2Config

    def __init__(self, config: Medusa2Config, attn_implementation: str = "sdpa"):
        super().__init__()
        self.config = config
        self.medusa = MedusaHead(config.medusa_config())
        self.lora = nn.ModuleDict({module_key(n): self._lora_pair(i, o) for n, (i, o) in config.lora_modules.items()})
        self.binding = Binding()

    def _lora_pair(self, fan_in: int, fan_out: int) -> nn.ModuleDict:
        """A [r, in] (PyTorch's default init, as peft), B [out, r] zeros: the adapter starts as a no-op."""
        pair = nn.ModuleDict({"A": nn.Linear(fan_in, self.config.lora_r, bias=False),
                              "B": nn.Linear(self.config.lora_r, fan_out, bias=False)})
        nn.init.zeros_(pair["B"].weight)
        return pair

    @classmethod
    def for_target(cls, options: Medusa2Options, target_config, **kw) -> Medusa2Head:
        cfg = Medusa2Config(hidden_size=target_config.hidden_size, vocab_size=target_config.vocab_size,
                            lora_modules=lora_layout(target_config, list(options.lora_targets)),
                            num_heads=options.num_heads, num_layers=options.num_layers, bias=options.bias,
                            step_decay=options.step_decay, lora_r=options.lora_r, lora_alpha=options.lora_alpha,
                            distill_weight=options.distill_weight)
        return cls(cfg, **kw)

    def init_from_target(self, target) -> None:
        """Heads' output layers from the target's lm_head; the LoRA layout checked against the target."""
        self.medusa.init_from_target(target)
        self.bind(target.model)

    def required_layers(self) -> list[int]:
        return []

    def lora_state(self) -> dict[str, torch.Tensor]:
        """LoRA weights under peft's saved names: `base_model.model.{module}.lora_{A,B}.weight`."""
        return {f"base_model.model.{name}.lora_{ab}.weight": self.lora[module_key(name)][ab].weight
                for name in self.config.lora_modules for ab in ("A", "B")}

    # --- the adapters inside the target ------------------------------------------------------
    def bind(self, model: nn.Module) -> None:
        """Build peft LoRA wrappers around `model`'s layers (once per model) holding this head's A / B."""
        if self.binding.model is model:
            return
        from peft import LoraConfig, inject_adapter_in_model

        originals = {}
        for name, (fan_in, fan_out) in self.config.lora_modules.items():
            layer = model.get_submodule(name)
            if not isinstance(layer, nn.Linear) or (layer.in_features, layer.out_features) != (fan_in, fan_out):
                raise ValueError(f"target module '{name}' is {layer}, the Medusa-2 adapters were trained for "
                                 f"nn.Linear({fan_in}, {fan_out}): use the target these heads were trained on")
            originals[name] = layer
        side = nn.ModuleDict({module_key(n): m for n, m in originals.items()})  # peft mutates this, not the target
        lora = LoraConfig(r=self.config.lora_r, lora_alpha=self.config.lora_alpha, lora_dropout=0.0,
                          target_modules=list(side.keys()), bias="none")
        inject_adapter_in_model(lora, side, adapter_name=ADAPTER)
        wrappers = {}
        for name in originals:
            wrapper = side[module_key(name)]
            wrapper.lora_A[ADAPTER] = self.lora[module_key(name)]["A"]  # this head's parameters
            wrapper.lora_B[ADAPTER] = self.lora[module_key(name)]["B"]
            wrappers[name] = wrapper
        self.binding = Binding(model, wrappers, originals)

    @contextmanager
    def adapted(self):
        """The bound target with its adapters in place; the original layers are back afterwards."""
        model = self.binding.model
        if model is None:
            raise RuntimeError("Medusa2Head: no target bound; call expand(target, ...) or bind(target.model) first")
        try:
            for name, wrapper in self.binding.wrappers.items():
                _set_submodule(model, name, wrapper)
            yield model
        finally:
            for name, layer in self.binding.originals.items():
                _set_submodule(model, name, layer)

    def adapted_final(self, input_ids, attention_mask) -> torch.Tensor:
        """input_ids, attention_mask [B, T] -> the adapted target's final-normed state [B, T, H]."""
        with self.adapted() as model:
            out = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return out.last_hidden_state

    def adapted_logits(self, input_ids, attention_mask=None) -> torch.Tensor:
        """The adapted target's logits [B, T, V] (what a merged export must reproduce)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        final = self.adapted_final(input_ids, attention_mask)
        return self.binding.model.get_output_embeddings()(final)

    # --- training ----------------------------------------------------------------------------
    @torch.no_grad()
    def collect(self, target, batch: dict) -> dict[str, torch.Tensor]:
        """teacher_final [B, T, H]: the adapters-off target's final-normed state (frozen, cacheable)."""
        out = target.forward(batch["input_ids"], attention_mask=batch["attention_mask"])
        return {"teacher_final": out.final}

    @torch.no_grad()
    def expand(self, target, feats: dict, batch: dict) -> dict:
        """Teacher logits at the rows whose next token is supervised ([N, V]) + the token batch."""
        self.bind(target.model)
        rows = shift(batch["loss_mask"].bool() & batch["attention_mask"].bool(), 1)  # [B, T]
        teacher = target.lm_head(feats["teacher_final"].to(target.dtype)[rows])  # [N, V]
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
                "loss_mask": batch["loss_mask"], "teacher_logits": teacher}

    def forward(self, **inputs) -> Medusa2Output:
        return self.train_forward(**inputs)

    def train_forward(self, input_ids, attention_mask, loss_mask, teacher_logits) -> Medusa2Output:
        """Heads' loss on the adapted state + distill_weight * KL(teacher || adapted) on supervised rows.

        input_ids, attention_mask, loss_mask [B, T]; teacher_logits [N, V] at shift(supervised, 1).
        `step_losses` and counts are the heads' (K each); `distill` is the KL term alone (detached).
        """
        final = self.adapted_final(input_ids, attention_mask)  # [B, T, H], with gradients into LoRA
        lm_head = self.binding.model.get_output_embeddings()
        with torch.no_grad():
            argmax = lm_head(final.detach()).argmax(-1)  # [B, T]: what greedy verification accepts
        heads = self.medusa.train_forward(final, input_ids, argmax, loss_mask, attention_mask)
        rows = shift(loss_mask.bool() & attention_mask.bool(), 1)
        kl = forward_kl(lm_head(final[rows]), torch.softmax(teacher_logits.float(), dim=-1))
        return Medusa2Output(loss=heads.loss + self.config.distill_weight * kl, step_losses=heads.step_losses,
                             counts=heads.counts, distill=kl.detach())


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
