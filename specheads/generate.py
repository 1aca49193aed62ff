"""`specheads generate`: decode one prompt with an exported draft, streaming the text as it comes.

The same prompt is then decoded by plain greedy decoding, so the command proves the speculative
output identical and reports tau, per-position acceptance and tokens/s for both
(docs/algorithms.md §9). Drafts are a chain (`--tree chain`), an EAGLE-2 dynamic tree
(`--tree eagle2`) or a static tree read from a JSON file holding a Medusa-style list of rank
paths (`--tree FILE.json`, e.g. `[[0], [1], [0, 0]]`); all run through the one decoder,
`verify.loop.decode`, by way of the session.

The tree and sampling settings live in `verify/settings.py`, shared with `specheads eval` and
`bench/verifier.py`.

`--temperature T > 0` samples instead (the "exact" rule of `verify.rules`: Leviathan speculative sampling
for chains, the EAGLE-2/3 point-mass rule for trees; both lossless, seeded by `--seed`). A sampled
output is distributed like the target's own samples but is not token-equal to a plain sample, so
the equality check applies to greedy decoding only; `specheads eval` and the benchmark stay greedy.
`--acceptance typical` (with `--temperature > 0`) verifies with Medusa's typical acceptance
instead: faster, but LOSSY, and the summary says so.
"""

from __future__ import annotations

import sys
import time

from specheads.cli_options import (
    mixing_from_args,
    sampling_from_args,
    spec_from_args,
)
from specheads.cli_parsers import generate_parser
from specheads.data.messages import FieldError, check_text
from specheads.data.prompts import NoChatTemplate, encode_chat, encode_text, user_turn
from specheads.metrics import broken_draft_warning
from specheads.mixing import Mixing
from specheads.model_ref import resolve_draft
from specheads.session import Session
from specheads.target import resolve_device
from specheads.verify.sampling import check_warp
from specheads.verify.settings import Sampling, TreeSpec, check_acceptance
from specheads.verify.text import TextStream, writer


class GenerateError(ValueError):
    """Arguments `specheads generate` cannot run with (the message says what to change)."""


# --- the prompt ----------------------------------------------------------------------------------


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """The prompt as ids: rendered as one user turn with the chat template, or raw."""
    if not text or not text.strip():
        raise GenerateError("the prompt is empty: pass some text with --prompt")
    if not chat:
        return encode_text(tokenizer, text)
    try:
        return encode_chat(tokenizer, user_turn(text))
    except NoChatTemplate as err:
        raise GenerateError(f"{err}: pass --no-chat to feed the prompt as raw text") from None


# --- the command ---------------------------------------------------------------------------------


def rate(stats, overhead_s: float = 0.0) -> float:
    """New tokens per wall-clock second of one decode (minus `overhead_s` spent streaming)."""
    seconds = stats.wall_s - overhead_s
    return stats.tokens / seconds if seconds > 0 else 0.0


def report_lines(spec: TreeSpec, spec_result, plain_result, equal: bool | None,
                 stream_s: float = 0.0, sampling: Sampling = Sampling()) -> list[str]:
    """The summary printed after the text: tau, per-position acceptance, tokens/s.

    `equal` None: sampled, where token equality with a plain sample is not expected.
    """
    s = spec_result.stats.summary()
    acc = " ".join(f"{a:.2f}" for a in s["acceptance_per_position"]) or "-"
    fast, slow = rate(spec_result.stats, stream_s), rate(plain_result.stats)
    plain = "plain greedy" if sampling.greedy else "plain sampling"
    check = (f"identical to plain greedy: {equal}" if equal is not None else
             f"sampled ({sampling.label()}), lossless: distributed like the target's samples"
             if sampling.lossless else
             f"sampled ({sampling.label()}), LOSSY: typical acceptance, not distributed like "
             "the target's samples")
    warning = broken_draft_warning(s)
    lines = [
        f"draft: {spec.label()}  tau={s['tau']:.3f}  acceptance per position: {acc}",
        f"speculative {fast:.1f} tok/s ({spec_result.stats.tokens} tokens, "
        f"{s['target_forwards']} target forwards) | {plain} {slow:.1f} tok/s | "
        f"speed-up {fast / slow if slow else 0.0:.2f}x | {check}",
    ]
    if warning:
        return lines + [warning]
    if slow and fast < slow:
        lines.append(f"speculation did not pay here ({fast / slow:.2f}x): {s['tau']:.2f} tokens per target "
                     "forward do not cover the draft's cost. It pays on prompts like the draft's training "
                     "data; try a shorter --k, or `specheads eval` for a recommendation over many prompts")
    return lines


