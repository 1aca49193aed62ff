"""A full disk during `train` or `export` says "disk full at PATH", that nothing is lost and that the
same command goes on once space is freed (never "This is a bug"); the same command then does.

The full disk is simulated: the weights writer raises what a full disk raises (OSError ENOSPC from
Python writes, safetensors' own error text from its Rust writer)."""

from __future__ import annotations

import errno

import pytest
from test_export import make_head, save
from test_train import RECIPE, _overrides

import specheads.export as export_module
import specheads.export.checkpoint as checkpoint_module
from specheads.cli import main as cli
from specheads.errors import DiskFull, disk_full, disk_guard, explain
from specheads.export.checkpoint import latest_checkpoint


class SafetensorError(Exception):
    """What safetensors raises on a full disk (its class lives in the Rust extension)."""


def _full_on_call(real, n: int, error: BaseException):
    calls = []

    def write(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise error
        return real(*args, **kwargs)

    return write


def test_train_on_a_full_disk_loses_nothing_and_resumes(tiny_target_dir, demo_data_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    args = ["train", str(RECIPE), *_overrides(tiny_target_dir, demo_data_dir, out, **{
        "train.max_steps": 2, "train.save_every": 1, "train.progress": "false"})]
    monkeypatch.setattr(checkpoint_module, "save_file", _full_on_call(
        checkpoint_module.save_file, 2, OSError(errno.ENOSPC, "No space left on device")))
    assert cli(args) == 1
    err = capsys.readouterr().err
    assert f"specheads train: error: disk full at {out} (No space left on device; " in err, err
    assert "nothing is lost" in err and "rerun the same command: it resumes from the latest checkpoint" in err
    assert "bug" not in err and "Traceback" not in err
    assert latest_checkpoint(out).name == "checkpoint-000001"
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temporaries, no lock left
    monkeypatch.undo()
    assert cli(args) == 0
    assert f"resumed from {out / 'checkpoint-000001'}" in capsys.readouterr().out
    assert latest_checkpoint(out).name == "checkpoint-000002"


def test_export_on_a_full_disk_keeps_the_earlier_export(tmp_path, monkeypatch, capsys):
    ckpt = save(tmp_path, make_head())
    out = tmp_path / "export"
    assert cli(["export", str(ckpt), "--format", "vllm", "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    capsys.readouterr()
    rust = SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
                           'left on device" })')
    monkeypatch.setattr(export_module, "save_file", _full_on_call(export_module.save_file, 1, rust))
    assert cli(["export", str(ckpt), "--format", "vllm", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"specheads export: error: disk full at {out} (Error while serializing" in err, err
    assert "nothing is lost" in err and "rerun the same command" in err and "bug" not in err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".export")]  # the temporary is gone


def test_a_full_disk_elsewhere_is_named_too(tmp_path):
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x.json"))
    message, rc = explain(full)
    assert rc == 1 and message.startswith(f"disk full at {tmp_path / 'x.json'} (No space left on device)")
    assert disk_full(RuntimeError("not a disk")) is None
    with pytest.raises(DiskFull) as caught, disk_guard(tmp_path / "out", "nothing is lost"):
        raise RuntimeError("write failed") from full
    assert str(caught.value).startswith(f"disk full at {tmp_path / 'x.json'} (No space left on device; ")
    assert str(caught.value).endswith("GiB free there now): nothing is lost")
