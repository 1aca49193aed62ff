"""Plain greedy decoding and the speculative chain loop, both with a KV cache, batch size 1.

Both loops share the same building blocks (prompt checks, masks, cache trimming, timing) so that
the speculative output can be compared token for token with plain greedy decoding: greedy chain
verification (docs/algorithms.md §8.1) is lossless, so any difference is a bug (or, in low
precision, an argmax tie flipped by batched-vs-sequential numerics).

Sequence bookkeeping: `seq` is prompt + emitted tokens; the target cache always holds every
position of `seq` except the last token, which is fed at the start of the next forward.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import torch

from specheads.metrics import chain_summary


class DecodeError(ValueError):
    """Inputs a decode loop cannot run on (empty prompt, prompt longer than the context, ...)."""


@dataclass
class DecodeStats:
    """Counts and timings of one generation; add them up over prompts before any ratio."""

    prefill_forwards: int = 0
    decode_forwards: int = 0  # target forwards after the prefill (one per verification step)
    decode_tokens: int = 0  # tokens emitted by those forwards (accepted drafts + bonus)
    tokens: int = 0  # all new tokens, the one emitted by the prefill included
    drafts: int = 0  # decode steps that verified >= 1 proposed token
    proposed_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [p]: drafts accepted through p
    wall_s: float = 0.0
    target_prefill_s: float = 0.0
    target_decode_s: float = 0.0
    proposer_start_s: float = 0.0  # the proposer's own prefill (once per prompt)
    proposer_s: float = 0.0  # propose + accept during decode steps

    def add(self, other: "DecodeStats") -> "DecodeStats":
        """Sum of two stats (accepted_per_pos padded to the longer one)."""
        out = DecodeStats()
        for name, value in asdict(self).items():
            if name == "accepted_per_pos":
                n = max(len(value), len(other.accepted_per_pos))
                a = value + [0] * (n - len(value))
                b = other.accepted_per_pos + [0] * (n - len(other.accepted_per_pos))
                out.accepted_per_pos = [x + y for x, y in zip(a, b)]
            else:
                setattr(out, name, value + getattr(other, name))
        return out

    def summary(self) -> dict:
        """tau (decode tokens per decode forward, bonus included) and per-position acceptance."""
        return chain_summary(self.drafts, self.accepted_per_pos, self.decode_tokens,
                             self.decode_forwards)


@dataclass
class DecodeResult:
    """New token ids (prompt excluded), why generation stopped, and the counts."""

    tokens: list[int]
    stop_reason: str  # "eos" | "length"
    stats: DecodeStats
    step_tokens: list[int] = field(default_factory=list)  # tokens emitted per decode forward
    step_proposed: list[int] = field(default_factory=list)  # tokens proposed per decode forward

    def record_step(self, emitted: int, accepted: int, proposed: int, depth: int) -> None:
        """One verification forward: `emitted` tokens out, `accepted` of `proposed` drafts taken;
        `depth` (the chain length or tree depth) bounds the acceptance positions counted."""
        s = self.stats
        s.decode_forwards += 1
        s.decode_tokens += emitted
        if proposed:
            s.drafts += 1
            s.proposed_tokens += proposed
            s.accepted_per_pos.extend([0] * max(0, depth - len(s.accepted_per_pos)))
            for p in range(min(accepted, emitted)):
                s.accepted_per_pos[p] += 1
        self.step_tokens.append(emitted)
        self.step_proposed.append(proposed)


# --- pure helpers ------------------------------------------------------------------------------


def causal_mask(past: int, q: int, dtype: torch.dtype, device) -> torch.Tensor | None:
    """Additive causal mask [1, 1, q, past + q] (0 = attend, dtype min = blocked); None for q == 1.

    Explicit and additive so that sdpa and eager attention behave the same with a cache
    (eager ignores boolean masks, sdpa's implicit causal flag is wrong when past > 0).
    """
    if q == 1:
        return None
    keys = torch.arange(past + q, device=device)
    rows = torch.arange(q, device=device) + past
    blocked = keys[None, :] > rows[:, None]  # [q, past + q]
    mask = torch.zeros(q, past + q, dtype=dtype, device=device)
    mask.masked_fill_(blocked, torch.finfo(dtype).min)
    return mask[None, None]


def positions(start: int, q: int, device) -> torch.Tensor:
    """position_ids [1, q] = start .. start + q - 1."""
    return torch.arange(start, start + q, device=device)[None]


def accepted_prefix(draft: torch.Tensor, target_argmax: torch.Tensor) -> int:
    """Greedy chain acceptance: draft [k], target_argmax [>= k] -> length of the matching prefix."""
    k = draft.shape[0]
    if k == 0:
        return 0
    match = (draft == target_argmax[:k]).long()
    return int(match.cumprod(0).sum())


def trim_cache(cache, keep: int) -> None:
    """Drop cache entries beyond the first `keep` positions (rejected drafts) in place."""
    have = cache.get_seq_length()
    if keep > have:
        raise DecodeError(f"cannot keep {keep} cache positions: only {have} are cached")
    if keep < have:
        cache.crop(keep - have)  # negative = number of trailing positions to drop
    if cache.get_seq_length() != keep:
        raise RuntimeError(f"cache holds {cache.get_seq_length()} positions after trimming to {keep}")


def cut_at_eos(tokens: list[int], eos: frozenset[int]) -> tuple[list[int], bool]:
    """tokens -> (tokens up to and including the first eos id, whether an eos was hit)."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1], True
    return tokens, False


def context_length(target) -> int | None:
    return getattr(target.config, "max_position_embeddings", None)


def prepare_prompt(target, prompt_ids, max_new_tokens: int) -> tuple[torch.Tensor, int]:
    """Validate the prompt -> (ids [1, P] on the target's device, new-token budget).

    The budget is max_new_tokens clamped so that prompt + output fits the target's context.
    """
    ids = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1)
    if ids.numel() == 0:
        raise DecodeError("the prompt is empty: give at least one token id")
    if max_new_tokens < 0:
        raise DecodeError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    vocab = target.vocab_size
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise DecodeError(f"prompt token ids must lie in 0..{vocab - 1} for this target")
    ctx = context_length(target)
    budget = max_new_tokens
    if ctx is not None:
        if ids.numel() >= ctx:
            raise DecodeError(
                f"the prompt has {ids.numel()} tokens but the target's context "
                f"(max_position_embeddings) is {ctx}: shorten the prompt to under {ctx} tokens"
            )
        budget = min(budget, ctx - ids.numel())
    return ids[None].to(target.device), budget


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Clock:
    """Accumulates seconds spent in a `with clock:` block (device synchronised)."""

    def __init__(self, device):
        self.device = device
        self.seconds = 0.0

    def __enter__(self):
        _sync(self.device)
        self._t0 = time.perf_counter()

    def __exit__(self, *exc):
        _sync(self.device)
        self.seconds += time.perf_counter() - self._t0


