"""The decoder: propose a draft per sequence, verify every sequence's draft in one target
forward, keep what each sequence's rule accepts.

`decode_batch` is the one loop (docs/algorithms.md §8) over `Request`s: up to batch_size
sequences share every target forward, each with its own proposer, rule, draft, accepted length
and cache length (`verify.ragged`: right-padded cache, per-row 4-D masks and positions), and a
sequence that finishes leaves the batch while the next waiting one joins it (continuous
batching). `decode` is one sequence through it (a batch of one row: the same masks and cache
operations as a sequential decoder); `greedy_decode` is plain greedy decoding (the reference).

Two choices set a sequence's decode:

* the draft shape, decided by its proposer: a `protocols.TreeProposer` drafts any tree, verified
  with a tree mask and the cache compacted to the accepted path (`TreeShape`); any other
  proposer drafts a chain of <= k (`ChainShape`; a single row needs no tree mask, so any
  attention kernel); `NO_DRAFT` (or k == 0) decodes plainly;
* the acceptance rule (`verify.rules`): "greedy", "exact" speculative sampling (Leviathan / Chen
  on chains, EAGLE point mass on trees) or "typical" (LOSSY); a rule decides one sequence and
  holds its own generator, so a row samples as it would alone.

Drafting is per sequence, except for rows whose chain proposers form a draft group
(`protocols.GroupedProposer`: EAGLE-3 chains over one head, alone or inside an adaptive-length or
hybrid (choose, union) wrapper, `protocols.SplitProposer`): their drafter forwards run batched, one per
draft position for the rows of the group that draft this step, each row drafting what it would
have alone.

Greedy and the exact rules leave every sequence's output distributed as its plain decoding
(greedy: token for token). Never more than max_new_tokens tokens; a sequence stops after an eos.
A batch's forward seconds (and its wall seconds) are shared equally among its rows, so the stats
summed over the rows are the batch's.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from specheads.protocols import GroupedProposer, SplitProposer, close_proposers
from specheads.target import TargetOutput
from specheads.verify.draft_asks import begin, draft_asks, end
from specheads.verify.ngram_proposers import NO_DRAFT
from specheads.verify.prompt_cache import Prefilled, PromptCache
from specheads.verify.ragged import (
    batch_forward,
    check_batch_attention,
    keep_paths,
    merge_rows,
    row_output,
    select_rows,
)
from specheads.verify.rules import AcceptRule, make_rule, one_row
from specheads.verify.shapes import ChainShape, Plan, TreeShape, draft_shape
from specheads.verify.steps import (
    Clock,
    DecodeError,
    DecodeResult,
    cut_at_eos,
    new_cache,
    prepare_prompt,
)

# --- requests ------------------------------------------------------------------------------------


@dataclass
class Request:
    """One sequence to decode: its checked prompt and budget, its own proposer (stateful: never
    shared by two requests), its own rule (its own generator) and its draft shape."""

    ids: torch.Tensor  # [1, P] on the target's device
    budget: int  # new tokens, clamped to the context
    proposer: object
    rule: AcceptRule
    shape: ChainShape | TreeShape
    eos: frozenset[int]


def as_batch(prompt_ids) -> torch.Tensor:
    """A prompt: ids [P] or [B, P] (any nesting) -> [B, P]."""
    ids = torch.as_tensor(prompt_ids, dtype=torch.long)
    if ids.dim() > 2:
        raise DecodeError(f"prompt_ids must be [tokens] or [batch, tokens], got shape {tuple(ids.shape)}")
    return ids.reshape(1, -1) if ids.dim() < 2 else ids


def make_request(target, proposer, prompt_ids: torch.Tensor, max_new_tokens: int,
                 rule: AcceptRule, shape: ChainShape | TreeShape,
                 eos_token_ids: Iterable[int] = ()) -> Request:
    """A Request of prompt_ids [1, P], checked against the target now (before any decoding)."""
    shape.check(target)
    ids, budget = prepare_prompt(target, one_row(prompt_ids, "prompt_ids"), max_new_tokens)
    return Request(ids, budget, proposer, rule, shape, frozenset(int(e) for e in eos_token_ids))


def request(target, proposer, prompt_ids, max_new_tokens: int, k: int = 0,
            eos_token_ids: Iterable[int] = (), *, rule: str | AcceptRule = "greedy",
            temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
            epsilon: float = 0.09, delta: float = 0.3) -> Request:
    """A Request with `decode`'s arguments (prompt_ids [P] or [1, P]; see `decode`)."""
    if proposer is None:
        raise DecodeError("decode needs a proposer: pass ngram_proposers.NO_DRAFT to decode plainly")
    shape = draft_shape(proposer, k)
    if isinstance(rule, str):
        rule = make_rule(rule, isinstance(shape, TreeShape), target.device, temperature, top_p,
                         top_k, seed, epsilon, delta)
    return make_request(target, proposer, as_batch(prompt_ids), max_new_tokens, rule, shape,
                        eos_token_ids)


