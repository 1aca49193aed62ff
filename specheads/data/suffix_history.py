"""Earlier answers for suffix decoding's global cache: a conversations file (any format the trainer
reads; the regenerated training data is the target's own answers) as (prompt ids, answer ids) per
assistant turn, so that an eval, `generate` or a fresh server starts with the history that a vLLM
server running `method: suffix` builds up from the requests it has answered.

Bounded as such a server's history is: only the newest `max_cached_requests` answers are kept (as
the cache keeps them), a turn whose prompt cannot fit the target's context is skipped and an answer
longer than the context is cut (no server answered them whole), both judged from their characters
before any tokenising (data/text_bound.py); progress is shown while it tokenises.

`history_overlap` says how much of an eval's prompts, or their answers, the history already holds:
suffix decoding then replays what it is asked to predict, and its rows read high.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specheads.data.conversations import DataError, read_conversations
from specheads.data.prompts import encode_chat
from specheads.data.text_bound import max_token_chars, text_chars
from specheads.engine_facts import VLLM_SUFFIX_DEFAULTS
from specheads.progress import Progress

MIN_OVERLAP_CHARS = 16  # shorter answers (e.g. "Hi") are found inside others by chance: not counted


@dataclass
class History:
    """The (prompt ids, answer ids) pairs, the user turns' and answers' texts, what was left out."""

    pairs: list[tuple[list[int], list[int]]] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)  # the last user turn before each kept answer
    answers: list[str] = field(default_factory=list)
    skipped: int = 0  # prompts that cannot fit the context
    cut: int = 0  # answers cut to the context


def _turns(path: str | Path) -> list[tuple[list[dict], str]]:
    """(the messages before it, its text) for every non-empty assistant turn after another turn."""
    conversations, _ = read_conversations(path, format_option=None, source_option="--suffix-history")
    turns = []
    for c in conversations:
        messages = [{"role": m.role, "content": m.content} for m in c.messages]
        turns += [(messages[:i], m["content"]) for i, m in enumerate(messages)
                  if m["role"] == "assistant" and i and m["content"]]
    return turns


def answered_turns(path: str | Path) -> list[tuple[list[dict], str]]:
    """`_turns`, refusing a file without any answer (also what checks a history nothing will read)."""
    turns = _turns(path)
    if not turns:
        raise DataError(f"{path}: no assistant answer to put in suffix decoding's cache; pass conversations "
                        "with answers (e.g. the output of `specheads regenerate`)")
    return turns


def read_history(path: str | Path, tokenizer, context: int | None = None, quiet: bool = False,
                 keep: int = VLLM_SUFFIX_DEFAULTS["max_cached_requests"]) -> History:
    """The newest `keep` assistant turns of `path`, bounded by `context` (module docstring)."""
    turns = answered_turns(path)
    limit = max_token_chars(tokenizer) * context if context else None
    out = History()
    progress = Progress(len(turns[-keep:]), f"suffix history {Path(path).name}", "answers", quiet, every_s=5.0)
    for before, answer in turns[-keep:]:
        progress.update()
        if limit is not None and text_chars(before) >= limit:
            out.skipped += 1
            continue
        if limit is not None and len(answer) > limit:
            answer, out.cut = answer[:limit], out.cut + 1
        prompt = encode_chat(tokenizer, before)
        if context is not None and len(prompt) >= context:
            out.skipped += 1
            continue
        ids = tokenizer.encode(answer, add_special_tokens=False)
        out.pairs.append((prompt, ids[:context] if context else ids))
        out.prompts.append(next((m["content"] for m in reversed(before) if m["role"] == "user"), ""))
        out.answers.append(answer)
    progress.close()
    return out


def history_pairs(path: str | Path, tokenizer, context: int | None = None, quiet: bool = False
                  ) -> list[tuple[list[int], list[int]]]:
    """(the chat prompt before it, the answer's tokens) for the assistant turns `read_history` keeps."""
    return read_history(path, tokenizer, context, quiet).pairs


def history_overlap(history: History, prompts: list[str], answers: list[str]) -> dict:
    """How many of an eval's prompts are among the history's user turns, and how many of its answers
    (the target's own, e.g. the plain decodes) appear in the history's answers."""
    asked = {p.strip() for p in history.prompts}
    said = "\0".join(history.answers)
    n_prompts = sum(1 for p in prompts if p.strip() and p.strip() in asked)  # a whole turn, word for word
    n_answers = sum(1 for a in answers if len(a.strip()) >= MIN_OVERLAP_CHARS and a.strip() in said)
    return {"prompts_in_history": n_prompts, "answers_in_history": n_answers, "prompts": len(prompts),
            "answers": len(answers)}


def overlap_warning(overlap: dict, file: str) -> str | None:
    """The flag every report carries when the history held the evaluated prompts or their answers."""
    if not (overlap["prompts_in_history"] or overlap["answers_in_history"]):
        return None
    return (f"the --suffix-history {file} holds {overlap['prompts_in_history']} of the {overlap['prompts']} "
            f"evaluated prompts and {overlap['answers_in_history']} of their {overlap['answers']} answers: suffix "
            "decoding replays what it is asked to predict, so the suffix and hybrid rows read high; pass a "
            "history without the evaluated prompts (e.g. the training data, not the held-out prompts)")
