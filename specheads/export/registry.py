"""The export registries, side by side: per drafter kind, the module that writes its folders
(`WRITERS`) and the module that reads them back (`LOADERS`); both follow `protocols.Writer`.
An unknown kind fails here, at the first lookup, with the list of kinds. Reading an export's meta,
checking its contract and loading it dispatch on the kind its specheads.json records; a folder
without one is another trainer's (export/foreign.py).
"""

from __future__ import annotations

from pathlib import Path

from specheads.engine_facts import GGUF_FORMAT, REFUSED
from specheads.export import dflash, draft, dspark, eagle1, eagle3, gguf, medusa, medusa2, mtp
from specheads.export.checkpoint import HEAD_FILE, RUN_FILE, runs_inside
from specheads.export.contract_rules import META_FILE
from specheads.export.folder import verify_export
from specheads.export.foreign import load_foreign, read_foreign_meta
from specheads.export.load import ExportMeta, is_foreign, read_record_meta
from specheads.export.plan import ExportRefused

# kind -> module, in heads.HEADS order; one line per kind so that adding a kind adds a line
WRITERS = {
    "eagle3": eagle3,
    "medusa": medusa,
    "medusa2": medusa2,
    "eagle": eagle1,
    "mtp": mtp,
    "draft": draft,
    "dflash": dflash,
    "dspark": dspark,
}
LOADERS = WRITERS  # each kind's writer module also reads its folders back (`load`)
# format -> module converting another format's export for an engine without a format of its own
DERIVED = {GGUF_FORMAT: gguf.export_gguf}


def writer_for(kind: str, fmt: str):
    """The writer module for a head kind, refusing formats that cannot serve it."""
    if kind not in WRITERS:
        raise ExportRefused(f"head kind '{kind}' has no exporter; kinds with one: {', '.join(WRITERS)}")
    writer = WRITERS[kind]
    if fmt not in writer.FORMATS_WRITTEN:
        reason = REFUSED.get((kind, fmt))  # a kind-specific explanation, when there is one
        raise ExportRefused(reason or f"format '{fmt}' cannot serve a '{kind}' head; use one of: "
                            f"{', '.join(writer.FORMATS_WRITTEN)}")
    return writer


def loader_for(kind: str, folder: str | Path):
    """The module that loads (and checks) an export of `kind` at `folder`."""
    if kind not in LOADERS:
        raise ValueError(f"{folder}: head kind '{kind}' cannot be loaded by this specheads version; "
                         f"kinds it loads: {', '.join(LOADERS)}")
    return LOADERS[kind]


def read_export_meta(folder: str | Path) -> ExportMeta:
    """What an export folder says about itself: its specheads.json, or (another trainer's folder)
    the EAGLE-3 format its config.json is written in; a training checkpoint is refused by name."""
    meta = read_record_meta(folder)
    if meta is None:
        refuse_training_output(Path(folder))
        meta = read_foreign_meta(Path(folder))
    return meta


def refuse_training_output(folder: Path) -> None:
    """A training checkpoint or run folder (`specheads train` wrote it) is not an export: say so, and the
    `specheads export` command that makes one from it."""
    if (folder / HEAD_FILE).is_file() or (folder / "latest").is_file() or (folder / RUN_FILE).is_file() \
            or runs_inside(folder):
        what = "a training checkpoint" if (folder / HEAD_FILE).is_file() else "a training run folder"
        raise ExportRefused(f"{folder} is {what} (`specheads train` wrote it), not an export: the verifier, eval and "
                            f"serve load exports. Export it first: `specheads export {folder} --format vllm --out "
                            f"{folder}-export`, then pass that folder")


def validate(folder: str | Path, fmt: str, kind: str | None = None, expected=None) -> None:
    """Check an export folder against the (format, kind) loader contract; raise ContractError listing
    every violation. `kind` defaults to the one the folder's specheads.json records; `expected` (the
    head config; default: specheads.json's) adds the checks against the trained head."""
    if kind is None:
        meta = read_record_meta(folder)
        if meta is None:
            raise ValueError(f"{Path(folder) / META_FILE}: no such file, so the folder names no head kind; "
                             f"pass kind (one of {', '.join(LOADERS)})")
        kind = meta.kind
    loader_for(kind, folder).validate(folder, fmt, expected=expected)


def load_with_meta(folder: str | Path, attn_implementation: str = "sdpa", check: bool = True,
                   num_target_layers: int | None = None):
    """An export folder -> (head in eval mode, its ExportMeta). `check` validates the contract first.
    A folder another trainer wrote (no specheads.json) is read as its engine reads it;
    `num_target_layers` resolves the engines' default taps when it names none."""
    meta = read_export_meta(folder)
    if is_foreign(meta):
        return load_foreign(meta, attn_implementation, num_target_layers)
    verify_export(meta.folder, meta.record)  # recorded weight checksums (older exports: a notice)
    return loader_for(meta.kind, meta.folder).load_export(meta, attn_implementation, check)


def load(folder: str | Path, attn_implementation: str = "sdpa", check: bool = True):
    """An export folder -> the head (see `load_with_meta` for the target fingerprint)."""
    return load_with_meta(folder, attn_implementation, check)[0]
