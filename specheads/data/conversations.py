"""Read chat datasets (ShareGPT, OpenAI messages, Alpaca, raw text) into `Conversation`s.

Every row is validated; a bad row raises `DataError` naming the file, the row and the field, or is
skipped and counted when `skip_malformed=True`. Sources are local only: the hub is never contacted.
"""
from __future__ import annotations

import csv
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specheads.data.messages import FieldError, Message, check_message, check_strings, check_text

FORMATS = ("sharegpt", "openai", "alpaca", "text")
FORMAT_ALIASES = {"messages": "openai", "raw": "text"}
SHAREGPT_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "model": "assistant", "chatgpt": "assistant",
    "system": "system",
}
_FORMAT_KEYS = (("conversations", "sharegpt"), ("messages", "openai"), ("instruction", "alpaca"), ("text", "text"))
_SKIP_HINT = "fix the row or set data.skip_malformed: true"
_MAX_REASONS = 5


class DataError(ValueError):
    """A dataset file or row that cannot be read; the message says where and what to do."""


@dataclass
class Conversation:
    """A chat sample (`messages`) or, when `text` is set, a raw-text sample with no chat structure."""

    id: str
    messages: list[Message] = field(default_factory=list)
    text: str | None = None
    tools: list[dict] | None = None  # OpenAI tool definitions the chat template renders


@dataclass
class ReadStats:
    """What `read_conversations` saw: rows read, kept, skipped, and a few reasons for the skips."""

    read: int = 0
    kept: int = 0
    skipped: int = 0
    format: str = ""
    reasons: list[str] = field(default_factory=list)

    def skip(self, reason: str) -> None:
        """Count one skipped row, keeping the first few reasons as examples."""
        self.skipped += 1
        if len(self.reasons) < _MAX_REASONS:
            self.reasons.append(reason)


@dataclass
class _Row:
    """One raw row: 0-based index (used in ids and messages), the jsonl line if any, and the data."""

    index: int
    value: Any
    line: int | None = None
    error: FieldError | None = None

    def where(self, path: Path) -> str:
        """`file: row N (line L)` — the location prefix of every row message."""
        line = f" (line {self.line})" if self.line is not None else ""
        return f"{path}: row {self.index}{line}"


# ---------------------------------------------------------------- reading rows from files


def _rows_from_jsonl(path: Path) -> Iterator[_Row]:
    """One row per non-blank line; a line that is not JSON becomes a row error with its line number."""
    with path.open(encoding="utf-8") as f:
        index = 0
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield _Row(index, json.loads(line), line_no)
            except json.JSONDecodeError as e:
                yield _Row(index, None, line_no, FieldError("<line>", f"invalid JSON ({e.msg} at column {e.colno})"))
            index += 1


def _rows_from_json(path: Path) -> Iterator[_Row]:
    """A JSON list of rows, or a dict holding exactly one list; a JSON-lines file named .json also works."""
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # several top-level values: JSON lines under a .json name
            yield from _rows_from_jsonl(path)
            return
        raise DataError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    if isinstance(data, dict):
        lists = [k for k, v in data.items() if isinstance(v, list)]
        if len(lists) != 1:
            raise DataError(f"{path}: a top-level JSON object must hold exactly one list of rows; "
                            f"found list fields {lists or 'none'} — write the file as a JSON list or JSON lines")
        data = data[lists[0]]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of rows, got {type(data).__name__}")
    yield from (_Row(i, row) for i, row in enumerate(data))


def _rows_from_txt(path: Path) -> Iterator[_Row]:
    """Raw text: one sample per block of lines separated by blank lines."""
    blocks, current = [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            current.append(line)
        elif current:
            blocks.append("\n".join(current))
            current = []
    if current:
        blocks.append("\n".join(current))
    yield from (_Row(i, {"text": block}) for i, block in enumerate(blocks))


def _rows_from_csv(path: Path) -> Iterator[_Row]:
    """CSV with a header line: flat formats only (Alpaca columns or a `text` column)."""
    with path.open(encoding="utf-8", newline="") as f:
        yield from (_Row(i, dict(row)) for i, row in enumerate(csv.DictReader(f)))


def _rows_from_parquet(path: Path) -> Iterator[_Row]:
    """Parquet read with pyarrow (installed with `datasets`); nested columns come back as lists/dicts."""
    import pyarrow.parquet as pq

    yield from (_Row(i, row) for i, row in enumerate(pq.read_table(path).to_pylist()))


def _rows_from_saved_dataset(path: Path) -> Iterator[_Row]:
    """A folder written by `datasets.Dataset.save_to_disk` (a DatasetDict must have one split or `train`)."""
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds.keys())
        if "train" not in ds and len(splits) != 1:
            raise DataError(f"{path}: a saved DatasetDict must have a 'train' split or exactly one split; "
                            f"found {splits} — save the split you want to train on")
        ds = ds["train"] if "train" in ds else ds[splits[0]]
    yield from (_Row(i, row) for i, row in enumerate(ds))


