"""Hybrid drafts: a model drafter (EAGLE-3, DFlash, DSpark, ...) beside a training-free one (suffix
decoding, prompt lookup), so a request is never drafted worse than by prompt lookup alone.

Two ways to combine them:

* choose (`HybridProposer`, a chain proposer): every step both draft, and the draft with the
  larger expected accepted length is verified. The baseline rule is ArcticInference's: the free
  draft wins when its score >= the model draft's length (a model draft counted as if fully
  accepted). Suffix drafts score themselves (`SuffixProposer.score`); prompt lookup gets an
  online estimate (`AcceptanceMeter`). Rule "measured" prices the model draft with the same
  estimate instead of its length.
* union (`UnionProposer`, a `protocols.TreeProposer`): both drafts in one verification tree, a
  trie under the root (shared prefixes merged), verified by the tree verifier.

Both inner proposers are advanced with every accepted step, whichever draft was used: the
`Proposer` protocol drops whatever `propose` built before `accept`, so an unused draft leaves no
state behind. `counts` records per step which draft was verified (choose) or accepted (union).
A choose or union step splits around the model's chain (`protocols.SplitProposer`), so rows whose
models share a drafter head draft in one draft group (`verify.loop`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from specheads.protocols import DraftAsk, GroupedProposer, SampledProposer, TreeProposer, close_proposers
from specheads.verify.draft_asks import split_step
from specheads.verify.sampling import point_mass
from specheads.verify.trees import SettingsError, Tree, chain_tree, tree_from_parents

RULES = ("arctic", "measured")  # choose mode: how the model draft is priced


# --- expected accepted length ---------------------------------------------------------------------


@dataclass
class AcceptanceMeter:
    """Online per-token acceptance rate a of one proposer's drafts (Beta prior), and the expected
    accepted length of an n-token draft under it: a + a^2 + .. + a^n (token i needs all before it)."""

    prior: float = 0.5  # a before any evidence
    weight: float = 2.0  # pseudo-tokens behind the prior
    tried: int = 0  # draft tokens the target settled a token for (all earlier ones matched)
    hits: int = 0  # of those, the ones equal to the settled token

    @property
    def rate(self) -> float:
        return (self.hits + self.prior * self.weight) / (self.tried + self.weight)

    def expected(self, n: int) -> float:
        a = self.rate
        return float(n) if a >= 1.0 else a * (1.0 - a ** n) / (1.0 - a)

    def record(self, draft: list[int], emitted: list[int]) -> None:
        """Compare a draft with the tokens the target settled after the same root (censored at
        their length): exact for greedy; for sampling, P(match) = p(d) = a point mass's acceptance."""
        for d, e in zip(draft, emitted):
            self.tried += 1
            if d != e:
                return
            self.hits += 1


def as_ids(tokens) -> list[int]:
    """A draft (tensor [n] on any device, or list) -> token ids."""
    return [int(t) for t in torch.as_tensor(tokens).reshape(-1).tolist()]


def check_chain(proposer, role: str) -> None:
    """Choose mode verifies one chain: both inner proposers must draft chains."""
    if isinstance(proposer, TreeProposer) or not hasattr(proposer, "propose"):
        raise SettingsError(f"the {role} proposer of a choose-mode hybrid must draft chains (propose(k)), got "
                            f"{type(proposer).__name__}: use its chain proposer, or mode 'union' for trees")


def merged_layers(*proposers) -> list[int]:
    """Target layers any inner proposer reads (the loop hands every one of them to both)."""
    return sorted({int(i) for p in proposers for i in getattr(p, "layers", ())})


# --- choose ---------------------------------------------------------------------------------------


