"""Native training checkpoints: head weights (safetensors) + resolved recipe + provenance + state.

Layout of OUTPUT_DIR:  checkpoint-000100/{head.safetensors, head_config.json, recipe.json,
provenance.json, trainer_state.json, scheduler.pt, optimizer[-rank{r}].pt, rng-rank{r}.pt},
`latest` (a file naming the newest complete checkpoint), `best` (the one with the highest
validation tau), metrics.jsonl and specheads_run.json (marks the folder as a run we write into).
The last `keep_last` checkpoints plus the best are kept. Every checkpoint is
written to a temp folder and renamed; trainer_state.json, written last, records the sha256 of every
other file, checked when the checkpoint is exported or resumed.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save_file

from specheads.atomic import OutputRefused, atomic_dir, describe_contents, remove_stale, write_json, write_text
from specheads.heads import head_class
from specheads.integrity import check_finite, file_hashes, read_safetensors, sha256_file, verify_files
from specheads.run_lock import LOCK_FILE

HEAD_FILE = "head.safetensors"
STATE_FILE = "trainer_state.json"
SHA_KEY = "sha256"  # trainer_state.json: {file name: sha256} of every other file of the checkpoint
REQUIRED = (HEAD_FILE, "head_config.json", "recipe.json", "provenance.json", STATE_FILE)
RUN_FILE = "specheads_run.json"  # {"purpose": "train"}: the folder is a training run of ours
CORRUPT_HINT = "use an earlier checkpoint (pass its checkpoint-NNNNNN folder) or re-run training"


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or corrupt; the message says which file."""


def save_checkpoint(output_dir: str | Path, step: int, head, recipe: dict, provenance: dict,
                    trainer_state: dict, optimizer_state=None, scheduler_state=None,
                    keep_last: int = 2, state: dict | None = None, keep_best: bool = True,
                    before_commit=None) -> Path:
    """Write checkpoint-{step} atomically, point `latest` (and `best`) at it, prune older ones.

    `state`: the full head state dict when it was gathered elsewhere (sharded training);
    `trainer_state["val_tau"]`, when present, ranks checkpoints for `best`;
    `before_commit(tmp)`: writes extra files (e.g. per-rank optimizer shards) before the rename.
    """
    output_dir = Path(output_dir)
    dest = output_dir / f"checkpoint-{step:06d}"
    remove_stale(output_dir, r"checkpoint-\d+")  # what a killed save left
    with atomic_dir(dest, owned=is_checkpoint, what="a training checkpoint") as tmp:
        if state is None:
            state = head.state_dict()
        state = {k: v.detach().cpu().contiguous() for k, v in state.items()}
        save_file(state, str(tmp / HEAD_FILE), metadata={"kind": head.kind})
        _dump(tmp / "head_config.json", asdict(head.config))
        _dump(tmp / "recipe.json", recipe)
        _dump(tmp / "provenance.json", provenance)
        if optimizer_state is not None:
            save_torch(optimizer_state, tmp / "optimizer.pt")
        if scheduler_state is not None:
            save_torch(scheduler_state, tmp / "scheduler.pt")
        if before_commit is not None:
            before_commit(tmp)
        # written last: the checksum of every other file (verified on export and resume)
        files = sorted(p.name for p in tmp.iterdir() if p.is_file())
        _dump(tmp / STATE_FILE, {"step": step, **trainer_state, SHA_KEY: file_hashes(tmp, files)})
    write_text(output_dir / "latest", dest.name + "\n")
    best = best_checkpoint(output_dir) if keep_best else None
    if best is not None:
        write_text(output_dir / "best", best.name + "\n")
    prune(output_dir, keep_last, keep=best)
    return dest


def save_torch(obj, path: Path) -> None:
    """torch.save through a Python file object: a full disk then raises OSError(ENOSPC) with the
    file's name (to a path, torch's writer says only `[enforce fail ...] unexpected pos`)."""
    with open(path, "wb") as fh:
        torch.save(obj, fh)


def is_checkpoint(folder: Path) -> bool:
    """A folder save_checkpoint wrote (what may be replaced by a checkpoint of the same step)."""
    return (folder / STATE_FILE).is_file() and (folder / "head_config.json").is_file()