_READERS: dict[str, Callable[[Path], Iterator[_Row]]] = {
    ".jsonl": _rows_from_jsonl, ".json": _rows_from_json, ".txt": _rows_from_txt,
    ".csv": _rows_from_csv, ".parquet": _rows_from_parquet,
}


def _reader_for(path: Path, option: str = "data.train") -> Callable[[Path], Iterator[_Row]]:
    """Pick the row reader from the file suffix, or the saved-dataset reader for a folder; `option`:
    what names the file in the calling command (a recipe's data.train, --suffix-history, ...)."""
    if not path.exists():
        raise DataError(f"{path}: no such file or folder — check {option}")
    if path.is_dir():
        if any((path / name).exists() for name in ("dataset_info.json", "dataset_dict.json", "state.json")):
            return _rows_from_saved_dataset
        raise DataError(f"{path}: a folder must be written by datasets' save_to_disk; "
                        f"otherwise point {option} at a {'/'.join(_READERS)} file")
    reader = _READERS.get(path.suffix.lower())
    if reader is None:
        raise DataError(f"{path}: unsupported file type '{path.suffix}'; use one of {', '.join(_READERS)} "
                        "or a datasets save_to_disk folder")
    return reader


# ---------------------------------------------------------------- parsing one row


def _require(row: dict, key: str, kind: type, path: str | None = None) -> Any:
    """`row[key]`, checked to exist and have type `kind` (a string: to hold only characters)."""
    path = path or key
    if key not in row or row[key] is None:
        raise FieldError(path, "missing")
    if not isinstance(row[key], kind):
        raise FieldError(path, f"expected {kind.__name__}, got {type(row[key]).__name__}")
    if isinstance(row[key], str):
        check_text(row[key], path)
    return row[key]


def _turn(item: Any, path: str) -> dict:
    """A conversation turn must be a JSON object."""
    if not isinstance(item, dict):
        raise FieldError(path, f"expected an object, got {type(item).__name__}")
    return item


def _parse_sharegpt(row: dict) -> list[Message]:
    """`conversations: [{from, value}]` with ShareGPT role names mapped to system/user/assistant."""
    messages = []
    for i, item in enumerate(_require(row, "conversations", list)):
        turn = _turn(item, f"conversations[{i}]")
        who = _require(turn, "from", str, f"conversations[{i}].from")
        if who.lower() not in SHAREGPT_ROLES:
            raise FieldError(f"conversations[{i}].from",
                             f"unknown role '{who}'; expected one of {', '.join(SHAREGPT_ROLES)}")
        value = _require(turn, "value", str, f"conversations[{i}].value")
        messages.append(Message(SHAREGPT_ROLES[who.lower()], value))
    return messages


def _content_text(content: Any, path: str) -> str:
    """OpenAI content: a string, or a list of `{"type": "text", "text": ...}` parts joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FieldError(path, f"expected a string or a list of text parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        part = _turn(part, f"{path}[{j}]")
        if part.get("type") != "text":
            raise FieldError(f"{path}[{j}].type", f"unsupported content part type {part.get('type')!r}; "
                             "only text parts are supported")
        texts.append(_require(part, "text", str, f"{path}[{j}].text"))
    return "\n".join(texts)


def _tool_calls(turn: dict, path: str) -> tuple[dict, ...] | None:
    """An assistant turn's `tool_calls`: absent/null/empty, or objects with `function.name` and `arguments`."""
    calls = turn.get("tool_calls")
    if not calls:
        return None
    if turn["role"] != "assistant":
        raise FieldError(path, f"only assistant messages carry tool calls, not '{turn['role']}'")
    if not isinstance(calls, list):
        raise FieldError(path, f"expected a list, got {type(calls).__name__}")
    for j, call in enumerate(calls):
        fn = _require(_turn(call, f"{path}[{j}]"), "function", dict, f"{path}[{j}].function")
        _require(fn, "name", str, f"{path}[{j}].function.name")
        if not isinstance(fn.get("arguments"), (str, dict)):
            raise FieldError(f"{path}[{j}].function.arguments", "expected a JSON string or an object")
    return tuple(calls)


