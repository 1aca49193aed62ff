"""One speculation session: the target and an exported draft loaded once, the draft checked
against the target under the one fingerprint policy, the draft shape (and its default length)
chosen once; then decode (greedy or sampled, chain or tree), stream text through the one
detokeniser (verify/text.py) and count (DecodeStats).

`specheads generate`, `eval` (online and --offline), `serve` and bench/verifier.py start here; a
`mixing.Mixing` (`--hybrid`, `--adaptive`) combines the drafter with a free proposer kept for the
session's life (suffix decoding's global cache spans requests).
Fingerprint policy: a draft trained for another target is always refused; a specheads export
that records no fingerprint is refused unless `allow_missing_fingerprint`
(--allow-missing-fingerprint); another trainer's folder has none and is only warned about.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from specheads.data.suffix_history import history_pairs
from specheads.export import load_with_meta
from specheads.export.load import ExportMeta
from specheads.mixing import Mixing, mix_free, warm_free
from specheads.model_ref import resolve_draft
from specheads.target import Target
from specheads.verify.loop import Request, decode_batch, request
from specheads.verify.ngram_proposers import NO_DRAFT
from specheads.verify.registry import make_proposer
from specheads.verify.settings import Sampling, TreeSpec, check_tree_fits, with_default_k
from specheads.verify.steps import DecodeResult
from specheads.verify.text import StreamingProposer, TextStream

GREEDY = Sampling()
WARM_UP_IDS = [0, 1, 2, 3]


def eos_ids(target) -> list[int]:
    """The tokenizer's eos id plus any the target's generation config names."""
    ids = set()
    if getattr(target.tokenizer, "eos_token_id", None) is not None:
        ids.add(int(target.tokenizer.eos_token_id))
    gen = getattr(target.model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None)
    ids.update(int(i) for i in (extra if isinstance(extra, (list, tuple)) else [extra]) if i is not None)
    return sorted(ids)


@dataclass
class Draft:
    """An exported head on its target's device and dtype, what its folder says about itself, and
    whether the target fingerprint was checked (False only where the policy let it pass unchecked)."""

    head: torch.nn.Module
    meta: ExportMeta
    fingerprint_checked: bool

    @property
    def k(self) -> int:
        """The default chain length: the export's num_speculative_tokens, else its TTT steps."""
        return with_default_k(TreeSpec("chain"), self.meta, self.head).k


def load_draft(folder: str | Path, target: Target, allow_missing_fingerprint: bool = False) -> Draft:
    """The export at `folder`, checked against `target` (module docstring: the policy)."""
    folder = resolve_draft(folder)  # a local folder, or a hub id through the hub cache
    head, meta = load_with_meta(folder, num_target_layers=target.num_layers)
    checked = meta.check_target(target, allow_missing=allow_missing_fingerprint)
    return Draft(head.to(device=target.device, dtype=target.dtype).eval(), meta, checked)


def run_request(spec: TreeSpec | None, target, proposer, ids: list[int], max_new_tokens: int, eos,
                sampling: Sampling = GREEDY) -> Request:
    """One decode's request with `sampling`'s rule: `spec` None decodes plainly (no drafts; plain
    sampling when sampled), else speculatively with `proposer`'s drafts (a chain of spec.k, or trees)."""
    if spec is None:
        proposer, k, rule = NO_DRAFT, 0, "greedy" if sampling.greedy else "exact"
    else:
        k, rule = spec.k or 0, sampling.rule
    return request(target, proposer, ids, max_new_tokens, k, eos, rule=rule,
                   temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed,
                   epsilon=sampling.epsilon, delta=sampling.delta)


def run(spec: TreeSpec | None, target, proposer, ids: list[int], max_new_tokens: int, eos,
        sampling: Sampling = GREEDY) -> DecodeResult:
    """One decode (`run_request`'s), alone."""
    return decode_batch(target, [run_request(spec, target, proposer, ids, max_new_tokens, eos, sampling)])[0]


@dataclass
class Decoded:
    """A speculative decode and the seconds spent streaming its text (inside its wall time)."""

    result: DecodeResult
    stream_s: float = 0.0


