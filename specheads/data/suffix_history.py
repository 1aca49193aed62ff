"""Earlier answers for suffix decoding's global cache: a conversations file (any format the trainer
reads; the regenerated training data is the target's own answers) as (prompt ids, answer ids) per
assistant turn, so that an eval, `generate` or a fresh server starts with the history that a vLLM
server running `method: suffix` builds up from the requests it has answered."""

from __future__ import annotations

from pathlib import Path

from specheads.data.conversations import DataError, read_conversations
from specheads.data.prompts import encode_chat


def history_pairs(path: str | Path, tokenizer) -> list[tuple[list[int], list[int]]]:
    """(the chat prompt before it, the answer's tokens) for every assistant turn of `path`."""
    conversations, _ = read_conversations(path)
    pairs = []
    for c in conversations:
        messages = [{"role": m.role, "content": m.content} for m in c.messages]
        for i, m in enumerate(messages):
            if m["role"] == "assistant" and i and m["content"]:
                answer = tokenizer.encode(m["content"], add_special_tokens=False)
                pairs.append((encode_chat(tokenizer, messages[:i]), answer))
    if not pairs:
        raise DataError(f"{path}: no assistant answer to put in suffix decoding's cache; pass conversations "
                        "with answers (e.g. the output of `specheads regenerate`)")
    return pairs
