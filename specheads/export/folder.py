"""The export folder as a whole: what may be replaced by an export, what a re-export keeps, and the
checksums of its weight files.

`--out` is replaced only when it is an earlier export (its specheads.json says so) of the same
format (another format's export is replaced only with `overwrite`); any other non-empty folder
(a training run, a checkpoint, the user's files) is refused with what it holds.
An earlier export may carry attachments made after it was written (`eval --attach`: `eval/` and the
README's "Recommended settings"): a re-export of the same weights (same checkpoint file, format and
dtype) keeps them, since they measured exactly these weights; a different export refuses to drop
them unless `overwrite`. Files a user added to an export are refused the same way.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from specheads.atomic import OutputRefused, atomic_dir, check_output
from specheads.export.contract_rules import META_FILE
from specheads.export.readme import RECOMMENDED
from specheads.integrity import IntegrityError, sha256_file, verify_files

PURPOSE = "export"  # specheads.json "purpose": marks a folder `specheads export` wrote
ATTACHED_DIR = "eval"
SHA_KEY = "sha256"  # specheads.json: {relative path: sha256} of every weight file
REEXPORT_HINT = "choose another --out, or move or remove it yourself"


def read_record(folder: Path) -> dict | None:
    """specheads.json of `folder` when it is an export we wrote (older versions: no purpose field)."""
    try:
        record = json.loads((folder / META_FILE).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict):
        return None
    ours = record.get("purpose") == PURPOSE or {"format", "export_provenance", "checkpoint_provenance"} <= set(record)
    return record if ours else None


def is_export(folder: Path) -> bool:
    return read_record(folder) is not None


def recommended_section(readme: str) -> str | None:
    """The README's "Recommended settings" section (to its end or the next `## `), if any."""
    lines = readme.rstrip("\n").split("\n")
    if RECOMMENDED not in lines:
        return None
    start = lines.index(RECOMMENDED)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "\n".join(lines[start:end]).rstrip("\n") + "\n"


@dataclass
class Replacement:
    """What happens to an earlier export at `--out`."""

    old: Path | None  # the earlier export (None: nothing there)
    keep_attachments: bool  # carry eval/ and the recommended settings into the new export


def attachments(folder: Path) -> list[str]:
    """What `eval --attach` added to an export folder."""
    found = [f"{ATTACHED_DIR}/"] if (folder / ATTACHED_DIR).is_dir() else []
    readme = folder / "README.md"
    if readme.is_file() and recommended_section(readme.read_text(errors="replace")):
        found.append('README.md "Recommended settings"')
    return found


def plan_replacement(out_dir: Path, identity: dict, overwrite: bool) -> Replacement:
    """Refuse (before any work) an `--out` that is not ours, or whose attachments would be lost."""
    check_output(out_dir, is_export, "an export folder", REEXPORT_HINT)
    record = read_record(out_dir) if out_dir.is_dir() else None
    if record is None:
        return Replacement(None, False)
    old_fmt, new_fmt = record.get("format"), identity.get("format")
    if old_fmt and new_fmt and old_fmt != new_fmt and not overwrite:
        raise OutputRefused(
            f"{out_dir} is an earlier export in format {old_fmt}; writing format {new_fmt} there would replace it. "
            f"Nothing was changed: choose another --out for {new_fmt} (e.g. {out_dir.parent / new_fmt}), or pass "
            "--overwrite to replace it")
    attached = attachments(out_dir)
    same = all(record.get(k) == v for k, v in identity.items())
    if attached and not same and not overwrite:
        raise OutputRefused(
            f"{out_dir} is an earlier export of other weights ({_identity_text(record, identity)}) with eval "
            f"results attached ({', '.join(attached)}), which describe those weights and would be lost. Nothing "
            f"was changed: pass --overwrite to replace it and drop them, or {REEXPORT_HINT}")
    return Replacement(out_dir, bool(attached) and same)


def _identity_text(record: dict, identity: dict) -> str:
    diff = [k for k, v in identity.items() if record.get(k) != v]
    return ", ".join(f"{k} {record.get(k)!r} there, {identity[k]!r} now" for k in diff)


def carry_over(rep: Replacement, tmp: Path) -> None:
    """Copy the earlier export's attachments into the new export being built in `tmp`."""
    if rep.old is None or not rep.keep_attachments:
        return
    if (rep.old / ATTACHED_DIR).is_dir():
        shutil.copytree(rep.old / ATTACHED_DIR, tmp / ATTACHED_DIR)
    old_readme, new_readme = rep.old / "README.md", tmp / "README.md"
    section = recommended_section(old_readme.read_text(errors="replace")) if old_readme.is_file() else None
    if section and new_readme.is_file():
        new_readme.write_text(new_readme.read_text().rstrip("\n") + "\n\n" + section)


def check_nothing_else_lost(rep: Replacement, tmp: Path, overwrite: bool) -> None:
    """Refuse to drop files a user added to the earlier export (anything the new one lacks)."""
    if rep.old is None or overwrite:
        return
    lost = sorted(str(p.relative_to(rep.old)) for p in rep.old.rglob("*")
                  if (p.is_file() or p.is_symlink()) and not (tmp / p.relative_to(rep.old)).exists())
    if lost:
        raise OutputRefused(
            f"{rep.old} is an earlier export holding files this export does not write ({', '.join(lost[:5])}"
            f"{' ...' if len(lost) > 5 else ''}), which would be lost. Nothing was changed: pass --overwrite to "
            f"replace it anyway, or {REEXPORT_HINT}")


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link `src` (a target's file an export carries unchanged); copy it where links fail."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def weight_hashes(folder: Path, names: list[str] | None = None) -> dict[str, str]:
    """{relative path: sha256} of the named files, default every *.safetensors under `folder`."""
    names = names if names is not None else sorted(str(p.relative_to(folder)) for p in folder.rglob("*.safetensors"))
    return {n: sha256_file(folder / n) for n in names}


def verify_export(folder: Path, record: dict) -> None:
    """Check the export's weight files against specheads.json (older exports: a notice)."""
    verify_files(folder, record.get(SHA_KEY), "export the checkpoint again", IntegrityError,
                 where=f"export {folder}")


def identity(ckpt, fmt: str, dtype: str | None) -> dict:
    """What makes two exports the same weights: checkpoint file, format, requested dtype."""
    return {"checkpoint_sha256": ckpt.weights_sha256, "format": fmt, "export_dtype": dtype}


@contextmanager
def export_dir(out_dir: Path, ident: dict, overwrite: bool = False):
    """atomic_dir for an export: yields the temp folder the writer fills (specheads.json included);
    then carries over attachments, refuses to drop anything else, and records the purpose, the
    identity and the weight checksums in specheads.json."""
    rep = plan_replacement(out_dir, ident, overwrite)
    with atomic_dir(out_dir, owned=is_export, what="an export folder", hint=REEXPORT_HINT) as tmp:
        yield tmp
        record = json.loads((tmp / META_FILE).read_text())
        record.update(purpose=PURPOSE, **ident)
        record[SHA_KEY] = weight_hashes(tmp, _written_weights(tmp))
        (tmp / META_FILE).write_text(json.dumps(record, indent=2) + "\n")
        carry_over(rep, tmp)
        check_nothing_else_lost(rep, tmp, overwrite)


def _written_weights(folder: Path) -> list[str]:
    """*.safetensors this export wrote (a target's shards hard-linked into an MTP export are the
    target's files, not ours: not hashed)."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*.safetensors") if p.stat().st_nlink == 1)
