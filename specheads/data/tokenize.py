"""Tokenise conversations with the target's own chat template into input_ids + a verified loss mask.

The mask marks each assistant turn's content plus its end-of-turn token and nothing else. It is
found by rendering conversation prefixes (so any template without re-rendering works), mapped to
tokens with the fast tokenizer's offsets, and then verified by decoding the marked tokens back.
"""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from specheads.data.conversations import Conversation

log = logging.getLogger(__name__)
_SHOW = 120  # characters of a string shown in error messages


class TemplateError(ValueError):
    """The chat template or tokenizer cannot give a trustworthy assistant mask for a sample."""


@dataclass
class TokenizedSample:
    """One training sample: token ids and a 0/1 mask of the tokens the loss is taken on."""

    id: str
    input_ids: list[int]
    loss_mask: list[int]


@dataclass
class TokenizeStats:
    """Counts from `tokenize_all`: samples in, kept, dropped (no supervised token left), truncated."""

    total: int = 0
    kept: int = 0
    dropped: int = 0
    truncated: int = 0


def _short(text: str) -> str:
    """`text` as a repr, cut to a readable length for error messages."""
    return repr(text) if len(text) <= _SHOW else repr(text[:_SHOW]) + f"... ({len(text)} chars)"


def _as_dicts(conv: Conversation) -> list[dict[str, Any]]:
    """Messages in the OpenAI form chat templates expect (tool-call fields only where set)."""
    out = []
    for m in conv.messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        extra = {"tool_calls": [dict(c) for c in m.tool_calls] if m.tool_calls else None,
                 "tool_call_id": m.tool_call_id, "name": m.name, "thinking": m.thinking}
        out.append({**d, **{k: v for k, v in extra.items() if v is not None}})
    return out