# --- one row of the batch ------------------------------------------------------------------------


@dataclass
class _Row:
    """One sequence's state: the batch cache holds every position of `seq` but the last."""

    index: int  # the request's place in decode_batch's list
    req: Request
    result: DecodeResult
    drafts: object | None  # the proposer, None when this sequence drafts nothing
    layers: list[int]  # target hidden states its proposer reads
    prop_clock: Clock
    seq: list[int] = field(default_factory=list)
    done: bool = False  # an eos was emitted

    @property
    def past(self) -> int:
        return len(self.seq) - 1

    @property
    def finished(self) -> bool:
        return self.done or len(self.result.tokens) >= self.req.budget


def new_row(index: int, req: Request, device) -> _Row:
    drafts = req.proposer if req.shape.drafts_with(req.proposer) else None
    return _Row(index, req, req.rule.new_result(req.shape.new_stats()), drafts,
                list(getattr(drafts, "layers", ())), Clock(device))


def start_row(row: _Row, ids: torch.Tensor, out: TargetOutput) -> None:
    """Its prompt ids [P] were prefilled (`out`: its rows, [1, P, ...]): first token, proposer."""
    first = row.req.rule.first_token(out.logits[:, -1])[0]  # logits [1, V]
    row.seq = ids.tolist() + [first]
    row.result.tokens.append(first)
    row.done = first in row.req.eos
    if row.drafts is not None and not row.finished:
        with row.prop_clock:
            row.drafts.start(ids, first, out)
        row.result.stats.proposer_start_s, row.prop_clock.seconds = row.prop_clock.seconds, 0.0


def remaining(row: _Row) -> int:
    """New tokens this row may still emit."""
    return row.req.budget - len(row.result.tokens)


def propose(row: _Row, target) -> Plan:
    """This step's tree and its tokens [N] (root first, on the CPU), cut to budget and context."""
    req = row.req
    plan = req.shape.tree(0), torch.empty(0, dtype=torch.long), None
    if row.drafts is not None and remaining(row) > 1:
        with row.prop_clock:
            plan = req.shape.draft(row.drafts, req.rule, remaining(row), target.vocab_size)
    return fit_plan(row, plan, target)


def fit_plan(row: _Row, plan: Plan, target) -> Plan:
    """A drafted plan (its nodes [N-1]) with the row's root in front, cut to budget and context."""
    tree, nodes, q = plan
    tokens = torch.cat([torch.tensor([row.seq[-1]]), nodes.reshape(-1).cpu()])
    tree, tokens = row.req.shape.fit(tree, tokens, remaining(row), row.past, target.context)
    return tree, tokens, q


def group_drafter(row: _Row):
    """The object drafting this row in a draft group this step, or None (it proposes alone): a row
    with drafts to ask for whose proposer is a `protocols.GroupedProposer` (drafting trees: a split
    one, whose model drafts a chain)."""
    shape, drafts = row.req.shape, row.drafts
    if (drafts is None or shape.length(remaining(row)) < 1 or not isinstance(drafts, GroupedProposer)
            or (isinstance(shape, TreeShape) and not isinstance(drafts, SplitProposer))):
        return None
    return drafts.group_drafter()


