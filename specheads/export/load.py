"""What every kind's load-back shares: an export's own record (specheads.json) as ExportMeta, and
reading its JSON and safetensors files with errors that name the file.

The verifier and the evaluation load exports, not training checkpoints, so what is tested is
what users serve. Each kind's module (export/<kind>.py, `load_export`) rebuilds the head from
config.json alone (as the engines do); specheads.json only adds training-only fields and the
target fingerprint. Folders other trainers wrote are read by export/foreign.py.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from specheads.export.contract_rules import META_FILE, ContractError, Violation
from specheads.target import TargetError, check_fingerprint


@dataclass
class ExportMeta:
    """What an export says about itself: format, the target it was trained for, how to serve it."""

    folder: Path
    format: str
    kind: str
    target: dict | None  # the training target's fingerprint (Target.fingerprint), None if unrecorded
    head_config: dict | None
    num_speculative_tokens: int | None
    serve_commands: list[str] = field(default_factory=list)
    record: dict = field(default_factory=dict)  # the whole specheads.json

    def check_target(self, target, allow_missing: bool = False) -> bool:
        """Refuse a loaded `Target` whose vocabulary or embedding differs from the training target's.

        The one fingerprint policy of every verb: a specheads export without a recorded
        fingerprint is refused unless `allow_missing` (the CLI's --allow-missing-fingerprint);
        another trainer's folder never has one and is only warned about. -> whether it was checked.
        """
        if self.target is not None:
            check_fingerprint(self.target, target, f"the head exported at {self.folder}")
            return True
        if not (is_foreign(self) or allow_missing):
            raise TargetError(f"{self.folder}: {META_FILE} records no target fingerprint, so nothing shows "
                              "the head was trained for this target; export it again with specheads to "
                              "record one, or pass --allow-missing-fingerprint to use it unchecked")
        why = "was written by another trainer" if is_foreign(self) else "records no target fingerprint"
        logging.getLogger(__name__).warning(
            "%s %s: nothing to check it against the target; the verifier still checks the vocabulary, "
            "width and taps fit", self.folder, why)
        return False


def is_foreign(meta: ExportMeta) -> bool:
    """True for a folder another trainer wrote (it has no specheads.json: export/foreign.py reads it)."""
    return not meta.record


def read_json(path: Path, fmt: str = "?") -> dict:
    """A JSON file of an export; ContractError naming the file when it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ContractError(path.parent, fmt, [Violation(str(path), "a readable JSON file", str(err),
                                                         "point at an export folder written by specheads")]) from None


def read_record_meta(folder: str | Path) -> ExportMeta | None:
    """The ExportMeta an export's specheads.json records (None: the folder has none); its kind and
    format are required fields."""
    folder = Path(folder)
    if not (folder / META_FILE).is_file():
        return None
    record = read_json(folder / META_FILE)
    for key in ("kind", "format"):
        if not isinstance(record.get(key), str):
            raise ValueError(f"{folder / META_FILE}: no \"{key}\" field (a string naming the export's {key}); "
                             "export the checkpoint again with specheads")
    return ExportMeta(
        folder=folder, format=record["format"], kind=record["kind"], target=record.get("target"),
        head_config=record.get("head_config"), num_speculative_tokens=record.get("num_speculative_tokens"),
        serve_commands=list(record.get("serve_commands") or []), record=record,
    )


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file of an export (never a pickle); ContractError naming it when unreadable."""
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise ContractError(path.parent, "?", [Violation(str(path), "a readable safetensors file", str(err),
                                                         "the file is truncated or corrupt; export again")]) from None
