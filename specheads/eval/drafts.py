"""Loading what an eval measures: the target in the chosen dtype/device and the exported draft,
its fingerprint checked against that target."""

from __future__ import annotations

import logging
from pathlib import Path

from specheads.export import load_with_meta
from specheads.target import Target, check_fingerprint, default_dtype

log = logging.getLogger(__name__)


def meta_value(meta, key: str):
    return meta.get(key) if isinstance(meta, dict) else getattr(meta, key, None)


def load_target(path: str, dtype: str | None = None, device: str = "auto") -> Target:
    """The target for an eval: `dtype` None = bfloat16 on a GPU, float32 elsewhere; the draft
    then follows the target's device and dtype."""
    return Target.load(path, dtype=dtype or default_dtype(device), device=device)


def load_draft(draft_dir: str | Path, target):
    """The exported head (moved to the target's device and dtype), its meta, fingerprint checked."""
    head, meta = load_with_meta(draft_dir)
    expected = meta_value(meta, "target")
    if expected:
        check_fingerprint(expected, target, f"draft '{draft_dir}'")
    else:
        log.warning("draft '%s' records no target fingerprint; cannot check it matches", draft_dir)
    return head.to(device=target.device, dtype=target.dtype).eval(), meta, bool(expected)
