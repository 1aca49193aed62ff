"""What a resumed training run may change, and what a new phase records.

A resume continues the run exactly as its latest checkpoint's recipe.json says: every recipe key
that changes the trained weights must be as recorded there, or the run is refused naming each
changed key with its old and new value. `specheads train ... --new-phase` is the explicit way to
change them: the new phase starts from the checkpoint's weights with a fresh optimizer and a fresh
learning-rate schedule over the steps from there to train.max_steps (max_steps always counts the
run's steps from 0), and each checkpoint's trainer_state.json lists the phases with what changed.
So a checkpoint's recipe.json is always the recipe its last phase trained with.

FREE_KEYS is the one list of keys that may change on a resume: where things are written and
logged, how often, which checkpoints are kept, how long a collective waits, how the frozen
target is laid out on the processes. None of them changes a weight.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

FREE_KEYS = frozenset({
    "target.path",  # a moved or copied target: its tokenizer and embedding fingerprint is checked instead
    "target.device",
    "train.output_dir",  # a copied run
    "train.resume",
    "train.log_every", "train.report_to", "train.project", "train.progress",
    "train.save_every", "train.keep_last", "train.keep_best",
    "train.val_every", "train.val_batch_size",  # validation reads the weights, never changes them
    "train.num_workers", "train.dist_timeout", "train.shard_target",
    "export.formats",  # checked against the head's options; not used in training
})
MAX_STEPS = "train.max_steps"  # free only where the schedule does not depend on it (constant)
NEW_PHASE_FLAG = "--new-phase"


class ResumeRefused(ValueError):
    """A resume that would not continue the recorded run (changed recipe, nothing left to train)."""


@dataclass
class ResumePlan:
    """Where training starts: the checkpoint resumed from (None: from scratch), its step, and the phase."""

    checkpoint: Path | None = None
    step: int = 0
    phase_start: int = 0  # the step the current phase began at: the schedule counts from there
    phases: list[dict] = field(default_factory=list)  # trainer_state "phases" (empty: one phase so far)
    new_phase: bool = False  # fresh optimizer and scheduler from the checkpoint's weights
    finished: bool = False  # the run is already at train.max_steps with this recipe: nothing to train

    def describe(self) -> str:
        if self.checkpoint is None:
            return ""
        if self.new_phase:
            changed = self.phases[-1]["changed"]
            what = ", ".join(f"{k} {_show(o)} -> {_show(n)}" for k, (o, n) in changed.items()) or "no recipe change"
            return f", new phase {len(self.phases)} from {self.checkpoint} ({what})"
        return f", resumed from {self.checkpoint}"


def flatten(d: dict, prefix: str = "") -> dict:
    """{'train': {'lr': 1}} -> {'train.lr': 1}; lists are values."""
    out = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        out.update(flatten(value, name + ".") if isinstance(value, dict) else {name: value})
    return out


def _show(value) -> str:
    return json.dumps(value)


def recipe_changes(saved: dict, current: dict) -> dict[str, tuple]:
    """{key: (recorded, now)} of every result-affecting key that differs (max_steps excluded); a key
    an older version did not record is not compared."""
    old, new = flatten(saved), flatten(current)
    return {k: (old[k], new.get(k)) for k in sorted(old)
            if k not in FREE_KEYS and k != MAX_STEPS and k in new and old[k] != new[k]}


def schedule_uses_max_steps(recipe_dict: dict) -> bool:
    """cosine and wsd spread over max_steps; constant (after warmup) does not."""
    return (recipe_dict.get("train") or {}).get("schedule", "cosine") != "constant"


def _listing(changes: dict[str, tuple]) -> str:
    return "; ".join(f"{k}: {_show(o)} -> {_show(n)}" for k, (o, n) in changes.items())


def _nothing_to_train(ckpt: Path, step: int, max_steps: int, changes: dict) -> str:
    reached = f"the run in {ckpt.parent} is at step {step} ({ckpt.name})"
    if max_steps < step:
        why = f"train.max_steps={max_steps} is below that"
    else:
        why = f"train.max_steps={max_steps} asks for no further step"
    unapplied = f" Your changes were not applied: {_listing(changes)}." if changes else ""
    return (f"{reached} and {why}: nothing was trained.{unapplied} To train on, raise train.max_steps above "
            f"{step}; for an earlier state, export one of its checkpoint-NNNNNN folders")


def _refusal(ckpt: Path, step: int, changes: dict, schedule_note: str) -> str:
    return (f"resuming {ckpt} (step {step}) with a changed recipe: {_listing(changes)}.{schedule_note} A resume "
            f"continues the run exactly as {ckpt / 'recipe.json'} records it. Nothing was changed: undo the "
            f"change(s) to resume, set train.output_dir to a new folder, or pass {NEW_PHASE_FLAG} to start a new "
            f"phase from {ckpt.name}'s weights with these settings (fresh optimizer and learning-rate schedule "
            f"over steps {step}..train.max_steps, recorded in the checkpoints)")


def plan_resume(checkpoint: Path | None, saved_recipe: dict, trainer_state: dict, current: dict,
                new_phase: bool = False) -> ResumePlan:
    """The ResumePlan for a run whose latest checkpoint is `checkpoint` (None: a fresh run) with the
    recorded recipe and trainer state, resumed with recipe dict `current`; ResumeRefused when that
    would silently change the run or train nothing."""
    if checkpoint is None:
        return ResumePlan()
    step = int(trainer_state["step"])
    phases = list(trainer_state.get("phases") or [])
    phase_start = int(phases[-1]["start_step"]) if phases else 0
    max_steps, recorded_max = current["train"]["max_steps"], saved_recipe.get("train", {}).get("max_steps")
    changes = recipe_changes(saved_recipe, current)
    if max_steps <= step:
        if max_steps == step == recorded_max and not changes and not new_phase:
            return ResumePlan(checkpoint, step, phase_start, phases, finished=True)
        raise ResumeRefused(_nothing_to_train(checkpoint, step, max_steps, changes))
    if recorded_max is not None and max_steps != recorded_max and (new_phase or schedule_uses_max_steps(current)):
        changes[MAX_STEPS] = (recorded_max, max_steps)
    if new_phase:
        record = {"start_step": step, "from": checkpoint.name,
                  "changed": {k: [o, n] for k, (o, n) in changes.items()}}
        return ResumePlan(checkpoint, step, step, [*(phases or [{"start_step": 0}]), record], new_phase=True)
    if changes:
        note = ""
        if MAX_STEPS in changes:
            schedule = current["train"].get("schedule")
            ended = " it already ended at its final learning rate, which would rise again;" if step == recorded_max else ""
            note = (f" The {schedule} schedule is spread over train.max_steps:{ended} changing it changes the "
                    "learning rate of every step left (train.schedule: constant does not depend on it).")
        raise ResumeRefused(_refusal(checkpoint, step, changes, note))
    return ResumePlan(checkpoint, step, phase_start, phases)
