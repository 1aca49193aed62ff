"""The descriptor record of a drafter kind and the helpers its example heads share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from specheads.verify.steps import causal_mask, positions


@dataclass(frozen=True)
class Example:
    """A small random-weight head of this kind, exported in `formats` (engine matrix, export tests)."""

    name: str  # the row name: "eagle3-fullvocab"
    build: Callable[[Any, int], torch.nn.Module]  # (target, seed) -> head
    seed: int
    formats: tuple[str, ...]
    note: str = ""
    family: str = ""  # built on this tiny target family (builtin.family_targets), not the test target
    matrix: bool = True  # a row of `make engine-check` (False: the export tests only)


@dataclass(frozen=True)
class EngineSide:
    """Our side of the engine check's `layers` and `forward` stages, for a kind whose draft the
    engines run. `ours` is `engines.check.Ours`: the export loaded, its target, its metadata."""

    # (ours, input_ids [1, T]) -> (target output, the states the draft reads [T, F])
    features: Callable
    # (ours, input_ids [1, T], next_token, target output, anchors | None, k) -> logits [N, V]
    first_pass: Callable
    # (ours, engine) -> config values the engine must derive beyond method, k and draft class
    expect: Callable = lambda ours, engine: {}
    # the check drafts blocks at anchors spread over the prompt (DFlash) rather than one chain
    anchors: bool = False


@dataclass(frozen=True)
class Kind:
    """What the engine matrix, the engine check and the export tests need to know of one kind."""

    name: str
    examples: tuple[Example, ...]
    engine_side: EngineSide | None = None  # None: the engines load it but run no draft forward we compare
    # (head, ours) -> the head as the check compares it (a DFlash head as trained, EAGLE-1 bound to the target)
    prepare: Callable = lambda head, ours: head
    # head_config -> the probe's --kind (P-EAGLE is an EAGLE-3 head that drafts in parallel)
    probe_kind: Callable[[dict], str] | None = None
    # (ours) -> the layout the engine's draft class depends on (MTP: the target family), else ""
    layout: Callable = lambda ours: ""

    def probe_name(self, head_config: dict | None) -> str:
        return self.probe_kind(head_config or {}) if self.probe_kind else self.name

    @property
    def example(self) -> Example:
        """The first example: the one the export tests use."""
        return self.examples[0]


# --- example heads --------------------------------------------------------------------------------
def perturb(head: torch.nn.Module, scale: float, seed: int) -> None:
    """Random weights that make every tensor matter (norms away from 1, no pass-through init)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            if p.is_floating_point():
                p.add_(torch.randn(p.shape, generator=g) * scale)


def random_head(head_cls, options, target, seed: int, scale: float = 0.0, init_from_target: bool = False):
    """A `head_cls` head for `target` built under `seed`; initialised from the target and/or
    perturbed by `scale` (0: not perturbed) when asked."""
    torch.manual_seed(seed)
    head = head_cls.for_target(options, target.config)
    if init_from_target:
        head.init_from_target(target)
    if scale:
        perturb(head, scale, seed)
    return head


def shifted(ids: torch.Tensor, next_token: int) -> torch.Tensor:
    """The tokens each draft row reads: ids [1, T] shifted left, `next_token` last -> [1, T]."""
    return torch.cat([ids[0, 1:], ids.new_tensor([next_token])])[None]


# --- our side of the engine check -------------------------------------------------------------------
def final_states(ours, ids: torch.Tensor):
    """(target output, the final-normed states [T, H]): what EAGLE-1 and MTP drafts read."""
    out = ours.target.forward(ids)
    return out, out.final[0]


def tapped_states(ours, ids: torch.Tensor, layers: list[int]):
    """(target output, the states after `layers`, concatenated [T, n*H])."""
    out = ours.target.forward(ids, layers=layers)
    return out, torch.cat([out.hidden[i][0] for i in layers], dim=-1)


def step_logits(ours, ids: torch.Tensor, next_token: int, hidden: torch.Tensor) -> torch.Tensor:
    """One EAGLE-style draft step over the whole prompt: row t reads token t+1 and `hidden` [1, T, H]
    at t -> full-vocabulary logits [T, V]."""
    head, T = ours.head, ids.shape[1]
    o = head.step(hidden, ours.target.embed(shifted(ids, next_token)), positions(0, T, ids.device),
                  causal_mask(0, T, hidden.dtype, ids.device))
    return ours.full_vocab(head.logits(o)[0].float())  # [T, Vd] -> [T, V]
