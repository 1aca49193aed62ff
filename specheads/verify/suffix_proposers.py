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


class SuffixProposer:
    """Suffix-tree drafts for one request at a time; the global cache lives as long as the proposer,
    so each finished request's output helps the next (as in a vLLM server)."""

    layers: list[int] = []  # reads no target states

    def __init__(self, settings: SuffixSettings | None = None, shared: SuffixProposer | None = None):
        self.settings = shared.settings if shared is not None else settings or SuffixSettings()
        if shared is None:
            self.cache = new_suffix_cache(self.settings.max_tree_depth, self.settings.max_cached_requests)
            self._ids = itertools.count()
        else:  # a view: the same global cache and request numbering, its own request
            self.cache, self._ids = shared.cache, shared._ids
        self.request: int | None = None
        self.context: list[int] = []
        self.score = 0.0  # the last draft's expected accepted tokens (sum of its probabilities)
        self.probs: list[float] = []  # the last draft's cumulative path probability per token

    def fork(self) -> SuffixProposer:
        """A proposer for one more concurrent request over the same global cache (a batch row)."""
        return type(self)(shared=self)

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
            return torch.empty(0, dtype=torch.long)
        return torch.tensor(self._speculate(k, tree=False).token_ids, dtype=torch.long)

    def accept(self, inputs, following: torch.Tensor, out=None, start: int = 0) -> None:
        self._extend([int(t) for t in following.reshape(-1).tolist()])

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