def _optional_field(turn: dict, key: str, path: str) -> str | None:
    """An optional string field of a message: absent or null gives None."""
    value = turn.get(key)
    if value is not None and not isinstance(value, str):
        raise FieldError(path, f"expected str, got {type(value).__name__}")
    return value


def _openai_message(turn: dict, i: int) -> Message:
    """One OpenAI message; an assistant turn that only calls tools may have null content."""
    role = _require(turn, "role", str, f"messages[{i}].role")
    check_message(turn, f"messages[{i}]")
    calls = _tool_calls(turn, f"messages[{i}].tool_calls")
    if turn.get("content") is None and not calls:
        raise FieldError(f"messages[{i}].content", "missing")
    content = "" if turn.get("content") is None else _content_text(turn["content"], f"messages[{i}].content")
    return Message(role, content, calls,
                   _optional_field(turn, "tool_call_id", f"messages[{i}].tool_call_id"),
                   _optional_field(turn, "name", f"messages[{i}].name"),
                   _optional_field(turn, "thinking", f"messages[{i}].thinking"))


def _parse_openai(row: dict) -> list[Message]:
    """`messages: [{role, content}]`, roles from OPENAI_ROLES, with OpenAI tool-call fields."""
    return [_openai_message(_turn(item, f"messages[{i}]"), i) for i, item in enumerate(_require(row, "messages", list))]


def _row_tools(row: dict) -> list[dict] | None:
    """The row's optional `tools` list (OpenAI function definitions)."""
    tools = row.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise FieldError("tools", "expected a list of tool definitions (objects)")
    check_strings(tools, "tools")
    return tools or None


def _optional_str(row: dict, key: str) -> str:
    """An optional string field: absent or null gives ''."""
    value = row.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise FieldError(key, f"expected str, got {type(value).__name__}")
    check_text(value, key)
    return value


def _parse_alpaca(row: dict) -> list[Message]:
    """`instruction` (+ optional `input` after a blank line), `output`, optional `system`."""
    prompt = _require(row, "instruction", str)
    extra = _optional_str(row, "input")
    output = _require(row, "output", str)
    system = _optional_str(row, "system")
    messages = [Message("system", system)] if system else []
    messages.append(Message("user", f"{prompt}\n\n{extra}" if extra else prompt))
    messages.append(Message("assistant", output))
    return messages


def _parse_text(row: dict) -> str:
    """A raw-text row: a non-empty `text` string."""
    text = _require(row, "text", str)
    if not text.strip():
        raise FieldError("text", "empty text")
    return text


_PARSERS = {"sharegpt": _parse_sharegpt, "openai": _parse_openai, "alpaca": _parse_alpaca}


def _check_chat(messages: list[Message], fmt: str) -> None:
    """A chat sample needs at least one message and at least one assistant turn to supervise."""
    key = "conversations" if fmt == "sharegpt" else "messages"
    if not messages:
        raise FieldError(key, "empty conversation")
    if not any(m.role == "assistant" for m in messages):
        raise FieldError(key, "no assistant turn: nothing to train on")


def _row_id(row: dict, stem: str, index: int) -> str:
    """The row's own `id` (string or integer) if present, else `<file stem>:<row index>`."""
    value = row.get("id")
    if value is None or value == "":
        return f"{stem}:{index}"
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise FieldError("id", f"expected a string or integer, got {type(value).__name__}")
    return str(value)


def _parse_row(row: _Row, fmt: str, stem: str) -> Conversation:
    """Turn one raw row into a `Conversation` of format `fmt`, or raise `FieldError`."""
    if row.error is not None:
        raise row.error
    if not isinstance(row.value, dict):
        raise FieldError("<row>", f"expected a JSON object, got {type(row.value).__name__}")
    conv_id = _row_id(row.value, stem, row.index)
    if fmt == "text":
        return Conversation(conv_id, [], _parse_text(row.value))
    messages = _PARSERS[fmt](row.value)
    _check_chat(messages, fmt)
    return Conversation(conv_id, messages, tools=_row_tools(row.value) if fmt == "openai" else None)


# ---------------------------------------------------------------- public API


