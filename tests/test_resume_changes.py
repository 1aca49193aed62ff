"""A resume continues the recorded run: any recipe change that affects the weights is refused by
name (old -> new) unless --new-phase; max_steps at or below the reached step says nothing was
trained; keys that do not change a weight (resume_plan.FREE_KEYS) change freely; a checkpoint's
recipe.json is always the recipe its weights were trained with."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_train import RECIPE, _overrides

from specheads.cli import main as cli
from specheads.config import load_recipe
from specheads.export.checkpoint import Checkpoint, latest_checkpoint
from specheads.resume_plan import FREE_KEYS, ResumeRefused, plan_resume
from specheads.schedule import lr_factor
from specheads.train import train


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def finished_runs(tiny_target_dir, demo_data_dir, tmp_path_factory):
    """Two 2-step runs: constant schedule (max_steps may grow) and cosine (it may not)."""
    root = tmp_path_factory.mktemp("finished")
    runs = {}
    for schedule in ("constant", "cosine"):
        out = root / schedule
        train(load_recipe(RECIPE, _overrides(tiny_target_dir, demo_data_dir, out, **{
            "train.max_steps": 2, "train.save_every": 1, "train.schedule": schedule, "train.warmup_steps": 0})))
        runs[schedule] = out
    return runs


def _copy(run: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "copy"
    shutil.copytree(run, dest)
    return dest


def _args(tiny_target_dir, demo_data_dir, out, schedule, **extra) -> list[str]:
    return _overrides(tiny_target_dir, demo_data_dir, out, **{
        "train.max_steps": 2, "train.save_every": 1, "train.schedule": schedule, "train.warmup_steps": 0, **extra})


@pytest.mark.parametrize("change, shown", [
    ({"train.lr": 0.5}, "train.lr: 0.003 -> 0.5"),
    ({"head.ttt_steps": 3}, "head.ttt_steps: 2 -> 3"),
    ({"train.batch_size": 8}, "train.batch_size: 4 -> 8"),
    ({"train.seed": 1, "train.weight_decay": 0.1}, "train.seed: 0 -> 1; train.weight_decay: 0.0 -> 0.1"),
    ({"data.train": "[OTHER]"}, "data.train: ["),
])
def test_a_changed_recipe_is_refused_naming_each_key(finished_runs, tiny_target_dir, demo_data_dir, tmp_path,
                                                     capsys, change, shown):
    out = _copy(finished_runs["constant"], tmp_path)
    if change.get("data.train") == "[OTHER]":
        other = tmp_path / "other.jsonl"
        other.write_text((demo_data_dir / "train.jsonl").read_text())
        change = {"data.train": f"[{other}]"}
    before = (out / "checkpoint-000002" / "recipe.json").read_bytes()
    args = _args(tiny_target_dir, demo_data_dir, out, "constant", **{"train.max_steps": 4, **change})
    assert cli(["train", str(RECIPE), *args]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"resuming {out / 'checkpoint-000002'} (step 2) with a changed recipe" in err
    assert shown in err and "--new-phase" in err and "train.max_steps: 2 -> 4" not in err  # constant: free
    assert latest_checkpoint(out).name == "checkpoint-000002"  # nothing trained
    assert (out / "checkpoint-000002" / "recipe.json").read_bytes() == before


def test_max_steps_at_or_below_the_reached_step(finished_runs, tiny_target_dir, demo_data_dir, tmp_path, capsys):
    out = _copy(finished_runs["constant"], tmp_path)
    assert cli(["train", str(RECIPE), *_args(tiny_target_dir, demo_data_dir, out, "constant",
                                             **{"train.max_steps": 1})]) == 1
    err = capsys.readouterr().err
    assert f"the run in {out} is at step 2 (checkpoint-000002) and train.max_steps=1 is below that: nothing " \
           "was trained" in err and "raise train.max_steps above 2" in err
    # the same command again on a finished run: exit 0, and it says nothing was trained
    assert cli(["train", str(RECIPE), *_args(tiny_target_dir, demo_data_dir, out, "constant")]) == 0
    printed = capsys.readouterr().out
    assert "already at train.max_steps=2 (checkpoint-000002): nothing to train" in printed
    assert f"checkpoint: {out / 'checkpoint-000002'}" in printed
    # ... but with a change it is refused: the change would silently not apply
    assert cli(["train", str(RECIPE), *_args(tiny_target_dir, demo_data_dir, out, "constant",
                                             **{"train.lr": 0.5})]) == 1
    assert "Your changes were not applied: train.lr: 0.003 -> 0.5" in capsys.readouterr().err


def test_a_longer_cosine_run_is_refused_a_constant_one_trains_on(finished_runs, tiny_target_dir, demo_data_dir,
                                                                 tmp_path, capsys):
    out = _copy(finished_runs["cosine"], tmp_path)
    assert cli(["train", str(RECIPE), *_args(tiny_target_dir, demo_data_dir, out, "cosine",
                                             **{"train.max_steps": 4})]) == 1
    err = capsys.readouterr().err
    assert "train.max_steps: 2 -> 4" in err and "The cosine schedule is spread over train.max_steps: it already " \
           "ended at its final learning rate, which would rise again" in err
    assert latest_checkpoint(out).name == "checkpoint-000002"
    # constant: max_steps does not change the schedule; free keys (log/save intervals, a copied
    # output_dir) change freely too
    out = _copy(finished_runs["constant"], tmp_path / "c")
    ckpt = train(load_recipe(RECIPE, _args(tiny_target_dir, demo_data_dir, out, "constant", **{
        "train.max_steps": 3, "train.log_every": 2, "train.save_every": 5, "train.keep_last": 3})))
    assert ckpt.name == "checkpoint-000003" and "resumed from" in capsys.readouterr().out
    assert Checkpoint(ckpt).recipe["train"]["lr"] == 0.003
    assert {"train.output_dir", "train.log_every", "train.save_every"} <= FREE_KEYS


def test_new_phase_trains_with_the_change_and_records_it(finished_runs, tiny_target_dir, demo_data_dir, tmp_path,
                                                         capsys):
    out = _copy(finished_runs["cosine"], tmp_path)
    args = _args(tiny_target_dir, demo_data_dir, out, "cosine", **{"train.max_steps": 4, "train.lr": 0.001})
    assert cli(["train", str(RECIPE), *args, "--new-phase"]) == 0
    printed = capsys.readouterr().out
    assert f"new phase 2 from {out / 'checkpoint-000002'} (train.lr 0.003 -> 0.001, train.max_steps 2 -> 4)" in printed
    ckpt = Checkpoint(out)
    assert ckpt.trainer_state["step"] == 4 and ckpt.recipe["train"]["lr"] == 0.001  # recipe.json = what trained it
    assert ckpt.trainer_state["phases"] == [
        {"start_step": 0},
        {"start_step": 2, "from": "checkpoint-000002", "changed": {"train.lr": [0.003, 0.001],
                                                                  "train.max_steps": [2, 4]}}]
    lrs = [r["lr"] for r in _records(out)]
    # a fresh cosine over steps 2..4 at the new peak (a record holds the lr of the step after it)
    assert lrs[2:] == pytest.approx([0.001 * lr_factor(s, 2, 0, "cosine") for s in (1, 2)])
    # resuming inside the phase is exact and keeps the phase record; the same recipe needs no flag
    (out / "latest").write_text("checkpoint-000003\n")
    shutil.rmtree(out / "checkpoint-000004")
    train(load_recipe(RECIPE, args))
    assert [r["lr"] for r in _records(out)] == pytest.approx(lrs)
    assert Checkpoint(out).trainer_state["phases"][-1]["start_step"] == 2


def test_plan_resume_on_recorded_dicts():
    saved = {"train": {"max_steps": 10, "schedule": "cosine", "lr": 1e-3, "log_every": 5}, "head": {"ttt_steps": 3}}
    now = json.loads(json.dumps(saved))
    ckpt = Path("/runs/x/checkpoint-000004")
    assert plan_resume(ckpt, saved, {"step": 4}, now).step == 4
    now["train"]["log_every"] = 1
    assert not plan_resume(ckpt, saved, {"step": 4}, now).new_phase
    now["head"]["ttt_steps"] = 5
    now["train"]["max_steps"] = 12
    with pytest.raises(ResumeRefused, match=r'train\.schedule: "cosine" -> "constant"\. A resume'):
        plan_resume(ckpt, saved, {"step": 4}, {**now, "head": saved["head"], "train": {**now["train"], "schedule": "constant"}})
    with pytest.raises(ResumeRefused, match=r"head\.ttt_steps: 3 -> 5; train\.max_steps: 10 -> 12\. The cosine"):
        plan_resume(ckpt, saved, {"step": 4}, now)
    plan = plan_resume(ckpt, saved, {"step": 4}, now, new_phase=True)
    assert plan.new_phase and plan.phase_start == 4 and plan.phases[-1]["changed"]["head.ttt_steps"] == [3, 5]
    assert plan_resume(None, {}, {}, now).checkpoint is None
