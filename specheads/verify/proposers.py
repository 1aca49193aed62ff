"""Draft proposers for the chain loop in `verify.decode`: a trained EAGLE-3 head and prompt lookup.

A proposer sees what the target has verified and proposes the next tokens:

* `start(prompt_ids [P], first_token, out)`: the target prefilled the prompt (positions 0..P-1,
  `out` = that forward, hidden states at `layers`) and emitted `first_token`.
* `propose(k) -> ids [<= k]`: draft tokens (target vocabulary) continuing the sequence; fewer or
  none is allowed (the step then verifies only what was proposed, a plain decode step for none).
* `accept(inputs [n], following [n], out, start)`: the verification forward fed `inputs` at
  positions start..start+n-1 and greedy acceptance settled the token after each of them
  (`following`: the accepted drafts, then the bonus token). Rows 0..n-1 of `out` belong to
  `inputs`; later rows (rejected drafts) must be ignored.

Any speculative state built by `propose` is dropped before `accept` extends the verified state.
"""

from __future__ import annotations

from typing import Protocol

import torch
from transformers import DynamicCache

from specheads.target import TargetError, TargetOutput
from specheads.verify.decode import causal_mask, positions, trim_cache


class Proposer(Protocol):
    layers: list[int]  # target hidden-state indices needed in every `out` given to the proposer

    def start(self, prompt_ids: torch.Tensor, first_token: int, out: TargetOutput) -> None: ...

    def propose(self, k: int) -> torch.Tensor: ...

    def accept(self, inputs: torch.Tensor, following: torch.Tensor, out: TargetOutput,
               start: int) -> None: ...


# --- EAGLE-3 ---------------------------------------------------------------------------------


def check_head_fits(head, target) -> None:
    """Refuse a head whose vocabulary / width / taps do not match the target it is run with."""
    cfg = head.config
    problems = []
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {cfg.vocab_size} vs the target's {target.vocab_size}")
    if cfg.target_hidden_size != target.hidden_size:
        problems.append(f"target_hidden_size {cfg.target_hidden_size} vs the target's {target.hidden_size}")
    bad_taps = [a for a in head.required_layers() if not 0 < a < target.num_layers]
    if bad_taps:
        problems.append(f"aux layers {bad_taps} outside 1..{target.num_layers - 1}")
    if problems:
        raise TargetError("the EAGLE-3 head does not fit this target: " + "; ".join(problems))


class Eagle3Proposer:
    """Chain drafts from an EAGLE-3 head (docs/algorithms.md §5, inference alignment).

    Row i of the draft (RoPE position i) reads fuse(target states at position i) and the
    embedding of token i+1; its output predicts token i+2. Draft step j >= 1 reads the previous
    step's pre-norm output and the embedding of d_j at position P-1+j. The draft's own KV cache
    keeps only rows computed from real target features.
    """

    def __init__(self, head, target):
        check_head_fits(head, target)
        self.head = head.eval()
        self.target = target
        self.layers = head.required_layers()
        self.cache = None
        self.rows = 0  # draft cache rows computed from real target features
        self.last_out = None  # pre-norm output of the last real row: [1, 1, H]

    @property
    def dtype(self) -> torch.dtype:
        return self.head.fc.weight.dtype

    def _extend(self, out: TargetOutput, n: int, next_ids: torch.Tensor, start: int) -> None:
        """Run draft rows start..start+n-1 from target rows 0..n-1 and the tokens after them."""
        if start != self.rows:
            raise RuntimeError(f"draft rows out of step: have {self.rows}, asked to add at {start}")
        hidden = self.head.fuse([out.hidden[i][:, :n] for i in self.layers])  # [1, n, H]
        embeds = self.target.embed(next_ids.reshape(1, n).to(self.target.device))  # [1, n, H]
        mask = causal_mask(start, n, self.dtype, hidden.device)
        o = self.head.step(hidden, embeds, positions(start, n, hidden.device), mask, self.cache)
        self.rows += n
        self.last_out = o[:, -1:]

    @torch.no_grad()
    def start(self, prompt_ids: torch.Tensor, first_token: int, out: TargetOutput) -> None:
        self.cache, self.rows = DynamicCache(), 0
        ids = prompt_ids.reshape(-1)
        next_ids = torch.cat([ids[1:], ids.new_tensor([first_token])])  # x_1 .. x_P
        self._extend(out, ids.numel(), next_ids, 0)

    @torch.no_grad()
    def propose(self, k: int) -> torch.Tensor:
        """k draft tokens [k] (target ids); the speculative cache rows are dropped afterwards."""
        out = self.last_out
        tokens = []
        for j in range(k):
            if j > 0:
                emb = self.target.embed(tokens[-1].reshape(1, 1))
                pos = positions(self.rows - 1 + j, 1, out.device)
                out = self.head.step(out, emb, pos, None, self.cache)
            draft_id = self.head.logits(out)[0, -1].argmax()
            tokens.append(self.head.to_target_ids(draft_id))
        trim_cache(self.cache, self.rows)
        return torch.stack(tokens) if tokens else torch.empty(0, dtype=torch.long)

    @torch.no_grad()
    def accept(self, inputs: torch.Tensor, following: torch.Tensor, out: TargetOutput,
               start: int) -> None:
        self._extend(out, inputs.numel(), following, start)


# --- prompt lookup -----------------------------------------------------------------------------


def lookup_continuation(context: torch.Tensor, k: int, max_ngram: int = 3,
                        min_ngram: int = 1) -> torch.Tensor:
    """Prompt lookup: context [L] -> up to k tokens that followed an earlier occurrence of the
    longest trailing n-gram (n = max_ngram .. min_ngram); empty when nothing matches.

    Among the earlier occurrences, the latest one followed by k full tokens wins (recent text is
    the best guess); when none is, the earliest one, which is followed by the most tokens.
    """
    L = context.numel()
    for n in range(max_ngram, min_ngram - 1, -1):
        if n < 1 or L <= n:
            continue
        tail = context[L - n:]
        windows = context[: L - 1].unfold(0, n, 1)  # [L - n, n]: every earlier n-gram start
        hits = (windows == tail).all(-1).nonzero().flatten()
        if hits.numel():
            full = hits[L - (hits + n) >= k]
            begin = int(full[-1] if full.numel() else hits[0]) + n
            return context[begin: begin + k]
    return context.new_empty(0)


class NgramProposer:
    """Training-free baseline: propose what followed the trailing n-gram earlier in the context."""

    layers: list[int] = []

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes need 1 <= min ({min_ngram}) <= max ({max_ngram})")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.context = torch.empty(0, dtype=torch.long)

    def start(self, prompt_ids: torch.Tensor, first_token: int, out=None) -> None:
        self.context = torch.cat([prompt_ids.reshape(-1).cpu().long(), torch.tensor([first_token])])

    def propose(self, k: int) -> torch.Tensor:
        return lookup_continuation(self.context, k, self.max_ngram, self.min_ngram)

    def accept(self, inputs, following: torch.Tensor, out=None, start: int = 0) -> None:
        self.context = torch.cat([self.context, following.reshape(-1).cpu().long()])
