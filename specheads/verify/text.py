"""Verified tokens as text while they are decoded: one incremental detokeniser, and a proposer
wrapper that hands it every token as soon as verification accepts it.

Used by `specheads generate` (text to a terminal) and `specheads serve` (deltas to a client,
cut at stop strings).
"""

from __future__ import annotations

import time
from collections.abc import Callable


def find_stop(text: str, stops: tuple[str, ...]) -> int:
    """Index of the earliest stop string in `text`, or -1."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else -1


def _common_prefix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


class TextStream:
    """Decodes a growing token list and hands only the new text to `emit`.

    Text is held back while it ends mid-character, and (with `stops`) while it could still be the
    start of a stop string; at the first stop string the text is cut and the stream stops. `eos`
    ids are left out of the text.
    """

    def __init__(self, tokenizer, emit: Callable[[str], None], eos=(), stops: tuple[str, ...] = ()):
        self.tokenizer, self.emit, self.eos, self.stops = tokenizer, emit, set(eos), stops
        self.tokens: list[int] = []
        self.sent = ""
        self.stopped = False
        self.hold = max((len(s) for s in stops), default=1) - 1

    def push(self, tokens: list[int], final: bool = False) -> None:
        """Add tokens; emit the text they complete (all of it when `final`)."""
        self.tokens.extend(int(t) for t in tokens if int(t) not in self.eos)
        if self.stopped:
            return
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd") and not final:  # an incomplete multi-byte character
            return
        cut = find_stop(text, self.stops)
        if cut >= 0:
            text, self.stopped = text[:cut], True
        elif not final and self.hold:
            text = text[: max(len(self.sent), len(text) - self.hold)]
        # a merge may change earlier text: send the rest from where the two agree
        start = len(self.sent) if text.startswith(self.sent) else len(_common_prefix(text, self.sent))
        if len(text) > start:
            self.emit(text[start:])
        self.sent = text


def writer(out) -> Callable[[str], None]:
    """An `emit` that writes to a text file (e.g. stdout) and flushes."""
    def emit(text: str) -> None:
        out.write(text)
        out.flush()
    return emit


class StreamingProposer:
    """Wraps a proposer so every verified token reaches a TextStream as soon as it is known.

    The decoder hands each step's emitted tokens to `accept` (and the prefill's token to `start`),
    so streaming needs no change to it; the last step's tokens, which no `accept` sees, are
    written by `finish` from the result. `seconds` (time spent decoding and writing text) is
    taken off the speculative wall time so that tokens/s compare fairly with plain decoding.
    """

    def __init__(self, inner, stream: TextStream):
        self.inner, self.stream = inner, stream
        self.sent = 0
        self.seconds = 0.0
        self.layers = inner.layers
        for hook in ("propose", "propose_tree", "propose_sampled"):  # seen by protocol checks
            if hasattr(inner, hook):
                setattr(self, hook, getattr(inner, hook))

    def __getattr__(self, name):  # max_nodes, ...
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
