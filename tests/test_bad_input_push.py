"""`specheads push` refuses incomplete or unreadable exports and a hub it cannot reach, in one line."""

from __future__ import annotations

import json
import shutil

import pytest
from refusals import BINARY, LATIN1, refused


@pytest.fixture
def work(tmp_path, random_export_dir):
    """A copy of a real export with eval/metrics.json attached, and an empty folder."""
    export = tmp_path / "export"
    shutil.copytree(random_export_dir, export)
    (export / "eval").mkdir(exist_ok=True)
    (export / "eval" / "metrics.json").write_text(json.dumps({"greedy_equal": True, "tau": 1.5}))
    (tmp_path / "empty").mkdir()
    return tmp_path


def test_not_an_export(work):
    refused(["push", "empty", "--repo", "org/x"], ["'empty' is not an export folder"], work)


def test_export_without_metrics(work):
    (work / "export" / "eval" / "metrics.json").unlink()
    refused(["push", "export", "--repo", "org/x"], ["has no eval/metrics.json", "--attach"], work)


@pytest.mark.parametrize("name,content,needle", [
    ("eval/metrics.json", BINARY, "binary"),
    ("eval/metrics.json", b"{not json", "not valid JSON"),
    ("README.md", LATIN1, "not UTF-8"),
])
def test_unreadable_export_file_is_named(work, name, content, needle):
    (work / "export" / name).write_bytes(content)
    refused(["push", "export", "--repo", "org/x"], [name, needle], work)


def test_bad_repo_id(work):
    refused(["push", "export", "--repo", "not a repo"], ["--repo 'not a repo'"], work)


def test_no_network_is_one_line(work):
    # --license: the tiny target's card names none, and an unknown licence is refused before the hub is asked
    text = refused(["push", "export", "--repo", "org/x", "--endpoint", "http://127.0.0.1:9", "--license", "mit"],
                   ["cannot reach the hub at http://127.0.0.1:9", "nothing was uploaded"], work,
                   HF_HUB_OFFLINE="0", HF_TOKEN="hf_not_a_real_token")
    assert len([ln for ln in text.splitlines() if "error" in ln]) == 1


def test_offline_mode_is_one_line(work):
    refused(["push", "export", "--repo", "org/x", "--license", "mit"], ["cannot reach the hub", "offline mode"], work,
            HF_HUB_OFFLINE="1")
