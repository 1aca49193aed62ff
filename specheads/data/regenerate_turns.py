"""Rewrite assistant turns with the target itself, so the drafter learns what the target says.

Turn by turn: each assistant turn is regenerated from the conversation so far, earlier assistant
turns already rewritten; system, user and tool messages are kept. With `tools="keep"` an assistant
turn that calls tools is kept verbatim (the tool results that follow answer those calls) and the
assistant's text answers are regenerated; `tools="skip"` leaves rows holding tool messages out.
`thinking="drop"` removes `<think>...</think>` blocks (and a server's separate reasoning field)
from the new answers; `"keep"` keeps them inline.

This is the turn-by-turn engine. Backends: `LocalBackend` (the target in this process: prompts
encoded by data/prompts.py's `encode_chat`, answered a batch at a time by `answer_batch` through a
decoder: plain transformers `generate` (`generate_batch`), or, with `--draft`, a speculation
session's batched decode loop (regenerate_command's `SessionDecoder`); both batched across conversations per turn)
and `OpenAIBackend` (any OpenAI-compatible server, conversations in parallel on a bounded thread
pool). `data/regenerate_run.py` is the resumable run (files in, rows out append-only with an index
of finished ids, data/resume.py); `specheads/regenerate_command.py` is the `specheads regenerate`
command (options, backend choice).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from specheads.data.conversations import Conversation, Message
from specheads.data.openai_client import chat, served_model
from specheads.data.prompts import encode_chat
from specheads.progress import Progress

THINK = re.compile(r"<think>.*?(</think>|$)\s*", re.DOTALL)


class RegenerateError(ValueError):
    """Options or input rows regeneration cannot use (the message says what to change)."""


@dataclass(frozen=True)
class RegenOptions:
    """What shapes the new answers; recorded in the output's meta and checked on resume."""

    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    thinking: str = "keep"  # keep | drop
    tools: str = "keep"  # keep | skip

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise RegenerateError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise RegenerateError("--temperature must be >= 0 and --top-p in (0, 1]")
        if self.thinking not in ("keep", "drop") or self.tools not in ("keep", "skip"):
            raise RegenerateError("--thinking takes keep|drop and --tools keep|skip")


@dataclass
class RegenerateStats:
    """What regeneration did: rows rewritten, turns cut at max_new_tokens, rows kept as they were."""

    conversations: int = 0
    turns: int = 0
    truncated: int = 0
    settings: dict = field(default_factory=dict)


@dataclass
class Row:
    """One conversation as OpenAI-style message dicts (tool fields kept), its tools, its id."""

    id: str
    messages: list[dict]
    tools: list | None = None


def regenerable(msg: dict, opts: RegenOptions) -> bool:
    """An assistant turn to rewrite (tool-calling turns are kept: their results follow)."""
    return msg.get("role") == "assistant" and not msg.get("tool_calls")


def count_turns(rows: list[Row], opts: RegenOptions) -> int:
    """Assistant turns the rows will have rewritten (the unit of regeneration progress)."""
    return sum(regenerable(m, opts) for r in rows for m in r.messages)


def shape_answer(text: str, reasoning: str | None, opts: RegenOptions) -> str:
    """The stored answer: thinking kept inline (a separate reasoning field wrapped) or dropped."""
    if opts.thinking == "drop":
        return THINK.sub("", text).strip() if "<think>" in text else text
    return f"<think>\n{reasoning}\n</think>\n\n{text}" if reasoning else text


# --- the turn loop, shared by both backends --------------------------------------------------


class TurnState:
    """A row being rewritten: messages so far and the index of the next source message."""

    def __init__(self, row: Row, opts: RegenOptions):
        self.row, self.opts = row, opts
        self.out: list[dict] = []
        self.next = 0
        self.truncated = 0
        self.turns = 0

    def advance(self) -> bool:
        """Copy kept messages up to the next turn to rewrite; False when the row is complete."""
        msgs = self.row.messages
        while self.next < len(msgs) and not regenerable(msgs[self.next], self.opts):
            self.out.append(dict(msgs[self.next]))
            self.next += 1
        return self.next < len(msgs)

    def answer(self, text: str, reasoning: str | None, finish_reason: str) -> None:
        """Record the new text of the pending assistant turn."""
        src = self.row.messages[self.next]
        new = {k: v for k, v in src.items() if k not in ("content", "reasoning_content", "reasoning")}
        self.out.append({**new, "content": shape_answer(text, reasoning, self.opts)})
        self.truncated += finish_reason == "length"
        self.turns += 1
        self.next += 1

    def result(self) -> dict:
        """The output row: messages, tools, and what regeneration did to it."""
        row = {"id": self.row.id, "messages": self.out}
        if self.row.tools:
            row["tools"] = self.row.tools
        row["regenerated"] = {"turns": self.turns, "truncated_turns": self.truncated}
        return row


