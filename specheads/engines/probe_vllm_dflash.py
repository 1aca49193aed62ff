"""vLLM 0.33's DFlash draft on a CPU: its own context K/V precompute, then one block forward per anchor.

A sibling of probe_vllm.py, run under the vLLM virtualenv's python; never imports specheads.
The engine's `precompute_and_store_context_kv` projects the fused target states into each layer's
context keys/values (hidden_norm, k/v projection, k_norm, RoPE) and hands them to the attention
backend's `do_kv_cache_update`; here that call files them per layer instead of into a paged cache.
The block [anchor, mask x k] then runs through the engine's draft module with an attention that
reads [context ; block] keys, non-causal inside the block unless the layer is causal.
"""

from __future__ import annotations

import math

CONTEXT: dict[str, tuple] = {}  # attention layer name -> (keys [C, kvh, hd], values [C, kvh, hd])
CAUSAL: dict[str, bool] = {}  # attention layer name -> the engine's causality for that layer

OPS_NOTE = ("vllm._custom_ops.rms_norm / rotary_embedding (fused kernels from vllm._C, absent from the PyPI "
            "wheel on a CPU) -> vLLM's own native implementations (vllm.ir.ops.rms_norm per weight row, "
            "RotaryEmbedding.forward_static): DFlash's context K/V precompute calls them directly")
KV_NOTE = ("the attention backend's do_kv_cache_update -> files each layer's context keys/values (already "
           "normed and rotated by vLLM's precompute_and_store_context_kv) for the block attention")
ATTN_NOTE = ("Attention.forward (DFlash draft) -> softmax over [context ; block] keys, all block keys visible "
             "unless the layer is causal (vLLM's draft backend runs it with use_non_causal): the paged "
             "CPU kernels need a KV cache and scheduler metadata")


def native_custom_ops() -> str:
    """Route the two fused ops DFlash's precompute calls to vLLM's own PyTorch implementations."""
    from vllm import _custom_ops as ops
    from vllm import ir
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    def rms_norm(out, x, weight, epsilon):
        if weight is not None and weight.dim() == 2:  # grouped: weight row i for x[i] (one per layer)
            for i in range(x.shape[0]):
                out[i].copy_(ir.ops.rms_norm(x[i], weight[i], epsilon))
        else:
            out.copy_(ir.ops.rms_norm(x, weight, epsilon))

    def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox, rope_dim_offset=0,
                         inverse=False):
        if rope_dim_offset or inverse:
            raise NotImplementedError("the probe's native rotary_embedding covers offset 0, forward only")
        q, k = RotaryEmbedding.forward_static(positions, query, key, head_size, cos_sin_cache.shape[-1],
                                              cos_sin_cache, is_neox)
        query.copy_(q)  # the fused op works in place
        if key is not None:
            key.copy_(k)

    ops.rms_norm, ops.rotary_embedding = rms_norm, rotary_embedding
    return OPS_NOTE


def file_context_kv(draft) -> str:
    """Each draft attention layer files the context K/V the engine's precompute hands its backend."""
    names = draft.get_draft_kv_cache_layer_names()
    CAUSAL.clear()
    CAUSAL.update(zip(names, draft.get_draft_attn_causal()))
    for layer in draft.model.layers:
        attn = layer.self_attn.attn

        def update(attn_layer, key, value, kv_cache, slot_mapping):
            CONTEXT[attn_layer.layer_name] = (key.clone(), value.clone())
        attn.impl.do_kv_cache_update = update
    return KV_NOTE


def block_attention() -> str:
    """Attention.forward for the draft: block queries over [context ; block] keys."""
    import torch
    from vllm.model_executor.layers.attention.attention import Attention

    def forward(layer, query, key, value, output_shape=None, output_dtype=None):
        n, nh, kvh, hd = query.shape[0], layer.num_heads, layer.num_kv_heads, layer.head_size
        ctx_k, ctx_v = CONTEXT[layer.layer_name]
        q = query.reshape(n, nh, hd).transpose(0, 1).float()  # [nh, N, hd]
        k = torch.cat([ctx_k.reshape(-1, kvh, hd), key.reshape(n, kvh, hd)]).transpose(0, 1).float()
        v = torch.cat([ctx_v.reshape(-1, kvh, layer.head_size_v), value.reshape(n, kvh, layer.head_size_v)])
        v = v.transpose(0, 1).float()  # [kvh, C+N, hdv]
        rep = nh // kvh
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        scale = getattr(layer.impl, "scale", None) or 1.0 / math.sqrt(hd)
        scores = (q @ k.transpose(1, 2)) * scale  # [nh, N, C+N]
        if CAUSAL[layer.layer_name]:
            c = scores.shape[-1] - n
            future = torch.ones(n, n, dtype=torch.bool).triu(1)
            scores[:, :, c:] = scores[:, :, c:].masked_fill(future, float("-inf"))
        out = scores.softmax(-1) @ v  # [nh, N, hdv]
        return out.transpose(0, 1).reshape(n, nh * layer.head_size_v).to(query.dtype)

    Attention.forward = forward
    return ATTN_NOTE


def run_blocks(vc, draft, aux, ids, next_token: int, anchors, k: int, score=None, first: int = 1):
    """Block logits [len(anchors) * k, V] and the last block's greedy tokens [k]; `score(states [k, H],
    anchor)` -> (logits, tokens) replaces DFlash's compute_logits + argmax (DSpark's Markov steps).

    aux [T, n*H]: the target states the engine taps. Anchor a: context rows 0..a-1 stored by the
    engine's precompute at positions 0..a-1, then the query block at positions from a. first = 1
    (fill-in): [x_a (next_token when a = T), mask x k], slots 1..k are the drafts; first = 0 (DSpark's
    sample_from_anchor): [x_a, mask x (k-1)], every slot drafts the token after it."""
    import torch
    from vllm.forward_context import set_forward_context
    from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id

    mask_id = get_parallel_drafting_token_id(vc.speculative_config.draft_model_config.hf_config)
    context = draft.combine_hidden_states(aux)  # [T, H]: fc over the tapped states
    T, rows, tokens = ids.numel(), [], None
    for a in anchors:
        CONTEXT.clear()
        positions = torch.arange(a)
        draft.precompute_and_store_context_kv(context[:a], positions, positions.clone())
        anchor = next_token if a == T else int(ids[a])
        block = torch.tensor([anchor] + [mask_id] * (k + first - 1))
        with set_forward_context(None, vc):
            out = draft(input_ids=block, positions=torch.arange(a, a + k + first))
        if score is None:
            logits = draft.compute_logits(out[first:])  # [k, V]: -inf off a reduced draft vocabulary
            tokens = logits.argmax(-1)
        else:
            logits, tokens = score(out[first:], anchor)
        rows.append(logits)
    return torch.cat(rows), tokens, mask_id
