"""The chat message type, the roles accepted and the checks every message passes.

`check_message` is the one check of a message, shared by `specheads serve` (requests) and every
reader of conversation and prompt files (train, eval, regenerate, generate's --prompt): a role
from OPENAI_ROLES, and text a tokenizer can encode (no lone surrogate). Each caller puts the
`FieldError` it raises in its own words: the request's 400, or the file and row.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# OpenAI's chat roles: the one list of roles accepted, by the server and every conversation reader
OPENAI_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class Message:
    """One chat turn; `role` is one of OPENAI_ROLES. The optional fields are OpenAI's
    tool-calling fields and a separate `thinking` text, passed to the chat template as they are."""

    role: str
    content: str
    tool_calls: tuple[dict, ...] | None = None  # assistant: [{type, id?, function: {name, arguments}}]
    tool_call_id: str | None = None  # tool: the call it answers
    name: str | None = None  # tool: the function's name
    thinking: str | None = None  # assistant: reasoning kept apart from content (e.g. harmony's analysis)


class FieldError(ValueError):
    """A bad field of a row or chat message: its path and what is wrong (the caller adds where:
    file and row, or the request)."""

    def __init__(self, field_path: str, problem: str):
        super().__init__(f"field '{field_path}': {problem}")
        self.field, self.problem = field_path, problem


def lone_surrogate(text: str) -> int:
    """Index of the first lone UTF-16 surrogate in `text` (e.g. from a JSON `\\ud800` escape), or -1."""
    if text.isascii():
        return -1
    try:
        text.encode("utf-8")  # fails on surrogates only: valid pairs were joined when parsed
    except UnicodeEncodeError as err:
        return err.start
    return -1


def check_text(text: str, field_path: str) -> None:
    """Refuse text no tokenizer can encode: a lone surrogate is half of a pair, not a character."""
    at = lone_surrogate(text)
    if at >= 0:
        raise FieldError(field_path, f"lone surrogate U+{ord(text[at]):04X} at position {at} (counting "
                         "from 0): half of a UTF-16 surrogate pair, not a character, so it cannot be "
                         "tokenized; remove it or write the character meant (one outside the BMP as a "
                         "whole pair, e.g. \\ud83d\\ude00)")


def _strings(value: Any, path: str) -> Iterator[tuple[str, str]]:
    """Every string inside `value` (nested objects and lists) with its field path, in order."""
    stack = [(path, value)]
    while stack:  # a loop, not recursion: a deeply nested request must not overflow the stack
        path, value = stack.pop()
        if isinstance(value, str):
            yield path, value
        elif isinstance(value, dict):
            stack.extend((f"{path}.{k}", v) for k, v in reversed(list(value.items())))
        elif isinstance(value, (list, tuple)):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(value))))


def check_strings(value: Any, path: str) -> None:
    """`check_text` on every string inside `value` (tool definitions, content parts, ...)."""
    for field_path, text in _strings(value, path):
        check_text(text, field_path)


def check_role(role: Any, field_path: str) -> None:
    """Refuse a role outside OPENAI_ROLES, as OpenAI's API does (templates would render any)."""
    if role not in OPENAI_ROLES:
        raise FieldError(field_path, f"unknown role {role!r}; expected one of {', '.join(OPENAI_ROLES)}")


def check_message(message: dict, where: str) -> None:
    """The one check of an OpenAI chat message, for requests and prompt files alike: an accepted
    role and, in every string field, text a tokenizer can encode (`where`: e.g. `messages[0]`)."""
    check_role(message.get("role"), f"{where}.role")
    check_strings({k: v for k, v in message.items() if k != "role"}, where)
