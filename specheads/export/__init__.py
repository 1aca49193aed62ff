"""Export a trained head into a folder vLLM or SGLang loads as it is, and load any export back.

`export` builds the folder in a temp directory, checks it against `contract.py`, and only then
renames it into place; a refused or invalid export leaves nothing at `out_dir`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from safetensors.torch import save_file

from specheads.export import eagle3
from specheads.export.checkpoint import Checkpoint, CheckpointError
from specheads.export.contract import ContractError, validate
from specheads.export.contract_rules import CONFIG_FILE, META_FILE, WEIGHTS_FILE
from specheads.export.eagle3 import ExportRefused
from specheads.export.folder import export_dir, identity, plan_replacement
from specheads.export.load import ExportMeta, read_export_meta
from specheads.export.readme import readme_text, serve_commands, target_ref
from specheads.export.record import export_record, float_dtype, write_json
from specheads.export.registry import LOADERS, WRITERS, load, load_with_meta, writer_for

__all__ = [
    "FORMATS", "LOADERS", "WRITERS", "Checkpoint", "CheckpointError", "ContractError", "ExportMeta", "ExportRefused",
    "export", "load", "load_with_meta", "read_export_meta", "validate",
]

log = logging.getLogger(__name__)
FORMATS = eagle3.FORMATS  # the EAGLE-3 formats (what existing callers iterate over)
ALL_FORMATS = tuple(dict.fromkeys(f for w in WRITERS.values() for f in w.FORMATS))  # any kind


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
    record["serve_commands"] = serve_commands(fmt, out_dir, target, k, ckpt.kind,
                                              parallel=getattr(head.config, "parallel_drafting", False))
    config = writer.config_json(head.config, fmt, k, target.config_name,
                                target.architectures, record["dtype"])
    with export_dir(out_dir, ident, overwrite) as tmp:
        weights_file = getattr(writer, "WEIGHTS_FILES", {}).get(fmt, WEIGHTS_FILE)
        save_file(tensors, str(tmp / weights_file), metadata={"format": "pt"})
        write_json(tmp / CONFIG_FILE, config)
        write_json(tmp / META_FILE, record)
        (tmp / "README.md").write_text(readme_text(fmt, out_dir, record["serve_commands"], target, record))
        if hasattr(writer, "validate"):  # kinds with their own loader-contract checker
            writer.validate(tmp, fmt, expected=head.config)
        else:
            validate(tmp, fmt, ckpt.kind, expected=head.config)
    for cmd in record["serve_commands"]:
        log.info("serve with: %s", cmd)
    return out_dir
