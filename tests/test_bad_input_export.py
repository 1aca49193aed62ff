"""`specheads export` and the CLI itself refuse bad input by name, without a traceback."""

from __future__ import annotations

import shutil

import pytest
from refusals import cli, refused


@pytest.fixture
def work(tmp_path, random_export_dir):
    """A copy of a real training output folder (checkpoint-000001 + latest)."""
    shutil.copytree(random_export_dir.parent / "run", tmp_path / "run")
    (tmp_path / "empty").mkdir()
    return tmp_path


@pytest.mark.parametrize("args,needles", [
    (["nope", "--format", "vllm"], ["nope: not a specheads checkpoint"]),
    (["empty", "--format", "vllm"], ["empty: not a specheads checkpoint"]),
    (["run", "--format", "bogus"], ["--format", "invalid choice: 'bogus'"]),
    (["run", "--format", "medusa"], ["format 'medusa'", "'eagle3'", "vllm, vllm-native, sglang"]),
    (["run", "--format", "vllm", "--adapter", "merge"], ["--adapter", "'eagle3'"]),
    (["run", "--format", "vllm", "--num-speculative-tokens", "0"], ["--num-speculative-tokens 0"]),
    (["run", "--format", "vllm", "--num-speculative-tokens", "-2"], ["--num-speculative-tokens -2"]),
])
def test_bad_export_is_named(work, args, needles):
    refused(["export", *args, "--out", "out"], needles, work, output=work / "out")
    assert not (work / "out").exists()


def test_unknown_verb_is_named(tmp_path):
    r = cli(["nosuchverb"], tmp_path)
    assert r.returncode == 2 and "unknown verb 'nosuchverb'" in r.stderr and "Traceback" not in r.stderr
