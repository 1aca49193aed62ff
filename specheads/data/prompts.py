"""Prompts: the prompts file's rows, and the one way a prompt becomes the target's token ids.

`encode_chat` renders a conversation with the tokenizer's chat template, ready for the assistant
turn (`add_generation_prompt`), and tokenizes it in one step: every chat prompt (generate, eval
online and offline, serve, regeneration, the bench scripts) goes through it, so the same messages
give the same ids everywhere. `encode_text` is the raw (non-chat) prompt of `generate --no-chat`
and `/v1/completions`.

`read_prompts` reads a prompts file, a JSON array or JSON lines, for every verb: rows with `prompt`
(one user message), `turns` (MT-bench / Spec-Bench style), OpenAI `messages` (its first user turn),
`question`, Alpaca `instruction` (+ `input`) or `text`; a bad row raises `PromptsError` naming the
file, the container, the row and the keys it has, and each turn passes the message checks of
data/messages.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specheads.data.messages import FieldError, check_text
from specheads.errors import read_user_text


class PromptsError(ValueError):
    """The prompts file is missing or a row is not a usable prompt (the message names the line)."""


class NoChatTemplate(PromptsError):
    """The tokenizer has no chat template to render a chat prompt with (callers add what to do)."""


@dataclass
class PromptRow:
    id: str
    turns: list[str]
    category: str | None = None


# --- the prompts file ----------------------------------------------------------------------------
PROMPT_KEYS = ("prompt", "turns", "messages", "question", "instruction", "text")  # the first one a row has wins
KEYS_TEXT = "prompt, turns (a list), messages (OpenAI: its first user turn), question, instruction (+ input), text"


def read_prompts(path: str | Path, limit: int | None = None) -> list[PromptRow]:
    """A prompts file: a JSON array or JSON lines of objects, each with one of PROMPT_KEYS (see
    `row_turns`); the one reader of eval, bench, regenerate, generate's files and the bench scripts."""
    path = Path(path)
    if limit is not None and limit < 1:
        raise PromptsError(f"--limit {limit}: must be >= 1 (the number of prompts to evaluate)")
    rows = []
    container, records = prompt_records(path)
    for n, where, obj in records:
        turns = row_turns(obj, where, container)
        rows.append(PromptRow(id=str(obj.get("id", obj.get("question_id", n))), turns=turns,
                              category=obj.get("category")))
        if limit is not None and len(rows) >= limit:
            break
    if not rows:
        raise PromptsError(f"prompts file '{path}' holds no prompts")
    return rows


def prompt_records(path: Path) -> tuple[str, list[tuple[int, str, object]]]:
    """The container ("a JSON array" / "JSON lines") and (number, where, parsed row) of each row of a JSON
    array file (it starts with `[`) or a JSON-lines file; the number (the default id) counts from 1 (JSON
    lines: the line), `where` is `FILE: JSON array item 3` / `FILE:7`."""
    text = read_user_text(path, "prompts file", PromptsError)
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as err:
            raise PromptsError(f"{path}: starts like a JSON array but does not parse ({err.msg}, line "
                               f"{err.lineno}); write one JSON array, or one JSON object per line") from None
        if not isinstance(items, list):
            raise PromptsError(f"{path}: expected a JSON array of objects, or one JSON object per line")
        return "a JSON array", [(i + 1, f"{path}: JSON array item {i}", obj) for i, obj in enumerate(items)]
    out = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append((n, f"{path}:{n}", json.loads(line)))
        except json.JSONDecodeError as err:
            raise PromptsError(f"{path}:{n}: not valid JSON ({err.msg}); expected one JSON object per line, "
                               "or a JSON array") from None
    return "JSON lines", out


def row_turns(obj: object, where: str, container: str = "JSON lines") -> list[str]:
    """The user turns of one prompts row: `prompt`, `turns` (MT-bench / Spec-Bench), OpenAI `messages`
    (the first user turn), `question`, Alpaca `instruction` (+ `input`) or `text`, checked."""
    if not isinstance(obj, dict):
        raise PromptsError(f"{where}: each row of the prompts file ({container}) must be a JSON object with one of "
                           f"the keys {KEYS_TEXT}; got a {type(obj).__name__}")
    key = next((k for k in PROMPT_KEYS if k in obj), None)
    if key is None:
        raise PromptsError(f"{where}: no prompt in this row of the prompts file ({container}): expected one of "
                           f"the keys {KEYS_TEXT}; found {', '.join(map(repr, obj)) or 'no keys'}")
    turns = _turns_of(obj, key, where)
    if not (turns and all(isinstance(t, str) and t.strip() for t in turns)):
        shape = "a non-empty list of non-empty strings" if key == "turns" else "a non-empty string"
        raise PromptsError(f"{where}: '{key}' must be {shape}")
    _check_turns(turns, key, where)
    return turns


def _check_turns(turns: list[str], key: str, where: str) -> None:
    """Each turn is a user message's text: it must hold only characters a tokenizer can encode."""
    for j, text in enumerate(turns):
        try:
            check_text(text, f"turns[{j}]" if key == "turns" else key)
        except FieldError as err:
            raise PromptsError(f"{where}: {err}") from None


def _turns_of(obj: dict, key: str, where: str) -> list:
    """The row's value at `key` as a list of turns (not checked yet)."""
    value = obj[key]
    if key == "turns":
        return value if isinstance(value, list) else []
    if key == "messages":
        users = [m.get("content") for m in value if isinstance(m, dict) and m.get("role") == "user"] \
            if isinstance(value, list) else []
        if not users:
            raise PromptsError(f"{where}: 'messages' holds no user message (a list of {{'role': 'user', "
                               "'content': ...}} objects)")
        return users[:1]
    if key == "instruction" and isinstance(value, str) and isinstance(obj.get("input"), str) and obj["input"].strip():
        return [f"{value}\n\n{obj['input']}"]
    return [value]


# --- prompt -> ids -------------------------------------------------------------------------------


def user_turn(text: str) -> list[dict]:
    """The conversation of one user message."""
    return [{"role": "user", "content": text}]


def encode_chat(tokenizer, messages: list[dict], tools: list | None = None,
                template_kwargs: dict | None = None) -> list[int]:
    """The conversation rendered with the tokenizer's chat template, ready for the assistant turn,
    as token ids: THE chat prompt encoder (`tools` and `template_kwargs` go to the template).
    Raises NoChatTemplate without a template; a template's own error passes through."""
    if not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplate("the target's tokenizer has no chat template")
    kwargs = dict(template_kwargs or {})
    if tools:
        kwargs["tools"] = tools
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def encode_text(tokenizer, text: str) -> list[int]:
    """A raw (non-chat) prompt as ids, with the tokenizer's special tokens (e.g. BOS) added."""
    return list(tokenizer(text)["input_ids"])
