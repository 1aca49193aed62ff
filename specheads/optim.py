"""The drafter's optimizer (recipe `train.optimizer`): AdamW, or Muon on the 2-D weight matrices of the
hidden layers with AdamW on everything else, as one torch optimizer so one LR schedule drives both.

Muon (torch.optim.Muon) orthogonalises each matrix's momentum by Newton-Schulz iterations; it is
defined for 2-D weights only. It gets every 2-D parameter except the token tables (names containing
`lm_head`, `embed` or DSpark's Markov vocabulary factors `markov_w1` / `markov_w2`: rows are tokens,
not a linear map to orthogonalise) and degenerate [1, N] / [N, 1] matrices (a confidence head's
projection: orthogonalising a vector only normalises it); norms, biases, `mask_hidden`, those tables
and vectors stay on AdamW. (Vocabulary-wide factors also hit a CPU crash: torch 2.13's bfloat16
Newton-Schulz Gram product of a [32, 49152] matrix dies with SIGFPE on some x86 CPUs.)
`adjust_lr_fn="match_rms_adamw"` scales Muon's step to AdamW's RMS, so `train.lr` and
`train.weight_decay` mean the same for both groups.
"""

from __future__ import annotations

import torch

OPTIMIZERS = ("adamw", "muon")
ADAMW_BETAS = (0.9, 0.95)
ADAMW_ONLY = ("lm_head", "embed", "markov_w1", "markov_w2")  # name parts of 2-D token tables kept on AdamW


def muon_split(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """(names Muon updates, names AdamW updates) of the trainable parameters."""
    muon, adamw = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            matrix = p.ndim == 2 and min(p.shape) > 1
            (muon if matrix and not any(part in name for part in ADAMW_ONLY) else adamw).append(name)
    return muon, adamw


class MuonAdamW(torch.optim.Optimizer):
    """Muon over `muon_params`, AdamW over `adamw_params`: one param_groups list (the same group dicts
    the two inner optimizers read, so an LR scheduler reaches both), one state dict."""

    def __init__(self, muon_params, adamw_params, lr: float, weight_decay: float):
        self.muon = torch.optim.Muon(muon_params, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(adamw_params, lr=lr, weight_decay=weight_decay, betas=ADAMW_BETAS)
        super().__init__([*self.muon.param_groups, *self.adamw.param_groups], {})

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self.muon.step()
        self.adamw.step()
        return loss

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        self.param_groups = [*self.muon.param_groups, *self.adamw.param_groups]


def build_optimizer(model: torch.nn.Module, name: str, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """The drafter's optimizer `name` (OPTIMIZERS) over its trainable parameters."""
    if name == "adamw":
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                                 weight_decay=weight_decay, betas=ADAMW_BETAS)
    params = dict(model.named_parameters())
    muon, adamw = muon_split(model)
    if not muon:
        raise ValueError("train.optimizer: muon found no 2-D weight matrix to update in this head; use adamw")
    return MuonAdamW([params[n] for n in muon], [params[n] for n in adamw], lr, weight_decay)
