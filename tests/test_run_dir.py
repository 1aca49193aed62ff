"""train.output_dir: a user's non-empty folder is refused before the target loads (training would
overwrite its metrics.jsonl / latest / best and prune checkpoint-* there) and left byte for byte as
it was, by single-process and torchrun launches alike; a folder that is our run resumes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_atomic import tree_state, user_tree
from test_export import make_head
from test_integrity import cli
from test_train import RECIPE, ROOT, _overrides

from specheads.atomic import OutputRefused
from specheads.config import load_recipe
from specheads.export.checkpoint import RUN_FILE, check_run_dir, is_training_run, latest_checkpoint, save_checkpoint
from specheads.train import train


def users_run_like_folder(root: Path) -> Path:
    """A user's own folder holding files of the names training writes."""
    user_tree(root)
    (root / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    (root / "latest").write_text("my-model-v2\n")
    (root / "best").write_text("my-model-v1\n")
    return root


def test_a_users_folder_is_refused_naming_what_it_holds(tmp_path):
    mine = users_run_like_folder(tmp_path / "mine")
    (tmp_path / "afile").write_text("x")
    before = tree_state(tmp_path)
    with pytest.raises(OutputRefused, match=r"train\.output_dir .*mine is a non-empty folder that is not a specheads "
                                            r"training run.*6 file\(s\).*best.*latest.*Nothing was changed"):
        check_run_dir(mine)
    with pytest.raises(OutputRefused, match=r"afile exists and is not a folder"):
        check_run_dir(tmp_path / "afile")
    assert tree_state(tmp_path) == before
    check_run_dir(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    check_run_dir(tmp_path / "empty")


def test_runs_of_this_and_older_versions_are_ours(tmp_path):
    marked = tmp_path / "marked"  # killed before its first checkpoint: marker + metrics only
    marked.mkdir()
    (marked / RUN_FILE).write_text(json.dumps({"purpose": "train"}))
    (marked / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    older = tmp_path / "older"  # an older version wrote no marker, only checkpoints
    save_checkpoint(older, 2, make_head(), recipe={}, provenance={}, trainer_state={})
    (older / RUN_FILE).unlink(missing_ok=True)
    assert is_training_run(marked) and is_training_run(older)
    check_run_dir(marked)
    check_run_dir(older)
    (marked / RUN_FILE).write_text(json.dumps({"purpose": "export"}))  # not a marker of a run
    assert not is_training_run(marked)


def test_train_refuses_a_users_folder_before_the_target_loads(tiny_target_dir, demo_data_dir, tmp_path, monkeypatch):
    from specheads.target import Target

    mine = users_run_like_folder(tmp_path / "mine")
    before = tree_state(tmp_path)

    def no_load(*args, **kwargs):
        raise AssertionError("the target must not load for a refused output_dir")

    monkeypatch.setattr(Target, "load", staticmethod(no_load))
    with pytest.raises(OutputRefused, match=r"mine is a non-empty folder.*metrics\.jsonl"):
        train(load_recipe(RECIPE, _overrides(tiny_target_dir, demo_data_dir, mine, **{"train.max_steps": 1})))
    run = cli("train", str(RECIPE), *_overrides(tiny_target_dir, demo_data_dir, mine, **{"train.max_steps": 1}))
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    assert f"train.output_dir {mine} is a non-empty folder" in run.stderr and "latest" in run.stderr
    assert tree_state(tmp_path) == before


def test_a_run_killed_before_its_first_checkpoint_starts_again(tiny_target_dir, demo_data_dir, tmp_path):
    """Our marked folder (no checkpoint yet, a partial metrics.jsonl) is trained into, not refused."""
    out = tmp_path / "run"
    out.mkdir()
    (out / RUN_FILE).write_text(json.dumps({"purpose": "train"}))
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "lo')  # cut short by a kill
    ckpt = train(load_recipe(RECIPE, _overrides(tiny_target_dir, demo_data_dir, out, **{"train.max_steps": 2})))
    assert ckpt == latest_checkpoint(out) and ckpt.name == "checkpoint-000002"
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # the killed run's records dropped, this run's logged


def test_torchrun_refuses_a_users_folder_on_every_rank(tiny_target_dir, demo_data_dir, tmp_path):
    mine = users_run_like_folder(tmp_path / "mine")
    before = tree_state(tmp_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "specheads.train", str(RECIPE),
           *_overrides(tiny_target_dir, demo_data_dir, mine, **{"train.max_steps": 1})]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode != 0
    refusals = proc.stderr.count(f"specheads train: error: train.output_dir {mine} is a non-empty folder")
    assert refusals == 2, proc.stderr[-3000:]  # rank 0 decided, both ranks stop with its message
    assert "training" not in proc.stdout
    assert tree_state(tmp_path) == before
