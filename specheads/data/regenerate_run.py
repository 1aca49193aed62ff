"""Regeneration runs: read a dataset, rewrite its assistant turns with a backend, write JSON lines.

Output OUT (one row per conversation: `id`, `messages`, `tools` if any, `regenerated` counts),
OUT.index (finished ids, see data/resume.py) and OUT.meta.json (source, options, backend, target
fingerprint or served model, and the report: rows finished, failed, truncated, resumed). A rerun
with the same OUT continues where the last one stopped; failed rows are retried.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specheads.atomic import write_json
from specheads.data.conversations import detect_format, read_conversations
from specheads.data.messages import OPENAI_ROLES, FieldError, check_message, check_strings
from specheads.data.prompts import PromptsError, prompt_records, read_prompts
from specheads.data.regenerate_turns import LocalBackend, RegenerateError, RegenOptions, Row, count_turns
from specheads.data.resume import RowWriter, check_resumable
from specheads.errors import read_user_text
from specheads.progress import Progress

# --- input rows --------------------------------------------------------------------------------


def _raw_rows(path: Path) -> list | None:
    """A .json list / .jsonl file's rows when they are OpenAI `messages` rows, else None."""
    if path.suffix.lower() not in (".json", ".jsonl") or not path.is_file():
        return None
    text = read_user_text(path, "dataset", RegenerateError)
    try:
        rows = json.loads(text) if path.suffix.lower() == ".json" else None
    except json.JSONDecodeError:
        rows = None
    if rows is None:
        try:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError:
            return None
    ok = isinstance(rows, list) and rows and all(isinstance(r, dict) and "messages" in r for r in rows)
    return rows if ok else None


def _message_row(row: dict, n: int, path: Path) -> Row:
    """An OpenAI row with tool messages and tool calls kept as they are (each message checked)."""
    msgs = row.get("messages")
    if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
        raise RegenerateError(f"{path}: row {n}: 'messages' must be a list of objects with role "
                              f"{' / '.join(OPENAI_ROLES)}")
    try:
        for i, m in enumerate(msgs):
            check_message(m, f"messages[{i}]")
        check_strings(row.get("tools"), "tools")
    except FieldError as err:
        raise RegenerateError(f"{path}: row {n}: {err}") from None
    return Row(str(row.get("id", f"{path.stem}:{n}")), msgs, row.get("tools"))


def _prompt_rows(path: Path) -> list[Row] | None:
    """A prompts file (`prompt` / `turns` / `question` rows in JSON lines or a JSON array, read by
    data/prompts.py; e.g. `specheads magpie`'s output) as conversations to answer: each user turn
    followed by an empty assistant turn; else None (a dataset read_conversations reads)."""
    if path.suffix.lower() not in (".json", ".jsonl") or not path.is_file():
        return None
    try:
        records = prompt_records(path)[1]
    except PromptsError:
        return None
    first = records[0][2] if records else None
    if not isinstance(first, dict) or detect_format(first) or not {"prompt", "turns", "question"} & set(first):
        return None
    return [Row(p.id, [m for t in p.turns for m in ({"role": "user", "content": t}, {"role": "assistant", "content": ""})])
            for p in read_prompts(path)]


def read_rows(path: str | Path, fmt: str = "auto", limit: int | None = None) -> list[Row]:
    """Conversations to regenerate (any format `read_conversations` reads, tool rows kept, or a
    prompts file whose answers are still to write)."""
    path = Path(path)
    raw = _raw_rows(path) if fmt in ("auto", "openai", "messages") else None
    prompts = _prompt_rows(path) if fmt == "auto" and raw is None else None
    if raw is not None:
        rows = [_message_row(r, n, path) for n, r in enumerate(raw)]
    elif prompts is not None:
        rows = prompts
    else:
        convs, _ = read_conversations(path, fmt, format_option="--format", source_option="the SOURCE argument")
        rows = [Row(c.id, [{"role": m.role, "content": m.content} for m in c.messages]) for c in convs]
    rows = rows[:limit] if limit is not None else rows
    seen = set()
    for r in rows:
        if r.id in seen:
            raise RegenerateError(f"{path}: row id {r.id!r} appears twice; ids must be unique to "
                                  "resume safely")
        seen.add(r.id)
    return rows


# --- the command -------------------------------------------------------------------------------


