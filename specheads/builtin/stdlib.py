"""Demo data from the Python standard library's own sources (present on every machine).

Modules are read in sorted order and split train / held-out by a stable hash of their
relative path, so the same module is always on the same side. Conversations pair a
function's signature + docstring (user) with the rest of its body (assistant).
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from specheads.atomic import atomic_file

HELDOUT_PER_MILLE = 100  # ~10% of modules are held out
SKIP_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__"})
MIN_BODY_CHARS = 40
MAX_BODY_CHARS = 1500
DEFAULT_N_PROMPTS = 64
MAX_PROMPT_CHARS = 400  # keeps prompt + 96 generated tokens inside the target's trained length


@dataclass(frozen=True)
class SourceFile:
    """One standard-library module: its path relative to the stdlib root and its text."""

    rel: str
    text: str


def stdlib_root() -> Path:
    """The running interpreter's standard-library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def stable_fraction(key: str) -> float:
    """A platform- and run-independent number in [0, 1) derived from `key`."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def is_heldout(rel: str) -> bool:
    """True when the module at relative path `rel` belongs to the held-out split."""
    return stable_fraction("split:" + rel) * 1000 < HELDOUT_PER_MILLE


def module_paths(root: Path | None = None) -> list[str]:
    """Sorted relative POSIX paths of the stdlib's `.py` files, minus tests and site-packages."""
    root = root or stdlib_root()
    rels = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if SKIP_DIRS.isdisjoint(rel.parts[:-1]):
            rels.append(rel.as_posix())
    return sorted(rels)


def read_sources(root: Path | None = None, limit: int | None = None) -> list[SourceFile]:
    """Read the stdlib modules (sorted, UTF-8 only); `limit` keeps the first N for quick tests."""
    root = root or stdlib_root()
    out = []
    for rel in module_paths(root):
        if limit is not None and len(out) >= limit:
            break
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out.append(SourceFile(rel, text))
    return out


def split_sources(sources: Iterable[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    """(train, held-out) by module, order preserved."""
    train, heldout = [], []
    for src in sources:
        (heldout if is_heldout(src.rel) else train).append(src)
    return train, heldout


def _dedent(lines: list[str], width: int) -> list[str]:
    """Remove up to `width` leading whitespace characters from each line (keeps relative indent)."""
    out = []
    for line in lines:
        stripped = line.lstrip(" \t")
        cut = min(width, len(line) - len(stripped))
        out.append(line[cut:])
    return out


def _is_trivial(body: list[ast.stmt]) -> bool:
    """A body with nothing to learn: empty, `pass`, or `...`."""
    if not body:
        return True
    if len(body) == 1 and isinstance(body[0], ast.Pass):
        return True
    return (len(body) == 1 and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant) and body[0].value.value is Ellipsis)


def _function_turns(node: ast.AST, lines: list[str]) -> tuple[str, str] | None:
    """(signature + docstring, body after the docstring) as source text, or None to skip."""
    if ast.get_docstring(node, clean=False) is None or _is_trivial(node.body[1:]):
        return None
    doc = node.body[0]
    if node.body[1].lineno <= doc.end_lineno:
        return None  # statement shares the docstring's line
    user = _dedent(lines[node.lineno - 1:doc.end_lineno], node.col_offset)
    body = _dedent(lines[doc.end_lineno:node.end_lineno], node.col_offset)
    while body and not body[0].strip():
        body.pop(0)
    user_text, body_text = "\n".join(user).rstrip(), "\n".join(body).rstrip()
    if not MIN_BODY_CHARS <= len(body_text) <= MAX_BODY_CHARS:
        return None
    return user_text, body_text


def extract_conversations(src: SourceFile) -> list[dict]:
    """All usable functions of one module as OpenAI-`messages` conversations, in source order."""
    try:
        tree = ast.parse(src.text)
    except (SyntaxError, ValueError):
        return []
    lines = src.text.splitlines()
    convs = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        turns = _function_turns(node, lines)
        if turns is None:
            continue
        convs.append({"id": f"{src.rel}:{node.lineno}:{node.name}",
                      "messages": [{"role": "user", "content": turns[0]},
                                   {"role": "assistant", "content": turns[1]}]})
    return sorted(convs, key=lambda c: int(c["id"].split(":")[1]))


def conversations(sources: Iterable[SourceFile]) -> list[dict]:
    """Conversations of every module in `sources`, module order then source order."""
    return [conv for src in sources for conv in extract_conversations(src)]


def module_of(conv_id: str) -> str:
    """The module path a conversation id came from."""
    return conv_id.split(":", 1)[0]


def choose_prompts(convs: list[dict], n: int = DEFAULT_N_PROMPTS,
                   max_prompt_chars: int | None = None) -> list[dict]:
    """A deterministic choice of `n` conversations (stable hash of id), optionally short-prompt only."""
    if max_prompt_chars is not None:
        convs = [c for c in convs if len(c["messages"][0]["content"]) <= max_prompt_chars]
    ranked = sorted(convs, key=lambda c: (stable_fraction("prompt:" + c["id"]), c["id"]))
    return ranked[:n]


def write_jsonl_atomic(path: Path, records: Iterable[dict]) -> Path:
    """Write JSON lines to a temp file beside `path`, then rename it into place."""
    with atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return Path(path)


def write_demo_data(out_dir: str | os.PathLike, n_prompts: int = DEFAULT_N_PROMPTS,
                    root: Path | None = None, limit: int | None = None) -> dict[str, Path]:
    """Write train.jsonl, heldout.jsonl and heldout_prompts.jsonl; returns their paths by name."""
    out_dir = Path(out_dir)
    train, heldout = split_sources(read_sources(root, limit))
    held_convs = conversations(heldout)
    prompts = [{"id": c["id"], "prompt": c["messages"][0]["content"]}
               for c in choose_prompts(held_convs, n_prompts, MAX_PROMPT_CHARS)]
    return {
        "train": write_jsonl_atomic(out_dir / "train.jsonl", conversations(train)),
        "heldout": write_jsonl_atomic(out_dir / "heldout.jsonl", held_convs),
        "heldout_prompts": write_jsonl_atomic(out_dir / "heldout_prompts.jsonl", prompts),
    }
