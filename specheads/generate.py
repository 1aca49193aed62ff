"""`specheads generate`: decode one prompt with an exported draft, streaming the text as it comes.

The same prompt is then decoded by plain greedy decoding, so the command proves the speculative
output identical and reports tau, per-position acceptance and tokens/s for both
(research/algorithms.md §10). Drafts are a chain (`--tree chain`, the loop in `verify.decode`),
an EAGLE-2 dynamic tree (`--tree eagle2`) or a static tree read from a JSON file holding a
Medusa-style list of rank paths (`--tree FILE.json`, e.g. `[[0], [1], [0, 0]]`); trees run
through `verify.tree_decode`.

The tree and sampling settings live in `verify/settings.py`, shared with `specheads eval` and
`bench/verifier.py`.

`--temperature T > 0` samples instead (`verify.sample_decode`: Leviathan speculative sampling
for chains, the EAGLE-2/3 point-mass rule for trees; both lossless, seeded by `--seed`). A sampled
output is distributed like the target's own samples but is not token-equal to a plain sample, so
the equality check applies to greedy decoding only; `specheads eval` and the benchmark stay greedy.
`--acceptance typical` (with `--temperature > 0`) verifies with Medusa's typical acceptance
instead: faster, but LOSSY, and the summary says so.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from specheads.verify.settings import (
    GenerateError, Sampling, TreeSpec, add_sampling_arguments, add_tree_arguments,
    check_acceptance, check_tree_fits, make_proposer, sampled_decode, sampling_from_args,
    spec_from_args, speculative_decode, with_default_k,
)

# --- loading -------------------------------------------------------------------------------------


def default_dtype(device: str) -> str:
    """bfloat16 on a GPU, float32 elsewhere (tiny CPU targets gain nothing from bf16)."""
    from specheads.target import resolve_device

    return "bfloat16" if resolve_device(device).type == "cuda" else "float32"


def load_checked_draft(draft_dir: str | Path, target):
    """The exported head on the target's device and dtype, and its meta; refuses another target's."""
    from specheads.export import load_with_meta

    folder = Path(draft_dir)
    if not folder.is_dir():
        raise FileNotFoundError(f"draft folder '{folder}' does not exist: pass an export folder "
                                "written by `specheads export`")
    head, meta = load_with_meta(folder)
    meta.check_target(target)
    return head.to(device=target.device, dtype=target.dtype).eval(), meta


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """The prompt as ids: rendered as one user turn with the chat template, or raw."""
    from specheads.eval.online import encode_chat

    if not text or not text.strip():
        raise GenerateError("the prompt is empty: pass some text with --prompt")
    if not chat:
        return list(tokenizer(text)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise GenerateError("the target's tokenizer has no chat template: pass --no-chat to feed "
                            "the prompt as raw text")
    return encode_chat(tokenizer, [{"role": "user", "content": text}])


# --- streaming -----------------------------------------------------------------------------------


class TextStream:
    """Decodes a growing token list and writes only the new text (held back mid-character)."""

    def __init__(self, tokenizer, out=None):
        self.tokenizer, self.out = tokenizer, out or sys.stdout
        self.tokens: list[int] = []
        self.printed = ""

    def _text(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)

    def push(self, tokens: list[int], final: bool = False) -> None:
        """Add tokens; write the text they complete (all of it when `final`)."""
        self.tokens.extend(int(t) for t in tokens)
        text = self._text()
        if text.endswith("\ufffd") and not final:  # an incomplete multi-byte character
            return
        if text.startswith(self.printed):
            self.out.write(text[len(self.printed):])
        else:  # a merge changed earlier text: print the rest from where the two agree
            common = len(_common_prefix(text, self.printed))
            self.out.write(text[common:])
        self.out.flush()
        self.printed = text


def _common_prefix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


class StreamingProposer:
    """Wraps a proposer so every verified token reaches a TextStream as soon as it is known.

    The loops hand each step's emitted tokens to `accept` (and the prefill's token to `start`),
    so streaming needs no change to them; the last step's tokens, which no `accept` sees, are
    written by `finish` from the result. `seconds` (time spent decoding and writing text) is
    taken off the speculative wall time so that tokens/s compare fairly with plain decoding.
    """

    def __init__(self, inner, stream: TextStream):
        self.inner, self.stream = inner, stream
        self.sent = 0
        self.seconds = 0.0

    def __getattr__(self, name):  # layers, propose, propose_tree, max_nodes, ...
        return getattr(self.inner, name)

    def start(self, prompt_ids, first_token, out) -> None:
        self._send([int(first_token)])
        self.inner.start(prompt_ids, first_token, out)

    def accept(self, inputs, following, out, start) -> None:
        self._send(following.reshape(-1).tolist())
        self.inner.accept(inputs, following, out, start)

    def _send(self, tokens: list[int]) -> None:
        t0 = time.perf_counter()
        self.sent += len(tokens)
        self.stream.push(tokens)
        self.seconds += time.perf_counter() - t0

    def finish(self, result_tokens: list[int]) -> None:
        """Write whatever the result holds beyond what was streamed."""
        self.stream.push(result_tokens[self.sent:], final=True)
        self.sent = len(result_tokens)


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
    from specheads.metrics import broken_draft_warning

    warning = broken_draft_warning(s)
    return [
        f"draft: {spec.label()}  tau={s['tau']:.3f}  acceptance per position: {acc}",
        f"speculative {fast:.1f} tok/s ({spec_result.stats.tokens} tokens, "
        f"{s['target_forwards']} target forwards) | {plain} {slow:.1f} tok/s | "
        f"speed-up {fast / slow if slow else 0.0:.2f}x | {check}",
    ] + ([warning] if warning else [])


def warm_up(target, proposer_factory, spec: TreeSpec, eos) -> None:
    """One short untimed decode each way so first-call overheads stay out of the timings."""
    from specheads.verify.decode import greedy_decode

    greedy_decode(target, [0, 1, 2, 3], 4)
    speculative_decode(spec, target, proposer_factory(), [0, 1, 2, 3], 4, eos)


def check_inputs(draft_dir, prompt: str, max_new_tokens: int, sampling: Sampling) -> None:
    """Refuse bad arguments before anything is loaded."""
    if max_new_tokens < 1:
        raise GenerateError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if not prompt or not prompt.strip():
        raise GenerateError("the prompt is empty: pass some text with --prompt")
    if not Path(draft_dir).is_dir():
        raise FileNotFoundError(f"draft folder '{draft_dir}' does not exist: pass an export "
                                "folder written by `specheads export`")
    if not sampling.greedy:
        from specheads.verify.sampling import check_warp

        check_warp(sampling.temperature, sampling.top_p, 0)
    check_acceptance(sampling)


def stream_decode(spec, target, head, ids, max_new_tokens, eos, sampling, out):
    """The speculative decode, its text streamed to `out` -> (result, seconds spent streaming)."""
    proposer = StreamingProposer(make_proposer(spec, head, target, not sampling.greedy),
                                 TextStream(target.tokenizer, out))
    if sampling.greedy:
        result = speculative_decode(spec, target, proposer, ids, max_new_tokens, eos)
    else:
        result = sampled_decode(spec, target, proposer, ids, max_new_tokens, eos, sampling)
    stream_s = proposer.seconds  # inside the timed decode: taken off its wall time
    proposer.finish(result.tokens)
    out.write("\n")
    out.flush()
    return result, stream_s


def run_generate(target_path: str, draft_dir: str, prompt: str, spec: TreeSpec,
                 max_new_tokens: int = 128, chat: bool = True, device: str = "auto",
                 dtype: str | None = None, out=None, err=None,
                 sampling: Sampling = Sampling()) -> dict:
    """Stream the speculative decode of `prompt` to `out`, then compare it with plain decoding
    (greedy: token for token; sampled: speed only)."""
    from specheads.eval.online import eos_ids
    from specheads.target import Target
    from specheads.verify.decode import greedy_decode

    out, err = out or sys.stdout, err or sys.stderr
    check_inputs(draft_dir, prompt, max_new_tokens, sampling)
    target = Target.load(target_path, dtype=dtype or default_dtype(device), device=device)
    head, meta = load_checked_draft(draft_dir, target)
    spec = with_default_k(spec, meta, head)
    check_tree_fits(spec, target)
    ids, eos = encode_prompt(target.tokenizer, prompt, chat), eos_ids(target)
    warm_up(target, lambda: make_proposer(spec, head, target), spec, eos)
    result, stream_s = stream_decode(spec, target, head, ids, max_new_tokens, eos, sampling, out)
    if sampling.greedy:
        plain = greedy_decode(target, ids, max_new_tokens, eos)
        equal = result.tokens == plain.tokens
    else:
        plain, equal = sampled_decode(None, target, None, ids, max_new_tokens, eos, sampling), None
    for line in report_lines(spec, result, plain, equal, stream_s, sampling):
        print(line, file=err)
    return {"tree": spec.describe(), "tokens": result.tokens, "plain_tokens": plain.tokens,
            "greedy_equal": equal, "sampling": sampling.describe(), "lossless": sampling.lossless,
            "acceptance": sampling.acceptance, "summary": result.stats.summary(),
            "tokens_per_s": rate(result.stats, stream_s), "plain_tokens_per_s": rate(plain.stats)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specheads generate", description=(
        "Generate from one prompt with an exported draft (greedy unless --temperature > 0), "
        "streaming the text; then decode it plainly and report tau, per-position acceptance "
        "and tokens/s of both."))
    p.add_argument("--target", required=True, help="local HF model folder or builtin:tiny")
    p.add_argument("--draft", required=True, help="export folder written by `specheads export`")
    p.add_argument("--prompt", required=True, help="the user message (or raw text with --no-chat)")
    add_tree_arguments(p)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="render the prompt with the chat template (default) or feed it raw")
    add_sampling_arguments(p)
    p.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda, cuda:1 ...")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on a GPU, float32 on a CPU")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    r = run_generate(a.target, a.draft, a.prompt, spec_from_args(a), a.max_new_tokens, a.chat,
                     a.device, a.dtype, sampling=sampling_from_args(a))
    print(f"done in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return 1 if r["greedy_equal"] is False else 0
