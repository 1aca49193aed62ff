"""The target's decode cache (appends in place) and attention kernel (GQA heads unrepeated): the
same numbers as transformers' own DynamicCache + sdpa, with the copies gone."""

from __future__ import annotations

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from specheads.attention import GQA_SDPA, register
from specheads.verify.kv_cache import HEADROOM, GrowingLayer, decode_cache


def tiny_gqa(attn: str) -> LlamaForCausalLM:
    """A 2-layer Llama with 4 query heads over 2 KV heads, same weights for every call."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation(attn)
    return model


def tree_mask(rows: int, past: int, n: int) -> torch.Tensor:
    """Additive [rows, 1, n, past + n]: the prefix and a causal chain over the new tokens."""
    mask = torch.zeros(rows, 1, n, past + n)
    mask[..., past:] = torch.triu(torch.full((n, n), torch.finfo(torch.float32).min), 1)
    return mask


def decode_logits(model, cache) -> list[torch.Tensor]:
    """Prefill 2 rows x 9 tokens, then three masked 3-token steps each cropped back by one."""
    torch.manual_seed(1)
    out = [model(input_ids=torch.randint(0, 97, (2, 9)), cache=cache, use_cache=True).logits]
    past = 9
    with torch.no_grad():
        for _ in range(3):
            ids = torch.randint(0, 97, (2, 3))
            pos = torch.arange(past, past + 3).expand(2, 3)
            out.append(model(input_ids=ids, position_ids=pos, attention_mask=tree_mask(2, past, 3),
                             cache=cache, use_cache=True).logits)
            cache.crop(-1)
            past += 2
    return out


def test_gqa_kernel_and_growing_cache_equal_transformers_sdpa_and_dynamic_cache():
    ours = decode_logits(tiny_gqa(register()), decode_cache(tiny_gqa("sdpa").config))
    theirs = decode_logits(tiny_gqa("sdpa"), DynamicCache())
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


def test_register_gives_a_name_models_accept():
    model = tiny_gqa(register())
    assert model.config._attn_implementation == GQA_SDPA == register()  # idempotent


def test_a_crop_then_an_update_reuses_the_buffer_in_place():
    layer = GrowingLayer()
    k = torch.randn(2, 2, 5, 4)
    layer.update(k, k + 1)
    start = layer.keys.data_ptr()
    assert layer._key_buf.shape[-2] == 5 + HEADROOM  # headroom allocated once
    layer.crop(-2)
    new = torch.randn(2, 2, 3, 4)
    keys, values = layer.update(new, new + 1)
    assert keys.data_ptr() == start and keys.shape == (2, 2, 6, 4)
    assert torch.equal(keys, torch.cat([k[:, :, :3], new], dim=-2))
    assert torch.equal(values, torch.cat([k[:, :, :3] + 1, new + 1], dim=-2))


def test_an_assigned_tensor_is_copied_never_written_through():
    layer = GrowingLayer()
    layer.update(torch.zeros(2, 2, 4, 4), torch.zeros(2, 2, 4, 4))
    picked = torch.ones(1, 2, 4, 4)  # e.g. one row selected out of the batch
    layer.keys, layer.values = picked, picked
    keys, _ = layer.update(torch.full((1, 2, 1, 4), 2.0), torch.full((1, 2, 1, 4), 2.0))
    keys[:, :, 0] = 7.0
    assert torch.equal(picked, torch.ones(1, 2, 4, 4))  # the assigned tensor is untouched
    assert keys.shape == (1, 2, 5, 4) and keys[0, 0, 4, 0] == 2.0


def test_growing_past_capacity_keeps_every_slot():
    layer = GrowingLayer()
    parts = [torch.randn(1, 2, HEADROOM, 4) for _ in range(3)]
    for part in parts:
        layer.update(part, part)
    assert torch.equal(layer.keys, torch.cat(parts, dim=-2))
