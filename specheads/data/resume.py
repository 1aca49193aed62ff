"""Append-only JSON-lines output with an index of finished ids, safe to kill at any point.

OUT holds the rows; OUT.index one line per finished row: `<id>\\t<byte offset where its row ends>`.
A row is written and fsynced before its index line, so on reopening everything in OUT up to the
last indexed offset is exactly the indexed rows: a tail beyond it (a row written but not indexed,
or half a row) is cut off, and a half-written last index line is dropped. Those rows are simply
done again; nothing is lost and nothing appears twice.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from specheads.atomic import write_text


class ResumeError(ValueError):
    """An output folder that cannot be resumed safely (the message says what to do)."""


def index_path(out: Path) -> Path:
    return out.with_name(out.name + ".index")


def read_index(out: Path) -> tuple[list[str], int]:
    """Finished ids in order and the offset where the last one ends (complete lines only)."""
    path = index_path(out)
    if not path.is_file():
        return [], 0
    ids, end = [], 0
    for line in path.read_text(encoding="utf-8").split("\n")[:-1]:  # the part after the last \n is partial
        name, sep, offset = line.rpartition("\t")
        if not sep or not offset.isdigit() or int(offset) < end:
            raise ResumeError(f"{path}: malformed index line {line!r}; delete {out} and {path} to "
                              "start over")
        ids.append(json.loads(name))
        end = int(offset)
    return ids, end


def check_resumable(out: str | Path) -> None:
    """Refuse an OUT that is not a file this writer made: a folder, or a non-empty file without its
    index (a user's file: resuming would cut it to nothing and append to it)."""
    out = Path(out)
    if out.is_dir():
        raise ResumeError(f"{out} is a folder: pass a file path (e.g. {out / 'regenerated.jsonl'}) as --out")
    if out.exists() and out.stat().st_size and not index_path(out).exists():
        raise ResumeError(f"{out} exists without {index_path(out).name}, so it is not an output of an earlier "
                          "run and finished rows cannot be told apart: nothing was changed; pass a new --out "
                          "or move the file away")


class RowWriter:
    """Opens OUT for appending after repairing it to its index; `write(id, row)` is durable."""

    def __init__(self, out: str | Path):
        self.out = Path(out)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        check_resumable(self.out)
        ids, end = read_index(self.out)
        size = self.out.stat().st_size if self.out.exists() else 0
        if size < end:
            raise ResumeError(f"{self.out} is shorter ({size} bytes) than its index says ({end}); "
                              f"delete it and {index_path(self.out)} to start over")
        if size > end:
            os.truncate(self.out, end)  # rows written but never indexed: they are redone
        self._repair_index(ids)
        self.done = set(ids)
        self.dropped_tail = size - end
        self.rows = open(self.out, "ab")
        self.index = open(index_path(self.out), "ab")

    def _repair_index(self, ids: list[str]) -> None:
        """Rewrite the index without a half-written last line (if it has one)."""
        path = index_path(self.out)
        if path.exists() and not path.read_bytes().endswith(b"\n") and path.stat().st_size:
            text = path.read_text(encoding="utf-8")
            write_text(path, text[: text.rfind("\n") + 1])
        elif not path.exists():
            path.touch()

    def write(self, row_id: str, row: dict) -> None:
        """Append the row, then its index line, each flushed to disk."""
        if row_id in self.done:
            raise ResumeError(f"row id {row_id!r} is already in {self.out}")
        self.rows.write((json.dumps(row, ensure_ascii=False) + "\n").encode())
        self.rows.flush()
        os.fsync(self.rows.fileno())
        self.index.write(f"{json.dumps(row_id)}\t{self.rows.tell()}\n".encode())
        self.index.flush()
        os.fsync(self.index.fileno())
        self.done.add(row_id)

    def close(self) -> None:
        self.rows.close()
        self.index.close()