def propose_all(rows: list[_Row], target) -> list[Plan]:
    """Every row's plan: two or more rows whose drafters share a group key draft together
    (`propose_group`), every other row alone (`propose`)."""
    drafters = [group_drafter(row) for row in rows]
    groups: dict = {}
    for b, drafter in enumerate(drafters):
        if drafter is not None:
            groups.setdefault(drafter.group_key(), []).append(b)
    plans: list[Plan | None] = [None] * len(rows)
    for members in groups.values():
        if len(members) > 1:
            grouped = propose_group([rows[b] for b in members], [drafters[b] for b in members], target)
            for b, plan in zip(members, grouped):
                plans[b] = plan
    return [plan if plan is not None else propose(row, target) for plan, row in zip(plans, rows)]


def propose_group(rows: list[_Row], drafters: list, target) -> list[Plan]:
    """Chain rows of one draft group: each row's ask of its model (`draft_asks.begin`: a wrapper's
    own, after its free draft, or None), one drafter forward per draft position for the rows that
    ask, each chain drawn as its rule says (`rules.ChainDraw`) and finished by its proposer
    (`draft_asks.end`); their seconds are shared equally."""
    clock = Clock(target.device)
    with clock:
        draws = [row.req.rule.chain_draw(row.drafts) for row in rows]
        asks = [begin(row.drafts, row.req.shape.length(remaining(row)), draw.sampler)
                for row, draw in zip(rows, draws)]
        drafted = draft_asks(drafters, asks)
        plans = [row.req.shape.planned(draw, end(row.drafts, chain), target.vocab_size)
                 for row, draw, chain in zip(rows, draws, drafted)]
    for row in rows:
        row.prop_clock.seconds += clock.seconds / len(rows)
    return [fit_plan(row, plan, target) for row, plan in zip(rows, plans)]


def settle(row: _Row, b: int, plan: Plan, path: list[int], nxt: int, out: TargetOutput,
           target_s: float, device) -> None:
    """Emit row b's accepted tokens and bonus, count the step, let its proposer catch up."""
    tree, tokens, _ = plan
    past, toks = row.past, tokens.tolist()
    emitted, row.done = cut_at_eos([toks[i] for i in path[1:]] + [nxt], row.req.eos)
    row.result.record_step(len(emitted), len(path) - 1, tree.size - 1, row.req.shape.depth(tree), target_s)
    row.seq.extend(emitted)
    row.result.tokens.extend(emitted)
    if row.drafts is not None and not row.finished:
        inputs, rows = row.req.shape.accepted(tokens, row_output(out, b, tokens.numel(), row.layers), path)
        following = torch.tensor([emitted], device=device)  # [1, n]
        with row.prop_clock:
            row.drafts.accept(inputs[0].to(device), following[0], rows, past)


def finish(row: _Row) -> DecodeResult:
    """Stop reason and totals (its seconds were added up step by step)."""
    result, stats = row.result, row.result.stats
    close_proposers(row.drafts)  # a request it keeps open (suffix decoding's) ends with the row
    if row.done:
        result.stop_reason = "eos"
    stats.tokens = len(result.tokens)
    stats.proposer_s = row.prop_clock.seconds
    return result


# --- the batch -----------------------------------------------------------------------------------


def union_layers(rows: list[_Row]) -> list[int]:
    return sorted({i for row in rows for i in row.layers})