def history(state: TurnState) -> list[dict]:
    """The messages the pending turn is generated from (`name`, tool fields kept)."""
    return [dict(m) for m in state.out]


# --- local backend -----------------------------------------------------------------------------

# A batch decoder: (prompts' ids, max_new_tokens) -> each prompt's new ids (past its first eos
# nothing counts). Plain decoding is `generate_batch` (transformers `generate` over the batch);
# `--draft` is regenerate_command's `SessionDecoder` (a speculation session's `decode_many`).
Decoder = Callable[[list[list[int]], int], list[list[int]]]


class LocalBackend:
    """The target in this process: each turn's prompts, a batch at a time, through `decoder`
    (default: plain `generate_batch`; `specheads regenerate --draft`: speculative, `SessionDecoder`)."""

    def __init__(self, target, opts: RegenOptions, batch_size: int = 16, decoder: Decoder | None = None,
                 draft: str | None = None):
        self.target, self.opts, self.batch_size = target, opts, batch_size
        self.decoder = decoder or generate_batch(target, opts)
        self.draft = draft  # the export folder the decoder speculates with (recorded in meta.json)

    def describe(self) -> dict:
        about = {"backend": "local", "target": self.target.fingerprint(), "path": str(self.target.path)}
        return {**about, "draft": self.draft} if self.draft else about

    def _prompt(self, state: TurnState) -> list[int]:
        return encode_chat(self.target.tokenizer, history(state), state.row.tools)

    def run(self, rows: list[Row], progress=None) -> list[dict]:
        """Rows -> output rows (in order), every regenerable assistant turn rewritten; `progress`
        (specheads.progress.Progress) counts the turns answered."""
        done = {r["id"]: r for r in self.run_iter(rows, progress)}
        return [done[r.id] for r in rows]

    def run_iter(self, rows: list[Row], progress=None):
        """Yield each output row as soon as its last turn is answered (so a caller can write it
        before the next batch runs: a kill loses only the batch in flight)."""
        states = [TurnState(r, self.opts) for r in rows]
        pending = []
        for s in states:
            if s.advance():
                pending.append(s)
            else:
                yield s.result()  # nothing to regenerate
        while pending:
            prompts = {id(s): self._prompt(s) for s in pending}
            pending.sort(key=lambda s: len(prompts[id(s)]))  # similar lengths: little padding
            later = []
            for b in range(0, len(pending), self.batch_size):
                chunk = pending[b:b + self.batch_size]
                answers = answer_batch(self.target.tokenizer, [prompts[id(s)] for s in chunk], self.decoder,
                                       self.opts.max_new_tokens)
                for s, (text, cut) in zip(chunk, answers):
                    s.answer(text, None, "length" if cut else "stop")
                    if s.advance():
                        later.append(s)
                    else:
                        yield s.result()
                if progress is not None:
                    progress.update(len(chunk))
            pending = later


def answer_batch(tokenizer, prompts: list[list[int]], decoder: Decoder,
                 max_new_tokens: int) -> list[tuple[str, bool]]:
    """The one local decode of regeneration: prompts' ids through `decoder` -> per prompt (answer
    text up to the first eos, without it; truncated: no eos within max_new_tokens)."""
    eos, out = tokenizer.eos_token_id, []
    for new in decoder(prompts, max_new_tokens):
        ended = eos in new
        new = new[: new.index(eos)] if ended else new
        out.append((tokenizer.decode(new, skip_special_tokens=True), not ended))  # pads are special: skipped
    return out