# --- the loops ---------------------------------------------------------------------------------


def target_step(target, ids: torch.Tensor, past: int, cache, layers=()):
    """Feed ids [1, q] at positions past .. past + q - 1 to the target, appending to `cache`."""
    q = ids.shape[1]
    return target.forward(
        ids, layers=list(layers), attention_mask=causal_mask(past, q, target.dtype, target.device),
        position_ids=positions(past, q, target.device), cache=cache, use_cache=True,
    )


def new_cache(target):
    from transformers import DynamicCache

    return DynamicCache(config=target.config)


def prefill(target, ids: torch.Tensor, layers, stats: DecodeStats, clock: "Clock"):
    """The prompt's one target forward into a new cache, timed and counted -> (cache, output)."""
    cache = new_cache(target)
    with clock:
        out = target_step(target, ids, 0, cache, layers)
    stats.prefill_forwards, stats.target_prefill_s = 1, clock.seconds
    clock.seconds = 0.0
    return cache, out


@torch.no_grad()
def greedy_decode(target, prompt_ids, max_new_tokens: int,
                  eos_token_ids: Iterable[int] = ()) -> DecodeResult:
    """Plain greedy decoding with a KV cache: one target forward per new token (the reference)."""
    return generate(target, None, prompt_ids, max_new_tokens, k=0, eos_token_ids=eos_token_ids)


@torch.no_grad()
def generate(target, proposer, prompt_ids, max_new_tokens: int, k: int,
             eos_token_ids: Iterable[int] = ()) -> DecodeResult:
    """Speculative greedy decoding: propose <= k tokens, verify [last, d_1..d_k] in one forward.

    `proposer` None (or k == 0) gives plain greedy decoding. The output equals plain greedy
    decoding token for token; never more than max_new_tokens tokens; stops after an eos id.
    """
    if k < 0:
        raise DecodeError(f"k (draft length) must be >= 0, got {k}")
    ids, budget = prepare_prompt(target, prompt_ids, max_new_tokens)
    eos = frozenset(int(e) for e in eos_token_ids)
    layers = list(getattr(proposer, "layers", ())) if proposer is not None else []
    stats = DecodeStats(accepted_per_pos=[0] * k)
    result = DecodeResult(tokens=[], stop_reason="length", stats=stats)
    tgt_clock, prop_clock = Clock(target.device), Clock(target.device)
    t_start = time.perf_counter()
    if budget == 0:
        stats.wall_s = time.perf_counter() - t_start
        return result

    cache, out = prefill(target, ids, layers, stats, tgt_clock)
    first = int(out.logits[0, -1].argmax())
    seq = ids[0].tolist() + [first]
    result.tokens.append(first)
    if proposer is not None and k > 0 and first not in eos and budget > 1:
        with prop_clock:
            proposer.start(ids[0], first, out)
        stats.proposer_start_s, prop_clock.seconds = prop_clock.seconds, 0.0

    done = first in eos
    result.stop_reason = "eos" if done else "length"
    while not done and len(result.tokens) < budget:
        remaining = budget - len(result.tokens)
        k_step = min(k, remaining - 1) if proposer is not None else 0
        draft = torch.empty(0, dtype=torch.long, device=target.device)
        if k_step > 0:
            with prop_clock:
                draft = proposer.propose(k_step).reshape(-1)[:k_step].to(target.device)
        n_prop = draft.shape[0]
        past = len(seq) - 1
        step_ids = torch.cat([torch.tensor([seq[-1]], device=target.device), draft])[None]
        with tgt_clock:
            out = target_step(target, step_ids, past, cache, layers)
        argmax = out.logits[0].argmax(-1)  # [1 + n_prop]
        m = accepted_prefix(draft, argmax)
        emitted = draft[:m].tolist() + [int(argmax[m])]
        emitted, done = cut_at_eos(emitted, eos)
        trim_cache(cache, past + 1 + m)

        result.record_step(len(emitted), m, n_prop, n_prop)
        seq.extend(emitted)
        result.tokens.extend(emitted)
        if proposer is not None and k > 0 and not done and len(result.tokens) < budget:
            inputs = step_ids[0, : m + 1]  # the fed tokens whose successors are now known
            with prop_clock:
                proposer.accept(inputs, torch.tensor(emitted, device=target.device), out, past)
    if done:
        result.stop_reason = "eos"
    stats.tokens = len(result.tokens)
    stats.target_decode_s = tgt_clock.seconds
    stats.proposer_s = prop_clock.seconds
    stats.wall_s = time.perf_counter() - t_start
    return result
