"""`specheads generate` refuses bad options by name; a closed stdout pipe ends it quietly."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from refusals import env, refused


@pytest.mark.parametrize("extra,needles", [
    pytest.param(["--device", "cuda"], ["device 'cuda'", "no CUDA device"],
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
    (["--device", "cpux"], ["device 'cpux'"]),
    (["--max-new-tokens", "0"], ["--max-new-tokens must be >= 1"]),
    (["--prompt", "  "], ["the prompt is empty"]),
    # a byte that is not UTF-8 on the command line (0xE9, Latin-1 e-acute): Python reads it as U+DCE9
    (["--prompt", "caf\udce9"], ["--prompt: lone surrogate U+DCE9 at position 3", "pass the prompt as UTF-8"]),
    (["--draft", "no_export"], ["no_export"]),
    (["--tree", "missing_tree.json"], ["--tree 'missing_tree.json'"]),
    (["--k", "0"], ["--k must be >= 1"]),
    (["--temperature", "-1"], ["temperature must be >= 0"]),
])
def test_bad_generate_option_is_named(tmp_path, tiny_target_dir, random_export_dir, extra, needles):
    base = {"--target": str(tiny_target_dir), "--draft": str(random_export_dir), "--prompt": "def add(a, b):"}
    opts = dict(zip(extra[::2], extra[1::2]))
    args = [x for kv in {**base, **opts}.items() for x in kv]
    refused(["generate", *args], needles, tmp_path, watch=(tiny_target_dir, random_export_dir))


def test_closed_stdout_pipe_ends_quietly(tmp_path, tiny_target_dir, random_export_dir):
    """`specheads generate ... | head`: the reader is gone before the first token; no traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "specheads", "generate", "--target", str(tiny_target_dir),
                             "--draft", str(random_export_dir), "--prompt", "def add(a, b):",
                             "--max-new-tokens", "16"], cwd=tmp_path, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # like `head` exiting
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 141, err[-2000:]
    assert "Traceback" not in err and "BrokenPipe" not in err


def test_summary_says_when_speculation_does_not_pay():
    from types import SimpleNamespace

    from specheads.generate import report_lines
    from specheads.verify.settings import TreeSpec
    from specheads.verify.steps import DecodeStats

    def result(wall_s):
        stats = DecodeStats(prefill_forwards=1, decode_forwards=20, decode_tokens=25, tokens=26, drafts=20,
                            proposed_tokens=60, accepted_per_pos=[5, 0, 0], wall_s=wall_s)
        return SimpleNamespace(stats=stats, tokens=list(range(26)))

    slow = report_lines(TreeSpec("chain", k=3), result(2.0), result(1.0), True)
    assert "did not pay here (0.50x)" in " ".join(slow)
    fast = report_lines(TreeSpec("chain", k=3), result(0.5), result(1.0), True)
    assert len(fast) == 2 and "did not pay" not in " ".join(fast)
