"""Sampling for speculative decoding: logit warping, seeded sampling and acceptance rules.

Pure functions over probability tensors (docs/algorithms.md §8.2-8.4):

* `warp` turns logits into the distribution that is actually sampled (temperature, top-k,
  top-p). The same warp must be applied to the target's and the draft's logits: the lossless
  rules compare p and q, and q is only meaningful under the target's warping (docs/algorithms.md §8.2).
* `sample` draws by inverse CDF from a `torch.Generator`, so a seed reproduces a generation and
  a zero-probability token can never be drawn (temperature 0 is then exactly argmax).
* `accept_chain` is Leviathan / Chen speculative sampling (lossless) for a sampled chain;
  `accept_tree_pointmass` is the EAGLE-2/3 rule for deterministic top-k trees (lossless);
  `typical_accept` is Medusa's typical acceptance, which is LOSSY.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Warper = Callable[[torch.Tensor], torch.Tensor]  # logits [..., V] -> probs [..., V]


def check_warp(temperature: float, top_p: float, top_k: int) -> None:
    """Refuse warping settings that do not define a distribution (NaN and inf included)."""
    if not 0 <= temperature < float("inf"):
        raise ValueError(f"temperature must be >= 0 and finite (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")


def warp(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0,
         top_k: int = 0) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] (float32 or wider), rows summing to 1.

    Order: temperature, then top-k, then top-p (nucleus: keep the smallest set of most likely
    tokens whose mass reaches top_p; ties broken by a stable sort). Temperature 0 is greedy:
    a one-hot row at `logits.argmax(-1)`, the same tie-break as the greedy rule. -inf logits
    (tokens outside a reduced draft vocabulary) get probability 0.

    The row maximum is subtracted before dividing by the temperature, so the scaled logits are
    <= 0 and never overflow, and a temperature below the dtype's smallest normal number divides
    in float64: any tiny positive temperature (1e-300, subnormals) gives the one-hot argmax row
    (exact ties split evenly), never NaN.
    """
    check_warp(temperature, top_p, top_k)
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    V = x.shape[-1]
    if temperature == 0:
        return torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)
    if temperature < torch.finfo(x.dtype).tiny:  # would round to 0 in x's dtype: divide in float64
        x = x.to(torch.float64)
    x = (x - x.amax(-1, keepdim=True)) / temperature  # [..., V], <= 0: no overflow
    if 0 < top_k < V:
        kth = x.topk(top_k, dim=-1).values[..., -1:]  # [..., 1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if top_p < 1:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        before = sorted_p.cumsum(-1) - sorted_p  # [..., V]: mass of strictly better-ranked tokens
        drop_sorted = before >= top_p  # the first token always stays (before = 0)
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def expand_draft_logits(logits: torch.Tensor, target_ids: torch.Tensor,
                        vocab_size: int) -> torch.Tensor:
    """Draft-vocab logits [..., Vd] -> target-vocab logits [..., V], -inf outside the draft vocab.

    `target_ids [Vd]` is the target id of every draft id. Warping the expanded row gives the
    draft's q over the target vocabulary (q = 0 for tokens the draft cannot produce).
    """
    out = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    out[..., target_ids] = logits
    return out


def point_mass(tokens: torch.Tensor, vocab_size: int, dtype=torch.float64) -> torch.Tensor:
    """tokens [n] -> one-hot rows [n, V]: the q of a deterministic proposer (n-gram, argmax)."""
    q = torch.zeros(tokens.shape[0], vocab_size, dtype=dtype, device=tokens.device)
    return q.scatter_(-1, tokens.reshape(-1, 1).long(), 1.0)


# --- seeded sampling ---------------------------------------------------------------------------


def make_generator(seed: int, device) -> torch.Generator:
    """A generator on `device` (draws happen where the logits are) seeded with `seed`."""
    return torch.Generator(device=torch.device(device)).manual_seed(int(seed))


