"""The real `specheads` CLI in a subprocess, refusing a bad input: the message names the culprit,
no traceback is printed, and no file outside the command's own output changed."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "demo" / "eagle3.yaml"


def env(**extra: str) -> dict:
    """This checkout's package first on the path, one thread, no hub access, no debug."""
    out = {k: v for k, v in os.environ.items() if k != "SPECHEADS_DEBUG"}
    return {**out, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "SPECHEADS_QUIET": "1", **extra}


def cli(args: list[str], cwd: Path, timeout: float = 300, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specheads", *map(str, args)], cwd=cwd, env=env(**extra),
                          capture_output=True, text=True, timeout=timeout)


def digest(*roots: Path, skip: tuple[Path, ...] = ()) -> dict[str, str]:
    """sha256 and mode of every file (and the set of folders) under `roots`, `skip` left out."""
    out = {}
    skip = tuple(Path(s).resolve() for s in skip)
    for root in roots:
        root = Path(root).resolve()
        for path in sorted([root, *root.rglob("*")]):
            if any(path == s or s in path.parents for s in skip):
                continue
            if path.is_file():
                out[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest() + oct(path.stat().st_mode)
            elif path.is_dir():
                out[str(path)] = "dir"
    return out


def refused(args: list[str], needles: list[str], cwd: Path, watch: tuple[Path, ...] = (),
            output: Path | None = None, **extra: str) -> str:
    """Run a command that must fail: non-zero exit, every needle in its output, no traceback,
    every file under `cwd` and `watch` (but `output`) unchanged. Returns stderr + stdout."""
    roots = (cwd, *watch)
    before = digest(*roots, skip=(output,) if output else ())
    r = cli(args, cwd, **extra)
    text = r.stderr + r.stdout
    assert r.returncode != 0, f"exit 0 for {args}:\n{text[-3000:]}"
    assert "Traceback" not in text, text[-3000:]
    for needle in needles:
        assert needle in text, f"{needle!r} not in:\n{text[-3000:]}"
    assert digest(*roots, skip=(output,) if output else ()) == before, "an input file changed"
    return text


def write_data(folder: Path, n: int = 4) -> Path:
    """A small valid ShareGPT-free OpenAI `messages` dataset."""
    rows = [{"messages": [{"role": "user", "content": f"def f{i}(x): what does it return?"},
                          {"role": "assistant", "content": f"It returns x + {i}."}]} for i in range(n)]
    path = folder / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_prompts(folder: Path, n: int = 2) -> Path:
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"def add{i}(a, b):"}) + "\n" for i in range(n)))
    return path


LATIN1 = "r\u00e9sum\u00e9: caf\u00e9\n".encode("latin-1")  # not UTF-8
BINARY = bytes(range(256)) * 8  # NUL bytes and everything else
