"""Building blocks of the decode loop (`verify.loop`): results and counts, prompt checks, the
target's verification forward over a chain or a tree, and cache trimming / compaction.

Sequence bookkeeping: `seq` is prompt + emitted tokens; the target cache always holds every
position of `seq` except the last token, which is fed at the start of the next forward.

A tree step verifies [root, nodes...] in one pass (docs/algorithms.md §8.5): RoPE positions
follow depth (`P + depth`), an additive 4-D mask lets a node see the whole cached prefix and its
own ancestors, and the new keys / values land in cache slots P .. P+N-1; the cache is then
compacted to the prefix plus the accepted path, so the next step starts from exactly what plain
decoding would have. A chain step uses a causal mask and crops the rejected slots.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from specheads.attention import GQA_SDPA
from specheads.metrics import chain_summary
from specheads.target import TargetError, TargetOutput
from specheads.verify.kv_cache import decode_cache
from specheads.verify.trees import Tree, prune, subtree


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
    # tokens a decode forward verified (root included) -> its steps and their target seconds: the
    # target's cost curve as the decodes met it (eval's prediction reads it)
    steps_by_nodes: dict[int, int] = field(default_factory=dict)
    target_s_by_nodes: dict[int, float] = field(default_factory=dict)

    def add(self, other: DecodeStats) -> DecodeStats:
        """Sum of two stats (accepted_per_pos padded to the longer one)."""
        out = DecodeStats()
        for name, value in asdict(self).items():
            if isinstance(value, dict):
                other_d = getattr(other, name)
                setattr(out, name, {n: value.get(n, 0) + other_d.get(n, 0) for n in sorted({*value, *other_d})})
            elif name == "accepted_per_pos":
                n = max(len(value), len(other.accepted_per_pos))
                a = value + [0] * (n - len(value))
                b = other.accepted_per_pos + [0] * (n - len(other.accepted_per_pos))
                out.accepted_per_pos = [x + y for x, y in zip(a, b)]
            else:
                setattr(out, name, value + getattr(other, name))
        return out

    @staticmethod
    def total(results) -> DecodeStats:
        """The stats of several decodes (DecodeResults) summed."""
        out = DecodeStats()
        for r in results:
            out = out.add(r.stats)
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

    def record_step(self, emitted: int, accepted: int, proposed: int, depth: int, target_s: float = 0.0) -> None:
        """One verification forward: `emitted` tokens out, `accepted` of `proposed` drafts taken;
        `depth` (the chain length or tree depth) bounds the acceptance positions counted; the
        target's `target_s` seconds for the proposed + 1 tokens verified."""
        s = self.stats
        s.decode_forwards += 1
        s.decode_tokens += emitted
        s.steps_by_nodes[proposed + 1] = s.steps_by_nodes.get(proposed + 1, 0) + 1
        s.target_s_by_nodes[proposed + 1] = s.target_s_by_nodes.get(proposed + 1, 0.0) + target_s
        if proposed:
            s.drafts += 1
            s.proposed_tokens += proposed
            s.accepted_per_pos.extend([0] * max(0, depth - len(s.accepted_per_pos)))
            for p in range(min(accepted, emitted)):
                s.accepted_per_pos[p] += 1
        self.step_tokens.append(emitted)
        self.step_proposed.append(proposed)


@dataclass
class SampleResult(DecodeResult):
    """A sampled generation; `lossy` is True when the acceptance rule does not preserve the
    target's distribution (typical acceptance): such outputs are not target samples."""

    rule: str = "leviathan"  # "leviathan" (chain) | "pointmass" | "typical" (trees)
    lossy: bool = False
    seed: int = 0


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
    ctx = target.context
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


# --- target forwards over a chain ----------------------------------------------------------------


def target_step(target, ids: torch.Tensor, past: int, cache, layers=()):
    """Feed ids [1, q] at positions past .. past + q - 1 to the target, appending to `cache`."""
    q = ids.shape[1]
    return target.forward(
        ids, layers=list(layers), attention_mask=causal_mask(past, q, target.dtype, target.device),
        position_ids=positions(past, q, target.device), cache=cache, use_cache=True,
    )


def new_cache(target):
    """An empty cache for the target's decode (full-attention layers append in place)."""
    return decode_cache(target.config)


def prefill(target, ids: torch.Tensor, layers, stats: DecodeStats, clock: Clock):
    """The prompt's one target forward into a new cache, timed and counted -> (cache, output)."""
    cache = new_cache(target)
    with clock:
        out = target_step(target, ids, 0, cache, layers)
    stats.prefill_forwards, stats.target_prefill_s = 1, clock.seconds
    clock.seconds = 0.0
    return cache, out


