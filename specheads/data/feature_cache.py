"""The feature-cache format and its reader: what `specheads capture` writes and training reads.

A capture folder holds `rankRRR-shardSSSSSS.safetensors` shards (each feature's unpadded token rows,
concatenated), a sidecar `.json` per shard (sample id, content key, offset, length; written after its
shard, so a shard is complete iff its sidecar exists), `capture.json` (the plan) and `manifest.json`
(written last, once every rank finished). Samples are found by a hash of their token ids, so batches
need no extra fields and stale data cannot be read silently. The writer is specheads/data/features.py.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from specheads.heads import head_class
from specheads.integrity import sha256_file
from specheads.target import check_fingerprint

FORMAT = "specheads-features"
VERSION = 1
MANIFEST = "manifest.json"
PLAN = "capture.json"
RECAPTURE = "capture again into a new folder (or restore the file from a good copy)"
STORAGE = {"bfloat16": torch.bfloat16, "float32": torch.float32, "int8": torch.int8}
INT8_NOTE = "per-row absmax int8: x ~= q * scale, scale = max|x| / 127 per token row (float32, key NAME.scale)"


class FeatureCacheError(ValueError):
    """A feature cache that cannot be written or read as asked; the message says what to do."""


def sample_key(input_ids) -> str:
    """Content key of a tokenised sample: sha256 of its token ids (int64, little-endian)."""
    ids = torch.as_tensor(list(input_ids) if not torch.is_tensor(input_ids) else input_ids, dtype=torch.int64)
    return hashlib.sha256(ids.cpu().contiguous().numpy().astype("<i8").tobytes()).hexdigest()[:32]


# ---------------------------------------------------------------- storage encoding


def encode(name: str, rows: torch.Tensor, storage: str) -> dict[str, torch.Tensor]:
    """rows [N, D] float -> the tensors stored for it (int8 adds a per-row float32 scale [N])."""
    if storage != "int8":
        return {name: rows.to(STORAGE[storage]).contiguous()}
    x = rows.float()
    scale = x.abs().amax(dim=-1).clamp_min(1e-12) / 127.0  # [N]
    q = torch.round(x / scale[:, None]).clamp_(-127, 127).to(torch.int8)  # [N, D]
    return {name: q.contiguous(), f"{name}.scale": scale.contiguous()}


def decode(name: str, tensors: dict[str, torch.Tensor], storage: str, dtype: torch.dtype) -> torch.Tensor:
    """Stored tensors -> rows [N, D] in `dtype` (int8 rows are multiplied back by their scale)."""
    if storage != "int8":
        return tensors[name].to(dtype)
    return (tensors[name].float() * tensors[f"{name}.scale"][:, None]).to(dtype)


def bytes_per_token(widths: dict[str, int], storage: str) -> int:
    """Stored bytes per token for features of the given flattened widths."""
    item = torch.empty(0, dtype=STORAGE[storage]).element_size()
    return sum(w * item + (4 if storage == "int8" else 0) for w in widths.values())



# ---------------------------------------------------------------- reading


def read_manifest(folder: str | Path) -> dict:
    """The manifest of a complete capture, or an error saying how to finish it."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        what = "an unfinished capture (run `specheads capture` again to resume it)" if (folder / PLAN).is_file() \
            else "not a feature capture"
        raise FeatureCacheError(f"data.features {folder}: no {MANIFEST}; it is {what}")
    manifest = _read_json(path)
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise FeatureCacheError(f"{path}: not a {FORMAT} v{VERSION} manifest")
    return manifest


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FeatureCacheError(f"{path}: cannot be read ({err}); the capture is damaged: capture again "
                                "into a new folder") from None


def feature_layout(kind: str) -> str:
    """What a kind's `collect` returns, as a name: kinds with one layout (EAGLE-3, DFlash, DSpark read
    the same tapped states and final state) share a capture taken at the same layers."""
    try:
        return getattr(head_class(kind), "feature_layout", kind)
    except ValueError:
        return kind


class OnlineFeatures:
    """Features computed per batch by the frozen target (the head's own `collect`)."""

    def __init__(self, target, head):
        self.target, self.head = target, head

    def __call__(self, batch: dict) -> dict[str, torch.Tensor]:
        return self.head.collect(self.target, batch)


