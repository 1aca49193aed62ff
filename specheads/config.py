"""Typed, strict recipe configs: YAML + dotted overrides -> dataclasses; unknown keys fail by name."""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from specheads.bounds import ConfigError, bounded, check_bounds
from specheads.errors import read_user_text
from specheads.heads import head_options_class
from specheads.optim import OPTIMIZERS
from specheads.schedule import SCHEDULES
from specheads.target import DTYPES, config_context, peek_config


@dataclass
class TargetConfig:
    """The frozen target: a local Hugging Face folder, or `builtin:tiny` for the embedded one."""

    path: str = "builtin:tiny"  # or a local HF folder
    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    device: str = "auto"


SUPERVISE = ("assistant", "all")  # data.supervise


@dataclass
class DataConfig:
    """Where conversations come from and how they are tokenised."""

    train: list[str] = field(default_factory=list)
    format: str = "auto"
    max_length: int = bounded(512, ge=2, hint="tokens per sample; at most the target's context")
    skip_malformed: bool = False
    end_of_turn: str | list[str] | None = None  # text(s) ending an assistant turn; default: eos_token
    # `specheads capture` folder(s): train from them instead of target forwards; a list reads several
    # captures of the same head and target as one (data added later, captured on its own)
    features: str | list[str] | None = None
    vocab_stats: str | None = None  # a `specheads vocab-stats` file: the draft vocabulary's frequencies
    # which positions the training loss distils the target on: the assistant turns (what drafting
    # meets), or every token of the conversation (user turns and template too: the target's own
    # next-token distribution there is as valid a label, and it is more of it from the same data).
    # Validation and checkpoint selection score the assistant turns either way.
    supervise: str = "assistant"

    def __post_init__(self):
        if self.supervise not in SUPERVISE:
            raise ConfigError(f"data.supervise '{self.supervise}': expected one of {', '.join(SUPERVISE)}")


@dataclass
class TrainConfig:
    """Optimisation, logging and checkpointing of one training run."""

    output_dir: str = "runs/train"
    max_steps: int = bounded(200, ge=1, hint="optimizer steps to train")
    batch_size: int = bounded(8, ge=1, hint="samples per process per micro-step")
    grad_accum: int = bounded(1, ge=1)
    lr: float = bounded(3e-4, gt=0, le=1, hint="peak learning rate, e.g. 3e-4")
    weight_decay: float = bounded(0.0, ge=0)
    optimizer: str = "adamw"  # adamw | muon (2-D hidden weights on Muon, the rest on AdamW: specheads/optim.py)
    warmup_steps: int = bounded(20, ge=0)
    schedule: str = "cosine"  # cosine | constant | wsd (warmup-stable-decay)
    decay_fraction: float = bounded(0.2, ge=0, le=1)  # wsd: share of max_steps spent decaying at the end
    min_lr_ratio: float = bounded(0.0, ge=0, le=1)  # cosine / wsd end at this share of the peak lr
    max_grad_norm: float = bounded(0.5, ge=0, hint="0 disables clipping")
    mixed_precision: str | bool = "no"  # no | bf16 | fp16: the head's autocast; the target keeps target.dtype
    seed: int = 0
    log_every: int = bounded(10, ge=1, hint="steps between log records")
    save_every: int = bounded(100, ge=1, hint="steps between checkpoints")
    keep_last: int = bounded(2, ge=1, hint="checkpoints kept; the latest is always one of them")
    keep_best: bool = True  # also keep the checkpoint with the best validation tau
    resume: bool = True
    num_workers: int = bounded(0, ge=0)
    val_samples: int = bounded(0, ge=0)  # held out from data.train (seeded) for offline tau; 0 = no validation
    val_every: int = bounded(0, ge=0)  # steps between validations (0 = only at checkpoints when val_samples > 0)
    val_batch_size: int = bounded(8, ge=1)
    report_to: list[str] = field(default_factory=list)  # accelerate trackers: wandb, tensorboard
    project: str = "specheads"  # tracker project name
    progress: bool = True  # progress bar with tokens/s and ETA on the main process
    shard_target: bool = False  # FSDP2-shard the frozen target's decoder layers over the processes
    # seconds a process waits for the others in one collective: a lost or frozen machine stops the run
    dist_timeout: int = bounded(600, ge=1, hint="seconds a collective waits for the other processes")

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"train.schedule '{self.schedule}': expected one of {', '.join(SCHEDULES)}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"train.optimizer '{self.optimizer}': expected one of {', '.join(OPTIMIZERS)}")
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
        (item_tp,) = typing.get_args(tp) or (Any,)
        if isinstance(value, str) and item_tp is str:
            value = [value]  # one item for a list of strings: data.train=/path.jsonl
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
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
        close = difflib.get_close_matches(str(unknown[0]), names, n=1)
        guess = f" Did you mean '{where}.{close[0]}'?" if close else ""
        raise ConfigError(
            f"{where}: unknown key '{where}.{unknown[0]}'.{guess} Valid keys: {', '.join(names)}"
        )
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}") for k, v in data.items()}
    obj = cls(**kwargs)
    check_bounds(obj, where)
    return obj


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
        try:
            node[parts[-1]] = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ConfigError(f"override '{item}': the value is not valid YAML ({err.problem})") from None
    return raw


