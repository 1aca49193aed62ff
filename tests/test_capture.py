"""Offline feature cache: same losses as online, honest disk estimate, SIGKILL resume (1 and 2 processes),
refusals."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specheads.config import load_recipe
from specheads.data.features import (
    MANIFEST,
    FeatureCacheError,
    OfflineFeatures,
    OnlineFeatures,
    capture,
    check_disk,
    decode,
    encode,
    read_manifest,
    sample_key,
)
from specheads.data.samples import prepare_samples
from specheads.data.tokenize import collate
from specheads.target import Target
from specheads.train import build_head, head_inputs

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "demo" / "eagle3.yaml"
SHARD_MB = 0.02  # ~50 tokens of the test target in bf16 per shard: many shards


def _recipe(target_dir, data_dir, *extra):
    return load_recipe(RECIPE, [f"target.path={target_dir}", f"data.train=[{data_dir / 'train.jsonl'}]",
                                "data.max_length=96", "head.draft_vocab_size=256", "head.ttt_steps=2", *extra])


@pytest.fixture(scope="module")
def setup(tiny_target_dir, demo_data_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("small") / "train.jsonl"
    data.write_text("\n".join((demo_data_dir / "train.jsonl").read_text().splitlines()[:48]) + "\n")
    recipe = _recipe(tiny_target_dir, data.parent)
    target = Target.load(str(tiny_target_dir), device="cpu")
    return recipe, target, prepare_samples(recipe, target.tokenizer, report=lambda *_: None)


@pytest.fixture(scope="module")
def captures(setup, tmp_path_factory):
    recipe, _, _ = setup
    root = tmp_path_factory.mktemp("caches")
    return {dtype: capture(recipe, root / dtype, storage=dtype, shard_mb=SHARD_MB, batch_size=4,
                           report=lambda *a, **k: None)
            for dtype in ("float32", "bfloat16", "int8")}


def _files_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def test_manifest_and_estimate_within_ten_percent(setup, captures):
    recipe, target, samples = setup
    for dtype, folder in captures.items():
        m = read_manifest(folder)
        assert m["storage"] == dtype and m["head_kind"] == "eagle3" and m["layers"] == [2, 4, 5]
        assert m["num_samples"] == len(samples) and m["num_tokens"] == sum(len(s.input_ids) for s in samples)
        assert m["features"] == {"aux": [3 * 48], "final": [48]}
        assert len(m["shards"]) > 5 and m["target"] == target.fingerprint()
        assert ("absmax" in m["quantization"]) if dtype == "int8" else m["quantization"] is None
        written = _files_bytes(folder)
        assert abs(m["estimated_bytes"] - written) / written < 0.10, (dtype, m["estimated_bytes"], written)
    bf16, i8 = (read_manifest(captures[k]) for k in ("bfloat16", "int8"))
    per_token = {k: sum(s["bytes"] for s in m["shards"]) / m["num_tokens"] for k, m in (("bf16", bf16), ("i8", i8))}
    assert 384 <= per_token["bf16"] < 400 and 200 <= per_token["i8"] < 216  # 192 values: 2 B vs 1 B + scales


def test_offline_features_equal_collect(setup, captures):
    recipe, target, samples = setup
    head = build_head(recipe, target, samples)
    batch = collate(samples[5:13], target.tokenizer.pad_token_id)  # other batches than the capture's
    online = OnlineFeatures(target, head)(batch)
    valid = batch["attention_mask"].bool()
    for dtype, tol in (("float32", 1e-5), ("bfloat16", 1e-2), ("int8", 2e-2)):
        offline = OfflineFeatures(captures[dtype], target, head, verify=True)(batch)
        assert offline.keys() == online.keys()
        for k in online:
            assert offline[k].shape == online[k].shape and offline[k].dtype == online[k].dtype
            err = (offline[k] - online[k])[valid].abs().max() / online[k][valid].abs().max()
            assert err < tol, (dtype, k, float(err))
            assert (offline[k][~valid] == 0).all()


def _train_losses(recipe, target, samples, features, steps=4) -> list[float]:
    torch.manual_seed(0)
    head = build_head(recipe, target, samples)
    optim = torch.optim.AdamW(head.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        batch = collate(samples[step * 6:(step + 1) * 6], target.tokenizer.pad_token_id)
        out = head(**head_inputs(target, head, batch, features(head) if features else None))
        out.loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(out.loss.item())
    return losses


def test_offline_training_gives_the_online_losses(setup, captures):
    recipe, target, samples = setup
    online = _train_losses(recipe, target, samples, None)
    offline = _train_losses(recipe, target, samples, lambda h: OfflineFeatures(captures["float32"], target, h))
    assert offline == pytest.approx(online, rel=1e-5)
    bf16 = _train_losses(recipe, target, samples, lambda h: OfflineFeatures(captures["bfloat16"], target, h))
    assert bf16 == pytest.approx(online, rel=2e-2) and bf16 != online  # close, and really read from bf16


def test_kinds_with_one_feature_layout_share_a_capture(setup, captures, tiny_target_dir, demo_data_dir):
    """An EAGLE-3 capture serves a DFlash / DSpark head tapping the same layers (their collect returns the
    same aux + final); a kind whose features differ (Medusa: the final state only) is refused by name."""
    recipe, target, samples = setup
    batch = collate(samples[5:9], target.tokenizer.pad_token_id)
    for kind in ("dflash", "dspark"):  # 0-based layer outputs [1, 3, 4] = hidden-state taps [2, 4, 5]
        head = build_head(load_recipe(ROOT / "recipes" / kind / "demo.yaml", [
            f"target.path={tiny_target_dir}", f"data.train=[{demo_data_dir / 'train.jsonl'}]",
            "head.target_layer_ids=[1,3,4]", "head.num_layers=3"]), target, samples)
        offline = OfflineFeatures(captures["float32"], target, head)(batch)
        online = OnlineFeatures(target, head)(batch)
        assert offline.keys() == online.keys() == {"aux", "final"}
        valid = batch["attention_mask"].bool()  # [B, T]: the capture stores zeros at padding
        for k in online:
            assert torch.allclose(offline[k][valid], online[k][valid], atol=1e-5), (kind, k)
    medusa = build_head(load_recipe(ROOT / "recipes" / "medusa" / "demo.yaml", [
        f"target.path={tiny_target_dir}", f"data.train=[{demo_data_dir / 'train.jsonl'}]"]), target, samples)
    with pytest.raises(FeatureCacheError, match=r"captured for a eagle3 head .* this head is medusa"):
        OfflineFeatures(captures["float32"], target, medusa)


def test_int8_is_per_row_absmax():
    x = torch.randn(7, 33) * torch.logspace(-3, 3, 7)[:, None]
    stored = encode("aux", x, "int8")
    assert stored["aux"].dtype == torch.int8 and stored["aux.scale"].shape == (7,)
    assert (stored["aux"].abs().amax(dim=1) == 127).all()
    err = (decode("aux", stored, "int8", torch.float32) - x).abs()
    assert (err <= stored["aux.scale"][:, None] / 2 + 1e-6 * x.abs()).all()


def test_refusals(setup, captures, tiny_target_dir, demo_data_dir, tmp_path):
    recipe, target, samples = setup
    other = build_head(_recipe(tiny_target_dir, demo_data_dir, "head.aux_layers=[1,3,6]"), target, samples)
    with pytest.raises(FeatureCacheError, match=r"layers \[2, 4, 5\].*layers \[1, 3, 6\].*capture again"):
        OfflineFeatures(captures["bfloat16"], target, other)
    head = build_head(recipe, target, samples)
    reader = OfflineFeatures(captures["bfloat16"], target, head)
    batch = collate(samples[:2], target.tokenizer.pad_token_id)
    batch["input_ids"][1, 3] += 1  # data changed since the capture
    with pytest.raises(FeatureCacheError, match="not in the capture"):
        reader(batch)
    with pytest.raises(FeatureCacheError, match=r"needs about .* GiB but only"):
        check_disk(2**62, tmp_path)
    with pytest.raises(FeatureCacheError, match="no manifest.json; it is not a feature capture"):
        read_manifest(tmp_path)
    with pytest.raises(FeatureCacheError, match=r"other settings \(storage, "):
        capture(recipe, captures["float32"], storage="bfloat16", shard_mb=SHARD_MB, report=lambda *a, **k: None)


def _cli(recipe_args, out, **kw):
    cmd = [sys.executable, "-u", "-m", "specheads.cli", "capture", str(RECIPE), *recipe_args, "--out", str(out),
           "--shard-mb", str(SHARD_MB), "--batch-size", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT, **kw)


def test_sigkill_then_resume_finishes_the_same_capture(setup, captures, tiny_target_dir, tmp_path):
    recipe, _, _ = setup
    args = [f"target.path={tiny_target_dir}", f"data.train=[{recipe.data.train[0]}]", "data.max_length=96",
            "head.draft_vocab_size=256", "head.ttt_steps=2"]
    reference = captures["bfloat16"]
    out = tmp_path / "killed"
    proc = _cli(args, out)
    for line in proc.stdout:
        if "shard rank000-shard00000" in line:  # killed right after its first shard
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not (out / MANIFEST).exists()
    before_text = {p.name: p.read_text() for p in out.glob("rank*-shard*.json")}
    before = set(before_text)
    total = len(read_manifest(reference)["shards"])
    assert 1 <= len(before) < total
    lines = []
    capture(recipe, out, shard_mb=SHARD_MB, batch_size=1, report=lambda *a, **k: lines.append(" ".join(map(str, a))))
    log = "\n".join(lines)
    assert f"resuming: {len(before)} of {total} shard(s)" in log
    got, want = read_manifest(out), read_manifest(reference)
    assert [(s["file"], s["tokens"]) for s in got["shards"]] == [(s["file"], s["tokens"]) for s in want["shards"]]
    for name in sorted(before):  # shards finished before the kill are kept as they were
        assert json.loads((out / name).read_text()) == json.loads(before_text[name])
    for g, w in zip(got["shards"], want["shards"]):  # the same features (to bf16 rounding of CPU kernels)
        a, b = load_file(out / g["file"]), load_file(reference / w["file"])
        assert a.keys() == b.keys() and all(torch.allclose(a[k].float(), b[k].float(), rtol=2e-2, atol=1e-3) for k in a)
        assert json.loads((out / g["sidecar"]).read_text())["samples"] == json.loads(
            (reference / w["sidecar"]).read_text())["samples"]
    assert not list(out.glob(".*"))  # no half-written file left behind


def test_a_duplicated_shard_is_refused_when_merging(setup, captures, tmp_path):
    recipe, _, _ = setup
    out = tmp_path / "dup"
    shutil.copytree(captures["float32"], out)
    (out / MANIFEST).unlink()
    for ext in ("safetensors", "json"):  # a stray copy of shard 0, e.g. from another attempt
        shutil.copy(out / f"rank000-shard000000.{ext}", out / f"rank000-shard999999.{ext}")
    with pytest.raises(FeatureCacheError, match=r"0 missing, \d+ extra or duplicated"):
        capture(recipe, out, storage="float32", shard_mb=SHARD_MB, report=lambda *a, **k: None)
    assert not (out / MANIFEST).exists()


LAUNCH = {  # real 2-process gloo groups on a CPU, the two ways users launch them
    # free ports: concurrent sessions never collide
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone"],
    "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(ROOT / "recipes" / "accelerate" / "cpu.yaml"), "--main_process_port", "0"],
}


def _launch(launcher: str, args: list[str], out: Path) -> subprocess.Popen:
    cmd = [*LAUNCH[launcher], "-m", "specheads.data.features", str(RECIPE), *args, "--out", str(out),
           "--dtype", "float32", "--shard-mb", str(SHARD_MB), "--batch-size", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)


def _children(pid: int) -> list[int]:
    """Every child of `pid`, whichever of its threads started it."""
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


def _dead(pid: int) -> bool:
    """Gone, or a zombie: it runs no more code and writes nothing more."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def _sigkill_with_workers(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and its workers (which it starts in their own sessions), and wait until
    they are all dead, so nothing of the killed run can write while the resumed run starts."""
    workers = _children(proc.pid)
    assert workers, "the launcher has no worker processes to kill"
    proc.send_signal(signal.SIGKILL)
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 120  # generous: the machine may be loaded
    while not all(_dead(pid) for pid in workers):
        assert time.monotonic() < deadline, f"workers {workers} still alive 120 s after SIGKILL"
        time.sleep(0.05)


@pytest.mark.slow
def test_two_process_capture_killed_resumed_covers_every_sample_once(setup, captures, tiny_target_dir, tmp_path):
    recipe, target, samples = setup
    args = [f"target.path={tiny_target_dir}", f"data.train=[{recipe.data.train[0]}]", "data.max_length=96",
            "head.draft_vocab_size=256", "head.ttt_steps=2"]
    out = tmp_path / "two"
    proc = _launch("torchrun", args, out)
    for line in proc.stdout:
        if " written (" in line:  # killed, launcher and both ranks, right after the first shard
            _sigkill_with_workers(proc)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL and not (out / MANIFEST).exists()
    before = {p.name: p.read_text() for p in out.glob("rank*-shard*.json")}
    assert json.loads((out / "capture.json").read_text())["world"] == 2
    resumed = _launch("accelerate", args, out)  # resumed with the other launcher
    log = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0, log[-3000:]
    assert "resuming: " in log and "capture complete" in log
    m = read_manifest(out)
    files = [s["file"] for s in m["shards"]]
    assert m["world"] == 2 and len(before) < len(files)
    assert {f[:7] for f in files} == {"rank000", "rank001"}  # both ranks really wrote shards
    entries = [e for s in m["shards"] for e in json.loads((out / s["sidecar"]).read_text())["samples"]]
    assert Counter((e["id"], e["key"]) for e in entries) == Counter((s.id, sample_key(s.input_ids)) for s in samples)
    assert all((out / name).read_text() == text for name, text in before.items())  # finished shards were kept
    assert not list(out.glob(".*"))
    one = _train_losses(recipe, target, samples, lambda h: OfflineFeatures(captures["float32"], target, h))
    two = _train_losses(recipe, target, samples, lambda h: OfflineFeatures(out, target, h, verify=True))
    assert two == pytest.approx(one, rel=1e-5)
    with pytest.raises(FeatureCacheError, match=r"started with 2 process\(es\), this run has 1: launch it with 2"):
        capture(recipe, out, storage="float32", shard_mb=SHARD_MB, report=lambda *a, **k: None)


def test_a_corrupted_shard_refuses_training_by_name(setup, captures, tmp_path):
    """Training reads captures through feature_source, which checks each shard's sha256 on first use."""
    from specheads.data.features import feature_source

    recipe, target, samples = setup
    folder = tmp_path / "cap"
    shutil.copytree(captures["float32"], folder)
    shard = folder / read_manifest(folder)["shards"][0]["file"]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x10  # one flipped bit in the last tensor's payload
    shard.write_bytes(bytes(data))
    with pytest.raises(FeatureCacheError, match=rf"{shard.name}: checksum mismatch.*capture again"):
        _train_losses(recipe, target, samples, lambda h: feature_source(str(folder), target, h))
    shard.write_bytes(bytes(data[:100]))  # truncated, checksums not asked for: still named, no SafetensorError
    with pytest.raises(FeatureCacheError, match=rf"{shard.name}: cannot be read"):
        _train_losses(recipe, target, samples, lambda h: OfflineFeatures(folder, target, h, verify=False))


