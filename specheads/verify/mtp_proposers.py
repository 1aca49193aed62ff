"""Chain proposers for MTP heads and small draft models (protocol: verify/proposers.py).

MTP: step j keeps its own KV cache of "real" rows, those whose inputs are all verified
(row i at step j reads E(x_{i+j+1}) and step j-1's row i, so step j holds rows 0..N-1-j when
x_N is the last verified token). A proposal runs, at each step j, the rows that involve draft
tokens and then drops them, so every draft equals the teacher-forced training computation.

Draft model: an ordinary causal LM with its own KV cache over the verified tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from specheads.target import TargetError, TargetOutput
from specheads.verify.decode import causal_mask, positions, trim_cache


def check_vocab_fits(kind: str, vocab_size: int, hidden_size: int | None, target) -> None:
    """Refuse a drafter whose vocabulary (or width, for MTP) differs from the target's."""
    problems = []
    if vocab_size != target.vocab_size:
        problems.append(f"vocab_size {vocab_size} vs the target's {target.vocab_size}")
    if hidden_size is not None and hidden_size != target.hidden_size:
        problems.append(f"hidden_size {hidden_size} vs the target's {target.hidden_size}")
    if problems:
        raise TargetError(f"the {kind} head does not fit this target: " + "; ".join(problems))


class MtpProposer:
    """Greedy chain drafts from an MTP head, module j % D at draft step j."""

    layers: list[int] = []  # only TargetOutput.final is read

    def __init__(self, head, target):
        check_vocab_fits("MTP", head.config.vocab_size, head.config.hidden_size, target)
        self.head, self.target = head.eval(), target
        self.tokens: list[int] = []
        self.h0 = None  # [1, N, H]: target final-normed states for positions 0..N-1
        self.outs: list[torch.Tensor] = []  # step j -> [1, R_j, H] real rows
        self.caches: list[DynamicCache] = []

    @property
    def dtype(self) -> torch.dtype:
        return self.head.layers[0].eh_proj.weight.dtype

    def _embed(self, ids: list[int]) -> torch.Tensor:
        return self.target.embed(torch.tensor([ids], device=self.target.device))  # [1, n, H]

    def _run(self, j: int, hidden, ids: list[int], first_row: int) -> torch.Tensor:
        """Rows first_row.. of step j (hidden [1, n, H], E(ids)) on top of step j's cache -> [1, n, H]."""
        n = hidden.shape[1]
        pos = positions(first_row + j, n, hidden.device)
        embeds = self.head.embed_rows(self._embed(ids).to(self.dtype), pos)
        mask = causal_mask(first_row, n, self.dtype, hidden.device)
        return self.head.step(j, hidden, embeds, pos, mask, self.caches[j])

    def _advance(self, steps: int) -> None:
        """Extend every step's real rows to what the verified tokens allow."""
        N = len(self.tokens) - 1
        while len(self.outs) < steps:
            self.outs.append(self.h0.new_zeros(1, 0, self.h0.shape[-1]).to(self.dtype))
            self.caches.append(DynamicCache())
        for j in range(steps):
            have, want = self.outs[j].shape[1], max(N - j, 0)
            if want <= have:
                continue
            src = self.h0 if j == 0 else self.outs[j - 1]
            out = self._run(j, src[:, have:want].to(self.dtype), self.tokens[have + j + 1: want + j + 1], have)
            self.outs[j] = torch.cat([self.outs[j], out], dim=1)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.target.lm_head.weight.to(h.dtype))

    @torch.no_grad()
    def start(self, prompt_ids: torch.Tensor, first_token: int, out: TargetOutput) -> None:
        ids = prompt_ids.reshape(-1)
        self.tokens = ids.tolist() + [int(first_token)]
        self.h0 = out.final[:, : ids.numel()]
        self.outs, self.caches = [], []

    @torch.no_grad()
    def propose(self, k: int) -> torch.Tensor:
        """k draft tokens [k]; rows built from drafts are dropped from the caches afterwards."""
        if k < 1:
            return torch.empty(0, dtype=torch.long)
        self._advance(k)
        N = len(self.tokens) - 1
        ext, drafts = list(self.tokens), []
        spec = self.outs[0][:, :0]  # step j-1's rows built from drafts (none at step 0)
        for j in range(k):
            real = max(N - j, 0)
            if j == 0:
                last = self.outs[0][:, -1:]
            else:
                src = torch.cat([self.outs[j - 1][:, real:], spec], dim=1)  # step j-1 rows real..N-1
                spec = self._run(j, src, ext[real + j + 1: N + j + 1], real)
                trim_cache(self.caches[j], real)
                last = spec[:, -1:]
            d = int(self._logits(last)[0, -1].argmax())
            drafts.append(d)
            ext.append(d)
        return torch.tensor(drafts, dtype=torch.long)

    @torch.no_grad()
    def accept(self, inputs: torch.Tensor, following: torch.Tensor, out: TargetOutput, start: int) -> None:
        if start != self.h0.shape[1]:
            raise RuntimeError(f"MTP state out of step: have {self.h0.shape[1]} target rows, asked to add at {start}")
        n = inputs.numel()
        self.h0 = torch.cat([self.h0, out.final[:, :n]], dim=1)
        self.tokens += [int(t) for t in following.reshape(-1).tolist()]


