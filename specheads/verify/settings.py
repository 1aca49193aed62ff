"""Speculation settings shared by `specheads generate`, `eval`, `serve` and bench/verifier.py:
the draft shape (a chain of k, an EAGLE-2 dynamic tree, a static Medusa-style choice list), the
proposer each needs, and which decode loop (greedy or sampling, chain or tree) runs it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specheads.verify import dspark_proposers
from specheads.verify import dflash_proposers, eagle1_proposers, eagle3_proposers, medusa_proposers, mtp_proposers
from specheads.verify.decode import as_batch
from specheads.verify.loop import ChainShape, TreeShape, decode
from specheads.verify.rules import GreedyRule, sampled_rule
from specheads.verify.trees import SettingsError, normalize_choices

# --- tree settings -------------------------------------------------------------------------------


@dataclass(frozen=True)
class TreeSpec:
    """How drafts are shaped: a chain of k, an EAGLE-2 dynamic tree, or a static choice list."""

    kind: str  # "chain" | "eagle2" | "static"
    k: int | None = None  # chain length (None: the export's num_speculative_tokens)
    depth: int = 5  # EAGLE-2 expansion levels after the first
    top_k: int = 8  # EAGLE-2 branching / frontier width
    total_tokens: int = 48  # EAGLE-2 verified nodes, root included
    choices: tuple[tuple[int, ...], ...] = ()  # static tree: Medusa-style rank paths
    source: str | None = None  # the file a static tree came from

    def nodes(self) -> int:
        """Tokens the target verifies per step, root included (the tree's size at most)."""
        if self.kind == "chain":
            return (self.k or 0) + 1
        if self.kind == "eagle2":
            return self.total_tokens
        return len(self.choices) + 1

    def levels(self) -> int:
        """Draft depth: the longest run of drafts one step can accept."""
        if self.kind == "chain":
            return self.k or 0
        if self.kind == "eagle2":
            return self.depth + 1
        return max(len(c) for c in self.choices)

    def describe(self) -> dict:
        """The settings as plain JSON (recorded in metrics.json and verifier.json)."""
        if self.kind == "chain":
            return {"kind": "chain", "k": self.k, "nodes": self.nodes()}
        if self.kind == "eagle2":
            return {"kind": "eagle2", "depth": self.depth, "top_k": self.top_k,
                    "total_tokens": self.total_tokens, "nodes": self.nodes()}
        return {"kind": "static", "file": self.source, "nodes": self.nodes(),
                "depth": self.levels(), "choices": [list(c) for c in self.choices]}

    def label(self) -> str:
        """A short human name, e.g. `chain k=3`, `eagle2 d=5 k=8 n=48`, `static n=14`."""
        if self.kind == "chain":
            return f"chain k={self.k}"
        if self.kind == "eagle2":
            return f"eagle2 d={self.depth} k={self.top_k} n={self.total_tokens}"
        return f"static n={self.nodes()}"


def read_tree_file(path: str | Path) -> tuple[tuple[int, ...], ...]:
    """A JSON list of rank paths (or {"choices": [...]}) -> normalised choices; clear errors."""
    path = Path(path)
    if not path.is_file():
        raise SettingsError(f"--tree '{path}': expected 'chain', 'eagle2' or a JSON file of rank "
                            "paths such as [[0], [1], [0, 0]]; no such file")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SettingsError(f"--tree '{path}': not a readable JSON file ({err})") from None
    if isinstance(obj, dict):
        obj = obj.get("choices")
    ok = isinstance(obj, list) and obj and all(
        isinstance(c, list) and all(isinstance(r, int) and not isinstance(r, bool) for r in c)
        for c in obj)
    if not ok:
        raise SettingsError(f"--tree '{path}': expected a non-empty JSON list of rank paths (lists "
                            "of integers), e.g. [[0], [1], [0, 0]]")
    return normalize_choices(obj)


def make_tree_spec(tree: str = "chain", k: int | None = None, depth: int = 5, top_k: int = 8,
                   total_tokens: int = 48) -> TreeSpec:
    """`--tree` value + sizes -> a validated TreeSpec."""
    if k is not None and k < 1:
        raise SettingsError(f"--k must be >= 1, got {k}")
    if tree == "chain":
        return TreeSpec("chain", k=k)
    if tree == "eagle2":
        if depth < 0 or top_k < 1 or total_tokens < 2:
            raise SettingsError(f"an EAGLE-2 tree needs --depth >= 0, --top-k >= 1 and "
                                f"--total-tokens >= 2; got {depth}, {top_k}, {total_tokens}")
        return TreeSpec("eagle2", depth=depth, top_k=top_k, total_tokens=total_tokens)
    return TreeSpec("static", choices=read_tree_file(tree), source=str(tree))


def with_default_k(spec: TreeSpec, meta, head) -> TreeSpec:
    """Fill a chain's missing k from the export (num_speculative_tokens, else the TTT steps)."""
    if spec.kind != "chain" or spec.k is not None:
        return spec
    k = getattr(meta, "num_speculative_tokens", None) or head.config.ttt_steps
    return TreeSpec("chain", k=int(k))


def check_tree_fits(spec: TreeSpec, target) -> None:
    """Refuse a tree that cannot be verified in one forward within the target's context."""
    ctx = getattr(target.config, "max_position_embeddings", None)
    if ctx is not None and spec.nodes() >= ctx:
        raise SettingsError(f"the draft tree ({spec.label()}) verifies {spec.nodes()} tokens per "
                            f"step but the target's context is {ctx}: use a smaller tree")


# head kind -> proposer module (`protocols.ProposerModule`); kinds must match heads.HEADS
PROPOSERS = {
    "eagle3": eagle3_proposers,
    "medusa": medusa_proposers,
    "medusa2": medusa_proposers,
    "eagle": eagle1_proposers,
    "mtp": mtp_proposers,
    "draft": mtp_proposers,
    "dflash": dflash_proposers,
    "dspark": dspark_proposers,
}


def proposer_module(kind: str):
    """The proposer module of a head kind, or an error listing the kinds that have one."""
    if kind not in PROPOSERS:
        raise SettingsError(f"head kind '{kind}' has no proposer; kinds with one: {', '.join(PROPOSERS)}")
    return PROPOSERS[kind]


def make_proposer(spec: TreeSpec, head, target, sampled: bool = False):
    """The proposer for a spec and a head, from its kind's module (drafts sampled from q when
    `sampled` and the kind supports it)."""
    return proposer_module(head.kind).make_proposer(spec, head, target, sampled)


def loop_shape(spec: TreeSpec | None) -> ChainShape | TreeShape:
    """The decode loop's draft shape for a spec (None: no drafts, a chain of 0)."""
    if spec is None:
        return ChainShape(0)
    return ChainShape(spec.k) if spec.kind == "chain" else TreeShape()


def speculative_decode(spec: TreeSpec, target, proposer, ids, max_new_tokens: int, eos):
    """Greedy speculative decoding with the spec's draft shape (chain or tree) -> DecodeResult."""
    return decode(target, proposer, as_batch(ids), max_new_tokens, GreedyRule(), loop_shape(spec),
                  eos)[0]


@dataclass(frozen=True)
class Sampling:
    """Temperature > 0 samples (top-p nucleus, seeded); temperature 0 is greedy decoding.

    `acceptance` "exact" keeps the target's distribution (lossless); "typical" is Medusa's
    typical acceptance with thresholds min(epsilon, delta * exp(-H(p))), which is LOSSY.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    acceptance: str = "exact"  # "exact" | "typical"
    epsilon: float = 0.09  # typical: hard probability threshold
    delta: float = 0.3  # typical: entropy-scaled threshold factor

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def lossless(self) -> bool:
        return self.acceptance == "exact"

    def describe(self) -> dict:
        """Plain JSON for metrics.json; the typical thresholds only when they apply."""
        d = {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed}
        if not self.lossless:
            d.update(acceptance=self.acceptance, epsilon=self.epsilon, delta=self.delta)
        return d

    def label(self) -> str:
        base = f"temperature {self.temperature:g}, top-p {self.top_p:g}, seed {self.seed}"
        if self.lossless:
            return base
        return f"{base}, typical acceptance eps={self.epsilon:g} delta={self.delta:g} (LOSSY)"


def check_acceptance(sampling: Sampling) -> None:
    """Refuse typical acceptance where it means nothing (greedy) or its thresholds are invalid."""
    if sampling.acceptance not in ("exact", "typical"):
        raise SettingsError(f"--acceptance must be 'exact' or 'typical', got '{sampling.acceptance}'")
    if sampling.lossless:
        return
    if sampling.greedy:
        raise SettingsError("--acceptance typical needs --temperature > 0: at temperature 0 it "
                            "reduces to exact greedy verification (drop --acceptance)")
    if not 0 < sampling.epsilon <= 1 or sampling.delta <= 0:
        raise SettingsError(f"typical acceptance needs 0 < --typical-epsilon <= 1 and "
                            f"--typical-delta > 0; got {sampling.epsilon}, {sampling.delta}")


def sampled_decode(spec: TreeSpec | None, target, proposer, ids, max_new_tokens: int, eos,
                   sampling: Sampling):
    """Speculative sampling with the spec's draft shape and the sampling's acceptance rule
    (exact: Leviathan for chains, point mass for trees, lossless; typical: LOSSY); `spec` None
    samples plainly."""
    shape = loop_shape(spec)
    exact = "leviathan" if isinstance(shape, ChainShape) else "pointmass"
    name = exact if sampling.lossless or spec is None else "typical"  # no drafts: plain sampling
    rule = sampled_rule(name, target.device,
                        sampling.temperature, sampling.top_p, 0, sampling.seed, sampling.epsilon,
                        sampling.delta)
    return decode(target, proposer if spec is not None else None, as_batch(ids), max_new_tokens,
                  rule, shape, eos)[0]