def check_prompt_text(prompt: str) -> None:
    """The user message must hold only characters; on a command line a lone surrogate is how
    Python reads a byte that is not UTF-8 (U+DC80-U+DCFF)."""
    try:
        check_text(prompt, "--prompt")
    except FieldError as err:
        raise GenerateError(f"--prompt: {err.problem}; from a shell, pass the prompt as UTF-8 "
                            "text") from None


def check_inputs(draft_dir, prompt: str, max_new_tokens: int, sampling: Sampling,
                 device: str = "auto") -> None:
    """Refuse bad arguments before anything is loaded."""
    resolve_device(device)  # a device this machine lacks
    if max_new_tokens < 1:
        raise GenerateError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if not prompt or not prompt.strip():
        raise GenerateError("the prompt is empty: pass some text with --prompt")
    check_prompt_text(prompt)
    resolve_draft(draft_dir)  # a missing folder or an uncached hub id fails before the target loads
    if not sampling.greedy:
        check_warp(sampling.temperature, sampling.top_p, 0)
    check_acceptance(sampling)


def run_generate(target_path: str, draft_dir: str, prompt: str, spec: TreeSpec,
                 max_new_tokens: int = 128, chat: bool = True, device: str = "auto",
                 dtype: str | None = None, out=None, err=None,
                 sampling: Sampling = Sampling(), allow_missing_fingerprint: bool = False,
                 mixing: Mixing = Mixing()) -> dict:
    """Stream the speculative decode of `prompt` to `out`, then compare it with plain decoding
    (greedy: token for token; sampled: speed only)."""
    out, err = out or sys.stdout, err or sys.stderr
    check_inputs(draft_dir, prompt, max_new_tokens, sampling, device)
    session = Session.open(target_path, draft_dir, spec, device=device, dtype=dtype,
                           allow_missing_fingerprint=allow_missing_fingerprint, mixing=mixing)
    print(f"speculation: {session.mixing.describe()}"
          + (f"; {session.free_note}" if session.free_note else ""), file=err)
    ids = encode_prompt(session.target.tokenizer, prompt, chat)
    session.warm_up()
    decoded = session.decode(ids, max_new_tokens, sampling, TextStream(session.target.tokenizer, writer(out)))
    out.write("\n")
    out.flush()
    result, stream_s = decoded.result, decoded.stream_s
    plain = session.plain(ids, max_new_tokens, sampling)
    equal = result.tokens == plain.tokens if sampling.greedy else None
    for line in report_lines(session.spec, result, plain, equal, stream_s, sampling):
        print(line, file=err)
    return {"tree": session.spec.describe(), "mixing": session.mixing.label(), "tokens": result.tokens,
            "plain_tokens": plain.tokens,
            "greedy_equal": equal, "sampling": sampling.describe(), "lossless": sampling.lossless,
            "acceptance": sampling.acceptance, "summary": result.stats.summary(),
            "tokens_per_s": rate(result.stats, stream_s), "plain_tokens_per_s": rate(plain.stats)}


def main(argv: list[str] | None = None) -> int:
    p = generate_parser()
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    spec = spec_from_args(a)
    r = run_generate(a.target, a.draft, a.prompt, spec, a.max_new_tokens, a.chat,
                     a.device, a.dtype, sampling=sampling_from_args(a),
                     allow_missing_fingerprint=a.allow_missing_fingerprint, mixing=mixing_from_args(a, a.draft, spec))
    print(f"done in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return 1 if r["greedy_equal"] is False else 0