class DraftModelProposer:
    """Greedy chain drafts from an independent causal LM sharing the target's tokenizer."""

    layers: list[int] = []

    def __init__(self, head, target):
        check_vocab_fits("draft-model", head.config.vocab_size, None, target)
        self.model, self.target = head.model.eval(), target
        self.tokens: list[int] = []
        self.cache = None

    @property
    def device(self):
        return next(self.model.parameters()).device

    def _feed(self, ids: list[int]) -> torch.Tensor:
        """Feed ids at the next positions -> next-token logits [V] of the last one."""
        past = self.cache.get_seq_length()
        x = torch.tensor([ids], device=self.device)
        mask = causal_mask(past, len(ids), next(self.model.parameters()).dtype, self.device)
        out = self.model(input_ids=x, attention_mask=mask, position_ids=positions(past, len(ids), self.device),
                         use_cache=True, **_cache(self.cache))
        return out.logits[0, -1]

    @torch.no_grad()
    def start(self, prompt_ids: torch.Tensor, first_token: int, out=None) -> None:
        self.tokens = prompt_ids.reshape(-1).tolist() + [int(first_token)]
        self.cache = DynamicCache()

    @torch.no_grad()
    def propose(self, k: int) -> torch.Tensor:
        """Cache every verified token, then k greedy drafts; draft rows are dropped afterwards."""
        if k < 1:
            return torch.empty(0, dtype=torch.long)
        verified = len(self.tokens)
        logits = self._feed(self.tokens[self.cache.get_seq_length():])
        drafts = [int(logits.argmax())]
        while len(drafts) < k:
            drafts.append(int(self._feed(drafts[-1:]).argmax()))
        trim_cache(self.cache, verified)
        return torch.tensor(drafts, dtype=torch.long)

    @torch.no_grad()
    def accept(self, inputs, following: torch.Tensor, out=None, start: int = 0) -> None:
        self.tokens += [int(t) for t in following.reshape(-1).tolist()]


def _cache(cache) -> dict:
    from specheads.hf_compat import cache_kwargs

    return cache_kwargs(cache)


def make_proposer(spec, head, target, sampled: bool = False):
    """Greedy chains only: trees and speculative sampling are not implemented for these kinds."""
    if spec.kind != "chain" or sampled:
        from specheads.verify.settings import GenerateError

        raise GenerateError(f"a '{head.kind}' head runs greedy chains only (--tree chain, temperature 0)")
    return MtpProposer(head, target) if head.kind == "mtp" else DraftModelProposer(head, target)
