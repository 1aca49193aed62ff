"""Integrity: checksums recorded with every weight file and checked by every reader; non-finite
weights refused at export; damaged files named with what to do; a draft that accepts nothing is
called out."""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_export import make_head, save

from specheads.export import CheckpointError, export, load_with_meta
from specheads.export.checkpoint import Checkpoint
from specheads.integrity import IntegrityError, sha256_file
from specheads.metrics import broken_draft_warning, chain_summary

ROOT = Path(__file__).resolve().parent.parent


def flip_bit(path: Path, tensor: str, bit: int = 3) -> None:
    """Flip one bit inside `tensor`'s bytes of a safetensors file (the header stays valid)."""
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    start = json.loads(data[8:8 + n])[tensor]["data_offsets"][0] + 8 + n
    data[start] ^= 1 << bit
    path.write_bytes(bytes(data))


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "specheads", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)


@pytest.mark.parametrize("tensor", ["fc.weight", "d2t"])
def test_a_flipped_bit_in_the_checkpoint_refuses_the_export(tmp_path, tensor):
    ckpt = save(tmp_path, make_head())
    flip_bit(ckpt / "head.safetensors", tensor)
    with pytest.raises(CheckpointError, match=r"head\.safetensors: checksum mismatch.*earlier checkpoint"):
        export(ckpt, "vllm", tmp_path / "out")
    run = cli("export", str(ckpt), "--format", "vllm", "--out", str(tmp_path / "out"))
    assert run.returncode != 0 and "head.safetensors: checksum mismatch" in run.stderr
    assert "Traceback" not in run.stderr and not (tmp_path / "out").exists()


def test_nan_weights_are_refused_at_export_naming_the_tensor(tmp_path):
    head = make_head()
    with torch.no_grad():
        head.fc.weight[0, 0] = float("nan")
        head.norm.weight[1] = float("inf")
    ckpt = save(tmp_path, head)
    with pytest.raises(CheckpointError, match=r"fc\.weight.*norm\.weight.*NaN or inf.*earlier checkpoint"):
        export(ckpt, "sglang", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_records_weight_checksums_and_load_checks_them(tmp_path):
    out = export(save(tmp_path, make_head()), "vllm", tmp_path / "out")
    record = json.loads((out / "specheads.json").read_text())
    assert record["sha256"] == {"model.safetensors": sha256_file(out / "model.safetensors")}
    assert record["purpose"] == "export" and len(record["checkpoint_sha256"]) == 64
    load_with_meta(out)
    flip_bit(out / "model.safetensors", "d2t")
    with pytest.raises(IntegrityError, match=r"model\.safetensors: checksum mismatch.*export the checkpoint again"):
        load_with_meta(out)


def test_older_checkpoints_and_exports_load_with_a_notice(tmp_path, caplog):
    ckpt = save(tmp_path, make_head())
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert set(state["sha256"]) == {"head.safetensors", "head_config.json", "recipe.json", "provenance.json"}
    del state["sha256"]  # as written by a version without checksums
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    with caplog.at_level(logging.WARNING):
        out = export(ckpt, "vllm", tmp_path / "out")
    assert sum("no checksums recorded" in r.message for r in caplog.records) == 1
    record = json.loads((out / "specheads.json").read_text())
    del record["sha256"]
    (out / "specheads.json").write_text(json.dumps(record))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        load_with_meta(out)
    assert [r.message.count("no checksums recorded") for r in caplog.records] == [1]


def test_resume_checks_every_file_it_reads(tmp_path):
    ckpt = save(tmp_path, make_head())
    torch.save({"optimizer": {}, "rng": {}}, ckpt / "rank000.pt")  # as a run writes it, then recorded
    state = json.loads((ckpt / "trainer_state.json").read_text())
    state["sha256"]["rank000.pt"] = sha256_file(ckpt / "rank000.pt")
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    Checkpoint(ckpt).verify_for_resume(0)
    from specheads.export.checkpoint import resume_hint

    with open(ckpt / "rank000.pt", "r+b") as fh:  # truncated copy
        fh.truncate(10)
    with pytest.raises(CheckpointError, match=r"rank000\.pt: checksum mismatch.*latest"):
        Checkpoint(ckpt, remedy=resume_hint(ckpt)).verify_for_resume(0)
    Checkpoint(ckpt).verify_for_resume(1)  # another rank does not read that shard


def test_truncated_vocab_stats_file_is_named(tmp_path):
    from specheads.data.vocab_stats import VocabStatsError, read_vocab_stats, save_vocab_stats

    path = save_vocab_stats(tmp_path / "stats.safetensors", torch.arange(50), {"target": "t"})
    assert torch.equal(read_vocab_stats(path)[0], torch.arange(50))
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(VocabStatsError, match=r"stats\.safetensors: cannot be read.*run `specheads vocab-stats` again"):
        read_vocab_stats(path)


def test_a_draft_that_accepts_nothing_is_called_out():
    dead = chain_summary(drafts=40, accepted_per_pos=[0, 0, 0], tokens=40, forwards=40)
    warning = broken_draft_warning(dead)
    assert "looks broken" in warning and "d2t" in warning and "NaN" in warning and "template" in warning
    assert broken_draft_warning(chain_summary(5, [0, 0, 0], 5, 5)) is None  # too few drafts to tell
    assert broken_draft_warning(chain_summary(40, [12, 5, 1], 58, 40)) is None  # weak, not broken


def test_hashing_is_fast_enough_not_to_matter(tmp_path):
    """~100 MB in well under a few seconds (the number is printed; the bound is loose for loaded CI)."""
    path = tmp_path / "big.bin"
    path.write_bytes(os.urandom(100 * 2**20))
    t0 = time.perf_counter()
    sha256_file(path)
    seconds = time.perf_counter() - t0
    print(f"sha256 of 100 MiB: {seconds:.3f} s ({100 / seconds:.0f} MiB/s)")
    assert seconds < 10
