"""Which weights an eval measured: `metrics.json` "draft_weights" holds the sha256 of every weight
file of the drafter it decoded with, so that `serve` (its automatic choice), `push` and the model card
can tell an eval of these weights from one copied beside other weights (e.g. a 300-step export's
`eval/` in a 2-step export) and refuse or ignore it, naming both hashes.

The hashes are those an export records in its specheads.json (checked against the files whenever the
export is loaded); a folder without them (another trainer's) has its *.safetensors hashed here.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from specheads.integrity import sha256_file

KEY = "draft_weights"  # metrics.json: {"files": {relative path: sha256}, "sha256": digest of them all}
META_FILE = "specheads.json"
REMEDY = "rerun `specheads eval --draft {folder} ... --attach` to measure these weights"


def draft_weights(folder: str | Path) -> dict:
    """{"files": {relative path: sha256}, "sha256": one digest over them} of the drafter at `folder`."""
    folder = Path(folder)
    files = _recorded(folder)
    if files is None:
        files = {p.relative_to(folder).as_posix(): sha256_file(p) for p in sorted(folder.rglob("*.safetensors"))
                 if p.relative_to(folder).parts[0] != "eval"}
    digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
    return {"files": files, "sha256": digest}


def _recorded(folder: Path) -> dict | None:
    """The weight checksums specheads.json records (None: none recorded)."""
    try:
        record = json.loads((folder / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    files = record.get("sha256") if isinstance(record, dict) else None
    return dict(sorted(files.items())) if isinstance(files, dict) and files else None


def short(digest: str | None) -> str:
    return f"{digest[:12]}…" if digest else "unrecorded"


def eval_mismatch(metrics: dict, folder: str | Path, path: Path | str) -> tuple[bool, str] | None:
    """None when the eval at `path` measured the weights at `folder`; else (other, why): `other` True
    when it records other weights' hash, False when it records none (written by an older specheads)."""
    recorded = metrics.get(KEY)
    measured = recorded.get("sha256") if isinstance(recorded, dict) else None
    here = draft_weights(folder)["sha256"]
    if measured is None:
        return False, (f"{path} records no hash of the weights it measured (written by an older specheads): "
                       f"nothing shows it measured the weights at {folder} (sha256 {short(here)}); "
                       + REMEDY.format(folder=folder))
    if measured != here:
        return True, (f"{path} measured other weights (sha256 {short(measured)}) than those at {folder} "
                      f"(sha256 {short(here)}): its numbers are not these weights'; " + REMEDY.format(folder=folder))
    return None


def history_warning(metrics: dict | None) -> str | None:
    """The eval's flag when its `--suffix-history` held the evaluated prompts or their answers (suffix
    decoding then replays what it is asked to predict: its rows read high); None otherwise."""
    history = (metrics or {}).get("suffix_history")
    return history.get("warning") if isinstance(history, dict) else None
