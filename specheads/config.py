"""Typed, strict recipe configs: YAML + dotted overrides -> dataclasses; unknown keys fail by name."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from specheads.heads import head_options_class
from specheads.schedule import SCHEDULES


class ConfigError(ValueError):
    """A recipe or override that does not fit the schema; the message names the key."""


@dataclass
class TargetConfig:
    """The frozen target: a local Hugging Face folder, or `builtin:tiny` for the embedded one."""

    path: str = "builtin:tiny"  # or a local HF folder
    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    device: str = "auto"


@dataclass
class DataConfig:
    """Where conversations come from and how they are tokenised."""

    train: list[str] = field(default_factory=list)
    format: str = "auto"
    max_length: int = 512
    skip_malformed: bool = False
    end_of_turn: str | list[str] | None = None  # text(s) ending an assistant turn; default: eos_token
    features: str | None = None  # a `specheads capture` folder: train from it instead of target forwards
    vocab_stats: str | None = None  # a `specheads vocab-stats` file: the draft vocabulary's frequencies


@dataclass
class TrainConfig:
    """Optimisation, logging and checkpointing of one training run."""

    output_dir: str = "runs/train"
    max_steps: int = 200
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 3e-4
    weight_decay: float = 0.0
    warmup_steps: int = 20
    schedule: str = "cosine"  # cosine | constant | wsd (warmup-stable-decay)
    decay_fraction: float = 0.2  # wsd: share of max_steps spent decaying at the end
    min_lr_ratio: float = 0.0  # cosine / wsd end at this share of the peak lr
    max_grad_norm: float = 0.5
    mixed_precision: str | bool = "no"  # no | bf16 | fp16: the head's autocast; the target keeps target.dtype
    seed: int = 0
    log_every: int = 10
    save_every: int = 100
    keep_last: int = 2
    keep_best: bool = True  # also keep the checkpoint with the best validation tau
    resume: bool = True
    num_workers: int = 0
    val_samples: int = 0  # held out from data.train (seeded) for offline tau; 0 = no validation
    val_every: int = 0  # steps between validations (0 = only at checkpoints when val_samples > 0)
    val_batch_size: int = 8
    report_to: list[str] = field(default_factory=list)  # accelerate trackers: wandb, tensorboard
    project: str = "specheads"  # tracker project name
    progress: bool = True  # progress bar with tokens/s and ETA on the main process
    shard_target: bool = False  # FSDP2-shard the frozen target's decoder layers over the processes

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"train.schedule '{self.schedule}': expected one of {', '.join(SCHEDULES)}")
        if self.mixed_precision is False:  # YAML 1.1 reads a bare `no` as false
            self.mixed_precision = "no"
        if self.mixed_precision not in ("no", "bf16", "fp16"):
            raise ConfigError(f"train.mixed_precision '{self.mixed_precision}': expected no, bf16 or fp16")
        unknown = [r for r in self.report_to if r not in ("wandb", "tensorboard")]
        if unknown:
            raise ConfigError(f"train.report_to: unknown tracker '{unknown[0]}'; expected wandb, tensorboard")


@dataclass
class ExportConfig:
    """Engine formats the trained head must be exportable to; training refuses variants they lack."""

    formats: list[str] = field(default_factory=lambda: ["vllm", "sglang"])


@dataclass
class Recipe:
    """A whole training recipe. `head` is parsed by the head kind's own options dataclass."""

    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    head: Any = None
    train: TrainConfig = field(default_factory=TrainConfig)
    export: ExportConfig = field(default_factory=ExportConfig)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against the annotation `tp`; ints are accepted for floats."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, where)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0])
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item_tp,) = typing.get_args(tp) or (Any,)
        return [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads `1e-4` (no dot) as a string
            return float(value)
        except ValueError:
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if tp is bool and not isinstance(value, bool):
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")
    return value


def from_dict(cls: type, data: Any, where: str = "recipe") -> Any:
    """Build dataclass `cls` from a mapping, rejecting unknown keys with their full dotted name."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in names]
    if unknown:
        raise ConfigError(
            f"{where}: unknown key '{where}.{unknown[0]}'. Valid keys: {', '.join(names)}"
        )
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}") for k, v in data.items()}
    return cls(**kwargs)


def to_dict(obj: Any) -> Any:
    """Dataclass (possibly nested) -> plain JSON/YAML-able dict."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply `a.b.c=value` overrides (values parsed as YAML) to a raw recipe mapping."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}': expected key=value, e.g. train.lr=1e-4")
        key, text = item.split("=", 1)
        node = raw
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}': '{part}' is not a section")
        node[parts[-1]] = yaml.safe_load(text)
    return raw


def load_recipe(path: str | Path | None, overrides: list[str] = ()) -> Recipe:
    """Read a YAML recipe, apply overrides, and validate it (including the head section)."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"recipe file not found: {path}")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: a recipe must be a mapping of sections")
    raw = apply_overrides(raw, list(overrides))
    return recipe_from_dict(raw)


def recipe_from_dict(raw: dict) -> Recipe:
    """Validate a raw mapping into a Recipe; the head section goes to its kind's options class."""
    raw = dict(raw)
    head_raw = raw.pop("head", None) or {"kind": "eagle3"}
    recipe = from_dict(Recipe, raw, "recipe")
    recipe.head = from_dict(head_options_class(head_raw.get("kind")), head_raw, "head")
    if recipe.train.grad_accum < 1 or recipe.train.batch_size < 1:
        raise ConfigError("train.batch_size and train.grad_accum must be >= 1")
    return recipe