class Batch:
    """Rows decoding together: `admit` prefills new requests into the batch, `step` runs one
    verification forward over every row; both return the (index, result) of rows that finished.
    `drop` takes rows out between steps (a server's cancelled requests)."""

    def __init__(self, target, prompts: PromptCache | None = None):
        self.target = target
        self.rows: list[_Row] = []
        self.cache = None
        self.clock = Clock(target.device)
        self.prompts = prompts  # prefills kept for later requests of the same prompt (eval's methods)

    def admit(self, items: list[tuple[int, Request]]) -> list[tuple[int, DecodeResult]]:
        """Prefill the requests' prompts in one forward of their own, then join the batch."""
        t0 = time.perf_counter()
        rows = [new_row(i, req, self.target.device) for i, req in items]
        live = [row for row in rows if row.req.budget > 0]
        kept = [None if self.prompts is None else self.prompts.get(row.req.ids[0], row.layers) for row in live]
        fresh = [row for row, entry in zip(live, kept) if entry is None]
        reused = [(row, entry) for row, entry in zip(live, kept) if entry is not None]
        if fresh:
            self._prefill(fresh)
        self._share_wall(rows, t0)
        for row, entry in reused:
            self._reuse(row, entry)
        self.rows += fresh + [row for row, _ in reused]
        return [(row.index, finish(row)) for row in rows if row.req.budget <= 0] + self._retire()

    def _prefill(self, rows: list[_Row]) -> None:
        prompts = [row.req.ids[0] for row in rows]  # [P_b] each
        cache = new_cache(self.target)
        layers = sorted(set(union_layers(rows)) | set(() if self.prompts is None else self.prompts.layers))
        before = self.clock.seconds
        with self.clock:
            out = batch_forward(self.target, prompts, [torch.arange(p.numel()) for p in prompts],
                                [torch.ones(p.numel(), p.numel(), dtype=torch.bool).tril() for p in prompts],
                                [0] * len(rows), cache, layers, last_only=True)
        share = (self.clock.seconds - before) / len(rows)
        if self.prompts is not None:
            for b, ids in enumerate(prompts):
                self.prompts.put(ids, cache, b, out, share)
        self.cache = merge_rows(self.cache, cache)
        for b, (row, ids) in enumerate(zip(rows, prompts)):
            row.result.stats.prefill_forwards, row.result.stats.target_prefill_s = 1, share
            start_row(row, ids, row_output(out, b, ids.numel(), row.layers))

    def _reuse(self, row: _Row, entry: Prefilled) -> None:
        """A kept prefill of the row's prompt joins the batch, booked as the prefill it replaces
        (`verify.prompt_cache`: one forward, its seconds, in the row's wall time too)."""
        self.cache = merge_rows(self.cache, entry.fill(new_cache(self.target)))
        stats = row.result.stats
        stats.prefill_forwards, stats.target_prefill_s = 1, entry.seconds
        stats.wall_s += entry.seconds
        start_row(row, row.req.ids[0], entry.output)

    def step(self) -> list[tuple[int, DecodeResult]]:
        """One verification forward: every row proposes, is verified, accepts and emits."""
        if not self.rows:
            return []
        t0 = time.perf_counter()
        plans = propose_all(self.rows, self.target)
        pasts, cache_len = [row.past for row in self.rows], self.cache.get_seq_length()
        before = self.clock.seconds
        with self.clock:
            out = batch_forward(self.target, [p[1] for p in plans], [p[0].depths for p in plans],
                                [p[0].mask for p in plans], pasts, self.cache, union_layers(self.rows))
            decided = [row.req.rule.decide(tree, tokens[None], out.logits[b: b + 1, : tokens.numel()], q)
                       for b, (row, (tree, tokens, q)) in enumerate(zip(self.rows, plans))]  # [1, N_b, V]
            paths = [paths[0] for paths, _ in decided]
            keep_paths(self.cache, pasts, cache_len, paths)
        share = (self.clock.seconds - before) / len(self.rows)
        for b, (row, plan, path, (_, nexts)) in enumerate(zip(self.rows, plans, paths, decided)):
            row.result.stats.target_decode_s += share
            settle(row, b, plan, path, nexts[0], out, share, self.target.device)
        self._share_wall(self.rows, t0)
        return self._retire()

    def _share_wall(self, rows: list[_Row], t0: float) -> None:
        share = (time.perf_counter() - t0) / max(len(rows), 1)
        for row in rows:
            row.result.stats.wall_s += share

    def drop(self, indices: Iterable[int]) -> list[tuple[int, DecodeResult]]:
        """The rows of these request indices leave now, unfinished (a client gone, a failed request):
        their cache rows are released and their proposers closed as a finished row's are, and the
        other rows decode on as if they had never been there. -> their (index, partial result)."""
        gone = set(indices)
        return self._leave([row.index in gone for row in self.rows])

    def _retire(self) -> list[tuple[int, DecodeResult]]:
        """Rows that emitted an eos or their budget leave the batch (and their cache rows)."""
        return self._leave([row.finished for row in self.rows])

    def _leave(self, leaving: list[bool]) -> list[tuple[int, DecodeResult]]:
        """Rows flagged in `leaving` (one flag per row) leave the batch and its cache."""
        if not any(leaving):
            return []
        keep = [b for b, gone in enumerate(leaving) if not gone]
        done = [row for row, gone in zip(self.rows, leaving) if gone]
        if not keep:
            self.cache = None
        else:
            select_rows(self.cache, keep, [self.rows[b].past for b in keep])
        self.rows = [self.rows[b] for b in keep]
        return [(row.index, finish(row)) for row in done]


