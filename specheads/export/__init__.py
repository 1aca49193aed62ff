"""Export a trained head into a folder vLLM or SGLang loads as it is, and load any export back.

`export` builds the folder in a temp directory, checks it against `contract.py`, and only then
renames it into place; a refused or invalid export leaves nothing at `out_dir`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save_file

import specheads
from specheads.export import draft, eagle1, eagle3, medusa, medusa2, mtp
from specheads.export.checkpoint import Checkpoint, CheckpointError
from specheads.export.contract import ContractError, validate
from specheads.export.contract_rules import (
    CONFIG_FILE, ENGINE_VERSIONS, META_FILE, WEIGHTS_FILE, contract_for,
)
from specheads.export.eagle3 import ExportRefused
from specheads.export.folder import export_dir, identity, plan_replacement
from specheads.export.load import ExportMeta, load, load_with_meta, read_export_meta
from specheads.export.readme import TargetRef, readme_text, serve_commands, target_ref

__all__ = [
    "FORMATS", "Checkpoint", "CheckpointError", "ContractError", "ExportMeta", "ExportRefused",
    "export", "load", "load_with_meta", "read_export_meta", "validate",
]

log = logging.getLogger(__name__)
WRITERS = {"eagle3": eagle3, "eagle": eagle1, "medusa": medusa, "medusa2": medusa2, "mtp": mtp, "draft": draft}  # head kind -> writer module (FORMATS, check_exportable, tensors, config)
FORMATS = eagle3.FORMATS  # the EAGLE-3 formats (what existing callers iterate over)
ALL_FORMATS = tuple(dict.fromkeys(f for w in WRITERS.values() for f in w.FORMATS))  # any kind
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def writer_for(kind: str, fmt: str):
    """The writer module for a head kind, refusing formats that cannot serve it."""
    if kind not in WRITERS:
        raise ExportRefused(f"head kind '{kind}' has no exporter yet; kinds with one: {', '.join(WRITERS)}")
    writer = WRITERS[kind]
    if fmt not in writer.FORMATS:
        reason = getattr(writer, "REFUSED", {}).get(fmt)  # a kind-specific explanation, if any
        raise ExportRefused(reason or f"format '{fmt}' cannot serve a '{kind}' head; use one of: "
                            f"{', '.join(writer.FORMATS)}")
    return writer


def export(checkpoint, fmt: str, out_dir: str | Path, num_speculative_tokens: int | None = None,
           verifier: str | None = None, dtype: str | None = None, adapter: str | None = None,
           overwrite: bool = False) -> Path:
    """Write `checkpoint` (a path or Checkpoint) as an `fmt` folder at `out_dir`; returns out_dir.

    `verifier` names the target for the serve commands (a hub id, or a local folder); `dtype`
    casts floating weights (float32 / bfloat16 / float16), never d2t / t2d; `adapter` (medusa2
    only): "merge" (default) or "ship" the target's LoRA adapters. `out_dir` may only be an earlier
    export (see export/folder.py); `overwrite` drops what it carries that this export would not keep.
    """
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
    ckpt.check_finite("the training diverged: export an earlier checkpoint, or train again (e.g. a lower train.lr)")
    writer = writer_for(ckpt.kind, fmt)
    if adapter is not None and not hasattr(writer, "ADAPTER_MODES"):
        raise ValueError(f"--adapter applies to heads trained with target adapters (medusa2), not '{ckpt.kind}'")
    out_dir, ident = Path(out_dir), identity(ckpt, fmt, dtype)
    plan_replacement(out_dir, ident, overwrite)  # refused before any work
    extra = {"adapter": adapter} if adapter is not None else {}
    if hasattr(writer, "export_folder"):  # kinds that write a whole model folder (MTP, draft model, Medusa-2)
        with export_dir(out_dir, ident, overwrite) as tmp:
            writer.export_folder(ckpt, fmt, tmp, out_dir, num_speculative_tokens, verifier, dtype, **extra)
        return out_dir
    head = ckpt.build_head()  # strict: every tensor present with the config's shape
    writer.check_exportable(head.config, fmt, ckpt.weights)
    k = head.config.ttt_steps if num_speculative_tokens is None else num_speculative_tokens
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"num_speculative_tokens {k!r}: expected a positive integer")
    tensors = writer.export_tensors(ckpt.weights, fmt, dtype)
    target = target_ref(ckpt.provenance, ckpt.recipe, verifier)
    record = export_record(ckpt, head.config, fmt, k, target, float_dtype(tensors))
    record["serve_commands"] = serve_commands(fmt, out_dir, target, k, ckpt.kind)
    config = writer.config_json(head.config, fmt, k, target.hub_id or target.name or "unknown",
                                target.architectures, record["dtype"])
    with export_dir(out_dir, ident, overwrite) as tmp:
        weights_file = getattr(writer, "WEIGHTS_FILES", {}).get(fmt, WEIGHTS_FILE)
        save_file(tensors, str(tmp / weights_file), metadata={"format": "pt"})
        _write_json(tmp / CONFIG_FILE, config)
        _write_json(tmp / META_FILE, record)
        (tmp / "README.md").write_text(readme_text(fmt, out_dir, record["serve_commands"], target, record))
        if hasattr(writer, "validate"):  # kinds with their own loader-contract checker
            writer.validate(tmp, fmt, expected=head.config)
        else:
            validate(tmp, fmt, ckpt.kind, expected=head.config)
    for cmd in record["serve_commands"]:
        log.info("serve with: %s", cmd)
    return out_dir


def float_dtype(tensors: dict[str, torch.Tensor]) -> str:
    """The name of the (single) floating dtype of the exported weights."""
    found = {t.dtype for t in tensors.values() if t.is_floating_point()}
    return DTYPE_NAMES.get(next(iter(found)), str(found)) if len(found) == 1 else "mixed"


def export_record(ckpt: Checkpoint, config, fmt: str, k: int, target: TargetRef, dtype: str) -> dict:
    """specheads.json: format, engine versions, the checkpoint's provenance (target fingerprint incl.)."""
    from specheads.provenance import provenance

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


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")