def _parsed_arguments(messages: list[dict]) -> list[dict]:
    """`messages` with JSON-string tool-call arguments parsed to objects, the form most templates expect."""
    def parse(call: dict) -> dict:
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
            return call
        try:
            args = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            return call
        return {**call, "function": {**fn, "arguments": args}} if isinstance(args, dict) else call
    return [{**m, "tool_calls": [parse(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m
            for m in messages]


def _check_tokenizer(tokenizer: Any) -> None:
    """Offsets need a fast tokenizer; rendering needs a chat template."""
    if not getattr(tokenizer, "is_fast", False):
        raise TemplateError(f"{type(tokenizer).__name__} is not a fast tokenizer: the loss mask needs "
                            "offset mappings — load the target's tokenizer with use_fast=True")
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateError("the tokenizer has no chat_template: set one (tokenizer.chat_template = ...) "
                            "or use raw-text data")


def _render(tokenizer: Any, messages: list[dict], conv_id: str, generation_prompt: bool = False,
            tools: list[dict] | None = None, **kwargs: Any) -> str:
    """The chat template applied to `messages` as text; template failures name the sample."""
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=generation_prompt, **kwargs)
    except Exception as e:  # jinja raises many types; the sample id is what the user needs
        raise TemplateError(f"sample {conv_id}: the chat template failed on {len(messages)} message(s): "
                            f"{type(e).__name__}: {e}") from e


def _require_prefix(prefix: str, full: str, conv_id: str, turn: int) -> None:
    """Prefix rendering only works if the template renders earlier turns the same way every time."""
    if not full.startswith(prefix):
        at = next((i for i, (a, b) in enumerate(zip(prefix, full)) if a != b), min(len(prefix), len(full)))
        raise TemplateError(
            f"sample {conv_id}: the chat template re-renders earlier turns (the render up to message {turn} "
            f"is not a prefix of the full render; first difference at character {at}: "
            f"{_short(prefix[at:])} vs {_short(full[at:])}). The prefix method cannot be used with this "
            "template: use a template with {% generation %} markers "
            "(assistant_mask_from_generation_markers) or normalise the data first")


def _prompt_end(tokenizer: Any, messages: list[dict], i: int, full: str, conv_id: str,
                tools: list[dict] | None) -> int:
    """Where turn `i`'s generated text can start: the end of the longest generation prompt for
    messages[:i] that the full render starts with. Variants cover templates whose prompt carries
    boilerplate (an empty think block when thinking is off), so that boilerplate is never supervised.
    """
    if i == 0:
        return 0
    renders = [_render(tokenizer, messages[:i], conv_id, True, tools)]
    try:
        renders.append(_render(tokenizer, messages[:i], conv_id, True, tools, enable_thinking=False))
    except TemplateError:  # a template without that switch: the plain prompt is the only variant
        pass
    fits = [len(r) for r in renders if full.startswith(r)]
    if not fits:
        _require_prefix(renders[0], full, conv_id, i)
    return max(fits)


def _content_variants(content: str) -> list[str]:
    """How templates may write an assistant message: as is, or only the answer after a think block.

    Trimmed content is not accepted: a template that trims (Llama 3, Gemma) is refused for messages
    with surrounding whitespace, which the data should drop first.
    """
    variants = [content]
    if "</think>" in content:
        variants.append(content.split("</think>")[-1].lstrip("\n"))
    return [v for i, v in enumerate(variants) if v and v not in variants[:i]]


def _find_eot(full: str, eots: list[str], lo: int, hi: int, last: bool = False) -> tuple[int, str]:
    """The first (or last) end-of-turn text of any of `eots` in `full[lo:hi]`: (position, text), -1 if none."""
    hits = [(full.rfind(e, lo, hi) if last else full.find(e, lo, hi), e) for e in eots]
    hits = [(at, e) for at, e in hits if at >= 0]
    if not hits:
        return -1, eots[0]
    return max(hits) if last else min(hits)


def _turn_span(full: str, message: dict, lo: int, hi: int, bounded: bool, eots: list[str], conv_id: str,
               i: int, turn: int) -> tuple[int, int]:
    """One assistant turn's supervised `[start, end)` in `full`, searched within the turn's `[lo, hi)`.

    Starts at its separate thinking text if the render has it, else at its content; ends after the
    end-of-turn that follows the content (the last one before `hi` when `hi` is the turn's true end,
    so a turn written as several harmony messages, e.g. analysis then a tool call, is supervised whole).
    """
    start, pos = -1, lo
    thinking = message.get("thinking") or ""
    if thinking.strip() and (at := full.find(thinking, lo, hi)) >= 0:
        start, pos = at, at + len(thinking)
    content = message.get("content") or ""
    limit = hi if start >= 0 else _find_eot(full, eots, pos, hi)[0]
    found = [(full.find(v, pos, limit if limit >= 0 else hi), v) for v in _content_variants(content)]
    at, text = next(((a, v) for a, v in found if a >= 0), (-1, content))
    if content.strip() and at < 0:
        raise TemplateError(f"sample {conv_id}: assistant message {i} does not appear verbatim in the "
                            f"template's render {_short(full[lo:hi])} — the template rewrites or drops assistant "
                            "content; normalise the data first")
    if at >= 0 and content:
        start, pos = (at if start < 0 else start), at + len(text)
    start = lo if start < 0 else start
    eot, mark = _find_eot(full, eots, pos, hi, last=bounded)
    if eot < 0:
        _missing_eot(full, start, text, eots[0], conv_id, turn)
    return start, eot + len(mark)


def assistant_char_spans(
    tokenizer: Any, messages: list[dict], full: str, end_of_turn: str | list[str], conv_id: str,
    tools: list[dict] | None = None,
) -> list[tuple[int, int]]:
    """Character spans `[start, end)` of each assistant turn in `full`: its text through its end-of-turn.

    A turn starts after the generation prompt of the preceding messages; the supervised text starts
    where the message's thinking or content (as is, or the answer after a think block) appears and
    runs through its end-of-turn text (any of `end_of_turn` when a list), so tool calls the template
    writes after the content are supervised and template boilerplate before it is not. An empty turn
    supervises only its end-of-turn (and any tool call). `tokenize_conversation` verifies each span.
    """
    eots = [end_of_turn] if isinstance(end_of_turn, str) else list(end_of_turn)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        lo = _prompt_end(tokenizer, messages, i, full, conv_id, tools)
        through = _render(tokenizer, messages[: i + 1], conv_id, tools=tools)
        bounded = full.startswith(through)  # templates that re-render earlier turns give no bound
        hi = len(through) if bounded else len(full)
        spans.append(_turn_span(full, message, lo, hi, bounded, eots, conv_id, i, len(spans)))
    return spans


def _missing_eot(full: str, start: int, text: str, end_of_turn: str, conv_id: str, turn: int) -> None:
    """The turn has no end-of-turn text where it should be: say what the render has instead."""
    cut = start + len(text)
    raise TemplateError(
        f"sample {conv_id}: loss-mask check failed for assistant turn {turn}: the supervised tokens decode "
        f"to {_short(full[start:cut + len(end_of_turn)])} but should be {_short(text + end_of_turn)}; the render "
        f"continues after the content with {_short(full[cut:cut + 40])}. If the template ends turns with a "
        "token other than the tokenizer's eos, set end_of_turn (data.end_of_turn) to it")


def _mask_from_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[list[int]]:
    """For each span, the indices of tokens that start inside it."""
    return [[t for t, (a, _) in enumerate(offsets) if s <= a < e] for s, e in spans]


def _verify_turns(tokenizer: Any, ids: list[int], turns: list[list[int]], expected: list[tuple[str, str]],
                  conv_id: str) -> None:
    """Each assistant turn's marked tokens must decode to exactly its content plus the end-of-turn text.

    `expected` holds per turn (content + end-of-turn, what the render really has after the content).
    """
    for k, (tokens, (want, after)) in enumerate(zip(turns, expected)):
        got = tokenizer.decode([ids[t] for t in tokens], skip_special_tokens=False,
                               clean_up_tokenization_spaces=False)
        if got != want:
            raise TemplateError(
                f"sample {conv_id}: loss-mask check failed for assistant turn {k}: the supervised tokens decode "
                f"to {_short(got)} but should be {_short(want)}; the render continues after the content with "
                f"{_short(after)}. If the template ends turns with a token other than the tokenizer's eos, set "
                "end_of_turn (data.end_of_turn) to it; if a token crosses the edge of the assistant text, this "
                "template and tokenizer cannot be masked per token")


def _chat_sample(tokenizer: Any, conv: Conversation, end_of_turn: str | list[str] | None) -> TokenizedSample:
    """Render, tokenise, mark and verify a chat sample (not truncated)."""
    return mask_messages(tokenizer, _as_dicts(conv), conv.id, end_of_turn, conv.tools)


def _choose_form(tokenizer: Any, messages: list[dict], conv_id: str, tools: list[dict] | None) -> tuple[list[dict], str]:
    """Messages with tool-call arguments as objects (how serving engines pass them to templates) and
    their render; as given (JSON strings) if only that form renders (templates that concatenate them)."""
    parsed = _parsed_arguments(messages)
    try:
        return parsed, _render(tokenizer, parsed, conv_id, tools=tools)
    except TemplateError:
        if parsed == messages:
            raise
        return messages, _render(tokenizer, messages, conv_id, tools=tools)


def _end_of_turn(tokenizer: Any, end_of_turn: str | list[str] | None) -> list[str]:
    """The end-of-turn texts: `end_of_turn` (one or several) or the tokenizer's eos_token."""
    eots = [tokenizer.eos_token] if end_of_turn is None else (
        [end_of_turn] if isinstance(end_of_turn, str) else list(end_of_turn))
    if not eots or not all(isinstance(e, str) and e for e in eots):
        raise TemplateError("no end-of-turn text: the tokenizer has no eos_token, or end_of_turn is empty — set "
                            "end_of_turn (data.end_of_turn) to the template's end-of-turn text(s)")
    return eots


def mask_messages(tokenizer: Any, messages: list[dict], conv_id: str = "messages",
                  end_of_turn: str | list[str] | None = None, tools: list[dict] | None = None) -> TokenizedSample:
    """Chat-template `messages` (dicts; tool calls and tool turns allowed) -> ids + verified assistant mask.

    `end_of_turn` may list several texts (e.g. harmony's `<|end|>`, `<|return|>`, `<|call|>`): a
    turn ends at whichever the template writes. `tools` are the tool definitions the template renders.
    """
    _check_tokenizer(tokenizer)
    eot = _end_of_turn(tokenizer, end_of_turn)
    messages, full = _choose_form(tokenizer, messages, conv_id, tools)
    spans = assistant_char_spans(tokenizer, messages, full, eot, conv_id, tools)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    ids, turns = list(enc["input_ids"]), _mask_from_spans(enc["offset_mapping"], spans)
    expected = [(full[s:e], full[e:e + 40]) for s, e in spans]
    _verify_turns(tokenizer, ids, turns, expected, conv_id)
    mask = [0] * len(ids)
    for t in (t for turn in turns for t in turn):
        mask[t] = 1
    return TokenizedSample(conv_id, ids, mask)


def _text_sample(tokenizer: Any, conv: Conversation) -> TokenizedSample:
    """Raw text: every token supervised, eos appended."""
    if tokenizer.eos_token_id is None:
        raise TemplateError(f"sample {conv.id}: raw-text samples need the tokenizer's eos_token, which is not set")
    ids = list(tokenizer(conv.text, add_special_tokens=False, verbose=False)["input_ids"]) + [tokenizer.eos_token_id]
    return TokenizedSample(conv.id, ids, [1] * len(ids))


def tokenize_conversation(
    tokenizer: Any, conv: Conversation, max_length: int, end_of_turn: str | list[str] | None = None
) -> TokenizedSample:
    """`conv` as input_ids and an assistant-only loss mask (verified), truncated to `max_length` tokens.

    `end_of_turn` is the text (or texts) the template writes after each assistant message (default:
    the tokenizer's eos_token); it is supervised so the drafter learns to stop.
    """
    return _truncate(_full_sample(tokenizer, conv, end_of_turn), max_length)


def _full_sample(tokenizer: Any, conv: Conversation, end_of_turn: str | list[str] | None) -> TokenizedSample:
    """The untruncated sample: raw text or a verified chat sample."""
    return _text_sample(tokenizer, conv) if conv.text is not None else _chat_sample(tokenizer, conv, end_of_turn)


def _truncate(sample: TokenizedSample, max_length: int) -> TokenizedSample:
    """Keep the first `max_length` tokens, with the mask cut at the same place."""
    if max_length < 1:
        raise ValueError(f"max_length must be at least 1, got {max_length}")
    return TokenizedSample(sample.id, sample.input_ids[:max_length], sample.loss_mask[:max_length])


def has_generation_markers(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template marks assistant text with `{% generation %}`."""
    return bool(re.search(r"\{%-?\s*generation\s*-?%\}", getattr(tokenizer, "chat_template", None) or ""))


def assistant_mask_from_generation_markers(tokenizer: Any, conv: Conversation) -> TokenizedSample:
    """The mask transformers derives from the template's `{% generation %}` markers (not truncated).

    An independent second method, used to cross-check `tokenize_conversation` on marked templates.
    """
    _check_tokenizer(tokenizer)
    if not has_generation_markers(tokenizer):
        raise TemplateError("the chat template has no {% generation %} markers; use tokenize_conversation")
    out = tokenizer.apply_chat_template(_as_dicts(conv), tools=conv.tools, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    return TokenizedSample(conv.id, list(out["input_ids"]), list(out["assistant_masks"]))


def tokenize_all(
    tokenizer: Any,
    convs: Iterable[Conversation],
    max_length: int,
    end_of_turn: str | list[str] | None = None,
    stats: TokenizeStats | None = None,
) -> list[TokenizedSample]:
    """Tokenise every conversation, dropping those left with no supervised token after truncation.

    The counts are logged and, when `stats` is given, written into it.
    """
    stats = stats if stats is not None else TokenizeStats()
    samples = []
    for conv in convs:
        stats.total += 1
        full = _full_sample(tokenizer, conv, end_of_turn)
        stats.truncated += len(full.input_ids) > max_length
        sample = _truncate(full, max_length)
        if not any(sample.loss_mask):
            stats.dropped += 1
            continue
        samples.append(sample)
    stats.kept = len(samples)
    if stats.dropped:
        log.warning("dropped %d of %d samples with no supervised token within max_length=%d",
                    stats.dropped, stats.total, max_length)
    return samples


def collate(samples: list[TokenizedSample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a batch to its longest sample: input_ids, attention_mask, loss_mask, all [B, T] long."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    length = max(len(s.input_ids) for s in samples)
    input_ids = torch.full((len(samples), length), pad_id, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros((len(samples), length), dtype=torch.long)  # [B, T]
    loss_mask = torch.zeros((len(samples), length), dtype=torch.long)  # [B, T]
    for b, s in enumerate(samples):
        n = len(s.input_ids)
        input_ids[b, :n] = torch.tensor(s.input_ids, dtype=torch.long)
        attention_mask[b, :n] = 1
        loss_mask[b, :n] = torch.tensor(s.loss_mask, dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}
