"""The engine check gives the same verdicts on every CPU-feature path the engines choose between.

vLLM and SGLang pick kernels and post-load weight repacking by what `torch.cpu` says the CPU has
(AMX, AVX-512, AVX2) and by `platform.machine()`; nobody picks the CPU CI runs on. The probes read
SPECHEADS_ENGINE_CPU (engines/probe_cpu.py) and force one path before the engine is imported; here
every forced path checks the exports whose loading depends on the CPU (DeepSeek-V3's MLA and MoE,
Qwen3-Next's MoE and gated DeltaNet) beside a dense EAGLE-3 head, and must pass with
verdicts identical to the others'.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from specheads.engines import check, matrix, probe_cpu

ENGINE_DIR = Path(check.__file__).parent
FORCED = [name for name in probe_cpu.PROFILES if name != "native"]
ROWS = {  # engine -> the matrix rows checked on every path
    "vllm": ["eagle3-vllm", "mtp-deepseek_v3-vllm", "mtp-qwen3_next-vllm"],
    "sglang": ["eagle3-sglang", "mtp-deepseek_v3-sglang"],
}


def _apply_in_process(profile: str) -> subprocess.CompletedProcess:
    """probe_cpu.apply() in a fresh Python (it patches process-wide functions), then what torch says."""
    code = ("import json, platform, sys, torch; sys.path.insert(0, sys.argv[1]); import probe_cpu; "
            "seen = probe_cpu.apply(); caps = torch.cpu.get_capabilities(); "
            "engine = {'__name__': 'vllm.platforms.interface'}; exec('import platform; m = platform.machine()', engine); "
            "print(json.dumps({'seen': seen, 'engine_machine': engine['m'], 'library_machine': platform.machine(), "
            "'amx_tile': caps['amx_tile'], 'avx512_f': caps['avx512_f'], 'amx': torch.cpu._is_amx_tile_supported()}))")
    env = {probe_cpu.ENV: profile, "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", code, str(ENGINE_DIR)], capture_output=True, text=True,
                          env=env, timeout=120)


@pytest.mark.parametrize("profile", FORCED)
def test_a_forced_profile_is_what_the_engine_reads(profile):
    done = _apply_in_process(profile)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout)
    machine, features = probe_cpu.PROFILES[profile]
    assert got["seen"] == {"profile": profile, "machine": machine, "features": features}
    assert got["engine_machine"] == machine and got["amx"] == features["amx_tile"]
    assert got["library_machine"] == platform.machine()  # what other libraries see is left alone
    assert got["amx_tile"] == features["amx_tile"] and got["avx512_f"] == features["avx512"]


def test_an_unknown_profile_is_named_with_the_choices():
    done = _apply_in_process("x86-amx512")
    assert done.returncode != 0
    assert "SPECHEADS_ENGINE_CPU='x86-amx512': expected one of native, x86-avx2" in done.stderr


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    wanted = {name for names in ROWS.values() for name in names}
    return {row.name: row for row in matrix.build_exports(tmp_path_factory.mktemp("exports")) if row.name in wanted}


def _verdict(report: check.EngineCheck) -> dict:
    """What the check concluded, without timings or the path-specific list of replaced kernels."""
    weights = report.stages.get("weights")
    return {"stages": {name: stage.status for name, stage in report.stages.items()},
            "weights": weights.detail if weights else None, "passed": report.passed}


@pytest.mark.engine
@pytest.mark.parametrize("engine", sorted(ROWS))
def test_every_cpu_path_gives_the_same_verdicts(engine, rows, tmp_path, monkeypatch):
    verdicts = {}
    for profile in FORCED:
        monkeypatch.setenv(probe_cpu.ENV, profile)
        jobs = [check.prepare(rows[name].export, engine, rows[name].target, work=tmp_path / profile / name)
                for name in ROWS[engine]]
        reports = check.run_jobs(jobs)
        for name, report in zip(ROWS[engine], reports):
            assert report.cpu["profile"] == profile, (name, report.cpu)
            assert report.passed, f"{name} on the {profile} path:\n{check.format_report(report)}"
        verdicts[profile] = {name: _verdict(r) for name, r in zip(ROWS[engine], reports)}
    first = verdicts[FORCED[0]]
    for profile in FORCED[1:]:
        assert verdicts[profile] == first, profile