# --- the run folder: what train.output_dir may be -------------------------------------------
def is_training_run(folder: Path) -> bool:
    """A folder training wrote: marked by RUN_FILE, or (older versions) holding a checkpoint."""
    try:
        if json.loads((folder / RUN_FILE).read_text()).get("purpose") == "train":
            return True
    except (OSError, ValueError, AttributeError):
        pass
    return any(is_checkpoint(c) for c in checkpoints(folder))


def run_dir_refusal(folder: str | Path) -> str | None:
    """Why `folder` may not be a train.output_dir (None: absent, empty, or a run of ours to resume).

    Training writes latest, best, metrics.jsonl and checkpoint-NNNNNN/ there and prunes old
    checkpoints, which would overwrite a user's files of those names."""
    folder = Path(folder)
    if not folder.exists() and not folder.is_symlink():
        return None
    if not folder.is_dir():
        return f"train.output_dir {folder} exists and is not a folder. Nothing was changed: choose another train.output_dir"
    if is_training_run(folder) or (not folder.is_symlink() and not [p for p in folder.iterdir() if p.name != LOCK_FILE]):
        return None  # ours, or empty but for the lock of a run still starting (or one that crashed)
    return (f"train.output_dir {folder} is a non-empty folder that is not a specheads training run (no {RUN_FILE}, "
            f"no checkpoint-NNNNNN); it holds {describe_contents(folder)}. Training writes latest, best, "
            "metrics.jsonl and checkpoint-NNNNNN/ there and would overwrite files of those names. Nothing was "
            "changed: set train.output_dir to a new or empty folder, or move those files away yourself")


def check_run_dir(folder: str | Path) -> None:
    """Refuse a train.output_dir that is not ours (OutputRefused), before anything is loaded."""
    reason = run_dir_refusal(folder)
    if reason is not None:
        raise OutputRefused(reason)


def mark_run(folder: str | Path) -> None:
    """Create the run folder and mark it as ours (so a run killed before its first checkpoint resumes)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / RUN_FILE).is_file():
        write_json(folder / RUN_FILE, {"purpose": "train"})


def _dump(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _val_tau(ckpt: Path) -> float | None:
    try:
        return json.loads((ckpt / "trainer_state.json").read_text()).get("val_tau")
    except (OSError, json.JSONDecodeError):
        return None


def checkpoints(output_dir: str | Path) -> list[Path]:
    """The run's checkpoint-NNNNNN folders, oldest first: exactly that name (a user's copy such as
    checkpoint-000010-backup is not one of ours, so never pruned nor made `best`)."""
    found = [p for p in Path(output_dir).glob("checkpoint-[0-9]*")
             if re.fullmatch(r"checkpoint-\d+", p.name) and p.is_dir() and not p.is_symlink()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def best_checkpoint(output_dir: str | Path) -> Path | None:
    """The checkpoint with the highest validation tau (earliest on ties); None without validation."""
    scored = [(tau, c) for c in checkpoints(output_dir)
              if (tau := _val_tau(c)) is not None]
    return max(scored, key=lambda tc: (tc[0], -int(tc[1].name.split("-")[1])))[1] if scored else None


def prune(output_dir: str | Path, keep_last: int, keep: Path | None = None) -> None:
    """Delete all but the newest `keep_last` checkpoints, sparing `keep` (the best one)."""
    ckpts = checkpoints(output_dir)
    for old in ckpts[: max(0, len(ckpts) - keep_last)]:
        if keep is None or old.name != keep.name:
            shutil.rmtree(old, ignore_errors=True)


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or a run's output dir (follows `latest`)."""
    path = Path(path)
    if (path / HEAD_FILE).exists() or (path / "head_config.json").exists():
        return path
    latest = path / "latest"
    if latest.is_file():
        return path / latest.read_text().strip()
    inside = runs_inside(path)
    if len(inside) == 1:  # a run folder (e.g. the demo's runs/demo) holding one training output_dir
        return resolve_checkpoint(inside[0])
    held = f" It holds the training output_dirs {', '.join(map(str, inside))}: pass one of them." if inside else (
        " Pass a training output_dir or one of its checkpoint-NNNNNN folders.")
    raise CheckpointError(f"{path}: not a specheads checkpoint (no {HEAD_FILE} and no 'latest' file).{held}")


