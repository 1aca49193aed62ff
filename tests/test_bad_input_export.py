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


def test_a_run_folder_exports_its_one_training_output_dir(work):
    (work / "demo").mkdir()
    shutil.move(str(work / "run"), str(work / "demo" / "checkpoint"))
    r = cli(["export", "demo", "--format", "vllm", "--out", "out"], work)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (work / "out" / "config.json").is_file()


def test_a_folder_of_several_runs_names_them(work):
    (work / "runs").mkdir()
    for name in ("a", "b"):
        shutil.copytree(work / "run", work / "runs" / name)
    refused(["export", "runs", "--format", "vllm", "--out", "out"],
            ["runs: not a specheads checkpoint", "runs/a", "runs/b", "pass one of them"], work, output=work / "out")


def test_an_export_of_another_format_is_not_replaced_silently(work):
    assert cli(["export", "run", "--format", "vllm", "--out", "exp"], work).returncode == 0
    refused(["export", "run", "--format", "sglang", "--out", "exp"],
            ["exp is an earlier export in format vllm", "format sglang there would replace it", "--overwrite"], work)
    r = cli(["export", "run", "--format", "sglang", "--out", "exp", "--overwrite"], work)
    assert r.returncode == 0, r.stderr[-3000:]