# --- target forwards over a tree ----------------------------------------------------------------

TREE_ATTENTION = ("eager", "sdpa", GQA_SDPA)  # kernels that honour an arbitrary 4-D mask


def check_tree_attention(config, what: str = "the target") -> None:
    """Refuse attention kernels that ignore an arbitrary 4-D mask (tree verification needs one)."""
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl in TREE_ATTENTION:
        return
    why = ("flash attention ignores custom 4-D masks, so tree nodes would see their siblings"
           if "flash" in impl else "it is not tested with custom 4-D tree masks")
    raise DecodeError(
        f"{what} uses attn_implementation='{impl}': tree verification cannot use it ({why}). "
        f"Load it with attn_implementation='sdpa' or 'eager'"
    )


def tree_attention_mask(tree_mask: torch.Tensor, past: int, dtype: torch.dtype,
                        device) -> torch.Tensor:
    """tree_mask [N, N] bool (ancestor-or-self) -> additive mask [1, 1, N, past + N].

    0 where a node may attend (every prefix column, its ancestors and itself), dtype min elsewhere.
    """
    n = tree_mask.shape[0]
    allow = torch.cat([torch.ones(n, past, dtype=torch.bool, device=device),
                       tree_mask.to(device)], dim=1)  # [N, past + N]
    mask = torch.zeros(n, past + n, dtype=dtype, device=device)
    mask.masked_fill_(~allow, torch.finfo(dtype).min)
    return mask[None, None]


def tree_forward(target, tokens: torch.Tensor, tree: Tree, past: int, cache,
                 layers=()) -> TargetOutput:
    """Run tree tokens [N] (root first) after `past` cached positions; appends N cache slots.

    Returns logits [1, N, V]: row j is the target's distribution for a child of node j.
    """
    device = target.device
    position_ids = (tree.depths.to(device) + past)[None]  # [1, N]
    mask = tree_attention_mask(tree.mask, past, target.dtype, device)  # [1, 1, N, past + N]
    return target.forward(tokens.reshape(1, -1).to(device), layers=list(layers),
                          attention_mask=mask, position_ids=position_ids, cache=cache,
                          use_cache=True)


def compact_cache(cache, past: int, path: list[int] | torch.Tensor) -> None:
    """Keep cache positions [0, past) and the tree slots past + path, in that order, in place."""
    path = torch.as_tensor(path, dtype=torch.long)
    n = path.numel()
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            raise DecodeError("tree verification does not support sliding-window cache layers yet")
        idx = (path + past).to(layer.keys.device)
        for name in ("keys", "values"):
            full = getattr(layer, name)  # [B, heads, past + N, head_dim]
            rows = full.index_select(-2, idx)  # gathered first: safe when slots overlap
            full[..., past: past + n, :] = rows
            setattr(layer, name, full[..., : past + n, :])
    if cache.get_seq_length() != past + n:
        raise RuntimeError(f"cache holds {cache.get_seq_length()} positions after compaction, "
                           f"expected {past + n}")


def gather_rows(out: TargetOutput, rows: torch.Tensor) -> TargetOutput:
    """Rows of a tree forward (logits and hidden states) along `rows` [n] -> a chain-like output."""
    rows = rows.to(out.logits.device)
    return TargetOutput(logits=out.logits.index_select(1, rows),
                        hidden={i: h.index_select(1, rows) for i, h in out.hidden.items()},
                        cache=out.cache,
                        final=None if out.final is None else out.final.index_select(1, rows))


def fit_tree(tree: Tree, tokens: torch.Tensor, remaining: int, past: int,
             ctx: int | None) -> tuple[Tree, torch.Tensor]:
    """Cut a proposed tree (tokens [N], root first) to the output budget and the context room."""
    if ctx is not None and tree.size > ctx:
        raise DecodeError(
            f"the draft tree has {tree.size} nodes but the target's context "
            f"(max_position_embeddings) is {ctx}: use a tree with fewer nodes"
        )
    kept = prune(tree, max_depth=remaining - 1, max_nodes=None if ctx is None else ctx - past)
    return subtree(tree, kept), tokens[kept.to(tokens.device)]


def check_vocab_fits(kind: str, vocab_size: int, hidden_size: int | None, target) -> None:
    """Refuse a drafter whose vocabulary (or width, for MTP) differs from the target's."""
    problems = []
    if vocab_size != target.vocab_size:
        problems.append(f"vocab_size {vocab_size} vs the target's {target.vocab_size}")
    if hidden_size is not None and hidden_size != target.hidden_size:
        problems.append(f"hidden_size {hidden_size} vs the target's {target.hidden_size}")
    if problems:
        raise TargetError(f"the {kind} head does not fit this target: " + "; ".join(problems))