def load_recipe(path: str | Path | None, overrides: list[str] = ()) -> Recipe:
    """Read a YAML recipe, apply overrides, and validate it (including the head section)."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"recipe file not found: {path}")
        text = read_user_text(path, "recipe", ConfigError)
        try:
            raw = yaml.safe_load(text) or {}
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
    if not isinstance(head_raw, dict):
        raise ConfigError(f"recipe.head: expected a mapping with 'kind', got {head_raw!r}")
    recipe = from_dict(Recipe, raw, "recipe")
    recipe.head = from_dict(head_options_class(head_raw.get("kind")), head_raw, "head")
    return recipe


# --- checks before the target is loaded ---------------------------------------------------------
def host_or_device_memory() -> tuple[int, str]:
    """(bytes, name) of the memory one training process can use: GPU 0's, else the host's RAM."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory, "cuda:0 memory"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host RAM"


def check_recipe_inputs(recipe: Recipe, outputs: tuple[str, ...] = (),
                        batch: tuple[str, int] | None = None, memory: bool = True) -> None:
    """Refuse what a recipe gets wrong before the slow part (loading the target): missing inputs,
    a max_length beyond the target's context, a batch that cannot fit in memory. `outputs`: the
    data keys the calling command writes (capture: features) rather than reads; `batch`: (option,
    value) of the command's batch size (default: train.batch_size); `memory` False: no target
    forward, no memory check."""
    d = recipe.data
    if not d.train:
        raise ConfigError("data.train is empty: list at least one dataset file or folder")
    for i, source in enumerate(d.train):
        if not Path(source).exists():
            raise ConfigError(f"data.train[{i}] '{source}' does not exist")
    for key in ("features", "vocab_stats"):
        value = getattr(d, key)
        if not value or key in outputs:
            continue
        for i, one in enumerate([value] if isinstance(value, str) else value):
            if not Path(one).exists():
                where = f"data.{key}" if isinstance(value, str) else f"data.{key}[{i}]"
                raise ConfigError(f"{where} '{one}' does not exist (make it with `specheads "
                                  f"{'capture' if key == 'features' else 'vocab-stats'}`)")
    if recipe.target.dtype not in DTYPES:
        raise ConfigError(f"target.dtype '{recipe.target.dtype}': expected one of {', '.join(DTYPES)}")
    peeked = peek_config(recipe.target.path)
    if peeked is None:
        return
    cfg, where = peeked
    ctx = config_context(cfg)
    if isinstance(ctx, int) and d.max_length > ctx:
        raise ConfigError(f"data.max_length = {d.max_length} exceeds the target's context of {ctx} "
                         f"tokens (max_position_embeddings in {where}): set data.max_length <= {ctx}")
    if memory:
        check_batch_memory(recipe, cfg, *(batch or ("train.batch_size", recipe.train.batch_size)))


def check_batch_memory(recipe: Recipe, cfg: dict, key: str, batch_size: int) -> None:
    """A lower bound of one micro-batch's activations (the target's logits and hidden states of
    every layer, B x max_length tokens) against the device's memory: refuse what cannot fit."""
    vocab, hidden, layers = (cfg.get(k) for k in ("vocab_size", "hidden_size", "num_hidden_layers"))
    if not all(isinstance(v, int) for v in (vocab, hidden, layers)):
        return
    per_token = (vocab + hidden * (layers + 1)) * DTYPES[recipe.target.dtype].itemsize
    need = batch_size * recipe.data.max_length * per_token
    have, name = host_or_device_memory()
    if need > have:
        fit = max(1, have // (recipe.data.max_length * per_token))
        raise ConfigError(
            f"{key} = {batch_size}: one micro-batch of {batch_size} x data.max_length "
            f"{recipe.data.max_length} tokens needs at least {need / 2**30:,.1f} GiB for the target's "
            f"logits and hidden states alone, more than the {have / 2**30:,.1f} GiB of {name}; use "
            f"{key} <= {fit}" + (" (raise train.grad_accum to keep the global batch)" if key == "train.batch_size" else ""))
