"""Drafter kind descriptors: per kind, the small heads that stand for it in `make engine-check` and
the export tests, and how the engine check runs our side of it. One module a kind, one line here.

A kind is its head (`heads/<kind>.py`), its writer (`export/<kind>.py`, which also says what its
README tells), its proposers (`verify/<kind>_proposers.py`) and this descriptor.
"""

from __future__ import annotations

from specheads.kinds import dflash, draft, dspark, eagle1, eagle3, medusa, medusa2, mtp
from specheads.kinds.base import EngineSide, Example, Kind

# kind -> descriptor, in heads.HEADS order; one line per kind
KINDS: dict[str, Kind] = {
    "eagle3": eagle3.KIND,
    "medusa": medusa.KIND,
    "medusa2": medusa2.KIND,
    "eagle": eagle1.KIND,
    "mtp": mtp.KIND,
    "draft": draft.KIND,
    "dflash": dflash.KIND,
    "dspark": dspark.KIND,
}

__all__ = ["KINDS", "EngineSide", "Example", "Kind", "kind_of"]


def kind_of(name: str) -> Kind:
    """The descriptor of kind `name`, or a clear error listing the kinds."""
    if name not in KINDS:
        raise ValueError(f"head kind '{name}' has no descriptor; kinds with one: {', '.join(KINDS)}")
    return KINDS[name]
