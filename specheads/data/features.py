"""Feature capture: run the frozen target once over the recipe's data and store what the head needs.

    specheads capture RECIPE --out DIR [--dtype bfloat16|float32|int8] [key=value ...]
    torchrun --nproc_per_node N -m specheads.data.features RECIPE --out DIR ...
    accelerate launch --multi_gpu --num_processes N -m specheads.data.features RECIPE --out DIR ...

It stores exactly what the head's `collect(target, batch)` returns, per real token (no padding), as
safetensors shards. With N processes, rank r takes samples r::N and writes its own shards; rank 0
merges the sidecars into `manifest.json` after every rank finished, checking that each sample is
stored exactly once. A shard is complete iff its sidecar exists, so a killed capture (any rank)
resumes at each rank's first missing shard when launched again with the same settings and N.
On a machine without CUDA the processes use gloo (`--cpu --num_processes N` would run one).
The format and the reader training uses (`feature_source`) live in specheads/data/feature_cache.py.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

from specheads.atomic import check_output, remove_stale, save_safetensors, write_json
from specheads.cli_parsers import capture_parser
from specheads.config import check_recipe_inputs, load_recipe
from specheads.data.feature_cache import (
    FORMAT,
    INT8_NOTE,
    MANIFEST,
    PLAN,
    STORAGE,
    VERSION,
    FeatureCacheError,
    OfflineFeatures,
    OfflineFeatureSet,
    OnlineFeatures,
    bytes_per_token,
    decode,
    encode,
    feature_source,
    read_manifest,
    sample_key,
)
from specheads.data.samples import prepare_samples
from specheads.data.tokenize import collate
from specheads.heads import head_class
from specheads.progress import Progress
from specheads.provenance import provenance
from specheads.target import Target

__all__ = ["capture", "main", "check_disk", "estimate_bytes", "plan_shards", "FeatureCacheError", "MANIFEST",
           "OfflineFeatures", "OfflineFeatureSet", "OnlineFeatures", "decode", "encode", "feature_source",
           "read_manifest", "sample_key"]
_HEADER_BYTES = 160  # safetensors header per tensor, estimated
_SIDECAR_ENTRY = 40  # json bytes per sample besides its id and key


# ---------------------------------------------------------------- the capture plan


@dataclass
class Shard:
    """One shard of one rank: which samples (indices into the rank's list) it holds."""

    rank: int
    index: int
    samples: list[int]

    @property
    def stem(self) -> str:
        return f"rank{self.rank:03d}-shard{self.index:06d}"


def plan_shards(lengths: list[int], rank: int, world: int, shard_tokens: int) -> list[Shard]:
    """Rank `rank` takes samples rank::world, cut into shards of about `shard_tokens` tokens."""
    shards, current, tokens = [], [], 0
    for i in range(rank, len(lengths), world):
        if current and tokens + lengths[i] > shard_tokens:
            shards.append(Shard(rank, len(shards), current))
            current, tokens = [], 0
        current.append(i)
        tokens += lengths[i]
    if current:
        shards.append(Shard(rank, len(shards), current))
    return shards


def estimate_bytes(samples, widths: dict[str, int], storage: str, shard_tokens: int, world: int) -> int:
    """Bytes the whole capture will write: tensors, safetensors headers, sidecars, manifest."""
    lengths = [len(s.input_ids) for s in samples]
    n_shards = sum(len(plan_shards(lengths, r, world, shard_tokens)) for r in range(world))
    n_tensors = len(widths) * (2 if storage == "int8" else 1)
    sidecars = sum(len(s.id) + 32 + _SIDECAR_ENTRY for s in samples) + 200 * n_shards
    return (sum(lengths) * bytes_per_token(widths, storage) + n_shards * (n_tensors * _HEADER_BYTES + 400)
            + sidecars + 2048)


def check_disk(needed: int, folder: Path) -> None:
    """Refuse to start a capture the disk under `folder` cannot hold (with 5% to spare)."""
    probe = folder
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed * 1.05 > free:
        raise FeatureCacheError(
            f"the feature capture needs about {needed / 2**30:.2f} GiB but only {free / 2**30:.2f} GiB is free "
            f"under {folder}: free space, choose another --out, or store --dtype int8")


def feature_widths(feats: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    """Per feature, the shape after [B, T] (what a token row reshapes back to)."""
    return {k: list(v.shape[2:]) for k, v in feats.items()}


def _flat(tail: list[int]) -> int:
    return int(torch.tensor(tail or [1]).prod())


# ---------------------------------------------------------------- writing


def _rows(feats: dict[str, torch.Tensor], attention_mask: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Per batch row, each feature's unpadded token rows [n_b, D] (right padding)."""
    lengths = attention_mask.sum(dim=1).tolist()
    return [{k: v[b, :n].reshape(n, -1).cpu() for k, v in feats.items()} for b, n in enumerate(lengths)]


def write_shard(folder: Path, shard: Shard, samples, collect, storage: str, batch_size: int, pad_id: int,
                device, progress=None) -> dict:
    """Collect one shard's features, write `<stem>.safetensors` then its sidecar (both atomically);
    `progress` (specheads.progress.Progress) counts the samples collected."""
    parts: dict[str, list[torch.Tensor]] = {}
    entries, offset = [], 0
    for b in range(0, len(shard.samples), batch_size):
        chunk = [samples[i] for i in shard.samples[b:b + batch_size]]
        batch = {k: v.to(device) for k, v in collate(chunk, pad_id).items()}
        for s, rows in zip(chunk, _rows(collect(batch), batch["attention_mask"])):
            for k, v in rows.items():
                parts.setdefault(k, []).append(v)
            entries.append({"id": s.id, "key": sample_key(s.input_ids), "offset": offset, "length": len(s.input_ids)})
            offset += len(s.input_ids)
        if progress is not None:
            progress.update(len(chunk))
    tensors = {}
    for k, v in parts.items():
        tensors.update(encode(k, torch.cat(v), storage))
    path = folder / f"{shard.stem}.safetensors"
    digest = save_safetensors(tensors, path, metadata={"format": FORMAT, "storage": storage})
    side = {"file": path.name, "sha256": digest, "bytes": path.stat().st_size, "tokens": offset,
            "samples": entries}
    write_json(folder / f"{shard.stem}.json", side)
    return side


def _check_plan(folder: Path, plan: dict, is_main: bool) -> None:
    """A resumed capture must use the same target, head, data and settings as the first attempt."""
    path = folder / PLAN
    if path.is_file():
        old = json.loads(path.read_text())
        diff = [k for k in plan if old.get(k) != plan[k]]
        if diff == ["world"]:
            raise FeatureCacheError(
                f"{folder} holds a capture started with {old['world']} process(es), this run has {plan['world']}: "
                f"launch it with {old['world']} process(es) to resume it, or delete the folder")
        if diff:
            raise FeatureCacheError(
                f"{folder} holds a capture with other settings ({', '.join(diff)} differ): "
                "delete the folder or pass the settings it was started with")
    elif is_main:
        write_json(path, plan)


# ---------------------------------------------------------------- the capture


def capture(recipe, out: str | Path, storage: str = "bfloat16", shard_mb: float = 1024.0,
            batch_size: int = 8, report=print, quiet: bool = False) -> Path:
    """Run the frozen target over the recipe's data once and store the head's features in `out`."""
    from accelerate import PartialState

    if storage not in STORAGE:
        raise FeatureCacheError(f"--dtype {storage}: expected one of {', '.join(STORAGE)}")
    # ranks wait for each other at the end, which after a resume can be hours apart: a long timeout
    state = PartialState(cpu=not torch.cuda.is_available(), timeout=timedelta(hours=48))
    folder = Path(out)
    if state.is_main_process:
        check_output(folder, lambda f: (f / PLAN).is_file(), "a feature capture",
                     "choose another --out, or move or remove it yourself")
    target = Target.load(recipe.target.path, dtype=recipe.target.dtype, device=str(state.device),
                         attn_implementation=recipe.target.attn_implementation)
    samples = prepare_samples(recipe, target.tokenizer, report=report if state.is_main_process else lambda *_: None)
    head = head_class(recipe.head.kind).for_target(recipe.head, target.config)
    pad_id = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0

    def collect(batch):
        return head.collect(target, batch)

    probe = collect({k: v.to(state.device) for k, v in _one(samples[0], pad_id).items()})
    tails = feature_widths(probe)
    widths = {k: _flat(t) for k, t in tails.items()}
    shard_tokens = max(1, int(shard_mb * 2**20) // bytes_per_token(widths, storage))
    world, rank = state.num_processes, state.process_index
    keys = [sample_key(s.input_ids) for s in samples]
    plan = {"head_kind": head.kind, "layers": head.required_layers(), "features": tails, "storage": storage,
            "target": target.fingerprint(), "num_samples": len(samples), "world": world,
            "shard_tokens": shard_tokens, "data_sha256": _data_hash(samples, keys)}
    folder.mkdir(parents=True, exist_ok=True)
    _check_plan(folder, plan, state.is_main_process)
    estimate = estimate_bytes(samples, widths, storage, shard_tokens, world)
    if state.is_main_process:
        report(f"[specheads] capture: {len(samples)} samples, {sum(len(s.input_ids) for s in samples)} tokens, "
               f"{bytes_per_token(widths, storage)} bytes/token ({storage}), estimate {estimate / 2**20:.1f} MiB "
               f"-> {folder}")
        check_disk(estimate - _written(folder), folder)
    state.wait_for_everyone()
    _capture_rank(folder, plan_shards([len(s.input_ids) for s in samples], rank, world, shard_tokens),
                  samples, collect, storage, batch_size, pad_id, state.device, report,
                  quiet=quiet or not state.is_main_process)
    state.wait_for_everyone()
    if state.is_main_process:
        expected = Counter(zip((s.id for s in samples), keys))
        manifest = _write_manifest(folder, plan, expected, estimate, provenance(target=target.fingerprint()))
        report(f"[specheads] capture complete: {manifest['num_tokens']} tokens in {len(manifest['shards'])} "
               f"shard(s), {manifest['bytes'] / 2**20:.1f} MiB (estimate {estimate / 2**20:.1f} MiB)")
    state.wait_for_everyone()
    return folder


def _one(sample, pad_id: int) -> dict:
    return collate([sample], pad_id)


def _data_hash(samples, keys: list[str]) -> str:
    """One hash over every sample's id and content key (order included)."""
    h = hashlib.sha256()
    for s, key in zip(samples, keys):
        h.update(f"{s.id}\0{key}\n".encode())
    return h.hexdigest()


def _written(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("rank*-shard*.*"))


def remove_leftovers(folder: Path, rank: int) -> None:
    """Temporaries a killed capture left for this rank's shards and sidecars (only this rank writes
    them, so every one is stale), and the names older versions used."""
    remove_stale(folder, rf"rank{rank:03d}-shard\d+\.(?:safetensors|json)", any_pid=True)
    for old in folder.glob(f".rank{rank:03d}-shard*.safetensors.tmp"):
        old.unlink(missing_ok=True)
    if rank == 0:  # safetensors' own temporary, which older versions let it make here
        for old in folder.iterdir():
            if re.fullmatch(r"\.tmp[A-Za-z0-9]{6}", old.name) and old.is_file():
                old.unlink(missing_ok=True)


def _capture_rank(folder, shards, samples, collect, storage, batch_size, pad_id, device, report,
                  quiet: bool = False) -> None:
    """Write this rank's missing shards in order; finished ones (sidecar present) are skipped;
    progress over their samples on stderr unless `quiet`."""
    if shards:
        remove_leftovers(folder, shards[0].rank)
    done = sum((folder / f"{s.stem}.json").is_file() for s in shards)
    if done:
        report(f"[specheads] resuming: {done} of {len(shards)} shard(s) of rank {shards[0].rank} already written")
    t0 = time.time()
    todo = [shard for shard in shards if not (folder / f"{shard.stem}.json").is_file()]
    with Progress(sum(len(shard.samples) for shard in todo), "capture", "samples", quiet=quiet) as bar:
        for shard in todo:
            side = write_shard(folder, shard, samples, collect, storage, batch_size, pad_id, device, bar)
            report(f"[specheads] shard {shard.stem} written ({side['tokens']} tokens, "
                   f"{time.time() - t0:.1f}s)", flush=True)


def _check_coverage(folder: Path, sides: list[dict], expected: Counter) -> None:
    """Every sample (id, content key) of the data is in exactly one shard, and nothing else is."""
    got = Counter((e["id"], e["key"]) for s in sides for e in s["samples"])
    if got != expected:
        missing, extra = expected - got, got - expected
        raise FeatureCacheError(
            f"{folder}: the shards hold {sum(got.values())} samples for {sum(expected.values())} in the data "
            f"({sum(missing.values())} missing, {sum(extra.values())} extra or duplicated, e.g. "
            f"{next(iter(missing or extra))[0]!r}): run the capture again with the same settings to finish it, "
            "or delete the folder")


def _write_manifest(folder: Path, plan: dict, expected: Counter, estimate: int, prov: dict) -> dict:
    """Merge every sidecar into manifest.json (written last: its presence means complete)."""
    sides = [json.loads(p.read_text()) for p in sorted(folder.glob("rank*-shard*.json"))]
    _check_coverage(folder, sides, expected)
    manifest = {"format": FORMAT, "version": VERSION, **plan,
                "quantization": INT8_NOTE if plan["storage"] == "int8" else None,
                "num_tokens": sum(s["tokens"] for s in sides), "estimated_bytes": estimate,
                "shards": [{k: s[k] for k in ("file", "sha256", "bytes", "tokens")} | {"sidecar": s["file"][:-12] + ".json",
                           "samples": len(s["samples"])} for s in sides],
                "provenance": prov}
    manifest["bytes"] = sum(s["bytes"] for s in sides) + sum(
        (folder / s["sidecar"]).stat().st_size for s in manifest["shards"]) + (folder / PLAN).stat().st_size
    write_json(folder / MANIFEST, manifest)
    return manifest


# ---------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    """`specheads capture`: parse arguments, load the recipe, check it, capture."""
    p = capture_parser()
    a = p.parse_args(argv)
    if not a.shard_mb > 0 or a.shard_mb == float("inf"):
        raise FeatureCacheError(f"--shard-mb {a.shard_mb}: must be a positive size in MiB, e.g. 1024")
    if a.batch_size < 1:
        raise FeatureCacheError(f"--batch-size {a.batch_size}: must be >= 1")
    recipe = load_recipe(a.recipe, a.overrides)
    out = a.out or recipe.data.features
    if not out:
        raise FeatureCacheError("no output folder: pass --out DIR or set data.features in the recipe")
    if not isinstance(out, str):
        raise FeatureCacheError(f"data.features is a list ({len(out)} folders): a capture writes one folder; "
                                "pass --out DIR")
    check_recipe_inputs(recipe, outputs=("features",), batch=("--batch-size", a.batch_size))
    capture(recipe, out, storage=a.dtype, shard_mb=a.shard_mb, batch_size=a.batch_size, quiet=a.quiet)
    return 0


if __name__ == "__main__":  # torchrun / accelerate launch: the same error boundary as the CLI
    from specheads.errors import run_verb

    sys.exit(run_verb("capture", main, sys.argv[1:]))
