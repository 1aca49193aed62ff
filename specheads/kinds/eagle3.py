"""EAGLE-3 (and P-EAGLE, an EAGLE-3 head drafting in parallel): examples and engine-check side."""

from __future__ import annotations

import torch

from specheads.engine_facts import AUX_LAYER_OFFSET
from specheads.heads.eagle3 import Eagle3Head, Eagle3Options
from specheads.kinds.base import EngineSide, Example, Kind, random_head, step_logits, tapped_states

FORMATS = ("vllm", "vllm-native", "sglang")


def example_head(target, seed: int, draft_vocab: int | None = None, **options):
    """Random weights; a scattered draft vocabulary of `draft_vocab` (default V / 2), so a wrong d2t shows;
    `options`: further head options (EAGLE 3.1 norms, qk_norm)."""
    V = target.vocab_size
    draft_vocab = draft_vocab or V // 2
    head = random_head(Eagle3Head, Eagle3Options(ttt_steps=3, draft_vocab_size=draft_vocab, **options), target, seed,
                       0.05)
    if draft_vocab < V:
        used = torch.sort(torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:draft_vocab]).values
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[used] = True
        head.set_vocab_map(used - torch.arange(draft_vocab), t2d)
    return head


def peagle_head(target, seed: int):
    """P-EAGLE: an EAGLE-3 head drafting in parallel (its mask_hidden perturbed like the rest)."""
    options = Eagle3Options(ttt_steps=3, draft_vocab_size=target.vocab_size // 2, parallel_drafting=True)
    return random_head(Eagle3Head, options, target, seed, 0.05)


def _aux(ours) -> list[int]:
    return list((ours.meta.head_config or {}).get("aux_layers") or [])


def features(ours, ids):
    return tapped_states(ours, ids, _aux(ours))


def first_pass(ours, ids, next_token, out, anchors, k):
    return step_logits(ours, ids, next_token, ours.head.fuse([out.hidden[i] for i in _aux(ours)]))


def expect(ours, engine: str) -> dict:
    hc = ours.meta.head_config or {}
    want = {"draft_vocab_size": hc.get("draft_vocab_size"),
            "aux_layer_ids": [a + AUX_LAYER_OFFSET[engine] for a in _aux(ours)]}
    if hc.get("parallel_drafting"):  # P-EAGLE
        want["parallel_drafting"] = True
    if engine == "vllm":  # speculators defaults it to true, native vLLM to false: it must match training
        want["norm_before_residual"] = bool(hc.get("norm_before_residual", False))
    return want


KIND = Kind(
    "eagle3",
    examples=(
        Example("eagle3", lambda t, s: example_head(t, s), 1, FORMATS, "draft vocab {half} of {V}"),
        Example("eagle3-fullvocab", lambda t, s: example_head(t, s, t.vocab_size), 2, FORMATS,
                "draft vocab = V = {V}: no d2t / t2d"),
        Example("peagle", peagle_head, 7, ("vllm", "vllm-native"), "P-EAGLE (parallel drafting)"),
        Example("eagle31", lambda t, s: example_head(t, s, fc_norm=True, norm_output=True), 3, FORMATS,
                "EAGLE 3.1: fc_norm + norm_output"),
        Example("eagle31-norm-before-fc", lambda t, s: example_head(t, s, norm_before_fc=True), 4, FORMATS,
                "EAGLE 3.1: norm_before_fc"),
        Example("eagle3-qwen3", lambda t, s: example_head(t, s, qk_norm=True, norm_output=True), 5,
                ("vllm", "vllm-native"), "Qwen3-style layer (q/k norms) + norm_output; SGLang has no loader"),
    ),
    engine_side=EngineSide(features, first_pass, expect),
    probe_kind=lambda hc: "peagle" if hc.get("parallel_drafting") else "eagle3",
    layout=lambda ours: "qwen3" if (ours.meta.head_config or {}).get("qk_norm") else "",  # vLLM's Qwen3 class
)