class Session:
    """A target, an optional draft and the draft shape they decode with.

    Without a draft the same loop runs with `NO_DRAFT` (plain decoding that still streams).
    `spec` is the shape asked for; `k` (default: the chain's k, else the draft's default length)
    is the chain length, which a tree session keeps for its chain warm-up and n-gram baseline.
    `eos` (default `eos_ids(target)`): the ids that end a decode.
    """

    def __init__(self, target: Target, draft: Draft | None = None, spec: TreeSpec = TreeSpec("chain"),
                 k: int | None = None, eos: list[int] | None = None, mixing: Mixing = Mixing()):
        self.target, self.draft = target, draft
        self.eos = eos_ids(target) if eos is None else list(eos)
        self.mixing, self.free, self.free_note = (mixing if draft is not None else Mixing(reason="no drafter")), None, None
        if draft is None:
            self.spec, self.k = TreeSpec("chain", k=1), None
            return
        self.k = k or spec.k or draft.k
        self.spec = TreeSpec("chain", k=self.k) if spec.kind == "chain" else spec
        check_tree_fits(self.spec, target)
        if self.mixing.active:  # one free proposer for the session: suffix decoding's global cache spans requests
            _, make_free, self.free_note = mix_free()
            self.free = make_free()
            if self.mixing.history:
                warm_free(self.free, history_pairs(self.mixing.history, target.tokenizer, target.context))

    @classmethod
    def open(cls, target_path: str, draft_dir: str | Path | None, spec: TreeSpec = TreeSpec("chain"),
             k: int | None = None, device: str = "auto", dtype: str | None = None,
             allow_missing_fingerprint: bool = False, mixing: Mixing = Mixing()) -> Session:
        """Load the target (`dtype` None: bfloat16 on a GPU, float32 elsewhere) and the draft once."""
        target = Target.load(target_path, dtype=dtype, device=device)
        draft = load_draft(draft_dir, target, allow_missing_fingerprint) if draft_dir else None
        return cls(target, draft, spec, k, mixing=mixing)

    @property
    def head(self):
        return None if self.draft is None else self.draft.head

    def proposer(self, sampled: bool = False, spec: TreeSpec | None = None):
        """A fresh proposer of the draft for `spec` (the drafter alone), or for the session's spec
        combined with the free proposer as `mixing` says; NO_DRAFT without a draft."""
        if self.draft is None:
            return NO_DRAFT
        if spec is not None or not self.mixing.active:
            return make_proposer(spec or self.spec, self.draft.head, self.target, sampled)
        model = make_proposer(self.spec, self.draft.head, self.target, sampled or self.mixing.adaptive)
        free = self.free.fork()  # this request's view of the session's free proposer (one global cache)
        return self.mixing.proposer(model, free, self.k, self.target.vocab_size if sampled else None)

    @property
    def loop_spec(self) -> TreeSpec:
        """The draft shape the decode loop runs (adaptive draft length: chains of up to k_max)."""
        return TreeSpec("chain", k=self.mixing.free_loop_k()) if self.mixing.adaptive else self.spec

    def decode(self, ids: list[int], max_new_tokens: int, sampling: Sampling = GREEDY,
               stream: TextStream | None = None) -> Decoded:
        """Decode `ids` speculatively with the draft; every verified token reaches `stream` as
        soon as it is known (its seconds are reported so that timings can leave them out)."""
        proposer = self.proposer(not sampling.greedy)
        streaming = None if stream is None else StreamingProposer(proposer, stream)
        drafts = proposer if streaming is None else streaming
        result = run(self.loop_spec, self.target, drafts, ids, max_new_tokens, self.eos, sampling)
        if streaming is None:
            return Decoded(result)
        streaming.finish(result.tokens)
        return Decoded(result, streaming.seconds)  # its seconds were inside the timed decode

    def plain(self, ids: list[int], max_new_tokens: int, sampling: Sampling = GREEDY) -> DecodeResult:
        """The reference: plain greedy decoding, or plain sampling with the same seed."""
        return run(None, self.target, None, ids, max_new_tokens, self.eos, sampling)

    def request(self, ids: list[int], max_new_tokens: int, sampling: Sampling = GREEDY,
                drafted: bool = True, wrap: Callable | None = None) -> Request:
        """One sequence for `decode_many` / a serving batch: with a fresh proposer of the draft
        (`drafted`, as `decode`; `wrap`, e.g. a server's text streaming, wraps it), else plain (as `plain`)."""
        if not drafted:
            return run_request(None, self.target, None, ids, max_new_tokens, self.eos, sampling)
        proposer = self.proposer(not sampling.greedy)
        return run_request(self.loop_spec, self.target, proposer if wrap is None else wrap(proposer), ids,
                           max_new_tokens, self.eos, sampling)

    def decode_many(self, prompts: list[list[int]], max_new_tokens: int,
                    sampling: Sampling | list[Sampling] = GREEDY, batch_size: int = 1,
                    drafted: bool = True, kept=None) -> list[DecodeResult]:
        """Every prompt decoded (`request`'s way), up to `batch_size` sequences per target forward;
        each result equals the prompt's decode alone (greedy: token for token). `sampling`: one
        for every prompt, or one per prompt (a seed of its own); `kept`: a
        `verify.prompt_cache.PromptCache` of prefills to reuse and fill."""
        each = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        if len(each) != len(prompts):
            raise ValueError(f"decode_many: {len(each)} samplings for {len(prompts)} prompts")
        reqs = [self.request(ids, max_new_tokens, s, drafted) for ids, s in zip(prompts, each)]
        return decode_batch(self.target, reqs, batch_size, kept)

    def warm_up(self) -> None:
        """Short untimed decodes (plain, the chain of k, the tree) so first-call overheads stay
        out of the timings."""
        run(None, self.target, None, WARM_UP_IDS, 4, [])
        if self.draft is None:
            return
        chain = TreeSpec("chain", k=self.k)
        run(chain, self.target, self.proposer(spec=chain), WARM_UP_IDS, 4, [])
        if self.spec.kind != "chain":
            run(self.spec, self.target, self.proposer(), WARM_UP_IDS, 4, [])
