"""check-engine: the venv manager, the verdicts, and (with SPECHEADS_ENGINE_TESTS=1) injected faults
caught by vLLM's own code, each reported with the engine's own text."""

from __future__ import annotations

import ast
import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specheads.engines import check, venvs

ENGINE_DIR = Path(check.__file__).parent


# --- the venv manager (no engine needed) -------------------------------------------------------------
def fake_engine_python(folder: Path, version: str) -> None:
    """A venv whose `python -c "import vllm; print(vllm.__version__)"` prints `version`."""
    (folder / "bin").mkdir(parents=True)
    py = folder / "bin" / "python"
    py.write_text(f"#!/bin/sh\necho {version}\n")
    py.chmod(py.stat().st_mode | stat.S_IEXEC)


def test_existing_install_without_stamp_is_accepted_and_stamped(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    assert venvs.venv_dir("vllm") == tmp_path / "engines" / "vllm-0.33.0"
    fake_engine_python(venvs.venv_dir("vllm"), "0.33.0")
    assert not venvs.is_ready("vllm")
    messages = []
    assert venvs.ensure("vllm", progress=messages.append) == venvs.python_of("vllm")
    assert venvs.is_ready("vllm") and messages == []  # nothing installed


def test_wrong_version_and_small_disk_refuse_loudly(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    fake_engine_python(venvs.venv_dir("vllm"), "0.32.0")
    monkeypatch.setattr(venvs.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(100, 99, int(2e9)))
    with pytest.raises(venvs.EngineSetupError, match=r"needs about 10 GB .* only 2\.0 GB are free"):
        venvs.ensure("vllm", progress=lambda m: None)
    assert not venvs.is_ready("vllm")


def test_failed_install_is_an_error_with_the_log(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    monkeypatch.setattr(venvs, "ENGINES", {**venvs.ENGINES, "vllm": venvs.EngineSpec("vllm", "0.33.0", 0.0, 1)})
    monkeypatch.setattr(venvs.sys, "executable", "/bin/false")  # `python -m venv` fails
    messages = []
    with pytest.raises(venvs.EngineSetupError, match="failed .exit 1."):
        venvs.ensure("vllm", progress=messages.append)
    assert "about 0 GB of disk" in messages[0] and "pip install vllm==0.33.0" in messages[0]


@pytest.mark.parametrize("probe", sorted(p.name for p in ENGINE_DIR.glob("probe_*.py")))
def test_probes_never_import_specheads(probe):
    """Probes run under the engine's Python (its own torch / transformers): no specheads imports."""
    tree = ast.parse((ENGINE_DIR / probe).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.split(".")[0] == "specheads"]


def test_cli_names_a_folder_that_is_no_export(tmp_path, capsys):
    from specheads.cli import main

    assert main(["check-engine", str(tmp_path), "--engine", "vllm", "--target", str(tmp_path)]) == 1
    assert "no config.json; pass a folder written by `specheads export`" in capsys.readouterr().err


# --- the verdicts (fabricated engine results; no engine needed) ----------------------------------------
def test_forward_verdict_catches_a_diff_an_argmax_and_the_chain():
    mine = torch.randn(6, 10)
    mine[:, 7:] = float("-inf")
    ok = check.judge_forward({"forward": "ok"}, {"draft_logits": mine + 5e-5, "chain": torch.tensor([1, 2])},
                             mine, [1, 2], {})
    assert ok.status == check.PASS
    shifted = mine.clone()
    shifted[2, 0] += 1.0
    bad = check.judge_forward({"forward": "ok"}, {"draft_logits": shifted, "chain": torch.tensor([1, 3])},
                              mine, [1, 2], {})
    assert bad.status == check.FAIL and "max |logit diff| 1 >" in bad.detail and "chain" in bad.detail
    support = mine.clone()
    support[:, 7] = 0.0  # a logit the engine puts where our draft vocabulary has none
    assert "d2t" in check.judge_forward({"forward": "ok"}, {"draft_logits": support, "chain": torch.tensor([1, 2])},
                                        mine, [1, 2], {}).detail


def test_layers_verdict_fails_an_off_by_one_tap():
    states = torch.randn(3, 5, 4).cumsum(0)  # three consecutive "layers"
    ours = states[1]
    assert check.judge_layers({"layers": "ok"}, {"aux_hidden": states[1]}, ours, {}).status == check.PASS
    off = check.judge_layers({"layers": "ok"}, {"aux_hidden": states[2]}, ours, {})
    assert off.status == check.FAIL and "off-by-one" in off.detail


def test_layers_verdict_scales_with_a_real_targets_magnitudes():
    """A 30-layer target's residual stream has norms in the thousands: fp32 kernel rounding (3.4e-4 on
    SmolLM2-135M in vLLM) passes, a tap one layer off (a whole layer's update) still fails, and below
    norm 10 the bound stays 1e-4 absolute."""
    gen = torch.Generator().manual_seed(0)
    states = (torch.randn(3, 8, 64, generator=gen) * 5).cumsum(0)  # three consecutive "layers"
    states[:, :, 0] = 2000.0  # a massive-activation feature, as real residual streams have
    ours = states[1]
    rounding = ours + 3.4e-4 * torch.sign(torch.randn(8, 64, generator=gen))
    assert check.judge_layers({"layers": "ok"}, {"aux_hidden": rounding}, ours, {}).status == check.PASS
    off = check.judge_layers({"layers": "ok"}, {"aux_hidden": states[2]}, ours, {})
    assert off.status == check.FAIL and "8 of 8 positions" in off.detail
    small = torch.randn(8, 16, generator=gen) * 0.1
    assert check.judge_layers({"layers": "ok"}, {"aux_hidden": small + 3e-4}, small, {}).status == check.FAIL


def test_weights_verdict_names_unwritten_parameters_even_when_a_later_stage_failed(tmp_path):
    """A missing d2t leaves vLLM's draft_id_to_target_id at the sentinel; the forward then fails too."""
    ours = type("Ours", (), {"kind": "eagle3", "meta": type("M", (), {"record": {}, "folder": tmp_path})()})()
    result = {"error": {"stage": "forward", "type": "IndexError", "message": "index -7777 is out of bounds"},
              "weights": {"created": ["draft_id_to_target_id"], "loaded": [], "dropped": [],
                          "never_written": ["draft_id_to_target_id"]}}
    verdict = check.judge_weights(result, ours, "vllm")
    assert verdict.status == check.FAIL and "draft_id_to_target_id" in verdict.detail


def test_engine_error_and_not_run_are_reported_as_such():
    err = {"error": {"stage": "weights", "type": "ValueError", "message": "There is no module named 'x'"},
           "layers": "not_run: an earlier stage failed"}
    assert check.judge_layers(err, {}, None, {}).status == check.NOT_RUN
    refused = check._judge_refusal({"error": {"stage": "config", "type": "ValidationError", "message": "medusa"}},
                                   "vLLM 0.33 removed Medusa")
    assert refused["config"].status == check.REFUSED and "medusa" in refused["config"].detail
    accepted = check._judge_refusal({"config": {"method": "medusa"}}, "vLLM 0.33 removed Medusa")
    assert accepted["config"].status == check.FAIL


# --- injected faults, caught by vLLM 0.33's own code ------------------------------------------------------
@pytest.fixture(scope="module")
def vllm_export(tmp_path_factory):
    """An EAGLE-3 head with a scattered reduced vocabulary, exported in vLLM's native format."""
    from specheads.builtin.tiny_target import cached_tiny_target
    from specheads.engines.matrix import fingerprint_provenance, save_example
    from specheads.export import export
    from specheads.kinds import KINDS
    from specheads.target import Target

    tiny = cached_tiny_target("test", progress=False)
    target = Target.load(str(tiny), device="cpu")
    root = tmp_path_factory.mktemp("engine")
    example = KINDS["eagle3"].example  # a scattered draft vocabulary of V / 2
    ckpt = save_example(root, example.build(target, example.seed), tiny, fingerprint_provenance(target))
    return export(ckpt, "vllm-native", root / "export"), tiny


def test_prepare_makes_relative_paths_absolute(vllm_export, monkeypatch):
    """`make engine-check RUN=runs/x` passes relative paths; the probe runs in its own folder."""
    export, tiny = vllm_export
    monkeypatch.chdir(export.parent)
    job = check.prepare(export.name, "vllm", os.path.relpath(tiny), work="work")
    assert job.export.is_absolute() and job.work.is_absolute() and job.ours.target_path.is_absolute()
    assert (job.work / "inputs.safetensors").is_file() and job.export == export.resolve()


def faulty(src: Path, dest: Path, tensors=None, config=None) -> Path:
    """A copy of `src` with its tensors / config.json changed by the given functions."""
    shutil.copytree(src, dest)
    if tensors:
        weights = load_file(str(dest / "model.safetensors"))
        save_file(tensors(weights), str(dest / "model.safetensors"))
    if config:
        cfg = json.loads((dest / "config.json").read_text())
        config(cfg)
        (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def renamed(w):
    w["layers.0.mlp.down.weight"] = w.pop("layers.0.mlp.down_proj.weight")
    return w


def without_d2t(w):
    w.pop("d2t")
    return w


def float_d2t(w):
    w["d2t"] = w["d2t"].float()
    return w


def shifted_aux(cfg):
    cfg["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in cfg["eagle_aux_hidden_state_layer_ids"]]


FAULTS = {"renamed": {"tensors": renamed}, "without_d2t": {"tensors": without_d2t},
          "float_d2t": {"tensors": float_d2t}, "shifted_aux": {"config": shifted_aux}}


@pytest.fixture(scope="module")
def vllm_reports(vllm_export, tmp_path_factory):
    """The clean export and each injected fault, checked by vLLM in one engine process."""
    export, tiny = vllm_export
    root = tmp_path_factory.mktemp("faults")
    folders = {"clean": export, **{name: faulty(export, root / name, **change) for name, change in FAULTS.items()}}
    jobs = [check.prepare(folder, "vllm", tiny, work=root / "work" / name) for name, folder in folders.items()]
    return dict(zip(folders, check.run_jobs(jobs)))


@pytest.mark.engine
def test_clean_export_passes_every_stage(vllm_reports):
    report = vllm_reports["clean"]
    assert [s.status for s in report.stages.values()] == [check.PASS] * 4, check.format_report(report)
    assert report.numbers["logits_max_abs_diff"] <= 1e-4 and report.numbers["argmax_equal"] >= 200
    assert report.numbers["chain_engine"] == report.numbers["chain_ours"]


@pytest.mark.engine
@pytest.mark.parametrize("fault,stage,engine_text", [
    ("renamed", "weights", "There is no module or parameter named 'layers.0.mlp.down'"),
    ("without_d2t", "weights", "draft_id_to_target_id"),
    ("float_d2t", "weights", "with dtype torch.float32 into parameter with dtype torch.int64"),
    ("shifted_aux", "layers", None),
])
def test_injected_fault_fails_with_the_engines_text(vllm_reports, fault, stage, engine_text):
    report = vllm_reports[fault]
    text = check.format_report(report)
    assert not report.passed and report.stages[stage].status == check.FAIL, text
    if engine_text:
        assert engine_text in report.stages[stage].detail, text
    if fault == "shifted_aux":
        assert report.stages["config"].status == check.FAIL and "aux_layer_ids" in report.stages["config"].detail


def test_matrix_takes_any_trained_run_and_its_target(tmp_path):
    """`make engine-check RUN=runs/real TARGET=...`: the run's exports are rows checked against TARGET."""
    from specheads.engines import matrix

    run, target = tmp_path / "real", tmp_path / "cache" / "smollm2"
    for fmt in ("vllm", "sglang"):
        (run / "export" / fmt).mkdir(parents=True)
        (run / "export" / fmt / "config.json").write_text("{}")
        (run / "export" / fmt / "specheads.json").write_text('{"kind": "eagle3"}')
    with pytest.raises(FileNotFoundError, match="not a target folder"):
        matrix.run_rows(*matrix.parse_run(f"{run}:{target}"))
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    rows = matrix.run_rows(*matrix.parse_run(f"{run}:{target}"))
    assert [(r.name, r.format, r.target) for r in rows] == [("real-vllm", "vllm", target), ("real-sglang", "sglang", target)]
    assert list(rows[1].engines) == ["sglang"]
    (run / "target").mkdir()
    (run / "target" / "config.json").write_text("{}")
    assert matrix.run_rows(*matrix.parse_run(str(run)))[0].target == run / "target"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert matrix.main(["--out", str(tmp_path / "o"), "--run", str(empty), "--runs-only"]) == 2
