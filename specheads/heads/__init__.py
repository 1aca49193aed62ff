"""Drafter kinds. Adding one = one file here, one entry in HEADS, exporters, a recipe, tests."""

from __future__ import annotations

from specheads.heads.dflash import DFlashHead
from specheads.heads.draft import DraftHead
from specheads.heads.dspark import DSparkHead
from specheads.heads.eagle1 import EagleHead
from specheads.heads.eagle3 import Eagle3Head
from specheads.heads.medusa import MedusaHead
from specheads.heads.medusa2 import Medusa2Head
from specheads.heads.mtp import MtpHead

# kind -> head class; each class carries `Options` (recipe section) and `Config` (architecture).
HEADS = {
    "eagle3": Eagle3Head,
    "medusa": MedusaHead,
    "medusa2": Medusa2Head,
    "eagle": EagleHead,
    "mtp": MtpHead,
    "draft": DraftHead,
    "dflash": DFlashHead,
    "dspark": DSparkHead,
}


def head_class(kind: str | None):
    """The class registered for `kind`, or a clear error listing the known kinds."""
    if kind not in HEADS:
        raise ValueError(f"head.kind '{kind}' is not a known drafter kind; expected one of {', '.join(HEADS)}")
    return HEADS[kind]


def head_options_class(kind: str | None):
    return head_class(kind).Options
