"""The decoder: propose a draft, verify it in one target forward, keep what a rule accepts.

`decode` is the one loop (docs/algorithms.md §8); `greedy_decode` is plain greedy decoding (the
reference) through it. Two choices set a decode:

* the draft shape, decided by the proposer: a `protocols.TreeProposer` drafts any tree, verified
  with a 4-D tree mask and the cache compacted to the accepted path (`TreeShape`; sdpa / eager);
  any other proposer drafts a chain of <= k, verified with a causal mask and the rejected slots
  cropped (`ChainShape`; any attention kernel). `NO_DRAFT` (or k == 0) decodes plainly;
* the acceptance rule (`verify.rules`): "greedy", "exact" speculative sampling (Leviathan / Chen
  on chains, EAGLE point mass on trees) or "typical" (LOSSY).

Greedy and the exact rules leave the output distributed as plain decoding (greedy: token for
token). Never more than max_new_tokens tokens; generation stops after an eos id.

Batch: prompts, drafts and verification tensors are [B, ...] at the loop's boundaries, and a
proposer is reached through `BatchProposer`; B must be 1 today (a clear error otherwise), so
batching later changes this module and the rules, not the callers.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from specheads.protocols import TreeProposer
from specheads.target import TargetOutput
from specheads.verify.ngram_proposers import NO_DRAFT
from specheads.verify.rules import AcceptRule, make_rule, one_row
from specheads.verify.steps import (
    Clock,
    DecodeError,
    DecodeResult,
    DecodeStats,
    check_tree_attention,
    compact_cache,
    cut_at_eos,
    fit_tree,
    gather_rows,
    prefill,
    prepare_prompt,
    target_step,
    tree_forward,
    trim_cache,
)
from specheads.verify.trees import Tree, chain_tree


class BatchProposer:
    """A per-sequence proposer (`protocols.Proposer` or `TreeProposer`, `[n]` tensors) behind the
    loop's batched boundary: [B, ...] in and out, B == 1."""

    def __init__(self, inner):
        self.inner = inner
        self.layers = list(getattr(inner, "layers", ()))

    def start(self, prompt_ids: torch.Tensor, first: list[int], out: TargetOutput) -> None:
        """prompt_ids [B, P], first [B]: the prefill's forward and the token it emitted."""
        self.inner.start(one_row(prompt_ids, "the prompt ids"), first[0], out)

    def propose_chain(self, k: int, rule: AcceptRule,
                      vocab_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """<= k drafts [B, n] drawn the way the rule needs, and their q [B, n, V] (or None)."""
        tokens, q = rule.draft_chain(self.inner, k, vocab_size)  # [n], [n, V]
        return tokens.reshape(1, -1), None if q is None else q[None]

    def propose_tree(self) -> tuple[Tree, torch.Tensor]:
        """A tree (shared by the batch) and its node tokens [B, N-1], root excluded."""
        tree, nodes = self.inner.propose_tree()
        return tree, nodes.reshape(1, -1)

    def accept(self, inputs: torch.Tensor, following: torch.Tensor, out: TargetOutput,
               start: int) -> None:
        """inputs [B, n] fed at start.., following [B, n]: the token settled after each."""
        self.inner.accept(one_row(inputs, "the accepted inputs"),
                          one_row(following, "the emitted tokens"), out, start)


# --- draft shapes --------------------------------------------------------------------------------


@dataclass
class ChainShape:
    """A chain of <= k drafts per step: causal-mask verification, rejected cache slots cropped."""

    k: int
    _trees: dict[int, Tree] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.k < 0:
            raise DecodeError(f"k (draft length) must be >= 0, got {self.k}")

    def check(self, target) -> None:
        pass

    def new_stats(self) -> DecodeStats:
        return DecodeStats(accepted_per_pos=[0] * self.k)

    def drafts_with(self, proposer) -> bool:
        return self.k > 0

    def depth(self, tree: Tree) -> int:
        return tree.size - 1  # a path

    def tree(self, n: int) -> Tree:
        """The chain of n drafts as a tree (built once per length)."""
        if n not in self._trees:
            self._trees[n] = chain_tree(n)
        return self._trees[n]

    def draft(self, drafts: BatchProposer, rule: AcceptRule, remaining: int,
              vocab_size: int) -> tuple[Tree, torch.Tensor, torch.Tensor | None]:
        nodes, q = drafts.propose_chain(min(self.k, remaining - 1), rule, vocab_size)  # [B, n]
        return self.tree(nodes.shape[1]), nodes, q

    def fit(self, tree: Tree, tokens: torch.Tensor, remaining: int, past: int, ctx):
        return tree, tokens  # k <= remaining - 1 <= context room already

    def forward(self, target, tokens: torch.Tensor, tree: Tree, past: int, cache, layers):
        return target_step(target, tokens, past, cache, layers)  # tokens [B, N]

    def keep(self, cache, past: int, path: list[int]) -> None:
        trim_cache(cache, past + len(path))

    def accepted(self, tokens: torch.Tensor, out: TargetOutput,
                 path: list[int]) -> tuple[torch.Tensor, TargetOutput]:
        """The accepted inputs [B, m+1] and the rows of `out` behind them (a prefix: as is)."""
        return tokens[:, : len(path)], out


class TreeShape:
    """Any draft tree per step: tree-mask verification, the cache compacted to the accepted path."""

    def check(self, target) -> None:
        check_tree_attention(target.config)

    def new_stats(self) -> DecodeStats:
        return DecodeStats()

    def drafts_with(self, proposer) -> bool:
        return True

    def depth(self, tree: Tree) -> int:
        return tree.max_depth

    def tree(self, n: int) -> Tree:
        return chain_tree(n)

    def draft(self, drafts: BatchProposer, rule: AcceptRule, remaining: int,
              vocab_size: int) -> tuple[Tree, torch.Tensor, None]:
        tree, nodes = drafts.propose_tree()  # nodes [B, N-1]
        return tree, nodes, None

    def fit(self, tree: Tree, tokens: torch.Tensor, remaining: int, past: int, ctx):
        tree, kept = fit_tree(tree, one_row(tokens, "the draft tokens"), remaining, past, ctx)
        return tree, kept[None]  # [B, N']

    def forward(self, target, tokens: torch.Tensor, tree: Tree, past: int, cache, layers):
        return tree_forward(target, tokens, tree, past, cache, layers)  # tokens [B, N]

    def keep(self, cache, past: int, path: list[int]) -> None:
        compact_cache(cache, past, path)

    def accepted(self, tokens: torch.Tensor, out: TargetOutput,
                 path: list[int]) -> tuple[torch.Tensor, TargetOutput]:
        path_t = torch.tensor(path, device=tokens.device)
        return tokens[:, path_t], gather_rows(out, path_t)


# --- the loop ------------------------------------------------------------------------------------


@dataclass
class _Run:
    """One generation's state: the target cache holds every position of `seq` but the last."""

    target: object
    rule: AcceptRule
    shape: ChainShape | TreeShape
    drafts: BatchProposer | None
    eos: frozenset[int]
    budget: int
    result: DecodeResult
    layers: list[int]  # target hidden states the proposer reads
    tgt_clock: Clock
    prop_clock: Clock
    context: int | None  # the target's max_position_embeddings
    seq: list[int] = field(default_factory=list)
    cache: object = None
    done: bool = False


def as_batch(prompt_ids) -> torch.Tensor:
    """A prompt: ids [P] or [B, P] (any nesting) -> [B, P]."""
    ids = torch.as_tensor(prompt_ids, dtype=torch.long)
    if ids.dim() > 2:
        raise DecodeError(f"prompt_ids must be [tokens] or [batch, tokens], got shape {tuple(ids.shape)}")
    return ids.reshape(1, -1) if ids.dim() < 2 else ids


def draft_shape(proposer, k: int) -> ChainShape | TreeShape:
    """The proposer decides: a tree proposer drafts trees, any other a chain of <= k."""
    return TreeShape() if isinstance(proposer, TreeProposer) else ChainShape(k)


@torch.no_grad()
def decode(target, proposer, prompt_ids, max_new_tokens: int, k: int = 0,
           eos_token_ids: Iterable[int] = (), *, rule: str | AcceptRule = "greedy",
           temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
           epsilon: float = 0.09, delta: float = 0.3) -> DecodeResult:
    """Speculative decoding of prompt_ids [P] (or [1, P]) with `proposer`'s drafts (a chain of
    <= k, or its trees), kept by `rule` ("greedy" | "exact" | "typical", or an AcceptRule).

    The sampling settings (warp, seed; typical's thresholds min(epsilon, delta * exp(-H))) apply
    to the sampling rules only. The same seed reproduces the same tokens; temperature 0 and the
    greedy rule equal plain greedy decoding token for token. A sampling result is a SampleResult
    (rule name, seed, `lossy`).
    """
    if proposer is None:
        raise DecodeError("decode needs a proposer: pass ngram_proposers.NO_DRAFT to decode plainly")
    shape = draft_shape(proposer, k)
    if isinstance(rule, str):
        rule = make_rule(rule, isinstance(shape, TreeShape), target.device, temperature, top_p,
                         top_k, seed, epsilon, delta)
    return run_loop(target, proposer, as_batch(prompt_ids), max_new_tokens, rule, shape,
                    eos_token_ids)[0]


def greedy_decode(target, prompt_ids, max_new_tokens: int,
                  eos_token_ids: Iterable[int] = ()) -> DecodeResult:
    """Plain greedy decoding with a KV cache: one target forward per new token (the reference)."""
    return decode(target, NO_DRAFT, prompt_ids, max_new_tokens, 0, eos_token_ids)


def run_loop(target, proposer, prompt_ids: torch.Tensor, max_new_tokens: int, rule: AcceptRule,
             shape: ChainShape | TreeShape, eos_token_ids: Iterable[int] = ()) -> list[DecodeResult]:
    """prompt_ids [B, P] -> one result per sequence (B == 1): prefill, then verification steps."""
    shape.check(target)
    ids, budget = prepare_prompt(target, one_row(prompt_ids, "prompt_ids"), max_new_tokens)  # [1, P]
    drafts = BatchProposer(proposer) if shape.drafts_with(proposer) else None
    run = _Run(target, rule, shape, drafts, frozenset(int(e) for e in eos_token_ids), budget,
               rule.new_result(shape.new_stats()), drafts.layers if drafts else [],
               Clock(target.device), Clock(target.device), target.context)
    t_start = time.perf_counter()
    if budget > 0:
        begin(run, ids)
    while not run.done and len(run.result.tokens) < budget:
        step(run)
    return [finish(run, t_start)]


def begin(run: _Run, ids: torch.Tensor) -> None:
    """Prefill the prompt ids [B, P], choose the first token, start the proposer."""
    stats = run.result.stats
    run.cache, out = prefill(run.target, ids, run.layers, stats, run.tgt_clock)
    first = run.rule.first_token(out.logits[:, -1])[0]  # logits [B, V]
    run.seq = ids[0].tolist() + [first]
    run.result.tokens.append(first)
    run.done = first in run.eos
    if run.drafts is not None and not run.done and run.budget > 1:
        with run.prop_clock:
            run.drafts.start(ids, [first], out)
        stats.proposer_start_s, run.prop_clock.seconds = run.prop_clock.seconds, 0.0


def propose(run: _Run, remaining: int, past: int) -> tuple[Tree, torch.Tensor, torch.Tensor | None]:
    """This step's tree and its tokens [B, N] (root first), cut to the budget and context."""
    device = run.target.device
    root = torch.tensor([[run.seq[-1]]], device=device)  # [B, 1]
    tree, nodes, q = run.shape.tree(0), root[:, :0], None
    if run.drafts is not None and remaining > 1:
        with run.prop_clock:
            tree, nodes, q = run.shape.draft(run.drafts, run.rule, remaining,
                                             run.target.vocab_size)
    tokens = torch.cat([root, nodes.to(device)], dim=1)  # [B, N]
    tree, tokens = run.shape.fit(tree, tokens, remaining, past, run.context)
    return tree, tokens, q


def step(run: _Run) -> None:
    """One verification forward: propose, verify, accept, emit, let the proposer catch up."""
    result, shape = run.result, run.shape
    remaining, past = run.budget - len(result.tokens), len(run.seq) - 1
    tree, tokens, q = propose(run, remaining, past)
    before = run.tgt_clock.seconds
    with run.tgt_clock:
        out = shape.forward(run.target, tokens, tree, past, run.cache, run.layers)
        paths, nexts = run.rule.decide(tree, tokens, out.logits, q)  # logits [B, N, V]
        path, nxt = paths[0], nexts[0]
        shape.keep(run.cache, past, path)
    toks = tokens[0].tolist()
    emitted, run.done = cut_at_eos([toks[i] for i in path[1:]] + [nxt], run.eos)
    result.record_step(len(emitted), len(path) - 1, tree.size - 1, shape.depth(tree), run.tgt_clock.seconds - before)
    run.seq.extend(emitted)
    result.tokens.extend(emitted)
    if run.drafts is not None and not run.done and len(result.tokens) < run.budget:
        inputs, rows = shape.accepted(tokens, out, path)
        following = torch.tensor([emitted], device=run.target.device)  # [B, n]
        with run.prop_clock:
            run.drafts.accept(inputs, following, rows, past)


def finish(run: _Run, t_start: float) -> DecodeResult:
    """Stop reason, totals and seconds."""
    result, stats = run.result, run.result.stats
    if run.done:
        result.stop_reason = "eos"
    stats.tokens = len(result.tokens)
    stats.target_decode_s = run.tgt_clock.seconds
    stats.proposer_s = run.prop_clock.seconds
    stats.wall_s = time.perf_counter() - t_start
    return result
