"""Model drafts asked for by a step (`protocols.DraftAsk`): drafted by the model proposer alone, or
by its draft group (`protocols.GroupedProposer`) together with other rows' asks.

A plain chain proposer asks for its own chain; a `protocols.SplitProposer` (adaptive length,
hybrid choose) decides before the model drafts whether and how it asks (its free draft, its
stopping rule), and afterwards which draft it verifies. `split_step` runs both halves around a
draft made alone: the per-row path, which a grouped row must equal.
"""

from __future__ import annotations

import torch

from specheads.protocols import DraftAsk, SampledProposer, SplitProposer, StoppingProposer

Drafted = tuple[torch.Tensor, torch.Tensor | None]  # ids [n], q [n, V] (None: top-1)

NOTHING: Drafted = (torch.empty(0, dtype=torch.long), None)  # the model was not asked


def cut(stop, n: int) -> int:
    """How many of an n-token draft a stopping rule keeps (asked j = 1.. in order)."""
    return next((j - 1 for j in range(1, n + 1) if stop(j)), n)


def draft_alone(model, ask: DraftAsk) -> Drafted:
    """The model's own draft for the ask; a model that cannot stop early drafts k and the rule
    cuts the chain afterwards (the same tokens, more draft work)."""
    if ask.sampler is None:
        tokens, q = model.propose(ask.k).reshape(-1)[: ask.k], None
    elif ask.stop is not None and isinstance(model, StoppingProposer):
        return model.propose_until(ask.k, *ask.sampler, ask.stop)
    elif isinstance(model, SampledProposer):
        tokens, q = model.propose_sampled(ask.k, *ask.sampler)
        tokens, q = tokens.reshape(-1)[: ask.k], q[: ask.k]
    else:
        raise TypeError(f"{type(model).__name__} cannot sample its drafts: ask it for its top-1 chain")
    if ask.stop is not None:
        m = cut(ask.stop, tokens.numel())
        tokens, q = tokens[:m], None if q is None else q[:m]
    return tokens, q


def begin(proposer, k: int, sampler) -> DraftAsk | None:
    """A step's ask of this row's model: a split proposer's own, else its chain of <= k."""
    return proposer.begin_step(k, sampler) if isinstance(proposer, SplitProposer) else DraftAsk(k, sampler)


def end(proposer, drafted: Drafted) -> Drafted:
    """The row's draft from what its model drafted (a split proposer's choice, else as is)."""
    return proposer.end_step(*drafted) if isinstance(proposer, SplitProposer) else drafted


def split_step(proposer, model, k: int, sampler) -> Drafted:
    """One step of a split proposer drafting alone: begin, the model's draft, end."""
    ask = proposer.begin_step(k, sampler)
    return proposer.end_step(*(NOTHING if ask is None else draft_alone(model, ask)))


def draft_asks(drafters: list, asks: list[DraftAsk | None]) -> list[Drafted]:
    """Every row's ask drafted by its group drafter (`GroupedProposer.group_drafter()`, its model's
    state): two or more asks of >= 1 token in one draft group call (its forwards cover those rows
    only), a lone one alone, None as nothing (no drafter forward)."""
    together = [b for b, ask in enumerate(asks) if ask is not None and ask.k >= 1]
    if len(together) < 2:
        together = []
    drafted = [NOTHING if ask is None or b in together else draft_alone(drafter, ask)
               for b, (drafter, ask) in enumerate(zip(drafters, asks))]
    if together:
        members = [drafters[b] for b in together]
        grouped = members[0].draft_group(members, [asks[b].k for b in together],
                                         [asks[b].sampler for b in together], [asks[b].stop for b in together])
        for b, chain in zip(together, grouped):
            drafted[b] = chain
    return drafted