@dataclass
class Report:
    """Counts of one run (rows already finished by an earlier run are `resumed`)."""

    rows: int = 0
    resumed: int = 0
    finished: int = 0
    failed: int = 0
    truncated: int = 0
    skipped_tools: int = 0
    turns: int = 0
    failures: list[str] = field(default_factory=list)

    def add(self, row: dict) -> None:
        self.finished += 1
        self.turns += row["regenerated"]["turns"]
        self.truncated += row["regenerated"]["truncated_turns"] > 0

    def fail(self, row_id: str, err: Exception) -> None:
        self.failed += 1
        if len(self.failures) < 20:
            self.failures.append(f"{row_id}: {err}")


def check_meta(out: Path, meta: dict) -> None:
    """Refuse to resume an output made with other settings or another target."""
    path = out.with_name(out.name + ".meta.json")
    if not path.is_file():
        return
    old = json.loads(path.read_text(encoding="utf-8"))
    for key in ("options", "target"):
        if old.get(key) != meta.get(key):
            raise RegenerateError(f"{out} was made with other {key} ({old.get(key)} vs now "
                                  f"{meta.get(key)}): pass a new --out or the same settings")


def _run_local(backend, rows, writer, report, chunk: int, progress) -> None:
    for b in range(0, len(rows), chunk):
        for row in backend.run_iter(rows[b:b + chunk], progress):  # each row written as soon as it is finished
            writer.write(row["id"], row)
            report.add(row)


def _run_openai(backend, rows, writer, report, concurrency: int, progress) -> None:
    """Bounded window of in-flight conversations; results written as they finish."""
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    todo = iter(rows)
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        running = {}
        while True:
            while len(running) < 2 * concurrency and (row := next(todo, None)) is not None:
                running[pool.submit(backend.run_one, row)] = row
            if not running:
                break
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in finished:
                row = running.pop(fut)
                progress.update(count_turns([row], backend.opts))
                try:
                    result = fut.result()
                except Exception as err:  # noqa: BLE001 - counted, the row is retried next run
                    report.fail(row.id, err)
                    continue
                writer.write(row.id, result)
                report.add(result)


def run_regenerate(source, out, backend, opts: RegenOptions, fmt: str = "auto",
                   limit: int | None = None, concurrency: int = 8, chunk: int = 64,
                   quiet: bool = False) -> Report:
    """Regenerate `source` into `out` (JSON lines), resuming whatever an earlier run finished;
    progress (turns) on stderr unless `quiet`."""
    out = Path(out)
    rows = read_rows(source, fmt, limit)
    report = Report(rows=len(rows))
    if opts.tools == "skip":
        kept = [r for r in rows if not any(m.get("role") == "tool" or m.get("tool_calls") for m in r.messages)]
        report.skipped_tools, rows = len(rows) - len(kept), kept
    about = backend.describe()
    meta = {"source": str(source), "options": asdict(opts), "target": about.get("target") or about.get("model"),
            "backend": about}
    check_resumable(out)
    check_meta(out, meta)
    writer = RowWriter(out)  # before the meta file: a refused --out gets nothing written beside it
    write_json(out.with_name(out.name + ".meta.json"), {**meta, "report": None})
    try:
        todo = [r for r in rows if r.id not in writer.done]
        report.resumed = len(rows) - len(todo)
        with Progress(count_turns(todo, opts), "regenerate", "turns", quiet=quiet) as progress:
            if isinstance(backend, LocalBackend):
                _run_local(backend, todo, writer, report, chunk, progress)
            else:
                _run_openai(backend, todo, writer, report, concurrency, progress)
    finally:
        writer.close()
    write_json(out.with_name(out.name + ".meta.json"), {**meta, "report": asdict(report),
                                                        "all_runs": count_rows(out)})
    return report


def count_rows(out: Path) -> dict:
    """Totals over every finished row of OUT, this run's and earlier (killed or not) runs': read
    from the rows themselves, so a resume counts all runs' truncations."""
    totals = {"rows": 0, "turns": 0, "truncated": 0, "truncated_turns": 0}
    with open(out, encoding="utf-8") as f:
        for line in f:
            regen = json.loads(line).get("regenerated") or {}
            totals["rows"] += 1
            totals["turns"] += regen.get("turns", 0)
            totals["truncated_turns"] += regen.get("truncated_turns", 0)
            totals["truncated"] += regen.get("truncated_turns", 0) > 0
    return totals