def test_leftovers_of_a_killed_capture_are_removed_when_it_runs_again(setup, captures, tmp_path):
    """What a rank killed mid-write leaves (this version's temp folder with safetensors' own `.tmpXXXXXX`
    inside, a sidecar temp file, an older version's names) is removed; a user's hidden file is not."""
    recipe, _, _ = setup
    folder = tmp_path / "cap"
    shutil.copytree(captures["float32"], folder)
    (folder / MANIFEST).unlink()
    leftovers = [folder / ".rank000-shard000003.safetensors.tmp-4242-abcdefgh", folder / ".tmpAbC123",
                 folder / ".rank000-shard000004.safetensors.tmp", folder / ".rank000-shard000003.json.tmp-4242-x1y2z3w4"]
    leftovers[0].mkdir()
    (leftovers[0] / ".tmpQwErTy").write_bytes(b"half a shard")
    for p in leftovers[1:]:
        p.write_bytes(b"half")
    (folder / ".keep-me").write_text("mine")
    capture(recipe, folder, storage="float32", shard_mb=SHARD_MB, report=lambda *a, **k: None)
    assert sorted(p.name for p in folder.glob(".*")) == [".keep-me"]
    assert read_manifest(folder)["num_samples"] == len(setup[2])


def test_capture_files_follow_the_umask(setup, tmp_path):
    import stat

    recipe, _, _ = setup
    old = os.umask(0o022)
    try:
        folder = capture(recipe, tmp_path / "cap", storage="float32", shard_mb=1.0, report=lambda *a, **k: None)
    finally:
        os.umask(old)
    modes = {stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()}
    assert modes == {0o644}


