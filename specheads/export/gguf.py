"""`specheads export --format gguf`: a folder llama.cpp serves as it is.

The sidecar is made by the pinned llama.cpp's own `convert_hf_to_gguf.py` from the export of ours its
converter reads (engine_facts.LLAMA_CPP_GGUF: EAGLE-3 from `vllm`, DFlash / DSpark from
`vllm-native`, a draft model from `vllm`, MTP from the MTP-in-target folder), with the target's HF
folder as `--target-model-dir`. The folder holds:

    draft.gguf           the sidecar (`llama-server -md`); MTP has none: its block is in target.gguf
    target.gguf          the target (`-m`), converted from its HF folder unless --no-target-gguf
    source/              the export the sidecar was converted from (our verifier loads it)
    *.gguf.json          llama.cpp's conversion records (command, pre-tokenizer choice)
    specheads.json, README.md (the serve command)

Everything is built in a temp folder and renamed into place (export/folder.py); what llama.cpp cannot
load is refused first, in llama.cpp's own words (export/llamacpp_tool.py `draft_spec`).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from pathlib import Path

from specheads.engine_facts import GGUF_FORMAT, LLAMA_CPP, LLAMA_CPP_GGUF, LLAMA_CPP_SERVE
from specheads.export import llamacpp_tool as lc
from specheads.export.checkpoint import Checkpoint
from specheads.export.contract_rules import META_FILE
from specheads.export.folder import export_dir, identity, plan_replacement, weight_hashes
from specheads.export.plan import ExportRefused, check_dtype, target_folder
from specheads.export.readme import Readme, readme_text, target_ref
from specheads.export.record import write_json

SOURCE_DIR = "source"
DRAFT_GGUF, TARGET_GGUF = "draft.gguf", "target.gguf"


class GgufError(ValueError):
    """llama.cpp is missing and cannot be built, or its converter failed (the message has its log)."""


OUTTYPES = {None: "f32", "float32": "f32", "float16": "f16", "bfloat16": "bf16"}  # --dtype -> --outtype


def source_for(kind: str):
    """The kind's GgufSource, or ExportRefused naming the kinds llama.cpp serves."""
    if kind not in LLAMA_CPP_GGUF:
        raise ExportRefused(f"llama.cpp {LLAMA_CPP.series} has no speculative type for a '{kind}' head; "
                            f"--format gguf exports {', '.join(LLAMA_CPP_GGUF)}")
    return LLAMA_CPP_GGUF[kind]


def serve_command(spec_type: str, target: str, draft: str | None, k: int | None) -> str:
    """The llama-server line that serves the folder (engine_facts.LLAMA_CPP_SERVE)."""
    q = shlex.quote
    cmd = LLAMA_CPP_SERVE.format(target=q(target), draft=f" -md {q(draft)}" if draft else "",
                                 spec_type=spec_type, k=k)
    return cmd if k is not None else cmd.replace(" --spec-draft-n-max None", "")


def draft_length(kind: str, record: dict) -> int | None:
    """--spec-draft-n-max: EAGLE-3, draft model and MTP draft a chain of k; DFlash / DSpark a block that
    llama.cpp sizes from the GGUF (block_size)."""
    return None if kind in ("dflash", "dspark") else int(record.get("num_speculative_tokens") or 1)


