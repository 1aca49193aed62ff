"""Prefills kept for later requests of the same prompt: eval decodes every prompt once per method
(plain, the drafter, each free proposer), and the target's prefill of a prompt is the same forward
every time, so it is run once and its cache rows, first-token logits and hidden states are handed
to the later requests (vLLM calls this prefix caching; here only whole prompts are matched).

A hit is booked as the prefill it replaces (one prefill forward, the seconds the first one took),
so every method's stats and measured speed-ups read as if it had prefilled on its own; only the
eval's wall time shrinks. Entries are kept until `max_bytes` is reached, and after that nothing
new is kept (a later method then meets the first prompts, in order, as hits; evicting would turn
every pass over a long wave into misses). The stored tensors are copies: a request's cache grows
in place and never writes into them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specheads.target import TargetOutput

MAX_BYTES = 1 << 30  # 1 GiB of kept prefills by default


@dataclass
class Prefilled:
    """One prompt's prefill: its cache rows, the last position's logits, the tapped hidden states."""

    keys: list[torch.Tensor]  # per layer [1, heads, P, head_dim]
    values: list[torch.Tensor]
    output: TargetOutput  # logits [1, 1, V] (the last position only), hidden {i: [1, P, H]}, final [1, P, H]
    seconds: float  # the prefill's share of the forward that computed it

    @property
    def nbytes(self) -> int:
        out = self.output
        tensors = [*self.keys, *self.values, out.logits, *out.hidden.values()]
        tensors += [] if out.final is None else [out.final]
        return sum(t.numel() * t.element_size() for t in tensors)

    def fill(self, cache):
        """Its rows copied into an empty cache (a layer's update copies: the entry stays unshared) -> cache."""
        for layer, k, v in zip(cache.layers, self.keys, self.values, strict=True):
            layer.update(k, v)
        return cache


class PromptCache:
    """Prefills by prompt ids, for requests whose proposers read target layers within `layers`."""

    def __init__(self, layers=(), max_bytes: int = MAX_BYTES):
        self.layers = sorted(set(layers))
        self.max_bytes = max_bytes
        self.entries: dict[tuple[int, ...], Prefilled] = {}
        self.bytes = 0
        self.hits = self.misses = 0
        self.full = False  # a prefill did not fit: nothing more is kept

    def get(self, ids: torch.Tensor, layers) -> Prefilled | None:
        """The kept prefill of prompt ids [P] whose taps cover `layers`, or None (a miss)."""
        entry = self.entries.get(tuple(ids.tolist()))
        if entry is None or not set(layers) <= set(entry.output.hidden):
            self.misses += 1
            return None
        self.hits += 1
        return entry

    def put(self, ids: torch.Tensor, cache, b: int, out: TargetOutput, seconds: float) -> None:
        """Keep row b of a prefill (its first P = len(ids) cache slots and outputs; `out.logits`
        [B, 1, V]: each row's last position, `ragged.batch_forward(last_only=True)`) while room is left."""
        key, P = tuple(ids.tolist()), ids.numel()
        if self.full or key in self.entries:
            return
        entry = Prefilled([layer.keys[b: b + 1, :, :P].clone() for layer in cache.layers],
                          [layer.values[b: b + 1, :, :P].clone() for layer in cache.layers],
                          TargetOutput(logits=out.logits[b: b + 1, -1:].clone(),
                                       hidden={i: h[b: b + 1, :P].clone() for i, h in out.hidden.items()},
                                       final=None if out.final is None else out.final[b: b + 1, :P].clone()),
                          seconds)
        if self.bytes + entry.nbytes > self.max_bytes:
            self.full = True
            return
        self.entries[key] = entry
        self.bytes += entry.nbytes