class HybridProposer:
    """Choose mode: both draft a chain each step; the one with the larger expected accepted length is
    verified (`rule`: "arctic" prices the model draft at its length, "measured" at its estimate).

    `model_k` / `free_k` cap each draft below the loop's k (None: k), so `decode(k=8)` with
    `model_k=3` lets a suffix draft run longer than the model's, as in ArcticInference.
    """

    def __init__(self, model, free, rule: str = "arctic", model_k: int | None = None,
                 free_k: int | None = None):
        check_chain(model, "model")
        check_chain(free, "free")
        if rule not in RULES:
            raise SettingsError(f"unknown hybrid rule '{rule}': use one of {RULES}")
        self.model, self.free, self.rule = model, free, rule
        self.model_k, self.free_k = model_k, free_k
        self.layers = merged_layers(model, free)
        self.meters = {"model": AcceptanceMeter(), "free": AcceptanceMeter()}
        self.counts: Counter = Counter()  # steps verified with: "model" | "free" | "none"
        self.accepted: Counter = Counter()  # draft tokens accepted, by the draft that was verified
        self.chosen = "none"  # this step's verified draft
        self.levels = self.model_steps = 0  # model draft tokens made, steps the model drafted in
        self.drafts: dict[str, list[int]] = {"model": [], "free": []}  # this step's two drafts
        self.free_score = self.model_score = 0.0
        self.free_now: list[int] = []  # this step's free draft, before the model drafts
        self.sampled = False  # this step's drafts are sampled (q returned)

    def start(self, prompt_ids: torch.Tensor, first_token: int, out) -> None:
        self.model.start(prompt_ids, first_token, out)
        self.free.start(prompt_ids, first_token, out)

    def close(self) -> None:
        close_proposers(self.model, self.free)

    def cap(self, k: int, own: int | None) -> int:
        return k if own is None else min(k, own)

    def score_free(self, draft: list[int]) -> float:
        """Expected accepted tokens of the free draft: its own score if it keeps one, else measured."""
        if not draft:
            return 0.0
        score = getattr(self.free, "score", None)
        return float(score) if score is not None else self.meters["free"].expected(len(draft))

    def score_model(self, n: int) -> float:
        return float(n) if self.rule == "arctic" else self.meters["model"].expected(n)

    def choose(self, model_n: int, free: list[int]) -> str:
        """Which draft to verify; reads the model draft's length only, never its tokens (a sampled
        model draft stays distributed as its q, see `SampledHybridProposer`)."""
        self.free_score, self.model_score = self.score_free(free), self.score_model(model_n)
        if free and self.free_score >= self.model_score:
            return "free"
        return "model" if model_n else "none"

    def record(self, model: list[int], free: list[int]) -> str:
        self.drafts = {"model": model, "free": free}
        self.levels += len(model)
        self.model_steps += bool(model)
        self.chosen = self.choose(len(model), free)
        self.counts[self.chosen] += 1
        return self.chosen

    def begin_step(self, k: int, sampler) -> DraftAsk:
        """Before the model drafts (`protocols.SplitProposer`): the free draft; the model is asked
        for its chain (top-1 when sampler is None, `propose`; else sampled, `propose_sampled`)."""
        self.free_now, self.sampled = as_ids(self.free.propose(self.cap(k, self.free_k))), sampler is not None
        return DraftAsk(self.cap(k, self.model_k), sampler)

    def end_step(self, tokens: torch.Tensor, q: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """After the model drafted tokens [n] (q [n, V]): the chosen draft, as `propose` ((ids, None))
        or `propose_sampled` returns it (the free draft with a point mass q)."""
        chosen = self.record(as_ids(tokens), self.free_now)
        if not self.sampled:
            return torch.tensor(self.drafts.get(chosen, []), dtype=torch.long), None
        if chosen != "free":
            return tokens, q
        return torch.tensor(self.free_now, dtype=torch.long), point_mass(torch.tensor(self.free_now), q.shape[-1], q.dtype)

    def group_drafter(self):
        """The model's drafter for a draft group (`protocols.GroupedProposer`), None if it has none."""
        return self.model.group_drafter() if isinstance(self.model, GroupedProposer) else None

    @torch.no_grad()
    def propose(self, k: int) -> torch.Tensor:
        """The chosen draft [<= k] (target ids)."""
        return split_step(self, self.model, k, None)[0]

    @torch.no_grad()
    def accept(self, inputs: torch.Tensor, following: torch.Tensor, out, start: int) -> None:
        """Advance both with the verified step (inputs [n]: root + accepted drafts), score both drafts."""
        self.model.accept(inputs, following, out, start)
        self.free.accept(inputs, following, out, start)
        emitted = as_ids(following)
        for name, draft in self.drafts.items():
            self.meters[name].record(draft, emitted)
        if self.chosen != "none":
            self.accepted[self.chosen] += inputs.numel() - 1
        self.drafts, self.chosen = {"model": [], "free": []}, "none"

    def summary(self) -> dict:
        """What eval reports: steps per verified draft, accepted tokens per draft, the meters' rates."""
        return {"mode": "choose", "rule": self.rule, "steps": dict(self.counts),
                "accepted": dict(self.accepted), "levels": self.levels, "model_steps": self.model_steps,
                "rates": {n: round(m.rate, 4) for n, m in self.meters.items()}}


class SampledHybridProposer(HybridProposer):
    """Choose mode for a sampled model proposer: the model draft d ~ q with its q, or the free draft
    with a point mass q. The choice reads the free draft (a function of the verified context) and the
    model draft's length (fixed by k for every kind's sampled proposer), never the sampled tokens, so
    the verified draft is distributed as the q handed to the rule and Leviathan's rule stays exact."""

    def __init__(self, model, free, rule: str = "arctic", model_k: int | None = None,
                 free_k: int | None = None):
        if not isinstance(model, SampledProposer):
            raise SettingsError(f"{type(model).__name__} does not sample its drafts: use HybridProposer "
                                "(its top-1 drafts are verified as point masses)")
        super().__init__(model, free, rule, model_k, free_k)

    @torch.no_grad()
    def propose_sampled(self, k: int, warper, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen draft [n] and its q [n, V]."""
        return split_step(self, self.model, k, (warper, gen))


# --- union ----------------------------------------------------------------------------------------


def draft_part(proposer, k: int | None) -> tuple[Tree, list[int]]:
    """One proposer's draft as a tree: its own tree, or its chain of <= k as a path."""
    if isinstance(proposer, TreeProposer):
        tree, tokens = proposer.propose_tree()
        return tree, as_ids(tokens)
    tokens = as_ids(proposer.propose(k))
    return chain_tree(len(tokens)), tokens


@dataclass
class Trie:
    """Draft trees merged under one root: a node per distinct token path, in insertion order
    (topological); `origin[i]` is the set of parts whose draft holds node i."""

    parents: list[int]
    tokens: list[int]  # node tokens; node 0 (the root) holds -1
    origin: list[set]

    @classmethod
    def empty(cls) -> Trie:
        return cls([-1], [-1], [set()])

    def child(self, node: int, token: int) -> int | None:
        return next((c for c in range(node + 1, len(self.parents))
                     if self.parents[c] == node and self.tokens[c] == token), None)

    def add(self, tree: Tree, tokens: list[int], name: str) -> None:
        """Insert a part's tree (tokens of its nodes 1..N-1), merging nodes on a shared token path."""
        where = [0]  # part node -> trie node
        for v, parent in enumerate(tree.parents.tolist()[1:], start=1):
            at, token = where[parent], tokens[v - 1]
            node = self.child(at, token)
            if node is None:
                self.parents.append(at)
                self.tokens.append(token)
                self.origin.append(set())
                node = len(self.parents) - 1
            self.origin[node].add(name)
            where.append(node)

    def walk(self, tokens: list[int]) -> int:
        """The node reached by following tokens (the accepted drafts) from the root."""
        node = 0
        for t in tokens:
            node = self.child(node, t)
        return node

    def tree(self) -> tuple[Tree, torch.Tensor]:
        return tree_from_parents(self.parents), torch.tensor(self.tokens[1:], dtype=torch.long)


def union_tree(parts: list[tuple[str, Tree, list[int]]]) -> Trie:
    """(name, tree, tokens) drafts -> their trie (siblings hold distinct tokens)."""
    trie = Trie.empty()
    for name, tree, tokens in parts:
        trie.add(tree, tokens, name)
    return trie


class UnionProposer:
    """Union mode: the model's draft and the free draft (chains of <= k / free_k, or their own
    trees) in one tree, shared prefixes merged; greedy and point-mass verification stay lossless.

    A sampled model proposer drafts its top-1 chain here: the tree rules verify deterministic drafts
    (point masses), and a q mixed with point masses in one tree has no exact tree rule."""

    def __init__(self, model, free, k: int, free_k: int | None = None):
        for proposer, role in ((model, "model"), (free, "free")):
            if not isinstance(proposer, TreeProposer) and not hasattr(proposer, "propose"):
                raise SettingsError(f"the {role} proposer drafts neither chains nor trees: {type(proposer).__name__}")
        if k < 0:
            raise SettingsError(f"the union's model draft length k must be >= 0, got {k}")
        self.model, self.free, self.k = model, free, k
        self.free_k = k if free_k is None else free_k
        self.layers = merged_layers(model, free)
        self.trie = Trie.empty()
        self.free_part: tuple[Tree, list[int]] = (chain_tree(0), [])  # this step's free draft
        self.counts: Counter = Counter()  # steps whose deepest accepted node was: "model" | "free" | "both" | "none"
        self.accepted = 0
        self.levels = self.model_steps = 0  # model draft levels run, steps the model drafted in

    def start(self, prompt_ids: torch.Tensor, first_token: int, out) -> None:
        self.model.start(prompt_ids, first_token, out)
        self.free.start(prompt_ids, first_token, out)

    def close(self) -> None:
        close_proposers(self.model, self.free)

    @torch.no_grad()
    def propose_tree(self) -> tuple[Tree, torch.Tensor]:
        """The merged tree and the tokens of its nodes 1..N-1 [N-1] (the model's draft first)."""
        if isinstance(self.model, TreeProposer):
            self.free_part = draft_part(self.free, self.free_k)
            return self.merge(*draft_part(self.model, self.k))
        return split_step(self, self.model, self.k, None)

    def begin_step(self, k: int, sampler) -> DraftAsk:
        """Before a chain model drafts (`protocols.SplitProposer`): the free part; the model is asked
        for its top-1 chain of <= self.k (the loop's k and sampler do not apply to trees)."""
        self.free_part = draft_part(self.free, self.free_k)
        return DraftAsk(self.k)

    def end_step(self, tokens: torch.Tensor, q=None) -> tuple[Tree, torch.Tensor]:
        """After the model drafted its chain tokens [n]: the merged tree and its node tokens [N-1]."""
        return self.merge(chain_tree(tokens.numel()), as_ids(tokens))

    def merge(self, model_tree: Tree, model_tokens: list[int]) -> tuple[Tree, torch.Tensor]:
        """The model's part and this step's free part in one trie -> (tree, node tokens [N-1])."""
        self.levels += model_tree.max_depth
        self.model_steps += bool(model_tokens)
        self.trie = union_tree([("model", model_tree, model_tokens), ("free", *self.free_part)])
        return self.trie.tree()

    def group_drafter(self):
        """A chain model's drafter for a draft group (`protocols.GroupedProposer`), else None."""
        chain = isinstance(self.model, GroupedProposer) and not isinstance(self.model, TreeProposer)
        return self.model.group_drafter() if chain else None

    @torch.no_grad()
    def accept(self, inputs: torch.Tensor, following: torch.Tensor, out, start: int) -> None:
        """Both advance with the accepted path's rows (root first); the step is credited to the
        part(s) holding its deepest accepted node."""
        self.model.accept(inputs, following, out, start)
        self.free.accept(inputs, following, out, start)
        drafts = as_ids(inputs)[1:]
        origin = self.trie.origin[self.trie.walk(drafts)] if drafts else set()
        self.counts["both" if len(origin) > 1 else next(iter(origin), "none")] += 1
        self.accepted += len(drafts)

    def summary(self) -> dict:
        return {"mode": "union", "steps": dict(self.counts), "accepted": self.accepted, "levels": self.levels,
                "model_steps": self.model_steps}


def hybrid_proposer(model, free, mode: str = "choose", k: int = 3, rule: str = "arctic",
                    model_k: int | None = None, free_k: int | None = None):
    """The hybrid for a mode: "choose" (sampled when the model samples its drafts) or "union"."""
    if mode == "union":
        return UnionProposer(model, free, k if model_k is None else model_k, free_k)
    if mode != "choose":
        raise SettingsError(f"unknown hybrid mode '{mode}': use 'choose' or 'union'")
    cls = SampledHybridProposer if isinstance(model, SampledProposer) else HybridProposer
    return cls(model, free, rule, model_k, free_k)
