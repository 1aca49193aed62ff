"""Export a trained head into a folder vLLM or SGLang loads as it is, and load any export back.

`export` builds the folder in a temp directory, checks it against `contract.py`, and only then
renames it into place; a refused or invalid export leaves nothing at `out_dir`.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from safetensors.torch import save_file

from specheads import engine_facts
from specheads.errors import disk_guard
from specheads.export.checkpoint import Checkpoint, CheckpointError
from specheads.export.contract_rules import CONFIG_FILE, META_FILE, ContractError
from specheads.export.folder import export_dir, identity, link_or_copy, plan_replacement
from specheads.export.llamacpp_tool import LlamaCppChoice
from specheads.export.load import ExportMeta
from specheads.export.plan import ExportRefused, check_dtype, float_dtype
from specheads.export.readme import readme_text, serve_commands, target_ref
from specheads.export.record import export_record, write_json
from specheads.export.registry import DERIVED, LOADERS, WRITERS, load, load_with_meta, read_export_meta, validate, writer_for
from specheads.protocols import ExportPlan, ExportRequest

__all__ = [
    "ALL_FORMATS", "CLI_FORMATS", "LOADERS", "WRITERS", "Checkpoint", "CheckpointError", "ContractError", "ExportMeta",
    "ExportRefused", "export", "load", "load_with_meta", "read_export_meta", "validate",
]

log = logging.getLogger(__name__)
ALL_FORMATS = tuple(engine_facts.FORMATS)  # any kind: the formats the writers plan
CLI_FORMATS = (*ALL_FORMATS, *DERIVED)  # the --format choices: those and the converted ones (gguf)


DISK_FULL_AFTER = ("nothing is lost: an export is built in a temporary folder beside --out, removed again, and "
                   "an earlier export there is untouched. Free some space and rerun the same command")


def export(checkpoint, fmt: str, out_dir: str | Path, num_speculative_tokens: int | None = None,
           verifier: str | None = None, dtype: str | None = None, adapter: str | None = None,
           overwrite: bool = False, target_gguf: bool = True, llama_cpp: LlamaCppChoice | None = None) -> Path:
    """`write_export`, with a full disk named as such (where, and that nothing is lost). `out_dir` is
    made absolute first: the serve commands and README name it, and must work from any directory."""
    out_dir = Path(os.path.abspath(Path(out_dir).expanduser()))
    with disk_guard(out_dir, DISK_FULL_AFTER):
        return write_export(checkpoint, fmt, out_dir, num_speculative_tokens, verifier, dtype, adapter, overwrite,
                            target_gguf, llama_cpp)


def write_export(checkpoint, fmt: str, out_dir: str | Path, num_speculative_tokens: int | None = None,
                 verifier: str | None = None, dtype: str | None = None, adapter: str | None = None,
                 overwrite: bool = False, target_gguf: bool = True, llama_cpp: LlamaCppChoice | None = None) -> Path:
    """Write `checkpoint` (a path or Checkpoint) as an `fmt` folder at `out_dir`; returns out_dir.

    `verifier` names the target for the serve commands (a hub id, or a local folder); `dtype`
    casts floating weights (float32 / bfloat16 / float16), never d2t / t2d; `adapter` (medusa2
    only): "merge" (default) or "ship" the target's LoRA adapters. `out_dir` may only be an earlier
    export (see export/folder.py); `overwrite` drops what it carries that this export would not keep.
    `llama_cpp` (gguf): which llama.cpp converts, and whether it may be built (llamacpp_tool.locate).
    Every kind goes through the same steps: options checked, the writer's plan (protocols.ExportPlan)
    written atomically with specheads.json and README.md, the loader contract checked.
    """
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
    ckpt.check_finite("the training diverged: export an earlier checkpoint, or train again (e.g. a lower train.lr)")
    if fmt in DERIVED:  # gguf: our export converted by the engine's own tool (`target_gguf`: the target too)
        check_options(WRITERS.get(ckpt.kind), ckpt.kind, num_speculative_tokens, dtype, adapter)
        def source_export(source_fmt: str, folder: Path) -> Path:
            return export(ckpt, source_fmt, folder, num_speculative_tokens, verifier, dtype)

        readme = WRITERS[ckpt.kind].README if ckpt.kind in WRITERS else None
        return DERIVED[fmt](ckpt, Path(out_dir), source_export, readme, verifier, dtype, overwrite, target_gguf,
                            llama_cpp or LlamaCppChoice())
    writer = writer_for(ckpt.kind, fmt)
    check_options(writer, ckpt.kind, num_speculative_tokens, dtype, adapter)
    out_dir, ident = Path(out_dir), identity(ckpt, fmt, dtype)
    plan_replacement(out_dir, ident, overwrite)  # refused before any work
    head = ckpt.build_head()  # strict: every tensor present with the config's shape
    writer.check_exportable(head.config, fmt, ckpt.weights)
    k = head.config.ttt_steps if num_speculative_tokens is None else num_speculative_tokens
    request = ExportRequest(ckpt, head, fmt, k, dtype, verifier, target_ref(ckpt.provenance, ckpt.recipe, verifier),
                            out_dir, adapter)
    plan = writer.plan(request)
    record = plan_record(request, plan)
    with export_dir(out_dir, ident, overwrite) as tmp:
        write_plan(plan, tmp)
        write_json(tmp / META_FILE, record)
        readme = readme_text(fmt, writer.README, record["serve_commands"], plan.target or request.target, record)
        (tmp / "README.md").write_text(readme + plan.readme_extra)
        writer.validate(tmp, fmt, expected=head.config if plan.expected is None else plan.expected)
    for cmd in record["serve_commands"]:
        log.info("serve with: %s", cmd)
    return out_dir


def check_options(writer, kind: str, k: int | None, dtype: str | None, adapter: str | None) -> None:
    """The export options, checked alike for every kind before any work."""
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
        raise ValueError(f"num_speculative_tokens {k!r}: expected a positive integer")
    check_dtype(dtype)
    modes = getattr(writer, "ADAPTER_MODES", None)
    if adapter is not None and modes is None:
        raise ValueError(f"--adapter applies to heads trained with target adapters (medusa2), not '{kind}'")
    if adapter is not None and adapter not in modes:
        raise ValueError(f"adapter '{adapter}': expected one of {', '.join(modes)}")


def plan_record(request: ExportRequest, plan: ExportPlan) -> dict:
    """specheads.json of the export (the folder's checksums are added by export_dir)."""
    ckpt, target = request.ckpt, plan.target or request.target
    record = export_record(ckpt, request.head.config, request.fmt, request.k, target, float_dtype(plan.tensors))
    record.update(plan.record)
    parallel = getattr(request.head.config, "parallel_drafting", False)
    record["serve_commands"] = plan.serve_prefix + serve_commands(request.fmt, request.out_dir, target, request.k,
                                                                  ckpt.kind, parallel, plan.serve_as)
    return record


def write_plan(plan: ExportPlan, tmp: Path) -> None:
    """The plan's files in the temp folder export_dir renames into place."""
    for name, src in plan.links.items():
        link_or_copy(src, tmp / name)
    for name, src in plan.copies.items():
        shutil.copy2(src, tmp / name)
    for name, write in plan.written.items():
        write(tmp / name)
    save_file(plan.tensors, str(tmp / plan.weights_file), metadata={"format": "pt"})
    for name, obj in {**plan.json_files, CONFIG_FILE: plan.config}.items():
        write_json(tmp / name, obj)
