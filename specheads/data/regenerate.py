"""Rewrite assistant turns with the target itself, so the drafter learns what the target says.

Local backend: batched greedy (or sampled) `generate` on the frozen target, turn by turn: each
assistant turn is regenerated from the conversation so far, earlier turns already rewritten.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specheads.data.conversations import Conversation, Message


@dataclass
class RegenerateStats:
    """What regeneration did: rows rewritten, turns cut at max_new_tokens, rows kept as they were."""

    conversations: int = 0
    turns: int = 0
    truncated: int = 0
    settings: dict = field(default_factory=dict)


def _render(tokenizer, messages: list[Message]) -> str:
    return tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in messages],
                                         tokenize=False, add_generation_prompt=True)


@torch.no_grad()
def _generate_batch(target, prompts: list[str], max_new_tokens: int, temperature: float) -> list[tuple[str, bool]]:
    """Prompts (rendered text) -> (answer text without end-of-turn, truncated?) per prompt."""
    tok = target.tokenizer
    side = tok.padding_side
    tok.padding_side = "left"
    try:
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(target.device)
    finally:
        tok.padding_side = side
    out = target.model.generate(
        **enc, max_new_tokens=max_new_tokens, do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else None, top_p=None, top_k=None,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    new = out[:, enc["input_ids"].shape[1]:]  # [B, <= max_new_tokens]
    results = []
    for row in new.tolist():
        ended = tok.eos_token_id in row
        row = row[: row.index(tok.eos_token_id)] if ended else row
        row = [t for t in row if t != tok.pad_token_id]
        results.append((tok.decode(row, skip_special_tokens=True), not ended))
    return results


def regenerate_local(target, convs: list[Conversation], max_new_tokens: int = 128,
                     batch_size: int = 32, temperature: float = 0.0,
                     progress: bool = True) -> tuple[list[Conversation], RegenerateStats]:
    """Every assistant turn rewritten by `target`; system and user turns are kept as they are."""
    from tqdm.auto import tqdm

    stats = RegenerateStats(settings={"max_new_tokens": max_new_tokens, "temperature": temperature,
                                      "backend": "local", "target": target.fingerprint()})
    work = [Conversation(c.id, [], c.text) for c in convs]
    max_turns = max((len(c.messages) for c in convs), default=0)
    bar = tqdm(total=sum(m.role == "assistant" for c in convs for m in c.messages),
               desc="regenerate", disable=not progress)
    for turn in range(max_turns):
        pending = []
        for src, dst in zip(convs, work):
            if turn < len(src.messages):
                msg = src.messages[turn]
                if msg.role == "assistant":
                    pending.append(dst)
                else:
                    dst.messages.append(Message(msg.role, msg.content))
        prompts = {id(c): _render(target.tokenizer, c.messages) for c in pending}
        pending.sort(key=lambda c: len(prompts[id(c)]))  # similar lengths batch with little padding
        for b in range(0, len(pending), batch_size):
            chunk = pending[b:b + batch_size]
            answers = _generate_batch(target, [prompts[id(c)] for c in chunk], max_new_tokens, temperature)
            for conv, (text, cut) in zip(chunk, answers):
                conv.messages.append(Message("assistant", text))
                stats.turns += 1
                stats.truncated += cut
            bar.update(len(chunk))
    bar.close()
    stats.conversations = sum(1 for c in work if c.messages)
    return work, stats
