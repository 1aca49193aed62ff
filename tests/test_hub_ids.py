"""Hub ids (`org/name`) name a target or a drafter: resolved through huggingface_hub's cache.

There is no hub here: each test lays out a hub cache folder as huggingface_hub writes one
(`models--org--name/snapshots/<rev>/...` and `refs/main`) with the tiny target's files and a
random export, and runs the real CLI with HF_HUB_CACHE pointing at it and HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.refusals import cli, refused

REVISION = "0123456789abcdef0123456789abcdef01234567"


def cache_model(cache: Path, repo_id: str, files: Path) -> Path:
    """Copy `files` into `cache` as the hub cache's snapshot of `repo_id` at REVISION."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / REVISION
    shutil.copytree(files, snapshot, symlinks=False)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


def test_generate_takes_hub_ids_from_the_hub_cache(tmp_path, tiny_target_dir, random_export_dir):
    cache = tmp_path / "hub"
    cache_model(cache, "acme/tiny", tiny_target_dir)
    cache_model(cache, "acme/tiny-eagle3", random_export_dir)
    r = cli(["generate", "--target", "acme/tiny", "--draft", "acme/tiny-eagle3", "--prompt", "def f(x):",
             "--max-new-tokens", "4", "--device", "cpu"], tmp_path, HF_HUB_CACHE=str(cache))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "greedy" in (r.stdout + r.stderr)


def test_a_hub_id_offline_and_not_cached_names_the_download_command(tmp_path, random_export_dir):
    cache = tmp_path / "hub"
    cache.mkdir()
    text = refused(["generate", "--target", "acme/absent", "--draft", str(random_export_dir), "--prompt", "hi"],
                   ["target 'acme/absent'", "HF_HUB_OFFLINE=1", "hf download acme/absent",
                    "huggingface-cli download acme/absent"], tmp_path, HF_HUB_CACHE=str(cache))
    assert str(cache) in text


def test_resolve_folder_prefers_an_existing_local_folder(tmp_path, monkeypatch):
    from specheads.model_ref import resolve_folder

    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_folder("org/name", "target") == Path("org/name")
