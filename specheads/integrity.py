"""Checksums and weight sanity: every weight or shard file we write has its sha256 recorded next to
it (checkpoint, export, capture), and every reader checks it, so flipped bits or a truncated copy
are refused by name instead of being trained on, exported or served."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)
BLOCK = 4 << 20  # bytes read per update: large blocks keep hashing I/O-bound


class IntegrityError(ValueError):
    """A file whose bytes are not what was written, or weights that are not finite."""


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, streamed in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(BLOCK):
            h.update(block)
    return h.hexdigest()


def file_hashes(folder: str | Path, names) -> dict[str, str]:
    """{name: sha256} for the named files of `folder` that exist."""
    folder = Path(folder)
    return {n: sha256_file(folder / n) for n in names if (folder / n).is_file()}


def verify_file(path: str | Path, expected: str | None, remedy: str, error: type = IntegrityError) -> None:
    """Refuse `path` when its sha256 differs from the recorded one (None: nothing recorded, skip)."""
    path = Path(path)
    if expected is None:
        return
    if not path.is_file():
        raise error(f"{path}: missing; {remedy}")
    if sha256_file(path) != expected:
        raise error(f"{path}: checksum mismatch (its bytes changed since it was written: corrupted or "
                    f"truncated copy); {remedy}")


def verify_files(folder: str | Path, recorded: dict[str, str] | None, remedy: str,
                 error: type = IntegrityError, where: str | None = None) -> None:
    """Check every file `recorded` lists; a folder written before checksums were recorded gets a
    one-line notice instead (older versions stay loadable)."""
    folder = Path(folder)
    if recorded is None:
        log.warning("%s: no checksums recorded (written by an older specheads); not verified", where or folder)
        return
    for name, digest in recorded.items():
        verify_file(folder / name, digest, remedy, error)


def read_safetensors(path: str | Path, remedy: str, error: type = IntegrityError) -> dict[str, torch.Tensor]:
    """load_file with a missing, truncated or corrupt file reported by name (never SafetensorError)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise error(f"{path}: missing; {remedy}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise error(f"{path}: cannot be read as safetensors ({str(err)[:160]}); the file is truncated or "
                    f"corrupt: {remedy}") from None


def check_finite(tensors: dict[str, torch.Tensor], where: str, remedy: str, error: type = IntegrityError) -> None:
    """Refuse weights holding NaN or inf, naming the first tensors that do."""
    bad = [name for name, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise error(f"{where}: tensor(s) {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''} hold NaN or inf "
                    f"values; {remedy}")
