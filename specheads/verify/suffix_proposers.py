"""Suffix decoding (arXiv 2411.04975): training-free drafts from suffix trees over the prompt, the
request's own output and a bounded global cache of earlier outputs, scored by how often each
continuation followed. The trees are arctic-inference's `SuffixDecodingCache`, the library behind
vLLM 0.33's `method: suffix`, called the way vLLM calls it (the last `max_tree_depth` tokens as
context, the accepted tokens fed back), so our drafts are the engine's drafts.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from specheads.engine_facts import VLLM_SUFFIX_DEFAULTS
from specheads.verify.trees import SettingsError, Tree, tree_from_parents

INSTALL_HINT = ("suffix decoding needs arctic-inference 0.3.0 (the suffix tree vLLM's `method: suffix` uses): "
                "run `make suffix` (builds it into the project venv, ~1 min), or drop the suffix proposer")


def new_suffix_cache(max_tree_depth: int, max_cached_requests: int):
    """A SuffixDecodingCache, or a SettingsError saying how to install the library."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError as err:
        raise SettingsError(f"{INSTALL_HINT} ({err})") from None
    return SuffixDecodingCache(max_tree_depth=max_tree_depth, max_cached_requests=max_cached_requests)


@dataclass(frozen=True)
class SuffixSettings:
    """vLLM's `suffix_decoding_*` settings, with its defaults (engine_facts.VLLM_SUFFIX_DEFAULTS)."""

    max_tree_depth: int = VLLM_SUFFIX_DEFAULTS["max_tree_depth"]
    max_cached_requests: int = VLLM_SUFFIX_DEFAULTS["max_cached_requests"]
    max_spec_factor: float = VLLM_SUFFIX_DEFAULTS["max_spec_factor"]
    min_token_prob: float = VLLM_SUFFIX_DEFAULTS["min_token_prob"]
    tree_tokens: int = 24  # the most draft nodes of a tree proposal (`propose_tree`)


class PathReliability:
    """How often suffix decoding's drafts really survive, per bin of the cumulative path probability
    the library reports for them, learnt online from every settled draft token of every request
    (two counters a bin: fixed memory). The library's probabilities are frequencies in the cache and
    can run optimistic (bench/suffix_replay.py reports the table on real answers). Each bin starts at
    the reported value, worth `prior` settled tokens, and moves to the measured rate."""

    def __init__(self, bins: int = 20, prior: float = 20.0):
        self.bins, self.prior = bins, prior
        self.shown = [0] * bins  # settled draft tokens reported in each bin
        self.kept = [0] * bins  # of those, the ones that survived (all earlier ones too)

    def _bin(self, p: float) -> int:
        return min(max(int(p * self.bins), 0), self.bins - 1)

    def record(self, probs: list[float], draft: list[int], settled: list[int]) -> None:
        """Draft tokens against the tokens the target settled after the same root: a token is settled
        when it was compared (before the first miss, within `settled`) or follows a miss (lost)."""
        for j, (p, d) in enumerate(zip(probs, draft)):
            if j >= len(settled):
                return  # censored: the target settled no token here
            b = self._bin(p)
            self.shown[b] += 1
            if d != settled[j]:
                for q in probs[j + 1:len(draft)]:  # every later token of the path is lost with it
                    self.shown[self._bin(q)] += 1
                return
            self.kept[b] += 1

    def __call__(self, p: float) -> float:
        b = self._bin(p)
        return (self.kept[b] + self.prior * p) / (self.shown[b] + self.prior)

    def survival(self, probs: list[float]) -> list[float]:
        """S_j of a path from its reported cumulative probabilities, calibrated and non-increasing."""
        out, s = [], 1.0
        for p in probs:
            s = min(s, self(min(max(float(p), 0.0), 1.0)))
            out.append(s)
        return out


