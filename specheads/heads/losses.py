"""What every head's training forward returns, and the losses and shifts heads share."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

COUNT_KEYS = ("rows", "reached", "cond_rows")
RANK_WIDTH = 8  # sibling ranks counted per draft step (0 = the draft's top-1)


@dataclass
class HeadOutput:
    """Loss plus per-draft-position counts (summed over batches and ranks before any ratio).

    rows[j]: positions where draft token j is scored; reached[j]: of those, where drafts 0..j
    all match the target's argmax; cond_rows[j]: where drafts 0..j-1 matched (so acceptance of
    position j given the earlier ones is reached[j] / cond_rows[j]).
    """

    loss: torch.Tensor
    step_losses: torch.Tensor  # [S]
    counts: dict[str, torch.Tensor]  # each [S]: rows, reached, cond_rows
    walk: torch.Tensor | None = None  # [S+1, B, T] bool, ChainCounts.walk(): for metrics.decode_walk


def shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [B, T, ...] -> x[:, n:] right-padded with zeros to length T (row i reads position i+n)."""
    if n == 0:
        return x
    pad = torch.zeros_like(x[:, :n])
    return torch.cat([x[:, n:], pad], dim=1)


def forward_kl(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Mean forward KL(p || q) over rows: logits [N, Vd], probs [N, Vd] (0 = exact match)."""
    if logits.shape[0] == 0:
        return _no_rows(logits)
    logq = F.log_softmax(logits.float(), dim=-1)
    return (torch.special.xlogy(probs, probs) - probs * logq).sum(-1).mean()


def _no_rows(logits: torch.Tensor) -> torch.Tensor:
    return logits.sum() * 0.0  # keeps the graph (and DDP's gradient hooks) alive


def total_variation(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Mean TV(p, q) = 1/2 sum_v |p_v - q_v| = 1 - alpha over rows: logits [N, Vd], probs [N, Vd]."""
    if logits.shape[0] == 0:
        return _no_rows(logits)
    q = torch.softmax(logits.float(), dim=-1)
    return 0.5 * (probs - q).abs().sum(-1).mean()


def acceptance(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """alpha [N] = sum_v min(p_v, q_v): the chance a sampled draft token is accepted."""
    return torch.minimum(probs, torch.softmax(logits.float(), dim=-1)).sum(-1)


def neg_log_acceptance(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Mean -log alpha (LK "nla", arXiv 2602.23881): TV's gradient scaled by 1/alpha, so a cold start
    with alpha near 0 still learns."""
    if logits.shape[0] == 0:
        return _no_rows(logits)
    return -torch.log(acceptance(logits, probs).clamp_min(1e-12)).mean()


LK_ETA = 3.0  # lk_hybrid's eta (arXiv 2602.23881; speculators' default)


def lk_hybrid(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Mean lambda * KL(p || q) + (1 - lambda)(1 - alpha), lambda = exp(-eta * sg(alpha)) per row:
    KL while the draft is far off, the acceptance rate itself once it is close (LK loss)."""
    if logits.shape[0] == 0:
        return _no_rows(logits)
    logq = F.log_softmax(logits.float(), dim=-1)
    kl = (torch.special.xlogy(probs, probs) - probs * logq).sum(-1)  # [N]
    alpha = torch.minimum(probs, logq.exp()).sum(-1)  # [N]
    lam = torch.exp(-LK_ETA * alpha.detach())
    return (lam * kl + (1 - lam) * (1 - alpha)).mean()


# recipe `head.loss` -> the per-step distillation loss (draft logits [N, Vd], target probs [N, Vd]) -> scalar
LOSSES = {"kl": forward_kl, "tv": total_variation, "nla": neg_log_acceptance, "lk": lk_hybrid}

# recipe `head.feature_noise` -> noise added to the target features in training (scale s):
# uniform U(-s, s) (EAGLE-1's augmentation), gaussian N(0, s^2)
NOISES = {
    "none": None,
    "uniform": lambda x, s: x + (torch.rand_like(x) * 2 - 1) * s,
    "gaussian": lambda x, s: x + torch.randn_like(x) * s,
}


def add_feature_noise(features: torch.Tensor, kind: str, scale: float) -> torch.Tensor:
    """features [..., F] plus NOISES[kind] noise of `scale`; "none" returns the tensor untouched."""
    noise = NOISES[kind]
    return features if noise is None else noise(features, scale)


def stack_counts(counts: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per-step scalar counts -> float tensors [S] keyed like COUNT_KEYS."""
    return {k: torch.stack(counts[k]).float() for k in COUNT_KEYS}


class ChainCounts:
    """Running per-position counts of a chain of draft steps (the `HeadOutput.counts`).

    starts [B, T] (optional): rows where a chain decoder drafts after the target emitted the row's
    next token; with it `walk()` keeps, per step, the rows whose drafts so far all matched, so that
    metrics.decode_walk can replay the rows in the order decoding visits them."""

    def __init__(self, like: torch.Tensor, starts: torch.Tensor | None = None):
        self.reached = torch.ones(like.shape[:2], dtype=torch.bool, device=like.device)  # [B, T]
        self.counts: dict[str, list[torch.Tensor]] = {k: [] for k in COUNT_KEYS}
        self.masks = None if starts is None else [starts.bool()]

    def step(self, rows: torch.Tensor, b: torch.Tensor, i: torch.Tensor, correct_rows: torch.Tensor,
             ranks: torch.Tensor | None = None) -> None:
        """rows [B, T] scored at this step, (b, i) = rows.nonzero(); correct_rows [N]: draft == target.

        ranks [N] (optional): the target token's rank in the draft's distribution. Counted into
        `rank_hits[r]` (r < RANK_WIDTH) over the rows where drafts 0..j-1 matched: the measured
        acceptance of a tree's rank-r sibling (tree predictions use it, see eval/predict.py).
        """
        correct = torch.zeros_like(self.reached)
        correct[b, i] = correct_rows
        if ranks is not None:
            live = self.reached[b, i]  # [N]
            hits = torch.bincount(ranks[live].clamp(max=RANK_WIDTH), minlength=RANK_WIDTH + 1)
            self.counts.setdefault("rank_hits", []).append(hits[:RANK_WIDTH])
        self.counts["cond_rows"].append((self.reached & rows).sum())
        self.reached = self.reached & correct
        self.counts["rows"].append(rows.sum())
        self.counts["reached"].append((self.reached & rows).sum())
        if self.masks is not None:
            self.masks.append(self.reached & rows)

    def stacked(self) -> dict[str, torch.Tensor]:
        out = stack_counts(self.counts)
        if self.counts.get("rank_hits"):
            out["rank_hits"] = torch.stack(self.counts["rank_hits"]).float()  # [S, RANK_WIDTH]
        return out

    def walk(self) -> torch.Tensor | None:
        """[S+1, B, T] bool: the starts, then per step j the rows whose drafts 0..j all matched."""
        return None if self.masks is None else torch.stack(self.masks)


def chain_starts(supervised: torch.Tensor) -> torch.Tensor:
    """supervised [B, T] -> [B, T]: row i starts a draft when x_{i+1} (the target's own token)
    and x_{i+2} (the first drafted one) are both answer tokens; a turn's first token comes from
    prefill, so its row i = p - 2 never drafts."""
    return shift(supervised, 1) & shift(supervised, 2)


def decayed_output(losses: list[torch.Tensor], decay: float, counts: ChainCounts) -> HeadOutput:
    """Per-step losses weighted decay ** j, summed; with the chain's counts."""
    step_losses = torch.stack(losses)  # [S]
    weights = decay ** torch.arange(len(losses), device=step_losses.device)
    return HeadOutput(loss=(weights * step_losses).sum(), step_losses=step_losses.detach(),
                      counts=counts.stacked(), walk=counts.walk())


@torch.no_grad()
def collect_final(target, batch: dict) -> dict[str, torch.Tensor]:
    """final [B, T, H]: the target's final-normed last hidden state (its lm_head input), the
    cacheable feature of every head that reads the target's last state."""
    out = target.forward(batch["input_ids"], attention_mask=batch["attention_mask"])
    return {"final": out.final}
