"""Head kind -> proposer module (`protocols.ProposerModule`); the kinds must match heads.HEADS.

`make_proposer` builds the proposer a draft shape (`settings.TreeSpec`) needs from a head's kind.
"""

from __future__ import annotations

from specheads.verify import (
    dflash_proposers,
    draft_proposers,
    dspark_proposers,
    eagle1_proposers,
    eagle3_proposers,
    medusa_proposers,
    mtp_proposers,
)
from specheads.verify.trees import SettingsError

PROPOSERS = {
    "eagle3": eagle3_proposers,  # P-EAGLE heads (parallel_drafting) included: peagle_proposers
    "medusa": medusa_proposers,
    "medusa2": medusa_proposers,
    "eagle": eagle1_proposers,
    "mtp": mtp_proposers,
    "draft": draft_proposers,
    "dflash": dflash_proposers,
    "dspark": dspark_proposers,
}


def proposer_module(kind: str):
    """The proposer module of a head kind, or an error listing the kinds that have one."""
    if kind not in PROPOSERS:
        raise SettingsError(f"head kind '{kind}' has no proposer; kinds with one: {', '.join(PROPOSERS)}")
    return PROPOSERS[kind]


def make_proposer(spec, head, target, sampled: bool = False):
    """The proposer for a spec and a head, from its kind's module (drafts sampled from q when
    `sampled` and the kind supports it)."""
    return proposer_module(head.kind).make_proposer(spec, head, target, sampled)