def runs_inside(folder: Path) -> list[Path]:
    """The training output_dirs (a `latest` file inside) directly under `folder`, sorted."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_dir() and (p / "latest").is_file())


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    latest = Path(output_dir) / "latest"
    if not latest.is_file():
        return None
    ckpt = Path(output_dir) / latest.read_text().strip()
    return ckpt if ckpt.is_dir() else None


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; the checkpoint is incomplete") from None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: not valid JSON ({err}); the checkpoint is corrupt") from None


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """Load a safetensors file, turning truncation/corruption into a CheckpointError."""
    return read_safetensors(path, CORRUPT_HINT, CheckpointError)


def resume_hint(ckpt: Path) -> str:
    """What to do when the checkpoint a run would resume from is corrupt."""
    return (f"resuming would carry the damage forward: move {ckpt.name} out of {ckpt.parent} and write the "
            f"name of the previous checkpoint into {ckpt.parent / 'latest'}, or train into a new output_dir")


class Checkpoint:
    """A loaded native checkpoint: the head rebuilt with its weights, plus its metadata."""

    def __init__(self, path: str | Path, remedy: str = CORRUPT_HINT):
        """`remedy`: what a refused (corrupt) checkpoint's message tells the user to do."""
        self.path, self._noticed, self._verified = resolve_checkpoint(path), False, set()
        self.remedy = remedy
        for name in REQUIRED:
            if not (self.path / name).is_file():
                raise CheckpointError(f"{self.path / name}: missing; the checkpoint is incomplete")
        self.head_config = read_json(self.path / "head_config.json")
        self.recipe = read_json(self.path / "recipe.json")
        self.provenance = read_json(self.path / "provenance.json")
        self.trainer_state = read_json(self.path / STATE_FILE)
        self.verify([n for n in self.recorded() or {} if n.endswith((".json", ".safetensors"))])  # not optimizer
        self.weights = read_weights(self.path / HEAD_FILE)

    def recorded(self) -> dict[str, str] | None:
        """{file: sha256} written with the checkpoint (None: an older version wrote it)."""
        return self.trainer_state.get(SHA_KEY)

    def verify(self, names: list[str] | None = None) -> None:
        """Check the recorded checksums of `names` (default: every file, what resume reads); a
        checkpoint without them (older version) gets a one-line notice, once."""
        recorded = self.recorded()
        if recorded is None and self._noticed:
            return
        self._noticed = recorded is None
        if recorded is not None:
            recorded = {n: d for n, d in recorded.items() if (names is None or n in names) and n not in self._verified}
            self._verified |= set(recorded)
        verify_files(self.path, recorded, self.remedy, CheckpointError, where=f"checkpoint {self.path}")

    def verify_for_resume(self, rank: int) -> None:
        """Check what resuming process `rank` reads: weights, configs, scheduler, its own shard."""
        self.verify([n for n in self.recorded() or {} if not n.startswith("rank") or n == f"rank{rank:03d}.pt"])

    @property
    def weights_sha256(self) -> str:
        """sha256 of head.safetensors (recorded, else computed: an older checkpoint)."""
        return (self.recorded() or {}).get(HEAD_FILE) or sha256_file(self.path / HEAD_FILE)

    def check_finite(self, remedy: str) -> None:
        """Refuse a checkpoint whose weights hold NaN or inf."""
        check_finite(self.weights, str(self.path / HEAD_FILE), remedy, CheckpointError)

    @property
    def kind(self) -> str:
        kind = self.head_config.get("kind")
        if not isinstance(kind, str):
            raise CheckpointError(f"{self.path / 'head_config.json'}: no \"kind\" field (the head kind, e.g. "
                                  f"eagle3); {CORRUPT_HINT}")
        return kind

    def build_head(self, attn_implementation: str = "sdpa"):
        """Rebuild the head and load its weights strictly (a missing or extra tensor is an error)."""
        cls = head_class(self.kind)
        head = cls(cls.Config(**self.head_config), attn_implementation=attn_implementation)
        load_strict(head, self.weights, str(self.path / HEAD_FILE))
        return head


def load_strict(head, weights: dict[str, torch.Tensor], where: str) -> None:
    """load_state_dict with shape and name checks reported against the file they came from."""
    expected = head.state_dict()
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing or extra:
        raise CheckpointError(f"{where}: tensors do not fit the head: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, tensor in weights.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{where}: tensor '{name}' has shape {tuple(tensor.shape)}, the head expects "
                f"{tuple(expected[name].shape)}"
            )
    head.load_state_dict(weights, strict=True)
