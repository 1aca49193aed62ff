"""Where a named model lives: a local folder, or a Hugging Face hub id (`org/name`) resolved
through `huggingface_hub` — the one home for turning `--target` / `--draft` / a recipe's
`target.path` into a folder on disk.

A path that exists is used as is. Otherwise a name shaped like a hub id is looked up in the hub
cache first (`HF_HUB_CACHE`, offline), then downloaded unless `HF_HUB_OFFLINE=1`; when neither
works the message names the download command. huggingface_hub is imported only here and only
for a hub id, so local folders cost no import.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*(@[A-Za-z0-9_.-]+)?$")
OFFLINE_ENV = "HF_HUB_OFFLINE"


class ModelRefError(ValueError):
    """A model name that is neither a local folder nor a hub id we can get (the message says how)."""


def offline() -> bool:
    return os.environ.get(OFFLINE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def download_command(repo_id: str, revision: str | None = None) -> str:
    rev = f" --revision {revision}" if revision else ""
    return f"`hf download {repo_id}{rev}` (or `huggingface-cli download {repo_id}{rev}`)"


def resolve_folder(name: str, what: str) -> Path:
    """`name` -> a local folder: the path itself when it exists, else the hub id's snapshot.
    `what` names the option in messages (e.g. "target", "--draft")."""
    folder = Path(name).expanduser()
    if folder.exists() or not HUB_ID.match(name):
        return folder
    repo_id, _, revision = name.partition("@")
    return _snapshot(repo_id, revision or None, what)


def _snapshot(repo_id: str, revision: str | None, what: str) -> Path:
    """The hub cache's snapshot of `repo_id` (downloaded when online and not cached)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        pass
    where = f"{what} '{repo_id}': no local folder of that name and not in the hub cache ({_cache_dir()})"
    if offline():
        raise ModelRefError(f"{where}, and {OFFLINE_ENV}=1 forbids downloading. Download it first with "
                            f"{download_command(repo_id, revision)}, or pass a local folder")
    try:
        return Path(snapshot_download(repo_id, revision=revision))
    except Exception as err:  # noqa: BLE001 - any hub failure becomes one line naming what to do
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise ModelRefError(f"{where}; downloading it failed ({first}). Download it with "
                            f"{download_command(repo_id, revision)} (a gated model needs `hf auth login` "
                            "first), or pass a local folder") from None


def _cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def resolve_draft(name: str | Path) -> Path:
    """A `--draft`: an export folder, or a hub id whose snapshot is one; refused by name otherwise."""
    folder = resolve_folder(str(name), "--draft")
    if not folder.is_dir():
        raise FileNotFoundError(f"draft folder '{name}' does not exist: pass an export folder written by "
                                "`specheads export` or a hub id (org/name)")
    return folder