def prompt_seed(seed: int, ids: list[int]) -> int:
    """A sampled speculative answer's own seed, from --seed and its prompt's ids: the answer does
    not depend on its batch, its place in it, --batch-size or a resume (31 bits)."""
    digest = hashlib.sha256(json.dumps([seed, ids]).encode()).digest()
    return int.from_bytes(digest[:4], "big") >> 1


def generate_batch(target, opts: RegenOptions) -> Decoder:
    """Plain decoding: transformers `generate` over the left-padded batch, greedy or sampled
    (seeded with opts.seed per batch). It stays regeneration's one plain path: 64 of the demo's
    prompts (128 new tokens, 2 CPU cores) took 5.7 s in batches of 32 against 22.4 s prompt by
    prompt through verify's greedy loop, with token-equal answers."""
    import torch

    tok = target.tokenizer
    sampled = opts.temperature > 0
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id  # masked out either way

    def decode(prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=target.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=target.device)
        if sampled:
            torch.manual_seed(opts.seed)
        with torch.no_grad():
            out = target.model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=sampled,
                temperature=opts.temperature if sampled else None, top_p=opts.top_p if sampled else None,
                top_k=None, eos_token_id=tok.eos_token_id, pad_token_id=pad,
            )
        return out[:, width:].tolist()  # [B, <= max_new_tokens]

    return decode


def regenerate_local(target, convs: list[Conversation], max_new_tokens: int = 128,
                     batch_size: int = 32, temperature: float = 0.0,
                     progress: bool = True) -> tuple[list[Conversation], RegenerateStats]:
    """Every assistant turn of `convs` rewritten by `target` (in memory, no files)."""
    opts = RegenOptions(max_new_tokens=max_new_tokens, temperature=temperature)
    rows = [Row(c.id, [{"role": m.role, "content": m.content} for m in c.messages]) for c in convs]
    backend = LocalBackend(target, opts, batch_size)
    out = []
    with Progress(count_turns(rows, opts), "regenerate", "turns", quiet=not progress) as bar:
        for b in range(0, len(rows), max(batch_size, 1) * 8):  # bounded work per generate round
            out += backend.run(rows[b:b + max(batch_size, 1) * 8], bar)
    stats = RegenerateStats(settings={"max_new_tokens": max_new_tokens, "temperature": temperature,
                                      "backend": "local", "target": target.fingerprint()})
    for r in out:
        stats.turns += r["regenerated"]["turns"]
        stats.truncated += r["regenerated"]["truncated_turns"]
    stats.conversations = sum(1 for r in out if r["messages"])
    convs_out = [Conversation(r["id"], [Message(m["role"], m["content"]) for m in r["messages"]], c.text)
                 for c, r in zip(convs, out)]
    return convs_out, stats


# --- OpenAI-compatible backend -----------------------------------------------------------------


class OpenAIBackend:
    """Any OpenAI-compatible server; one conversation's turns in order, conversations in parallel."""

    def __init__(self, endpoint, model: str | None, opts: RegenOptions):
        self.endpoint, self.opts = endpoint, opts
        self.card = served_model(endpoint, model)
        self.model = self.card["id"]

    def describe(self) -> dict:
        """Provenance: the endpoint, the model, and the target fingerprint when the server has one."""
        extra = self.card.get("specheads") or {}
        return {"backend": "openai", "endpoint": self.endpoint.base, "model": self.model,
                "root": self.card.get("root"), "target": extra.get("target")}

    def _body(self, state: TurnState) -> dict:
        o = self.opts
        body = {"model": self.model, "messages": history(state), "max_tokens": o.max_new_tokens,
                "temperature": o.temperature, "top_p": o.top_p}
        if o.temperature > 0:  # a distinct, reproducible seed per row and turn
            body["seed"] = (o.seed * 1_000_003 + _stable(state.row.id) * 131 + state.turns) % 2**31
        if state.row.tools:
            body["tools"] = state.row.tools
        return body

    def run_one(self, row: Row) -> dict:
        """One conversation, turn by turn -> its output row (raises EndpointError on failure)."""
        state = TurnState(row, self.opts)
        while state.advance():
            state.answer(*chat(self.endpoint, self._body(state)))
        return state.result()


def _stable(text: str) -> int:
    import hashlib

    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big")

