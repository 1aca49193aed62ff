"""`specheads generate` (and the tree options `specheads eval` shares with it) on a real tiny target.

The command runs once as a real subprocess; the other cases go through the same CLI entry point
in-process to keep the file fast. The streamed text must be exactly plain greedy decoding's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from specheads.cli import main as cli
from specheads.data.prompts import encode_chat
from specheads.session import Session, eos_ids, load_draft
from specheads.target import Target
from specheads.verify.loop import greedy_decode
from specheads.verify.settings import TreeSpec, make_tree_spec
from specheads.verify.text import TextStream, writer

PROMPT = "def add(a, b):"


class Sink:
    """A text output that remembers every write."""

    def __init__(self):
        self.writes: list[str] = []

    def write(self, text: str) -> None:
        self.writes.append(text)

    def flush(self) -> None:
        pass


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return Target.load(str(tiny_target_dir), device="cpu")


@pytest.fixture(scope="module")
def export_dir(random_export_dir):
    return random_export_dir


def plain_text(target, prompt: str, max_new_tokens: int, chat: bool = True) -> str:
    ids = (encode_chat(target.tokenizer, [{"role": "user", "content": prompt}]) if chat
           else list(target.tokenizer(prompt)["input_ids"]))
    result = greedy_decode(target, ids, max_new_tokens, eos_ids(target))
    return target.tokenizer.decode(result.tokens, skip_special_tokens=True)


def test_generate_subprocess_streams_plain_greedy_text(tiny_target_dir, export_dir, target):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "specheads", "generate", "--target", str(tiny_target_dir),
         "--draft", str(export_dir), "--prompt", PROMPT, "--max-new-tokens", "16", "--k", "2",
         "--device", "cpu"],
        capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == plain_text(target, PROMPT, 16) + "\n"
    assert "tau=" in proc.stderr and "acceptance per position" in proc.stderr
    assert "tok/s" in proc.stderr and "identical to plain greedy: True" in proc.stderr


@pytest.mark.parametrize("tree", ["eagle2", "static"])
def test_generate_trees_raw_prompt(tiny_target_dir, export_dir, target, tree, tmp_path, capsys):
    args = ["--tree", "eagle2", "--depth", "2", "--top-k", "3", "--total-tokens", "8"]
    if tree == "static":
        path = tmp_path / "tree.json"
        path.write_text(json.dumps([[0], [1], [0, 0], [0, 1], [0, 0, 0]]))
        args = ["--tree", str(path)]
    rc = cli(["generate", "--target", str(tiny_target_dir), "--draft", str(export_dir),
              "--prompt", PROMPT, "--no-chat", "--max-new-tokens", "12", "--device", "cpu", *args])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert out.out == plain_text(target, PROMPT, 12, chat=False) + "\n"
    assert ("eagle2 d=2 k=3 n=8" if tree == "eagle2" else "static n=6") in out.err


@pytest.mark.parametrize("tree", ["chain", "eagle2"])
def test_generate_samples_reproducibly(tiny_target_dir, export_dir, tree, capsys):
    """temperature > 0: lossless speculative sampling, the same text again for the same seed."""
    args = ["generate", "--target", str(tiny_target_dir), "--draft", str(export_dir), "--prompt",
            PROMPT, "--max-new-tokens", "12", "--device", "cpu", "--tree", tree,
            "--total-tokens", "8", "--depth", "2", "--temperature", "0.9", "--top-p", "0.95"]
    runs = []
    for seed in ("3", "3"):
        assert cli(args + ["--seed", seed]) == 0
        runs.append(capsys.readouterr())
    assert runs[0].out == runs[1].out and runs[0].out.strip()
    assert "temperature 0.9, top-p 0.95, seed 3" in runs[0].err and "plain sampling" in runs[0].err
    assert cli(args[:-4] + ["--temperature", "-1"]) == 1
    assert "temperature must be >= 0" in capsys.readouterr().err


def test_text_streams_step_by_step(target, export_dir):
    """Text reaches the output while decoding runs, one piece per verification step."""
    session = Session(target, load_draft(export_dir, target), TreeSpec("chain", k=2))
    sink = Sink()
    ids = encode_chat(target.tokenizer, [{"role": "user", "content": PROMPT}])
    result = session.decode(ids, 16, stream=TextStream(target.tokenizer, writer(sink))).result
    assert result.tokens == greedy_decode(target, ids, 16, eos_ids(target)).tokens
    assert len([w for w in sink.writes if w]) > 1
    assert "".join(sink.writes) == target.tokenizer.decode(result.tokens, skip_special_tokens=True)


def test_generate_errors(tiny_target_dir, export_dir, tmp_path, capsys):
    base = ["generate", "--target", str(tiny_target_dir), "--device", "cpu"]
    cases = [
        (["--draft", str(export_dir), "--prompt", "   "], "prompt is empty"),
        (["--draft", str(tmp_path / "nope"), "--prompt", PROMPT], "does not exist"),
        (["--draft", str(export_dir), "--prompt", PROMPT, "--tree", "eagle2",
          "--total-tokens", "400"], "context is 256"),
        (["--draft", str(export_dir), "--prompt", PROMPT, "--tree", str(tmp_path / "t.json")],
         "no such file"),
    ]
    for args, message in cases:
        assert cli(base + args) == 1
        assert message in capsys.readouterr().err

    other = tmp_path / "other"
    shutil.copytree(export_dir, other)
    meta = json.loads((other / "specheads.json").read_text())
    meta["target"]["embedding_sketch"] = [[-v for v in row] for row in meta["target"]["embedding_sketch"]]
    (other / "specheads.json").write_text(json.dumps(meta))
    assert cli(base + ["--draft", str(other), "--prompt", PROMPT]) == 1
    assert "different target" in capsys.readouterr().err


def test_tree_spec_parsing(tmp_path):
    assert make_tree_spec("chain", k=3).nodes() == 4
    spec = make_tree_spec("eagle2", depth=3, top_k=4, total_tokens=20)
    assert (spec.nodes(), spec.levels(), spec.describe()["kind"]) == (20, 4, "eagle2")
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"choices": [[0, 0], [0], [1]]}))
    static = make_tree_spec(str(path))
    assert static.choices == ((0,), (1,), (0, 0)) and static.nodes() == 4 and static.levels() == 2
    for bad, message in [("[]", "non-empty"), ("[[0], [0]]", "more than once"),
                         ("[[0, 1]]", "prefix"), ("{", "readable JSON"), ('[["a"]]', "integers")]:
        path.write_text(bad)
        with pytest.raises(ValueError, match=message):
            make_tree_spec(str(path))
    with pytest.raises(ValueError, match="--k"):
        make_tree_spec("chain", k=0)
    with pytest.raises(ValueError, match="total-tokens"):
        make_tree_spec("eagle2", total_tokens=1)


def test_eval_records_the_tree(tiny_target_dir, export_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": PROMPT}) + "\n")
    out = tmp_path / "out"
    rc = cli(["eval", "--target", str(tiny_target_dir), "--draft", str(export_dir), "--prompts",
              str(prompts), "--out", str(out), "--max-new-tokens", "10", "--tree", "eagle2",
              "--depth", "2", "--top-k", "2", "--total-tokens", "6"])
    assert rc == 0 and "tree=eagle2" in capsys.readouterr().out
    m = json.loads((out / "metrics.json").read_text())
    assert m["tree"] == {"kind": "eagle2", "depth": 2, "top_k": 2, "total_tokens": 6, "nodes": 6}
    assert m["greedy_equal"] is True and m["speculative"]["tau"] >= 1.0
    assert len(m["speculative"]["acceptance_per_position"]) <= 3

    rc = cli(["eval", "--target", str(tiny_target_dir), "--draft", str(export_dir), "--prompts",
              str(prompts), "--out", str(out), "--max-new-tokens", "10", "--k", "2"])
    assert rc == 0 and capsys.readouterr().out.startswith("k=2 tau=")
    m = json.loads((out / "metrics.json").read_text())
    assert m["tree"] == {"kind": "chain", "k": 2, "nodes": 3} and m["greedy_equal"] is True
    assert len(m["speculative"]["acceptance_per_position"]) == 2


@pytest.mark.parametrize("tree", ["chain", "eagle2"])
def test_generate_tiny_temperatures_equal_greedy(tiny_target_dir, export_dir, target, tree, capsys):
    """Temperatures 1e-3 .. 1e-300 sampled garbage once (float32 overflow in the warp): at these
    temperatures the target's distribution is one-hot on its argmax, so the sampled text is the
    greedy text, for the speculative loop and plain sampling alike."""
    greedy = plain_text(target, PROMPT, 12)
    args = ["generate", "--target", str(tiny_target_dir), "--draft", str(export_dir), "--prompt",
            PROMPT, "--max-new-tokens", "12", "--device", "cpu", "--tree", tree,
            "--total-tokens", "8", "--depth", "2", "--seed", "5"]
    for temperature in ("1e-300", "1e-40", "1e-20", "1e-3"):
        assert cli(args + ["--temperature", temperature]) == 0, temperature
        run = capsys.readouterr()
        assert run.out.rstrip("\n") == greedy, temperature
        assert f"temperature {float(temperature):g}" in run.err and "lossless" in run.err
    for bad in ("nan", "inf"):
        assert cli(args + ["--temperature", bad]) == 1
        err = capsys.readouterr().err
        assert "temperature must be >= 0 and finite" in err and "Traceback" not in err
