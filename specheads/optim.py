"""The drafter's optimizer (recipe `train.optimizer`): AdamW, or Muon on the 2-D weight matrices with
AdamW on everything else, as one torch optimizer so one LR schedule drives both.

Muon orthogonalises each matrix's momentum by Newton-Schulz iterations; it is defined for 2-D weights
only. The hidden layers' matrices go to torch.optim.Muon. DSpark's low-rank Markov factors
`markov_w1` / `markov_w2` ([V, r]: vocabulary-wide, rank r) go to `Float32Muon`, the same update with
the iteration in float32: torch 2.13's Muon iterates in bfloat16, and its Gram product of a
[32, 49152] bfloat16 matrix died with SIGFPE on an x86 CPU (SmolLM2 DSpark training), so which CPU CI
draws must not decide whether a run survives. The other token tables (names containing `lm_head` or
`embed`: rows are tokens, not a linear map to orthogonalise), degenerate [1, N] / [N, 1] matrices (a
confidence head's projection: orthogonalising a vector only normalises it), norms, biases and
`mask_hidden` stay on AdamW. `adjust_lr_fn="match_rms_adamw"` scales Muon's step to AdamW's RMS, so
`train.lr` and `train.weight_decay` mean the same for every group.
"""

from __future__ import annotations

import math

import torch

OPTIMIZERS = ("adamw", "muon")
ADAMW_BETAS = (0.9, 0.95)
ADAMW_ONLY = ("lm_head", "embed")  # name parts of 2-D token tables kept on AdamW
FLOAT32_MUON = ("markov_w1", "markov_w2")  # name parts of vocabulary-wide factors Muon runs in float32
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's quintic Newton-Schulz defaults
NS_STEPS, NS_EPS, MUON_MOMENTUM = 5, 1e-7, 0.95


def muon_split(model: torch.nn.Module) -> tuple[list[str], list[str], list[str]]:
    """(names torch's Muon updates, names Float32Muon updates, names AdamW updates) of the trainable
    parameters."""
    muon, muon32, adamw = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        matrix = p.ndim == 2 and min(p.shape) > 1
        if not matrix or any(part in name for part in ADAMW_ONLY):
            adamw.append(name)
        else:
            (muon32 if any(part in name for part in FLOAT32_MUON) else muon).append(name)
    return muon, muon32, adamw


def orthogonalise_float32(update: torch.Tensor) -> torch.Tensor:
    """torch.optim.Muon's Newton-Schulz iteration (its coefficients and steps) in float32:
    [A, B] -> [A, B] with singular values near one."""
    x = update.float()
    wide = x.T if x.shape[0] > x.shape[1] else x  # [min, max]: the Gram matrix is the small side
    wide = wide / wide.norm().clamp(min=NS_EPS)
    a, b, c = NS_COEFFICIENTS
    for _ in range(NS_STEPS):
        gram = wide @ wide.T  # [min, min]
        wide = a * wide + (b * gram + c * gram @ gram) @ wide
    return (wide.T if x.shape[0] > x.shape[1] else wide).to(update.dtype)


class Float32Muon(torch.optim.Optimizer):
    """Muon with torch.optim.Muon's defaults (Nesterov momentum 0.95, 5 quintic Newton-Schulz steps,
    decoupled weight decay, `match_rms_adamw` step size) whose iteration runs in float32."""

    def __init__(self, params, lr: float, weight_decay: float):
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "momentum": MUON_MOMENTUM})

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = orthogonalise_float32(p.grad.lerp(buf, group["momentum"]))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"] * 0.2 * math.sqrt(max(p.shape)))
        return loss


class MuonAdamW(torch.optim.Optimizer):
    """torch's Muon over `muon_params`, Float32Muon over `muon32_params`, AdamW over `adamw_params`:
    one param_groups list (the same group dicts the inner optimizers read, so an LR scheduler reaches
    all), one state dict."""

    def __init__(self, muon_params, muon32_params, adamw_params, lr: float, weight_decay: float):
        self.inner = {}
        if muon_params:
            self.inner["muon"] = torch.optim.Muon(muon_params, lr=lr, weight_decay=weight_decay,
                                                  adjust_lr_fn="match_rms_adamw")
        if muon32_params:
            self.inner["muon32"] = Float32Muon(muon32_params, lr=lr, weight_decay=weight_decay)
        if adamw_params:
            self.inner["adamw"] = torch.optim.AdamW(adamw_params, lr=lr, weight_decay=weight_decay,
                                                    betas=ADAMW_BETAS)
        super().__init__(self._groups(), {})

    def _groups(self) -> list[dict]:
        return [g for opt in self.inner.values() for g in opt.param_groups]

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for opt in self.inner.values():
            opt.step()
        return loss

    def state_dict(self) -> dict:
        return {name: opt.state_dict() for name, opt in self.inner.items()}

    def load_state_dict(self, state_dict: dict) -> None:
        if set(state_dict) != set(self.inner):
            raise ValueError(f"optimizer state holds the groups {sorted(state_dict)}, but this head's Muon "
                             f"optimizer has {sorted(self.inner)}: it was saved by another head or version; "
                             "start the run again without resuming")
        for name, opt in self.inner.items():
            opt.load_state_dict(state_dict[name])
        self.param_groups = self._groups()


def build_optimizer(model: torch.nn.Module, name: str, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """The drafter's optimizer `name` (OPTIMIZERS) over its trainable parameters."""
    if name == "adamw":
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                                 weight_decay=weight_decay, betas=ADAMW_BETAS)
    params = dict(model.named_parameters())
    muon, muon32, adamw = muon_split(model)
    if not muon and not muon32:
        raise ValueError("train.optimizer: muon found no 2-D weight matrix to update in this head; use adamw")
    return MuonAdamW(*([params[n] for n in names] for names in (muon, muon32, adamw)), lr, weight_decay)
