"""specheads.json, the record every export carries: format, engine, provenance, the head's config."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

import specheads
from specheads.export.checkpoint import Checkpoint
from specheads.engine_facts import ENGINES, FORMATS
from specheads.export.readme import TargetRef
from specheads.provenance import provenance

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # export dtypes
DTYPE_NAMES = {t: name for name, t in DTYPES.items()}


def check_dtype(dtype: str | None) -> None:
    """An export dtype is one of DTYPES (None keeps the checkpoint's)."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype '{dtype}': expected one of {', '.join(DTYPES)}")


def cast(tensor: torch.Tensor, dtype: str | None) -> torch.Tensor:
    """A floating tensor in `dtype` (None: unchanged); ids and masks never cast; contiguous, on CPU."""
    tensor = tensor.detach().cpu()
    return (tensor.to(DTYPES[dtype]) if dtype is not None and tensor.is_floating_point() else tensor).contiguous()


def float_dtype(tensors: dict[str, torch.Tensor]) -> str:
    """The name of the (single) floating dtype of the exported weights."""
    found = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(found) != 1:
        return "mixed"
    one = next(iter(found))
    return DTYPE_NAMES.get(one, str(one).removeprefix("torch."))


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