class OfflineFeatures:
    """Features read from a capture: the same dict `collect` gives, for any batch of cached samples."""

    def __init__(self, folder: str | Path, target, head, verify: bool = True):
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
        m = self.manifest
        if feature_layout(m["head_kind"]) != feature_layout(head.kind) or m["layers"] != head.required_layers():
            raise FeatureCacheError(
                f"data.features {self.folder}: captured for a {m['head_kind']} head with layers {m['layers']}, "
                f"but this head is {head.kind} with layers {head.required_layers()}: capture again for this head")
        check_fingerprint(m["target"], target, f"the feature capture {self.folder}")
        self.target, self.storage, self.tails = target, m["storage"], m["features"]
        self.index: dict[str, tuple[str, int, int]] = {}
        self.expected = {s["file"]: s["sha256"] for s in m["shards"]} if verify else {}
        for shard in m["shards"]:
            side = _read_json(self.folder / shard["sidecar"])
            for e in side["samples"]:
                self.index[e["key"]] = (shard["file"], e["offset"], e["length"])
        self._open: dict[str, object] = {}
        self._verified: set[str] = set()

    def _handle(self, file: str):
        from safetensors import SafetensorError, safe_open

        if file not in self._open:
            self._verify(file)
            if len(self._open) >= 8:
                self._open.pop(next(iter(self._open)))
            try:
                self._open[file] = safe_open(str(self.folder / file), framework="pt")
            except (SafetensorError, OSError) as err:
                raise FeatureCacheError(f"{self.folder / file}: cannot be read as safetensors ({err}); the shard "
                                        f"is truncated or corrupt: {RECAPTURE}") from None
        return self._open[file]

    def _verify(self, file: str) -> None:
        """Check a shard against the manifest's sha256 the first time it is opened (each shard is
        hashed once per process, when training first needs it)."""
        if file in self.expected and file not in self._verified:
            if sha256_file(self.folder / file) != self.expected[file]:
                raise FeatureCacheError(f"{self.folder / file}: checksum mismatch (the shard changed since it was "
                                        f"captured: corrupted or truncated); {RECAPTURE}")
            self._verified.add(file)

    def rows(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """One unpadded sample's token ids [n] -> each feature [n, *tail] in the target's dtype."""
        key = sample_key(input_ids)
        if key not in self.index:
            raise FeatureCacheError(
                f"data.features {self.folder}: a batch holds a sample that is not in the capture ({input_ids.numel()} "
                "tokens); the data, chat template or max_length changed since the capture: capture again")
        return self.rows_of(key)

    def rows_of(self, key: str) -> dict[str, torch.Tensor]:
        """The features of the sample whose `sample_key` is key (it is in `index`)."""
        file, offset, length = self.index[key]
        f = self._handle(file)
        names = [k for k in f.keys() if not k.endswith(".scale")]
        try:
            stored = {k: f.get_slice(k)[offset:offset + length] for k in f.keys()}
        except Exception as err:  # safetensors raises its own error type for damaged data
            raise FeatureCacheError(f"{self.folder / file}: cannot be read ({err}); the shard is corrupt: "
                                    f"{RECAPTURE}") from None
        return {k: decode(k, stored, self.storage, self.target.dtype).reshape(length, *self.tails[k]) for k in names}

    def __call__(self, batch: dict) -> dict[str, torch.Tensor]:
        return batched(self.rows, batch)


class OfflineFeatureSet:
    """Several captures read as one (data captured at different times for the same head and target):
    each sample is read from the capture that holds it."""

    def __init__(self, folders: list[str | Path], target, head, verify: bool = True):
        self.parts = [OfflineFeatures(f, target, head, verify) for f in folders]

    def rows(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        key = sample_key(input_ids)  # hashed once, looked up in each capture's index
        for part in self.parts:
            if key in part.index:
                return part.rows_of(key)
        raise FeatureCacheError(
            f"data.features {', '.join(str(p.folder) for p in self.parts)}: a batch holds a sample that is in none "
            f"of these captures ({input_ids.numel()} tokens); the data, chat template or max_length changed since "
            "they were captured, or data.train lists a file no capture covers: capture it")

    def __call__(self, batch: dict) -> dict[str, torch.Tensor]:
        return batched(self.rows, batch)


def batched(rows, batch: dict) -> dict[str, torch.Tensor]:
    """batch input_ids / attention_mask [B, T] (right-padded) -> features [B, T, ...] from `rows`
    (one unpadded sample's ids [n] -> each feature [n, ...]); padding is zero."""
    ids, lengths = batch["input_ids"], batch["attention_mask"].sum(dim=1).tolist()
    B, T = ids.shape
    out: dict[str, torch.Tensor] = {}
    for b, n in enumerate(lengths):
        for k, v in rows(ids[b, :n]).items():
            if k not in out:
                out[k] = torch.zeros(B, T, *v.shape[1:], dtype=v.dtype)
            out[k][b, :n] = v
    return {k: v.to(ids.device) for k, v in out.items()}


def feature_source(features: str | list[str] | None, target, head):
    """What training calls per batch for the head's features: offline when one capture or several
    (`data.features` a list) are given, else the target's forwards."""
    if not features:
        return OnlineFeatures(target, head)
    if isinstance(features, str):
        return OfflineFeatures(features, target, head)
    return OfflineFeatures(features[0], target, head) if len(features) == 1 else \
        OfflineFeatureSet(features, target, head)