def uniforms(shape, gen: torch.Generator) -> torch.Tensor:
    """Float64 uniforms in [0, 1) of `shape`, on the generator's device."""
    return torch.rand(shape, generator=gen, dtype=torch.float64, device=gen.device)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [..., V] (non-negative, any positive sum), u [...] in [0, 1) -> ids [...].

    Picks the first index whose cumulative mass exceeds u * total, so a zero-probability index
    is never returned (rounding at the top end falls back to the last positive index).
    """
    cdf = probs.to(torch.float64).cumsum(-1)  # [..., V]
    x = (u.to(cdf.device) * cdf[..., -1]).unsqueeze(-1)  # [..., 1]
    idx = torch.searchsorted(cdf.contiguous(), x.contiguous(), right=True).squeeze(-1)
    V = probs.shape[-1]
    last = V - 1 - (probs.flip(-1) > 0).to(torch.long).argmax(-1)  # last positive index
    return torch.minimum(idx, last)


def sample(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One draw per row: probs [..., V] -> ids [...] (long)."""
    return inverse_cdf(probs, uniforms(probs.shape[:-1], gen))


def sample_draft_rows(logits: torch.Tensor, head, vocab_size: int, warper,
                      gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft logits [k, Vd] of rows that never see each other's samples (parallel drafters) ->
    (k drafts [k] as target ids, their q [k, V]); `head.to_target_ids` maps draft ids."""
    ids = head.to_target_ids(torch.arange(logits.shape[-1], device=logits.device))
    q = warper(expand_draft_logits(logits, ids, vocab_size))  # [k, V]
    return sample(q.to(gen.device), gen), q


# --- lossless acceptance -----------------------------------------------------------------------


def accept_chain_batch(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                       gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan / Chen speculative sampling for B independent chains (lossless).

    draft [B, k] sampled from q [B, k, V]; p [B, k+1, V] the target's warped distributions after
    each prefix (row k: after all drafts). Accept d_j with probability min(1, p_j(d_j)/q_j(d_j))
    (tested as u * q < p, no division); stop at the first rejection and sample its replacement
    from norm(max(0, p_j - q_j)); when all k are accepted sample the bonus from p_k.
    Returns (num_accepted [B], next_token [B]). The emitted tokens draft[:m] + [next] are
    distributed exactly as sampling the target token by token.
    """
    B, k = draft.shape
    V = p.shape[-1]
    p = p.to(torch.float64)
    q = q.to(device=p.device, dtype=torch.float64)
    idx = draft.to(p.device).long().unsqueeze(-1)  # [B, k, 1]
    px = p[:, :k].gather(-1, idx).squeeze(-1)  # [B, k]
    qx = q.gather(-1, idx).squeeze(-1)  # [B, k]
    ok = uniforms((B, k), gen).to(p.device) * qx < px  # [B, k]
    m = ok.long().cumprod(-1).sum(-1)  # [B]: leading accepted drafts
    q_pad = torch.cat([q, q.new_zeros(B, 1, V)], dim=1)  # [B, k+1, V]: q_k = 0 -> residual = p_k
    rows = torch.arange(B, device=p.device)
    p_m, q_m = p[rows, m], q_pad[rows, m]  # [B, V]
    residual = (p_m - q_m).clamp(min=0)
    empty = residual.sum(-1, keepdim=True) <= 0  # p == q up to rounding: fall back to p
    residual = torch.where(empty, p_m, residual)
    return m, sample(residual, gen)


def accept_chain(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                 gen: torch.Generator) -> tuple[int, int]:
    """One chain: draft [k], q [k, V], p [k+1, V] -> (num_accepted, next_token); see the batch."""
    k, V = draft.numel(), p.shape[-1]
    m, nxt = accept_chain_batch(draft.reshape(1, k), q.reshape(1, k, V),
                                p.reshape(1, k + 1, V), gen)
    return int(m[0]), int(nxt[0])


def children_lists(parents: list[int]) -> list[list[int]]:
    """parents [N] (root -1, topological order) -> the children of every node, ascending."""
    kids: list[list[int]] = [[] for _ in parents]
    for i in range(1, len(parents)):
        kids[parents[i]].append(i)
    return kids


def accept_tree_pointmass(tree, tokens: torch.Tensor, p: torch.Tensor,
                          gen: torch.Generator) -> tuple[list[int], int]:
    """EAGLE-2/3 acceptance for a deterministic draft tree (lossless; docs/algorithms.md §8.3).

    tree: a `Tree` (parents in topological order); tokens [N] (root first); p [N, V] the
    target's warped distribution for a child of each node. At a node, try its children in
    order, each sibling token once: accept child x with probability r(x) / sum(r) where r is
    the node's residual (initially p); on rejection set r(x) = 0. An accepted child becomes the
    current node (its r starts from its own p); when every child is rejected, or there are
    none, the next token is sampled from r. Equivalent to drawing y ~ p and following the child
    holding y if there is one, so the output is distributed as target sampling.
    Returns (accepted path as node indices, root first; next token).
    """
    parents, toks = tree.parents.tolist(), tokens.tolist()
    kids = children_lists(parents)
    u = uniforms(len(parents), gen).tolist()  # one draw per node: each is tried at most once
    path, node = [0], 0
    while True:
        residual, tried, chosen = p[node], set(), None  # [V], copied at the first rejection
        mass = float(residual.sum()) if kids[node] else 1.0  # sum of the residual
        for child in kids[node]:
            t = toks[child]
            if t in tried:
                continue
            tried.add(t)
            pt = float(residual[t])
            if u[child] * mass < pt:
                chosen = child
                break
            if len(tried) == 1:  # the first rejection is always the first try
                residual = residual.clone()
            residual[t] = 0.0
            mass -= pt
        if chosen is None:
            if tried and float(residual.sum()) <= 0:  # only by rounding: the last try accepts
                residual = p[node]
            return path, int(sample(residual, gen))
        path.append(chosen)
        node = chosen


# --- lossy: typical acceptance -------------------------------------------------------------------


@dataclass(frozen=True)
class TypicalDecision:
    """Outcome of typical acceptance. LOSSY: outputs are NOT distributed as the target's."""

    path: list[int]
    next_token: int
    lossy: bool = True


def typical_thresholds(p: torch.Tensor, posterior_threshold: float = 0.09,
                       posterior_alpha: float = 0.3) -> torch.Tensor:
    """p [N, V] -> per-node thresholds [N]: min(eps, alpha * exp(-H(p))), H with p + 1e-5 inside."""
    entropy = -(p * torch.log(p + 1e-5)).sum(-1)  # [N]
    return torch.clamp(posterior_alpha * torch.exp(-entropy), max=posterior_threshold)


def typical_accept(tree, tokens: torch.Tensor, p: torch.Tensor,
                   gen: torch.Generator | None = None, posterior_threshold: float = 0.09,
                   posterior_alpha: float = 0.3) -> TypicalDecision:
    """Medusa typical acceptance (docs/algorithms.md §8.4) over a tree. LOSSY: no residual correction, so the output
    distribution is not the target's (it favours likely, low-entropy continuations).

    A node's token x is acceptable when p_parent(x) > threshold(parent). Each root-to-leaf path
    keeps its longest acceptable prefix; the longest wins, ties by the highest sum of log-probs.
    The next token is sampled from p at the last accepted node restricted to tokens >= its
    threshold (`gen` None: its argmax, Medusa's fast mode). One-hot p (temperature 0) reduces
    to greedy tree acceptance.
    """
    thresh = typical_thresholds(p, posterior_threshold, posterior_alpha)  # [N]
    par = tree.parents[1:].to(p.device)
    tok = tokens[1:].to(p.device).long()
    child_p = p[par, tok]  # [N-1]
    ok = torch.cat([child_p.new_ones(1, dtype=torch.bool), child_p > thresh[par]])  # [N]
    logp = torch.cat([child_p.new_zeros(1), torch.log(child_p.clamp(min=1e-30))])  # [N]
    paths = tree.paths.to(p.device)  # [L, D+1], -1 padded
    nodes = paths.clamp(min=0)
    good = ok[nodes] & (paths >= 0)  # [L, D+1]
    lengths = good[:, 1:].long().cumprod(-1).sum(-1)  # [L]: acceptable prefix per path
    best_len = int(lengths.max())
    upto = torch.arange(paths.shape[1], device=p.device) <= best_len  # [D+1]
    score = (logp[nodes] * upto).sum(-1).masked_fill(lengths != best_len, float("-inf"))  # [L]
    row = int(score.argmax())
    path = paths[row, : best_len + 1].tolist()
    last = p[path[-1]]
    if gen is None:
        nxt = int(last.argmax())
    else:
        typical = last.masked_fill(last < thresh[path[-1]], 0.0)
        nxt = int(sample(typical if float(typical.sum()) > 0 else last, gen))
    return TypicalDecision(path=path, next_token=nxt)
