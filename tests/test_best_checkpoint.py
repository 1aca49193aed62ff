"""Checkpoint selection by the validation split's expected accepted length (teacher-forced tau), not
by loss: a validation that beats every kept checkpoint is saved and becomes `best`, and the metric
is recorded in metrics.jsonl and the checkpoint's trainer_state.json."""

from __future__ import annotations

import json

from test_train import RECIPE, _overrides

from specheads.config import load_recipe
from specheads.data.samples import prepare_samples
from specheads.eval.offline import offline_acceptance
from specheads.export.checkpoint import Checkpoint, checkpoints
from specheads.schedule import validation_split
from specheads.target import Target
from specheads.train import train


def test_best_checkpoint_is_the_best_validated_tau(tiny_target_dir, demo_data_dir, tmp_path):
    """Validation every step, checkpoints only at the end: the best step is kept all the same, with
    the Muon optimizer (whose state the checkpoints carry)."""
    out = tmp_path / "run"
    recipe = load_recipe(RECIPE, _overrides(tiny_target_dir, demo_data_dir, out, **{
        "train.max_steps": 6, "train.save_every": 100, "train.val_every": 1, "train.val_samples": 10,
        "train.keep_last": 1, "train.optimizer": "muon", "train.lr": 2e-2}))
    train(recipe)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    taus = {r["step"]: r["val_tau"] for r in records if "val_tau" in r}
    assert sorted(taus) == [1, 2, 3, 4, 5, 6]
    running = [max(taus[s] for s in taus if s <= step) for step in sorted(taus)]
    assert [r["best_val_tau"] for r in records if "val_tau" in r] == running
    best_step = min(s for s in taus if taus[s] == max(taus.values()))
    best = out / (out / "best").read_text().strip()
    assert best.name == f"checkpoint-{best_step:06d}"
    # kept: the best and the latest; the saves of improvements the best later beat are pruned
    assert {c.name for c in checkpoints(out)} == {best.name, "checkpoint-000006"}
    state = Checkpoint(best).trainer_state
    assert state["val_tau"] == max(taus.values()) and state["step"] == best_step
    # the recorded metric is the offline tau of those very weights (EAGLE-3: teacher-forced, in decode order)
    target = Target.load(str(tiny_target_dir), device="cpu")
    samples = prepare_samples(recipe, target.tokenizer, report=lambda *_: None)
    held = [samples[i] for i in validation_split(len(samples), 10, 0)[1]]
    offline = offline_acceptance(target, Checkpoint(best).build_head(), held)
    assert abs(offline["decode_order"]["tau"] - state["val_tau"]) < 1e-5