def test_captures_of_parts_of_the_data_read_as_one(setup, captures, tiny_target_dir, tmp_path):
    """data.features as a list: conversations added later are captured on their own and training reads
    both captures as one, with the very features of one capture of everything; a sample neither holds,
    a list given to capture and a missing folder are refused by name."""
    from specheads.config import ConfigError
    from specheads.data.features import OfflineFeatureSet, feature_source
    from specheads.data.features import main as capture_main
    from specheads.train import train

    recipe, target, samples = setup
    lines = Path(recipe.data.train[0]).read_text().splitlines()
    halves = []
    for i, part in enumerate((lines[:20], lines[20:])):
        (tmp_path / f"part{i}.jsonl").write_text("\n".join(part) + "\n")
        halves.append(capture(_recipe(tiny_target_dir, tmp_path, f"data.train=[{tmp_path / f'part{i}.jsonl'}]"),
                              tmp_path / f"cap{i}", storage="float32", shard_mb=SHARD_MB, batch_size=4,
                              report=lambda *a, **k: None))
    head = build_head(recipe, target, samples)
    batch = collate(samples, target.tokenizer.pad_token_id)  # every sample: some in each part
    both = feature_source([str(h) for h in halves], target, head)
    assert isinstance(both, OfflineFeatureSet)
    whole = OfflineFeatures(captures["float32"], target, head)(batch)
    read = both(batch)
    assert read.keys() == whole.keys() and all(torch.equal(read[k], whole[k]) for k in whole)
    for half in halves:  # each part alone lacks the other's samples
        with pytest.raises(FeatureCacheError, match="not in the capture"):
            OfflineFeatures(half, target, head)(batch)
    with pytest.raises(FeatureCacheError, match=rf"{halves[0]}, {halves[1]}: a batch holds a sample that is in none"):
        OfflineFeatureSet(halves, target, head)(collate([_reversed(samples[0])], target.tokenizer.pad_token_id))
    losses = _train_losses(recipe, target, samples, lambda h: feature_source([str(x) for x in halves], target, h))
    assert losses == pytest.approx(_train_losses(recipe, target, samples, None), rel=1e-5)

    listed = f"data.features=[{halves[0]},{halves[1]}]"
    ckpt = train(load_recipe(RECIPE, [*_overrides(recipe), listed, f"train.output_dir={tmp_path / 'run'}",
                                      "train.max_steps=2", "train.batch_size=4", "train.progress=false"]))
    from specheads.export.checkpoint import Checkpoint

    assert Checkpoint(ckpt).recipe["data"]["features"] == [str(h) for h in halves]
    with pytest.raises(ConfigError, match=r"data.features\[1\] '.*nowhere' does not exist"):
        train(load_recipe(RECIPE, [*_overrides(recipe), f"data.features=[{halves[0]},{tmp_path / 'nowhere'}]",
                                   f"train.output_dir={tmp_path / 'run2'}"]))
    with pytest.raises(FeatureCacheError, match="a capture writes one folder; pass --out DIR"):
        capture_main([str(RECIPE), *_overrides(recipe), listed])


def _reversed(sample):
    """The sample with its tokens in the other order: in no capture."""
    import dataclasses

    return dataclasses.replace(sample, input_ids=sample.input_ids[::-1])


def _overrides(recipe) -> list[str]:
    return [f"target.path={recipe.target.path}", f"data.train=[{recipe.data.train[0]}]", "data.max_length=96",
            "head.draft_vocab_size=256", "head.ttt_steps=2"]
