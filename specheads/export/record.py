"""specheads.json, the record every export carries: format, engine, provenance, the head's config."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

import specheads
from specheads.export.checkpoint import Checkpoint
from specheads.export.contract_rules import ENGINE_VERSIONS, contract_for
from specheads.export.readme import TargetRef
from specheads.provenance import provenance

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def float_dtype(tensors: dict[str, torch.Tensor]) -> str:
    """The name of the (single) floating dtype of the exported weights."""
    found = {t.dtype for t in tensors.values() if t.is_floating_point()}
    return DTYPE_NAMES.get(next(iter(found)), str(found)) if len(found) == 1 else "mixed"


def export_record(ckpt: Checkpoint, config, fmt: str, k: int, target: TargetRef, dtype: str) -> dict:
    """specheads.json: format, engine versions, the checkpoint's provenance (target fingerprint incl.)."""
    engine = contract_for(fmt, ckpt.kind).engine
    return {
        "format": fmt,
        "kind": ckpt.kind,
        "engine": {"name": engine, "version": ENGINE_VERSIONS[engine]},
        "purpose": "export",  # marks the folder as ours (export/folder.py: what may be replaced)
        "engine_versions": dict(ENGINE_VERSIONS),
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