def check_requests(target, requests: list[Request], batch_size: int) -> None:
    """Refuse a batch the ragged path cannot run, or two requests sharing a stateful proposer."""
    if batch_size < 1:
        raise DecodeError(f"batch_size must be >= 1, got {batch_size}")
    if batch_size > 1 and len(requests) > 1:
        check_batch_attention(target.config)
    drafting = [id(r.proposer) for r in requests
                if r.shape.drafts_with(r.proposer) and r.proposer is not NO_DRAFT]
    if len(set(drafting)) != len(drafting):
        raise DecodeError("two requests share one proposer object: proposers keep per-sequence "
                          "state, give every request its own")


@torch.no_grad()
def decode_batch(target, requests: list[Request], batch_size: int | None = None,
                 kept: PromptCache | None = None) -> list[DecodeResult]:
    """Decode every request with up to `batch_size` (default: all) sequences per target forward;
    a finished sequence's place goes to the next waiting request (`kept`: prefills kept across
    calls, `verify.prompt_cache`). -> results in request order."""
    size = len(requests) if batch_size is None else batch_size
    check_requests(target, requests, size)
    results: list[DecodeResult | None] = [None] * len(requests)
    waiting = list(enumerate(requests))[::-1]  # popped from the end: request order
    batch = Batch(target, kept)
    while waiting or batch.rows:
        room = size - len(batch.rows)
        if room > 0 and waiting:
            done = batch.admit([waiting.pop() for _ in range(min(room, len(waiting)))])
        else:
            done = batch.step()
        for i, result in done:
            results[i] = result
    return results


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
    (rule name, seed, `lossy`). Several prompts: `decode_batch` of `request`s.
    """
    req = request(target, proposer, prompt_ids, max_new_tokens, k, eos_token_ids, rule=rule,
                  temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, epsilon=epsilon,
                  delta=delta)
    return decode_batch(target, [req])[0]


def greedy_decode(target, prompt_ids, max_new_tokens: int,
                  eos_token_ids: Iterable[int] = ()) -> DecodeResult:
    """Plain greedy decoding with a KV cache: one target forward per new token (the reference)."""
    return decode(target, NO_DRAFT, prompt_ids, max_new_tokens, 0, eos_token_ids)


def run_loop(target, proposer, prompt_ids: torch.Tensor, max_new_tokens: int, rule: AcceptRule,
             shape: ChainShape | TreeShape, eos_token_ids: Iterable[int] = ()) -> list[DecodeResult]:
    """prompt_ids [1, P] with an explicit rule and shape -> [its result] (one sequence)."""
    return decode_batch(target, [make_request(target, proposer, prompt_ids, max_new_tokens, rule,
                                              shape, eos_token_ids)])
