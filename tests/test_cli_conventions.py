"""The CLI follows the conventions users know from vLLM and friends: --version, help with defaults,
Ctrl-C on its own line naming what a rerun does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from refusals import cli

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "demo" / "eagle3.yaml"


def test_version_and_top_level_help(tmp_path):
    from specheads import __version__

    r = cli(["--version"], tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == f"specheads {__version__}"
    r = cli(["--help"], tmp_path)
    assert r.returncode == 0 and "GGUF" in r.stdout and "--version" in r.stdout


def test_ctrl_c_names_the_checkpoint_a_rerun_resumes_from(tiny_target_dir, demo_data_dir, tmp_path):
    out = tmp_path / "run"
    over = {"target.path": tiny_target_dir, "data.train": f"[{demo_data_dir / 'train.jsonl'}]", "data.max_length": 96,
            "head.draft_vocab_size": 256, "head.ttt_steps": 2, "train.output_dir": out, "train.batch_size": 4,
            "train.max_steps": 100000, "train.save_every": 2, "train.log_every": 1, "train.progress": "true"}
    cmd = [sys.executable, "-m", "specheads", "train", str(RECIPE), *(f"{k}={v}" for k, v in over.items())]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    deadline = time.monotonic() + 600
    try:
        while not (out / "latest").is_file() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    line = next((ln for ln in err.splitlines() if "error: interrupted" in ln), "")
    assert line.startswith("specheads train: error: interrupted: the same command resumes from "), err[-3000:]
    assert str(out / "checkpoint-") in line and "Traceback" not in err
    assert "\r" not in err and "Setting accelerator to CPU" not in err  # a log gets lines, not a bar's redraws


def test_no_library_noise_where_we_load(tiny_target_dir, random_export_dir, tmp_path):
    """transformers' 'Loading weights' bar and DeepSpeed's CPU notice do not reach the user; nothing in
    a log is redrawn with carriage returns."""
    r = cli(["generate", "--target", tiny_target_dir, "--draft", random_export_dir, "--prompt", "def f(x):",
             "--max-new-tokens", "4", "--device", "cpu"], tmp_path, SPECHEADS_QUIET="0")
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "Loading weights" not in out and "Setting accelerator to CPU" not in out and "\r" not in out, out[-3000:]


VERBS_WITH_OPTIONS = ["train", "capture", "vocab-stats", "export", "eval", "generate", "tiny-target", "demo", "push",
                      "serve", "bench", "regenerate", "magpie", "check-engine"]


def test_every_verbs_help_shows_its_defaults_and_train_speaks_to_users(tmp_path):
    for verb in VERBS_WITH_OPTIONS:
        r = cli([verb, "--help"], tmp_path)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (verb, r.stderr[-2000:])
    gen = cli(["generate", "--help"], tmp_path).stdout
    assert "tokens to generate (default: 128)" in " ".join(gen.split())
    train = cli(["train", "--help"], tmp_path).stdout
    assert "the only module that builds an Accelerator" not in train and "resumes from the latest checkpoint" in train


def test_help_loads_no_torch(tmp_path):
    """--help answers before any module that loads torch or transformers is imported (under a second)."""
    probe = ("import sys, time\nfrom specheads.cli import main\nt0 = time.perf_counter()\n"
             "try:\n    main(sys.argv[1:] + ['--help'])\nexcept SystemExit:\n    pass\n"
             "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
             "print('HEAVY', heavy, time.perf_counter() - t0, file=sys.stderr)\n")
    for verb in [*VERBS_WITH_OPTIONS, "target from-gguf"]:
        r = subprocess.run([sys.executable, "-c", probe, *verb.split()], capture_output=True, text=True,
                           cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
        line = next(ln for ln in r.stderr.splitlines() if ln.startswith("HEAVY"))
        assert line.startswith("HEAVY []"), (verb, line)
        assert float(line.split()[-1]) < 1.0, (verb, line)


def test_one_spelling_everywhere_with_the_old_ones_kept():
    from specheads.cli import _eval_parser
    from specheads.engine_facts import EXPORT_FORMATS
    from specheads.export import CLI_FORMATS

    base = ["--target", "T", "--draft", "D", "--out", "o"]
    a = _eval_parser().parse_args([*base, "--num-prompts", "3", "--no-progress"])
    assert a.limit == 3 and a.quiet is True
    a = _eval_parser().parse_args([*base, "--limit", "2", "--quiet"])
    assert a.limit == 2 and a.quiet is True
    assert set(EXPORT_FORMATS) == set(CLI_FORMATS)  # export's --format choices, known without importing export
    from specheads.cli_parsers import STORAGE_DTYPES
    from specheads.data.feature_cache import STORAGE

    assert STORAGE_DTYPES == tuple(STORAGE)  # capture --dtype, known without importing torch
    from specheads.cli_parsers import NEW_PHASE_FLAG
    from specheads.resume_plan import NEW_PHASE_FLAG as RESUME_FLAG

    assert NEW_PHASE_FLAG == RESUME_FLAG
    from specheads.cli_parsers import serve_parser
    from specheads.serve.server import ServeOptions

    a, defaults = serve_parser().parse_args(["--target", "T"]), ServeOptions()
    assert all(getattr(a, key) == getattr(defaults, key) for key in ("max_batch", "max_queue", "read_timeout",
                                                                      "max_body_mb", "log_interval"))


def test_check_engines_light_parser_names_the_probed_engines():
    from specheads.cli_parsers import CHECK_ENGINES
    from specheads.engines.check import PROBES

    assert CHECK_ENGINES == tuple(sorted(PROBES))
