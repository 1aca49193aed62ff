"""Medusa-1 draft heads: K residual blocks over the target's final-normed state, one output layer each.

Head k (0-based) maps h_t (the target's lm_head input at position t) to logits for x_{t+k+2}:
`lm_heads[k](blocks[k](h_t))`, each block `x + SiLU(W x + b)` repeated `num_layers` times with
distinct weights (docs/algorithms.md §1). State-dict names are vLLM <= 0.32's
(`blocks.{k}.layers.{l}`, `lm_heads.{k}`); the original Medusa names are written by the exporter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specheads.bounds import bounded
from specheads.heads.losses import ChainCounts, HeadOutput, chain_starts, collect_final, decayed_output, shift


@dataclass
class MedusaOptions:
    """Recipe `head:` section for Medusa-1 (frozen target)."""

    kind: str = "medusa"
    num_heads: int = bounded(4, ge=1)  # K: draft tokens per step
    num_layers: int = bounded(1, ge=1)  # residual blocks per head
    step_decay: float = bounded(0.8, gt=0, le=1)  # loss weight of head k is step_decay ** k
    bias: bool = True  # the blocks' linear bias (medusa_fc_bias)

    def __post_init__(self):
        if self.num_heads < 1 or self.num_layers < 1:
            raise ValueError(f"head.num_heads ({self.num_heads}) and head.num_layers "
                             f"({self.num_layers}) must be >= 1")


@dataclass
class MedusaConfig:
    """Full architecture of trained Medusa heads; round-trips through JSON."""

    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1
    bias: bool = True
    step_decay: float = 0.8
    kind: str = "medusa"

    @property
    def ttt_steps(self) -> int:
        """Draft tokens one step proposes (the export's default num_speculative_tokens)."""
        return self.num_heads

    @property
    def target_hidden_size(self) -> int:
        return self.hidden_size

    @property
    def draft_vocab_size(self) -> int:
        return self.vocab_size


class ResidualStack(nn.Module):
    """`num_layers` blocks x + SiLU(W x + b), each with its own weights: [.., H] -> [.., H]."""

    def __init__(self, hidden: int, num_layers: int, bias: bool):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(hidden, hidden, bias=bias) for _ in range(num_layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for linear in self.layers:
            x = x + F.silu(linear(x))
        return x


class MedusaHead(nn.Module):
    """K Medusa heads over a frozen target (Medusa-1)."""

    kind = "medusa"
    Options = MedusaOptions
    Config = MedusaConfig

    def __init__(self, config: MedusaConfig, attn_implementation: str = "sdpa"):
        super().__init__()
        self.config = config
        H, V = config.hidden_size, config.vocab_size
        self.blocks = nn.ModuleList([ResidualStack(H, config.num_layers, config.bias)
                                     for _ in range(config.num_heads)])
        self.lm_heads = nn.ModuleList([nn.Linear(H, V, bias=False) for _ in range(config.num_heads)])
        for block in self.blocks:  # start as (almost) the identity: x + SiLU(b)
            for linear in block.layers:
                nn.init.zeros_(linear.weight)

    @classmethod
    def for_target(cls, options: MedusaOptions, target_config, **kw) -> MedusaHead:
        cfg = MedusaConfig(hidden_size=target_config.hidden_size, vocab_size=target_config.vocab_size,
                           num_heads=options.num_heads, num_layers=options.num_layers,
                           bias=options.bias, step_decay=options.step_decay)
        return cls(cfg, **kw)

    @torch.no_grad()
    def init_from_target(self, target) -> None:
        """Every output layer starts as a copy of the target's lm_head (docs/algorithms.md §1)."""
        weight = target.lm_head.weight  # [V, H]
        if tuple(weight.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(f"the target's lm_head is {tuple(weight.shape)}, the Medusa heads expect "
                             f"{(self.config.vocab_size, self.config.hidden_size)}")
        for lm in self.lm_heads:
            lm.weight.copy_(weight.to(lm.weight.dtype))

    def required_layers(self) -> list[int]:
        return []  # only the final-normed state, which every target forward returns

    def head_logits(self, k: int, hidden: torch.Tensor) -> torch.Tensor:
        """Head k on final-normed states [.., H] -> logits [.., V] for the token k+2 ahead."""
        return self.lm_heads[k](self.blocks[k](hidden.to(self.lm_heads[k].weight.dtype)))

    def all_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [K, N, V] of every head."""
        return torch.stack([self.head_logits(k, hidden) for k in range(self.config.num_heads)])

    # --- training ----------------------------------------------------------------------------
    def collect(self, target, batch: dict) -> dict[str, torch.Tensor]:
        """final [B, T, H]: the target's final-normed last hidden state (its lm_head input)."""
        return collect_final(target, batch)

    @torch.no_grad()
    def expand(self, target, feats: dict, batch: dict) -> dict:
        """Cached features + batch -> `train_forward` kwargs (the target's argmax recomputed)."""
        final = feats["final"].to(target.dtype)
        return {"final": final, "input_ids": batch["input_ids"],
                "target_argmax": target.lm_head(final).argmax(-1),  # [B, T]
                "loss_mask": batch["loss_mask"], "attention_mask": batch["attention_mask"]}

    def forward(self, **inputs) -> HeadOutput:
        return self.train_forward(**inputs)

    def train_forward(self, final, input_ids, target_argmax, loss_mask, attention_mask) -> HeadOutput:
        """Per-head cross-entropy on the data's tokens, weighted step_decay ** k.

        final [B, T, H] at x_<=i; input_ids, target_argmax, loss_mask, attention_mask [B, T].
        Head k at row i predicts x_{i+k+2} and counts as accepted when it equals the target's
        argmax at position i+k+1 (what greedy verification would accept).
        """
        supervised = loss_mask.bool() & attention_mask.bool()
        losses, counts = [], ChainCounts(loss_mask, chain_starts(supervised))
        for k in range(self.config.num_heads):
            rows = shift(supervised, k + 2)
            b, i = rows.nonzero(as_tuple=True)
            logits = self.head_logits(k, final[b, i])  # [N, V]
            losses.append(cross_entropy(logits, input_ids[b, i + k + 2]))
            counts.step(rows, b, i, logits.argmax(-1) == target_argmax[b, i + k + 1])
        return decayed_output(losses, self.config.step_decay, counts)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean CE over rows: logits [N, V], labels [N]; 0 (graph kept) when there are no rows."""
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    return F.cross_entropy(logits.float(), labels)
