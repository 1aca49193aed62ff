"""EAGLE-3 head: training-time test matches step-by-step inference, vocab map, learning."""

from __future__ import annotations

import pytest
import torch
from random_models import overfit
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from specheads.heads.eagle3 import Eagle3Head, Eagle3Options, shift, ttt_attention_mask
from specheads.heads.vocab import build_vocab_map, draft_to_target
from specheads.metrics import ttt_summary
from specheads.target import Target


class _Tok:
    def get_vocab(self):
        return {f"t{i}": i for i in range(97)}


@pytest.fixture()
def setup():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    target = Target(LlamaForCausalLM(cfg), _Tok(), "tiny")
    head = Eagle3Head.for_target(Eagle3Options(ttt_steps=3, draft_vocab_size=50), cfg)
    ids = torch.randint(0, 97, (2, 12))
    out = target.forward(ids, layers=head.required_layers())
    aux = torch.cat([out.hidden[i] for i in head.required_layers()], -1)
    return cfg, target, head, ids, out, aux


def test_default_taps_are_vllm_defaults(setup):
    cfg, target, head, ids, out, _ = setup
    assert head.required_layers() == [2, 4, 5]  # (2, L//2, L-3) for L = 8
    ref = target.model(ids, output_hidden_states=True).hidden_states
    for i in head.required_layers():
        torch.testing.assert_close(out.hidden[i], ref[i], rtol=0, atol=0)


def test_ttt_rows_equal_sequential_inference(setup):
    """Row i at TTT step j must equal the draft run as at inference after prefix x_<=i."""
    _, target, head, ids, _, aux = setup
    head.eval()
    emb = target.embed(ids[:1])
    T = ids.shape[1]
    with torch.no_grad():
        outs, hidden, cache = [], head.fuse(aux[:1]), DynamicCache()
        for j in range(3):
            mask = ttt_attention_mask(torch.ones(1, T, dtype=torch.bool), j, torch.float32)
            hidden = head.step(hidden, shift(emb, j + 1), torch.arange(T)[None] + j, mask, cache)
            outs.append(hidden)
        for i in (0, 5, 8):
            cache = DynamicCache()
            causal = torch.full((i + 1, i + 1), torch.finfo(torch.float32).min).triu(1)[None, None]
            y = head.step(head.fuse(aux[:1, : i + 1]), emb[:, 1 : i + 2], torch.arange(i + 1)[None], causal, cache)
            torch.testing.assert_close(y[0, i], outs[0][0, i], atol=1e-5, rtol=1e-5)
            h = y[:, i : i + 1]
            for j in (1, 2):
                if i + j + 1 >= T:
                    break
                h = head.step(h, emb[:, i + j + 1 : i + j + 2], torch.tensor([[i + j]]), None, cache)
                torch.testing.assert_close(h[0, 0], outs[j][0, i], atol=1e-5, rtol=1e-5)


def test_ttt_mask_golden():
    valid = torch.tensor([[True, True, False]])
    allow = ttt_attention_mask(valid, 1, torch.float32)[0, 0] == 0
    expected = torch.tensor([
        [1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 1, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(allow, expected)


def test_vocab_map_golden():
    counts = torch.tensor([0, 5, 1, 9, 0, 5, 2])
    d2t, t2d = build_vocab_map(counts, 4)
    # most frequent: 3 (9), 1 (5), 5 (5), 6 (2) -> sorted ids [1, 3, 5, 6]
    assert d2t.tolist() == [1, 2, 3, 3] and d2t.dtype == torch.int64
    assert t2d.tolist() == [False, True, False, True, False, True, True]
    assert draft_to_target(torch.tensor([0, 1, 2, 3]), d2t).tolist() == [1, 3, 5, 6]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_vocab_map(counts, 8)


def test_head_overfits_one_batch(setup):
    _, target, head, ids, out, aux = setup
    d2t, t2d = build_vocab_map(torch.bincount(ids.flatten(), minlength=97), 50)
    head.set_vocab_map(d2t, t2d)
    mask = torch.ones_like(ids)
    inputs = dict(aux=aux, embeds=target.embed(ids), target_logits=out.logits, loss_mask=mask, attention_mask=mask)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    first, res = overfit(head, inputs, opt)
    assert res.loss.item() < 0.5 * first
    summary = ttt_summary(*[res.counts[k].tolist() for k in ("rows", "reached", "cond_rows")])
    assert summary["acc_uncond"][0] > 0.5 and summary["tau_est"] > 1.5
    # counts are consistent: reached <= cond_rows <= rows, monotone reach
    assert torch.all(res.counts["reached"] <= res.counts["cond_rows"])
    assert torch.all(res.counts["cond_rows"] <= res.counts["rows"])
