"""specheads.json, the record every export carries: format, engine, provenance, the head's config."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import specheads
from specheads.engine_facts import ENGINES, FORMATS
from specheads.export.checkpoint import Checkpoint
from specheads.export.readme import TargetRef
from specheads.provenance import provenance


def export_record(ckpt: Checkpoint, config, fmt: str, k: int, target: TargetRef, dtype: str) -> dict:
    """specheads.json: format, engine versions, the checkpoint's provenance (target fingerprint incl.)."""
    engine = FORMATS[fmt].engine
    return {
        "format": fmt,
        "kind": ckpt.kind,
        "engine": {"name": engine, "version": ENGINES[engine].series},
        "purpose": "export",  # marks the folder as ours (export/folder.py: what may be replaced)
        "engine_versions": {name: e.series for name, e in ENGINES.items()},
        "num_speculative_tokens": k,
        "dtype": dtype,
        "specheads_version": specheads.__version__,
        "checkpoint": ckpt.path.name,
        "checkpoint_step": ckpt.trainer_state.get("step"),
        "verifier": {"name": target.name, "hub_id": target.hub_id},
        "target": ckpt.provenance.get("target"),
        "head_config": asdict(config),
        "checkpoint_provenance": ckpt.provenance,
        "export_provenance": provenance(),
    }


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")
