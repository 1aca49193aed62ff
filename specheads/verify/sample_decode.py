"""Speculative sampling decode loops (chain and tree), batch size 1, seeded.

The loops mirror the greedy ones (`verify.decode.generate`, `verify.tree_decode.tree_generate`):
same prompt checks, cache trimming / compaction, proposer protocol and `DecodeStats` counts; only
the choice of tokens differs. Every token is drawn from the target's warped distribution
(`sampling.warp`): the first one from the prefill, later ones through an acceptance rule:

* chain (`sample_generate`): Leviathan / Chen speculative sampling (docs/algorithms.md
  §8.2). A proposer with `propose_sampled(k, warper, gen) -> (tokens [n], q [n, V])` samples its
  drafts from its own warped q (`SampledEagle3Proposer`); any other chain proposer (n-gram, a
  greedy EAGLE-3 proposer) proposes deterministically and is treated as a point mass q.
  `rule="typical"` verifies deterministic top-1 drafts with Medusa typical acceptance instead
  (LOSSY, flagged like the tree rule below).
* tree (`sample_tree_generate`): the EAGLE-2/3 point-mass rule over the deterministic top-k
  trees of the existing tree proposers (§8.3), or Medusa typical acceptance (§8.4), which is
  LOSSY and flagged `lossy=True` on the result.

Both lossless rules leave the output distributed exactly as sampling the target token by token;
at temperature 0 they reduce to greedy verification, so the output equals greedy decoding.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import torch

from specheads.verify.decode import (
    DecodeError,
    DecodeResult,
    DecodeStats,
    Clock,
    prefill,
    context_length,
    cut_at_eos,
    positions,
    prepare_prompt,
    target_step,
    trim_cache,
)
from specheads.verify.proposers import Eagle3Proposer
from specheads.verify.sampling import (
    accept_chain,
    accept_tree_pointmass,
    check_warp,
    expand_draft_logits,
    make_generator,
    point_mass,
    sample,
    typical_accept,
    warp,
)
from specheads.verify.tree_decode import (
    check_tree_attention,
    compact_cache,
    fit_tree,
    gather_rows,
    tree_forward,
)
from specheads.verify.trees import chain_tree

Warper = Callable[[torch.Tensor], torch.Tensor]  # logits [..., V] -> probs [..., V]
TREE_RULES = ("pointmass", "typical")
CHAIN_RULES = ("leviathan", "typical")


@dataclass
class SampleResult(DecodeResult):
    """A sampled generation; `lossy` is True when the acceptance rule does not preserve the
    target's distribution (typical acceptance): such outputs are not target samples."""

    rule: str = "leviathan"  # "leviathan" (chain) | "pointmass" | "typical" (trees)
    lossy: bool = False
    seed: int = 0


