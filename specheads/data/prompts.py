"""Prompts: the prompts file's rows, and the one way a prompt becomes the target's token ids.

`encode_chat` renders a conversation with the tokenizer's chat template, ready for the assistant
turn (`add_generation_prompt`), and tokenizes it in one step: every chat prompt (generate, eval
online and offline, serve, regeneration, the bench scripts) goes through it, so the same messages
give the same ids everywhere. `encode_text` is the raw (non-chat) prompt of `generate --no-chat`
and `/v1/completions`.

`read_prompts` reads a prompts file (jsonl rows with `prompt`, one user message, or `turns`,
MT-bench / Spec-Bench style); a bad row raises `PromptsError` naming the file and line, and each
turn passes the message checks of data/messages.py.
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


def read_prompts(path: str | Path, limit: int | None = None) -> list[PromptRow]:
    """jsonl rows with `prompt` (one user message) or `turns` (MT-bench / Spec-Bench style)."""
    path = Path(path)
    if limit is not None and limit < 1:
        raise PromptsError(f"--limit {limit}: must be >= 1 (the number of prompts to evaluate)")
    rows = []
    for n, line in enumerate(read_user_text(path, "prompts file", PromptsError).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise PromptsError(f"{path}:{n}: not valid JSON ({err.msg})") from None
        turns = [obj["prompt"]] if isinstance(obj, dict) and "prompt" in obj else (
            obj.get("turns") if isinstance(obj, dict) else None)
        if not (isinstance(turns, list) and turns and all(isinstance(t, str) and t for t in turns)):
            raise PromptsError(f"{path}:{n}: expected a non-empty string 'prompt' or a non-empty "
                               "list of strings 'turns'")
        _check_turns(turns, "prompt" in obj, f"{path}:{n}")
        rows.append(PromptRow(id=str(obj.get("id", obj.get("question_id", n))), turns=turns,
                              category=obj.get("category")))
        if limit is not None and len(rows) >= limit:
            break
    if not rows:
        raise PromptsError(f"prompts file '{path}' holds no prompts")
    return rows


def _check_turns(turns: list[str], single: bool, where: str) -> None:
    """Each turn is a user message's text: it must hold only characters a tokenizer can encode."""
    for j, text in enumerate(turns):
        try:
            check_text(text, "prompt" if single else f"turns[{j}]")
        except FieldError as err:
            raise PromptsError(f"{where}: {err}") from None


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
