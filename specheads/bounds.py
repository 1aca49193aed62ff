"""Range-checked dataclass fields shared by recipe sections and head options (below both floors)."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any


class ConfigError(ValueError):
    """A recipe or override that does not fit the schema; the message names the key."""


def bounded(default: Any, *, ge: float | None = None, gt: float | None = None,
            le: float | None = None, hint: str = "") -> Any:
    """A dataclass field whose value `from_dict` checks against ge / gt / le (None: no bound)."""
    return field(default=default, metadata={"bounds": (ge, gt, le), "hint": hint})


def check_bounds(obj: Any, where: str) -> None:
    """Every `bounded` field of dataclass `obj` within its range, or a ConfigError naming it."""
    for f in dataclasses.fields(obj):
        if "bounds" not in f.metadata:
            continue
        value = getattr(obj, f.name)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        ge, gt, le = f.metadata["bounds"]
        rule = next((r for r, bad in ((f">= {ge}", ge is not None and not value >= ge),
                                      (f"> {gt}", gt is not None and not value > gt),
                                      (f"<= {le}", le is not None and not value <= le)) if bad), None)
        if rule is None and value == value:  # NaN fails every comparison
            continue
        hint = f" ({f.metadata['hint']})" if f.metadata.get("hint") else ""
        raise ConfigError(f"{where}.{f.name} = {value!r}: must be {rule or 'a number'}{hint}")