def export_gguf(ckpt: Checkpoint, out_dir: Path, source_export: Callable[[str, Path], Path], readme: Readme,
                verifier: str | None = None, dtype: str | None = None, overwrite: bool = False,
                target_gguf: bool = True, llama_cpp: lc.LlamaCppChoice = lc.LlamaCppChoice()) -> Path:
    """Write the llama.cpp folder of `ckpt` at `out_dir` (see the module docstring); returns out_dir.
    `source_export(format, folder)` writes our export the converter reads (export.export, passed in:
    this module sits below the pipeline); `readme` is the kind's writer's."""
    src = source_for(ckpt.kind)
    check_dtype(dtype)
    if dtype not in OUTTYPES:
        raise ValueError(f"--dtype {dtype}: llama.cpp's converter writes {', '.join(v for v in OUTTYPES if v)}")
    out_dir = Path(out_dir)
    ident = identity(ckpt, GGUF_FORMAT, dtype)
    plan_replacement(out_dir, ident, overwrite)  # refused before any work
    target_dir = None if src.in_target else target_folder(
        ckpt, verifier, f"--format gguf converts {ckpt.kind} with the target's HF folder (tokenizer, sizes)")
    with export_dir(out_dir, ident, overwrite) as tmp:
        source = source_export(src.format, tmp / SOURCE_DIR)
        try:
            spec_type, _ = lc.draft_spec(source)  # llama.cpp's refusals, before llama.cpp is looked for
            conversions = convert_all(lc.locate(llama_cpp), source, target_dir, tmp, OUTTYPES[dtype], target_gguf)
        except lc.RefusedExport as e:
            raise ExportRefused(str(e).replace(str(tmp / SOURCE_DIR), f"the {src.format} export")) from None
        except lc.LlamaCppError as e:
            raise GgufError(str(e)) from None
        record = json.loads((source / META_FILE).read_text())
        served = write_record(tmp, ckpt.kind, spec_type, record, conversions, out_dir, target_dir)
        target = target_ref(ckpt.provenance, ckpt.recipe, verifier)
        text = readme_text(GGUF_FORMAT, Readme(readme.name, readme.head_lines), served, target,
                           json.loads((tmp / META_FILE).read_text()))
        (tmp / "README.md").write_text(text + "\n" + readme_extra(target_gguf or src.in_target, target_dir, out_dir))
    return out_dir


def convert_all(llama: lc.LlamaCpp, source: Path, target_dir: Path | None, tmp: Path, outtype: str,
                target_gguf: bool) -> dict:
    """draft.gguf (none for MTP) and target.gguf (MTP: from the export, which is the target) in `tmp`."""
    in_target, out = target_dir is None, {}
    if not in_target:
        out["draft"] = lc.convert_draft(source, target_dir, tmp / DRAFT_GGUF, outtype, llama)
    if target_gguf or in_target:
        out["target"] = lc.convert(source if in_target else target_dir, tmp / TARGET_GGUF, outtype, llama)
    return out


def write_record(tmp: Path, kind: str, spec_type: str, source_record: dict, conversions: dict, out_dir: Path,
                 target_dir: Path | None) -> list[str]:
    """specheads.json of the GGUF folder: the source export's record, retargeted at llama.cpp."""
    k = draft_length(kind, source_record)
    target = str(out_dir / TARGET_GGUF)
    draft = None if "draft" not in conversions else str(out_dir / DRAFT_GGUF)
    served = [serve_command(spec_type, target, draft, k)]
    for role, rec in list(conversions.items()):  # paths as they will be after the rename, not the temp folder's
        conversions[role] = json.loads(json.dumps(rec).replace(str(tmp), str(out_dir)))
        write_json(tmp / f"{Path(rec['gguf']).name}.json", conversions[role])
    record = {key: v for key, v in source_record.items() if key not in ("sha256", "purpose")}
    record.update(format=GGUF_FORMAT, engine={"name": "llama.cpp", "version": LLAMA_CPP.series},
                  source_format=source_record["format"], spec_type=spec_type, spec_draft_n_max=k,
                  target_model_dir=str(target_dir) if target_dir else None, conversions=conversions,
                  gguf_sha256=weight_hashes(tmp, sorted(p.name for p in tmp.glob("*.gguf"))), serve_commands=served)
    write_json(tmp / META_FILE, record)
    return served


def readme_extra(has_target: bool, target_dir: Path | None, out_dir: Path) -> str:
    """How the folder was made, and how to make target.gguf when it was not written."""
    lines = ["## llama.cpp", "",
             f"- `draft.gguf` was converted by llama.cpp {LLAMA_CPP.series}'s own `convert_hf_to_gguf.py` from "
             "`source/` (our export), with the target's folder as `--target-model-dir`; `*.gguf.json` records the "
             "command and the pre-tokenizer the converter wrote.",
             "- Greedy outputs equal llama.cpp without speculation; check with "
             f"`python -m specheads.engines.llamacpp check {shlex.quote(str(out_dir))} --target TARGET`."]
    if not has_target:
        lines.append("- `target.gguf` was not written (--no-target-gguf): make it with `python -m "
                     f"specheads.engines.llamacpp convert {shlex.quote(str(target_dir))} target.gguf`.")
    return "\n".join(lines) + "\n"
