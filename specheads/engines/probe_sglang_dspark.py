"""SGLang 0.5.23's DSPARK draft on a CPU: DFLASH's context write and block forward (probe_sglang_dflash.py;
the DSpark draft is a DFlashDraftModel), then the draft's own base logits and Markov head step by step.

A sibling of probe_sglang.py, run under the SGLang virtualenv's python; never imports specheads.
The worker's runtime knobs (gamma, mask token) come from SGLang's own `resolve_runtime_config`; the
target's embedding and lm_head reach the draft through its own `attach_shared_modules` (what
DSparkWorkerV2 does); each slot's logits are `compute_base_logits` plus the head's `step_bias` from the
previous token (the anchor for slot 1, then the greedy draft), as `draft_markov_block` runs them
(its fused greedy / sampling kernels are CUDA-only); the confidence head, when built, gives its
per-slot output through `compute_confidence`.
"""

from __future__ import annotations

import os

from probe_sglang_dflash import store_context
from probe_sglang_forward import forward_batch

HOOK_NOTE = ("SGLang's DSPARK argument handler runs with its view of the server's device reading 'cuda' (it refuses other "
             "devices; SGLang serves DSPARK on CUDA/NPU/XPU only); config parsing and the weight loader are SGLang's own")
STEP_NOTE = ("draft_markov_block's fused greedy / sampling step kernels (CUDA) -> the Markov head's own "
             "init_state / step_bias and an argmax over compute_base_logits + bias, slot by slot")
RAGGED_NOTE = ("SGLANG_RAGGED_VERIFY_MODE=cap-accept for exports with a confidence head: SGLang builds (and then "
               "requires) the confidence head only outside its default static mode")


def confidence_mode(draft_dir) -> str | None:
    """Build the confidence head when the export has one (SGLang skips its tensors in static mode)."""
    import json
    from pathlib import Path

    cfg = json.loads((Path(draft_dir) / "config.json").read_text())
    if cfg.get("enable_confidence_head") is True:
        os.environ["SGLANG_RAGGED_VERIFY_MODE"] = "cap-accept"
        return RAGGED_NOTE
    return None


def allow_dspark_on_cpu() -> str:
    from sglang.srt.arg_groups import speculative_hook

    handler, view = speculative_hook._handle_dspark, speculative_hook.resolving_view

    class OnCuda:
        """The handler's read view of the server arguments, its device reading 'cuda'."""

        def __init__(self, resolving):
            self._resolving = resolving

        def __getattr__(self, name):
            return "cuda" if name == "device" else getattr(self._resolving, name)

    def handle_dspark_as_on_cuda(server_args):
        speculative_hook.resolving_view = lambda sa: OnCuda(view(sa))
        try:
            return handler(server_args)
        finally:
            speculative_hook.resolving_view = view

    speculative_hook._handle_dspark = handle_dspark_as_on_cuda
    return HOOK_NOTE


def runtime(draft_cfg, target_cfg, num_draft_tokens: int) -> dict:
    """gamma and the mask token as the DSPARK worker resolves them, and the Markov fields it parsed."""
    from sglang.srt.speculative.dspark_components.dspark_config import (
        get_dspark_sample_from_anchor,
        parse_dspark_draft_config,
        resolve_runtime_config,
    )

    hf = draft_cfg.hf_config
    rt = resolve_runtime_config(draft_hf_config=hf, speculative_num_draft_tokens=num_draft_tokens,
                                target_vocab_size=int(target_cfg.vocab_size))
    parsed = parse_dspark_draft_config(draft_hf_config=hf)
    return {"mask_token_id": int(rt.mask_token_id), "block_size": int(rt.gamma), "markov_rank": parsed.markov_rank,
            "markov_head_type": parsed.markov_head_type, "sample_from_anchor": get_dspark_sample_from_anchor(hf)}


def run_blocks(draft_model, target_model, hidden, ids, next_token: int, anchors, k: int, mask_id: int, gamma: int,
               from_anchor: bool = False):
    """Logits of the k drafted slots of each anchor's block [len(anchors) * k, V], the last block's greedy
    tokens [k] and each block's confidence [len(anchors) * k] (None without a confidence head). The block
    is the worker's query layout: [anchor, mask x gamma] at positions a..a+gamma, drafts from slot 1
    (fill-in); with `from_anchor` (the worker's sample_from_anchor), [anchor, mask x (gamma-1)], drafts
    from slot 0."""
    import torch
    from sglang.srt.speculative.dflash_worker_v2 import _resolve_dflash_embedding_module

    if k > gamma:
        raise ValueError(f"k {k} > gamma {gamma}: SGLang drafts gamma tokens")
    draft_model.attach_shared_modules(embed_tokens=_resolve_dflash_embedding_module(draft_model, target_model),
                                      lm_head=target_model.lm_head)
    markov = draft_model.markov_head
    T, rows, confidence, tokens = ids.shape[0], [], [], None
    for a in anchors:
        store_context(draft_model, hidden[:a], torch.arange(a))
        anchor = next_token if a == T else int(ids[a])
        first = 0 if from_anchor else 1
        queries = gamma + first  # the worker's query_token_num
        block = torch.tensor([anchor] + [mask_id] * (queries - 1))
        positions = torch.arange(a, a + queries)
        fb = forward_batch(block, positions, "TARGET_VERIFY", "NULL")
        out = draft_model(block, positions, fb, input_embeds=draft_model.forward_embed(block))
        drafts = out.hidden_states[first:first + k]  # [k, H]
        base, features = draft_model.compute_base_logits(drafts)  # [k, V]
        state, prev, step_rows, picked = markov.init_state(drafts[None]), torch.tensor([anchor]), [], []
        for i in range(k):
            bias, state = markov.step_bias(prev, hidden_states=drafts[i:i + 1], state=state)
            step_rows.append((base[i:i + 1] + bias)[0])
            prev = step_rows[-1].argmax(-1, keepdim=True)
            picked.append(prev)
        tokens = torch.cat(picked)
        rows.append(torch.stack(step_rows)[:, :int(target_model.config.vocab_size)])
        if draft_model.confidence_head is not None:
            conf, _ = draft_model.compute_confidence(anchor_tokens=torch.tensor([anchor]), draft_tokens=tokens[None],
                                                     confidence_features=features)
            confidence.append(conf.reshape(-1))
    return torch.cat(rows), tokens, torch.cat(confidence) if confidence else None
