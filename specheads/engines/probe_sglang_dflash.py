"""SGLang 0.5.23's DFLASH draft on a CPU: the worker's own context materialization, then one block
forward per anchor.

A sibling of probe_sglang.py, run under the SGLang virtualenv's python; never imports specheads.
The DFLASH worker's sequential path (`DFlashWorkerV2._append_target_hidden_sequential`, called with
the draft model and a KV pool that files each layer's keys/values) projects the target states into
every layer's context keys/values; the block [anchor, mask x (block_size - 1)] then runs through the
draft module with the target's embedding, and the target's lm_head gives the logits.
"""

from __future__ import annotations

from types import SimpleNamespace

from probe_sglang_forward import KV, forward_batch

KV_NOTE = ("the draft KV pool's set_kv_buffer -> files each layer's context keys/values (from the DFLASH "
           "worker's own _append_target_hidden_sequential: project_target_hidden, kv_proj_only, k_norm, "
           "RoPE) for the block attention; the fused Triton materialization is CUDA-only")


class FilingPool:
    """The draft KV pool as the worker's context write sees it: keys/values filed per layer."""

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, k_scale=None, v_scale=None, **kw):
        KV.kv[id(layer)] = (cache_k.clone(), cache_v.clone())  # [C, kvh, hd]


def store_context(draft_model, context, positions) -> None:
    """Context rows [C, n*H] at positions [C] into every draft layer, through the worker's own code."""
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    KV.reset()
    worker = SimpleNamespace(draft_model=draft_model, draft_model_runner=SimpleNamespace(token_to_kv_pool=FilingPool()))
    ctx_hidden = draft_model.project_target_hidden(context)  # fc + hidden_norm: [C, H]
    DFlashWorkerV2._append_target_hidden_sequential(worker, ctx_hidden=ctx_hidden, ctx_positions=positions,
                                                    ctx_cache_loc=positions.clone())


def mask_token_id(draft_cfg, target_cfg) -> int:
    """The mask token the DFLASH worker resolves (its own `_resolve_mask_token_id`, no tokenizer)."""
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    parsed = parse_dflash_draft_config(draft_hf_config=draft_cfg.hf_config)
    worker = SimpleNamespace(target_worker=SimpleNamespace(model_runner=SimpleNamespace(model_config=target_cfg),
                                                           tokenizer=None))
    return DFlashWorkerV2._resolve_mask_token_id(worker, mask_token=parsed.mask_token,
                                                 mask_token_id=parsed.mask_token_id)


def run_blocks(draft_model, target_model, hidden, ids, next_token: int, anchors, k: int, mask_id: int,
               block_size: int):
    """Logits of slots 1..k of each anchor's block [len(anchors) * k, V] and the last block's greedy
    tokens [k]. The block is the worker's: block_size (= speculative_num_draft_tokens, which the
    worker hands the draft with set_block_size) tokens, anchor + block_size - 1 masks, at positions
    a..a+block_size-1, embedded with the target's table (times its noise scale)."""
    import torch
    from sglang.srt.layers.logits_processor import LogitsMetadata
    from sglang.srt.speculative.dflash_worker_v2 import _resolve_dflash_embedding_module

    draft_model.set_block_size(block_size)
    if k > block_size - 1:
        raise ValueError(f"k {k} > block_size - 1 = {block_size - 1}: SGLang drafts block_size - 1 tokens")
    embed = _resolve_dflash_embedding_module(draft_model, target_model)
    scale = float(target_model.get_dflash_noise_embedding_scale()) if hasattr(
        target_model, "get_dflash_noise_embedding_scale") else 1.0
    T, rows, tokens = ids.shape[0], [], None
    for a in anchors:
        store_context(draft_model, hidden[:a], torch.arange(a))
        block = torch.tensor([next_token if a == T else int(ids[a])] + [mask_id] * (block_size - 1))
        positions = torch.arange(a, a + block_size)
        fb = forward_batch(block, positions, "TARGET_VERIFY", "NULL")
        out = draft_model(block, positions, fb, input_embeds=embed(block) * scale)
        drafts = out.hidden_states[1:k + 1]  # [k, H]
        logits = target_model.logits_processor._get_logits(drafts, target_model.lm_head,
                                                           LogitsMetadata.from_forward_batch(fb))
        rows.append(logits[:, :int(target_model.config.vocab_size)])
        tokens = rows[-1].argmax(-1)
    return torch.cat(rows), tokens, block_size