class SuffixProposer:
    """Suffix-tree drafts for one request at a time; the global cache lives as long as the proposer,
    so each finished request's output helps the next (as in a vLLM server), and so does the
    reliability of its path probabilities (`PathReliability`, read by adaptive draft length)."""

    layers: list[int] = []  # reads no target states

    def __init__(self, settings: SuffixSettings | None = None, shared: SuffixProposer | None = None):
        self.settings = shared.settings if shared is not None else settings or SuffixSettings()
        if shared is None:
            self.cache = new_suffix_cache(self.settings.max_tree_depth, self.settings.max_cached_requests)
            self._ids = itertools.count()
            self.reliability = PathReliability()
        else:  # a view: the same global cache, request numbering and reliability, its own request
            self.cache, self._ids, self.reliability = shared.cache, shared._ids, shared.reliability
        self.request: int | None = None
        self.context: list[int] = []
        self.score = 0.0  # the last draft's expected accepted tokens (sum of its probabilities)
        self.probs: list[float] = []  # the last draft's cumulative path probability per token
        self.drafted: list[int] = []  # the last path draft's tokens, until the target settles them

    def fork(self) -> SuffixProposer:
        """A proposer for one more concurrent request over the same global cache (a batch row)."""
        return type(self)(shared=self)

    def warm(self, history: list[tuple[list[int], list[int]]]) -> None:
        """Put earlier (prompt, answer) pairs in the global cache, as finished requests (the library
        keeps the newest `max_cached_requests`)."""
        for prompt, answer in history:
            request = next(self._ids)
            self.cache.start_request(request, list(prompt))
            self.cache.add_active_response(request, list(answer))
            self.cache.stop_request(request)

    def start(self, prompt_ids: torch.Tensor, first_token: int, out=None) -> None:
        self.close()
        self.request = next(self._ids)
        prompt = [int(t) for t in prompt_ids.reshape(-1).tolist()]
        self.cache.start_request(self.request, prompt)
        self.context = prompt
        self._extend([int(first_token)])

    def _extend(self, tokens: list[int]) -> None:
        self.cache.add_active_response(self.request, tokens)
        self.context.extend(tokens)

    def _speculate(self, max_tokens: int, tree: bool):
        s = self.settings
        draft = self.cache.speculate(self.request, self.context[-s.max_tree_depth:], max_spec_tokens=int(max_tokens),
                                     max_spec_factor=s.max_spec_factor, min_token_prob=s.min_token_prob,
                                     use_tree_spec=tree)
        self.score = float(draft.score)
        self.probs = [float(p) for p in draft.probs]
        return draft

    def propose(self, k: int) -> torch.Tensor:
        """Up to k draft tokens [<= k] along the best-scored suffix path (vLLM's path mode)."""
        if k < 1:
            self.drafted = []
            return torch.empty(0, dtype=torch.long)
        self.drafted = [int(t) for t in self._speculate(k, tree=False).token_ids]
        return torch.tensor(self.drafted, dtype=torch.long)

    def survival(self, n: int) -> list[float]:
        """Calibrated S_1..S_n of the last path draft (its first n tokens)."""
        return self.reliability.survival(self.probs[:n])

    def accept(self, inputs, following: torch.Tensor, out=None, start: int = 0) -> None:
        settled = [int(t) for t in following.reshape(-1).tolist()]
        if self.drafted:
            self.reliability.record(self.probs, self.drafted, settled)
            self.drafted = []
        self._extend(settled)

    def close(self) -> None:
        """End the current request: its output stays in the global cache for later requests."""
        if self.request is not None and self.request in self.cache.active_requests:
            self.cache.stop_request(self.request)
        self.request = None


class SuffixTreeProposer(SuffixProposer):
    """Suffix decoding's draft trees (the library's tree mode), verified by our tree verifier."""

    def propose_tree(self) -> tuple[Tree, torch.Tensor]:
        """A frequency-scored draft tree of up to `tree_tokens` nodes under the last token:
        (tree, the draft nodes' tokens [N - 1]); node 0 is the last emitted token."""
        draft = self._speculate(self.settings.tree_tokens, tree=True)
        parents = [-1] + [p + 1 for p in draft.parents]  # library: -1 = child of the last token
        return tree_from_parents(parents), torch.tensor(draft.token_ids, dtype=torch.long)
