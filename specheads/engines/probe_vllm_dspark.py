"""vLLM 0.33's DSpark draft on a CPU: DFlash's context precompute and block forward (probe_vllm_dflash.py;
Qwen3DSparkModel is the DFlash Qwen3 backbone), then the model's own Markov and confidence methods.

A sibling of probe_vllm.py, run under the vLLM virtualenv's python; never imports specheads.
Each block's slots are scored as `DSparkSpeculator._sample_sequential` scores them at temperature 0:
`compute_draft_logits` (lm_head through the logits processor) plus `markov_bias(markov_embed(prev))`,
prev = the anchor for slot 1 and the greedy draft (mapped to target ids) after it; the confidence head,
when loaded, gives `compute_confidence(h, markov_embed(prev))`. The speculator itself needs the V2
runner's persistent buffers and sampling metadata, so the probe runs these model methods directly.
"""

from __future__ import annotations

from probe_vllm_dflash import run_blocks

MARKOV_NOTE = ("DSparkSpeculator._sample_sequential (the V2 runner's persistent input buffers) -> its model calls "
               "run slot by slot: compute_draft_logits + markov_bias(markov_embed(prev)), argmax, "
               "map_draft_to_target, and compute_confidence on the slots drafted")


V2_NOTE = ("VLLM_USE_V2_MODEL_RUNNER=1 while vLLM builds the config: DSpark runs only in Model Runner V2 ('Model "
           "Runner V1 does not support: dspark speculative decoding'), which vLLM picks only where Triton is "
           "installed; the probe loads and runs the draft with the V2 runner's own DSpark loader")


def v2_runner(markov: bool, notes: list):
    """For DSpark (a Markov block drafter), select Model Runner V2 while the config is built; returns the undo."""
    import os

    if not markov:
        return lambda: None
    saved = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    if V2_NOTE not in notes:
        notes.append(V2_NOTE)

    def undo():
        if saved is None:
            os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
        else:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = saved
    return undo


def config_fields(hf) -> dict:
    """What the DSpark speculator and model read from the draft config (with their own defaults)."""
    return {"block_size": getattr(hf, "block_size", None), "markov_rank": getattr(hf, "markov_rank", None),
            "markov_head_type": getattr(hf, "markov_head_type", None),
            "sample_from_anchor": getattr(hf, "sample_from_anchor", True),  # DSparkSpeculator's default
            "enable_confidence_head": getattr(hf, "enable_confidence_head", False),
            "confidence_head_with_markov": getattr(hf, "confidence_head_with_markov", False)}


def markov_steps(draft, k: int):
    """A `run_blocks` slot scorer: slot states [k, H] and the anchor -> (logits [k, V] with the Markov
    bias, greedy target ids [k]); the confidence of each block's slots is appended to `scored.confidence`."""
    import torch

    def scored(states, anchor: int):
        base = draft.compute_draft_logits(states)  # [k, Vd]
        prev, rows, embeds, tokens = torch.tensor([anchor]), [], [], []
        for i in range(k):
            embed = draft.markov_embed(prev)  # [1, r]
            row = base[i:i + 1] + draft.markov_bias(embed)
            prev = draft.map_draft_to_target(row.argmax(-1))
            rows.append(row[0])
            embeds.append(embed)
            tokens.append(prev)
        if draft.model.confidence_head is not None:
            scored.confidence.append(draft.compute_confidence(states, torch.cat(embeds)))
        return full_vocab(draft, torch.stack(rows)), torch.cat(tokens)

    scored.confidence = []
    return scored


def full_vocab(draft, logits):
    """Draft-vocabulary logits at their target ids, -inf elsewhere (identity for a full vocabulary)."""
    import torch

    d2t = draft.draft_id_to_target_id
    if d2t is None:
        return logits
    full = logits.new_full((logits.shape[0], draft.target_vocab_size), float("-inf"))
    full[:, torch.arange(d2t.shape[0]) + d2t] = logits
    return full


def run_dspark_blocks(vc, draft, aux, ids, next_token: int, anchors, k: int):
    """(logits [n*k, V], the last block's tokens [k], confidence [n*k] or None) over the anchors."""
    import torch

    scorer = markov_steps(draft, k)
    hf = vc.speculative_config.draft_model_config.hf_config
    first = 0 if config_fields(hf)["sample_from_anchor"] else 1  # DSparkSpeculator's query layout
    logits, tokens, _ = run_blocks(vc, draft, aux, ids, next_token, anchors, k, score=scorer, first=first)
    return logits, tokens, torch.cat(scorer.confidence) if scorer.confidence else None