class SampledEagle3Proposer(Eagle3Proposer):
    """EAGLE-3 chain proposer that samples d_j ~ q_j = warp(draft logits) and returns q.

    Same verified state as `Eagle3Proposer` (start / accept unchanged); q is expressed over the
    target vocabulary, 0 outside the draft vocabulary, warped exactly like the target.
    """

    @torch.no_grad()
    def propose_sampled(self, k: int, warper: Warper,
                        gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """k draft tokens [k] (target ids) and their distributions q [k, V]."""
        head, out = self.head, self.last_out
        V = self.target.vocab_size
        ids = head.to_target_ids(torch.arange(head.config.draft_vocab_size, device=out.device))
        tokens, qs = [], []
        for j in range(k):
            if j > 0:
                emb = self.target.embed(tokens[-1].reshape(1, 1))
                out = head.step(out, emb, positions(self.rows - 1 + j, 1, out.device), None,
                                self.cache)
            q = warper(expand_draft_logits(head.logits(out)[0, -1], ids, V))  # [V]
            tokens.append(sample(q.to(gen.device), gen).to(out.device))
            qs.append(q)
        trim_cache(self.cache, self.rows)
        if not tokens:
            return torch.empty(0, dtype=torch.long), torch.empty(0, V)
        return torch.stack(tokens), torch.stack(qs)


def draft_chain(proposer, k: int, warper: Warper, gen: torch.Generator, vocab_size: int,
                deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts [n <= k] and their q [n, V]: sampled if the proposer can (and not
    `deterministic`, as typical acceptance wants top-1 drafts), else a point mass."""
    if hasattr(proposer, "propose_sampled") and not deterministic:
        tokens, q = proposer.propose_sampled(k, warper, gen)
    else:
        tokens = proposer.propose(k).reshape(-1)[:k]
        q = point_mass(tokens, vocab_size)
    return tokens.reshape(-1)[:k], q[:k]


# --- shared loop pieces --------------------------------------------------------------------------


@dataclass
class _Run:
    """State shared by both loops: result, clocks, the sequence and the target cache."""

    result: SampleResult
    tgt_clock: Clock
    prop_clock: Clock
    t_start: float
    seq: list[int]
    cache: object = None
    done: bool = False


def _begin(target, proposer, prompt_ids, max_new_tokens: int, warper: Warper, gen,
           eos: frozenset[int], rule: str, lossy: bool, seed: int, stats: DecodeStats):
    """Prefill, sample the first token, start the proposer -> (_Run, token budget, layers)."""
    ids, budget = prepare_prompt(target, prompt_ids, max_new_tokens)
    layers = list(getattr(proposer, "layers", ())) if proposer is not None else []
    result = SampleResult(tokens=[], stop_reason="length", stats=stats, rule=rule, lossy=lossy,
                          seed=seed)
    run = _Run(result, Clock(target.device), Clock(target.device), time.perf_counter(),
               ids[0].tolist())
    if budget == 0:
        return run, budget, layers
    run.cache, out = prefill(target, ids, layers, stats, run.tgt_clock)
    first = int(sample(warper(out.logits[0, -1]).to(gen.device), gen))
    run.seq.append(first)
    result.tokens.append(first)
    run.done = first in eos
    if proposer is not None and not run.done and budget > 1:
        with run.prop_clock:
            proposer.start(ids[0], first, out)
        stats.proposer_start_s, run.prop_clock.seconds = run.prop_clock.seconds, 0.0
    return run, budget, layers


def _finish(run: _Run) -> SampleResult:
    result, stats = run.result, run.result.stats
    if run.done:
        result.stop_reason = "eos"
    stats.tokens = len(result.tokens)
    stats.target_decode_s = run.tgt_clock.seconds
    stats.proposer_s = run.prop_clock.seconds
    stats.wall_s = time.perf_counter() - run.t_start
    return result


def _setup(target, temperature: float, top_p: float, top_k: int, seed: int, eos_token_ids):
    check_warp(temperature, top_p, top_k)
    warper = partial(warp, temperature=temperature, top_p=top_p, top_k=top_k)
    return warper, make_generator(seed, target.device), frozenset(int(e) for e in eos_token_ids)


# --- chain ---------------------------------------------------------------------------------------


@torch.no_grad()
def sample_generate(target, proposer, prompt_ids, max_new_tokens: int, k: int,
                    temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                    eos_token_ids: Iterable[int] = (), rule: str = "leviathan",
                    epsilon: float = 0.09, delta: float = 0.3) -> SampleResult:
    """Speculative sampling with a chain of <= k drafts per target forward.

    rule "leviathan" (default): lossless speculative sampling. rule "typical": Medusa typical
    acceptance of the proposer's deterministic drafts with thresholds min(epsilon, delta *
    exp(-H)), LOSSY (result.lossy is True). `proposer` None (or k == 0) gives plain ancestral
    sampling from the warped target. The same seed reproduces the same tokens; temperature 0
    equals greedy decoding token for token.
    """
    if k < 0:
        raise DecodeError(f"k (draft length) must be >= 0, got {k}")
    if rule not in CHAIN_RULES:
        raise DecodeError(f"unknown chain acceptance rule '{rule}': use one of {CHAIN_RULES}")
    warper, gen, eos = _setup(target, temperature, top_p, top_k, seed, eos_token_ids)
    stats = DecodeStats(accepted_per_pos=[0] * k)
    run, budget, layers = _begin(target, proposer, prompt_ids, max_new_tokens, warper, gen, eos,
                                 rule, rule == "typical", seed, stats)
    decide = partial(decide_chain, rule, epsilon=epsilon, delta=delta)
    result, device, V = run.result, target.device, target.vocab_size
    use_drafts = proposer is not None and k > 0
    while not run.done and len(result.tokens) < budget:
        k_step = min(k, budget - len(result.tokens) - 1) if use_drafts else 0
        draft, q = torch.empty(0, dtype=torch.long, device=device), torch.empty(0, V)
        if k_step > 0:
            with run.prop_clock:
                draft, q = draft_chain(proposer, k_step, warper, gen, V, rule == "typical")
            draft = draft.to(device)
        n_prop, past = draft.shape[0], len(run.seq) - 1
        step_ids = torch.cat([torch.tensor([run.seq[-1]], device=device), draft])[None]  # [1, 1+n]
        with run.tgt_clock:
            out = target_step(target, step_ids, past, run.cache, layers)
            p = warper(out.logits[0])  # [1 + n, V]
            m, nxt = decide(step_ids[0].to(gen.device), q.reshape(n_prop, V).to(gen.device),
                            p.to(gen.device), gen)
            trim_cache(run.cache, past + 1 + m)
        emitted, run.done = cut_at_eos(draft[:m].tolist() + [nxt], eos)
        result.record_step(len(emitted), m, n_prop, n_prop)
        run.seq.extend(emitted)
        result.tokens.extend(emitted)
        if use_drafts and not run.done and len(result.tokens) < budget:
            with run.prop_clock:
                proposer.accept(step_ids[0, : m + 1], torch.tensor(emitted, device=device), out,
                                past)
    return _finish(run)


def decide_chain(rule: str, step_ids: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                 gen: torch.Generator, epsilon: float = 0.09,
                 delta: float = 0.3) -> tuple[int, int]:
    """One verified chain -> (accepted drafts, next token) under `rule`.

    step_ids [1 + n]: the root then n drafts; q [n, V] their draft distributions; p [1 + n, V]
    the target's warped distributions after each prefix. "typical" sees the chain as a tree.
    """
    draft = step_ids[1:]
    if rule == "leviathan":
        return accept_chain(draft, q, p, gen)
    decision = typical_accept(chain_tree(draft.numel()), step_ids, p, gen,
                              posterior_threshold=epsilon, posterior_alpha=delta)
    return len(decision.path) - 1, decision.next_token


# --- tree ----------------------------------------------------------------------------------------


def decide_tree(rule: str, tree, tokens: torch.Tensor, p: torch.Tensor,
                gen: torch.Generator, epsilon: float = 0.09,
                delta: float = 0.3) -> tuple[list[int], int]:
    """Acceptance on one verified tree -> (accepted path, next token) under `rule`."""
    if rule == "pointmass":
        return accept_tree_pointmass(tree, tokens, p, gen)
    decision = typical_accept(tree, tokens, p, gen, posterior_threshold=epsilon,
                              posterior_alpha=delta)
    return decision.path, decision.next_token


@torch.no_grad()
def sample_tree_generate(target, proposer, prompt_ids, max_new_tokens: int,
                         temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                         seed: int = 0, eos_token_ids: Iterable[int] = (),
                         rule: str = "pointmass", epsilon: float = 0.09,
                         delta: float = 0.3) -> SampleResult:
    """Tree speculative sampling: one target forward per draft tree.

    rule "pointmass" (default): EAGLE-2/3 acceptance for deterministic top-k trees, lossless.
    rule "typical": Medusa typical acceptance with thresholds min(epsilon, delta * exp(-H)),
    LOSSY (result.lossy is True). `proposer` None gives plain ancestral sampling through the
    tree path. Temperature 0 equals greedy decoding token for token under either rule.
    """
    if rule not in TREE_RULES:
        raise DecodeError(f"unknown tree acceptance rule '{rule}': use one of {TREE_RULES}")
    check_tree_attention(target.config)
    warper, gen, eos = _setup(target, temperature, top_p, top_k, seed, eos_token_ids)
    stats = DecodeStats()
    run, budget, layers = _begin(target, proposer, prompt_ids, max_new_tokens, warper, gen, eos,
                                 rule, rule == "typical", seed, stats)
    result, device, ctx = run.result, target.device, context_length(target)
    while not run.done and len(result.tokens) < budget:
        remaining, past = budget - len(result.tokens), len(run.seq) - 1
        root = torch.tensor([run.seq[-1]], device=device)
        tree, nodes = chain_tree(0), root[:0]
        if proposer is not None and remaining > 1:
            with run.prop_clock:
                tree, nodes = proposer.propose_tree()
        tokens = torch.cat([root, nodes.reshape(-1).to(device)])  # [N]
        tree, tokens = fit_tree(tree, tokens, remaining, past, ctx)
        with run.tgt_clock:
            out = tree_forward(target, tokens, tree, past, run.cache, layers)
            p = warper(out.logits[0])  # [N, V]
            path, nxt = decide_tree(rule, tree, tokens.to(gen.device), p.to(gen.device), gen,
                                    epsilon, delta)
            compact_cache(run.cache, past, path)
        path_t = torch.tensor(path, device=device)
        emitted, run.done = cut_at_eos(tokens[path_t[1:]].tolist() + [nxt], eos)
        result.record_step(len(emitted), len(path) - 1, tree.size - 1, tree.max_depth)
        run.seq.extend(emitted)
        result.tokens.extend(emitted)
        if proposer is not None and not run.done and len(result.tokens) < budget:
            with run.prop_clock:
                proposer.accept(tokens[path_t], torch.tensor(emitted, device=device),
                                gather_rows(out, path_t), past)
    return _finish(run)