def detect_format(value: Any) -> str | None:
    """The format a row's keys indicate (conversations, messages, instruction, text), or None."""
    if isinstance(value, dict):
        for key, fmt in _FORMAT_KEYS:
            if key in value:
                return fmt
    return None


PROMPT_ONLY_KEYS = {"prompt", "turns", "question"}  # rows of a prompts file: questions, no answers yet


def _undetected_hint(keys: list[str], path: Path, option: str | None, source_option: str) -> str:
    """What to do with rows whose format is not detected: prompts want answers first (regenerate),
    anything else names the format option of the command (or, without one, the formats it reads)."""
    if PROMPT_ONLY_KEYS & set(keys):
        return (f"these rows are prompts without answers, and {source_option} needs conversations with answers: "
                f"have the target write them with `specheads regenerate {path} --out ANSWERS.jsonl --target "
                "TARGET` and pass ANSWERS.jsonl")
    if option is None:
        return f"{source_option} reads conversations in one of these formats: {', '.join(FORMATS)}"
    return f"set {option} explicitly (one of {', '.join(FORMATS)})"


def _resolve_format(rows: list[_Row], fmt: str, path: Path, option: str | None = "data.format",
                    source_option: str = "data.train") -> str:
    """`fmt` itself, or for "auto" the format of the first row whose keys say which it is; `option`:
    what sets the format in the calling command (a recipe's data.format, regenerate's --format; None:
    nothing does), `source_option`: what names the file."""
    fmt = FORMAT_ALIASES.get(fmt, fmt)
    if fmt != "auto":
        if fmt not in FORMATS:
            raise DataError(f"{path}: unknown data format '{fmt}'; expected auto or one of {', '.join(FORMATS)}")
        return fmt
    for row in rows:
        found = row.error is None and detect_format(row.value)
        if found:
            return found
    keys = sorted(rows[0].value) if rows and isinstance(rows[0].value, dict) else []
    raise DataError(f"{path}: cannot detect the data format: no row has a 'conversations', 'messages', "
                    f"'instruction' or 'text' field (first row keys: {keys}) — "
                    f"{_undetected_hint(keys, path, option, source_option)}")


def read_conversations(
    source: str | Path, fmt: str = "auto", skip_malformed: bool = False, format_option: str | None = "data.format",
    source_option: str = "data.train",
) -> tuple[list[Conversation], ReadStats]:
    """Read one local dataset file or save_to_disk folder into conversations, validating every row
    (`format_option`: what sets the format in the calling command, named when it cannot be detected,
    None where no option does; `source_option`: what names the file, e.g. --suffix-history).

    A malformed row raises `DataError` (file, row, field, fix), or is skipped and counted in the
    returned `ReadStats` when `skip_malformed` is true.
    """
    path = Path(source)
    reader = _reader_for(path, source_option)
    try:
        rows = list(reader(path))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (invalid byte at offset {e.start}) — convert it to "
                        f"UTF-8 or check that {source_option} names the right file") from None
    except (OSError, ValueError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"{path}: cannot read it as {path.suffix or 'a dataset'} ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if not rows:
        raise DataError(f"{path}: the file holds no rows — check {source_option}")
    stats = ReadStats(format=_resolve_format(rows, fmt, path, format_option, source_option))
    convs = []
    for row in rows:
        stats.read += 1
        try:
            convs.append(_parse_row(row, stats.format, path.stem))
        except FieldError as e:
            reason = f"{row.where(path)}: {e}"
            if not skip_malformed:
                raise DataError(f"{reason} — {_SKIP_HINT}") from None
            stats.skip(reason)
    stats.kept = len(convs)
    return convs, stats


def _unit_hash(text: str) -> float:
    """A stable hash of `text` mapped to [0, 1) (sha256, unaffected by Python's hash salting)."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_heldout(
    convs: list[Conversation],
    heldout_fraction: float,
    seed: int = 0,
    key: Callable[[Conversation], str] = lambda c: c.id,
) -> tuple[list[Conversation], list[Conversation]]:
    """Split into (train, held-out) by a stable hash of `key(conv)` and `seed`.

    A sample's side depends only on its key and the seed, not on order or dataset size, so the
    held-out set stays put when data is added; its size is `heldout_fraction` in expectation.
    """
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    train, heldout = [], []
    for conv in convs:
        side = heldout if _unit_hash(f"{seed}:{key(conv)}") < heldout_fraction else train
        side.append(conv)
    return train, heldout
