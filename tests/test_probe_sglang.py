"""The SGLang probe's own pieces, without SGLang: its replacement attention kernel, the loader
recorder that finds dropped tensors and unwritten parameters, and the hot-token mapping."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from specheads.engines import probe_kinds
from specheads.engines import probe_sglang_forward as fwd
from specheads.engines import probe_sglang_weights as wts


def _layer(nh=4, kvh=2, hd=8):
    return SimpleNamespace(tp_q_head_num=nh, tp_k_head_num=kvh, qk_head_dim=hd, v_head_dim=hd,
                           scaling=hd ** -0.5, logit_cap=0)


def _reference(q, k, v, nh, kvh, hd):
    """sdpa with a causal mask over the whole sequence: q, k, v [T, heads*hd] -> [T, nh*hd]."""
    q = q.reshape(-1, nh, hd).transpose(0, 1)
    k = k.reshape(-1, kvh, hd).transpose(0, 1).repeat_interleave(nh // kvh, 0)
    v = v.reshape(-1, kvh, hd).transpose(0, 1).repeat_interleave(nh // kvh, 0)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(q.shape[1], -1)


def test_attention_equals_causal_sdpa_and_continues_from_its_cache():
    torch.manual_seed(0)
    layer, T = _layer(), 9
    q, k, v = torch.randn(T, 32), torch.randn(T, 16), torch.randn(T, 16)
    ref = _reference(q, k, v, 4, 2, 8)
    fwd.KV.reset()
    whole = fwd.causal_attention(layer, q, k, v, None)
    torch.testing.assert_close(whole, ref, rtol=0, atol=1e-6)
    fwd.KV.reset()
    first = fwd.causal_attention(layer, q[:6], k[:6], v[:6], None)
    rest = [fwd.causal_attention(layer, q[i:i + 1], k[i:i + 1], v[i:i + 1], None) for i in range(6, T)]
    torch.testing.assert_close(torch.cat([first] + rest), ref, rtol=0, atol=1e-6)
    fwd.KV.reset()
    shifted = fwd.causal_attention(layer, q[1:], k[1:], v[1:], None)  # a different sequence
    assert not torch.allclose(shifted[-1], ref[-1], atol=1e-3)


class _Fused(torch.nn.Module):
    """A toy model whose loader behaves like SGLang's: fuses q/k into one parameter, buffers `a`
    until `b` arrives, and silently ignores names it does not know."""

    def __init__(self):
        super().__init__()
        self.qk = torch.nn.Parameter(torch.zeros(4, 3))
        self.ab = torch.nn.Parameter(torch.zeros(4, 3))
        self.head = torch.nn.Parameter(torch.zeros(5, 3))

    def load_weights(self, weights):
        cached = {}
        for name, t in weights:
            if name in ("layer.attn.q.weight", "layer.attn.k.weight"):
                row = 0 if ".q." in name else 2
                self.qk.data[row:row + 2] = t
            elif name in ("layer.mix.a.weight", "layer.mix.b.weight"):
                cached[name] = t
                if len(cached) == 2:
                    self.ab.data.copy_(torch.cat([cached["layer.mix.a.weight"], cached["layer.mix.b.weight"]]))
            elif name == "head.weight":
                self.head.data.copy_(t)


def _load(model, names):
    rec = wts.LoadRecorder(model)
    shapes = {n: (5, 3) if n.startswith(("head", "model.head")) else (2, 3) for n in names}
    model.load_weights(rec.wrap((n, torch.full(shapes[n], float(i + 1))) for i, n in enumerate(names)))
    rec.settle()
    return rec


def test_recorder_credits_fused_and_buffered_writes_and_finds_a_dropped_name():
    names = ["layer.attn.q.weight", "layer.attn.k.weight", "layer.mix.a.weight", "layer.mix.b.weight",
             "head.weight"]
    rec = _load(_Fused(), names)
    assert all(rec.stored[n] for n in names), rec.stored  # `a` credited when `b` wrote both
    assert rec.stored["layer.mix.a.weight"] == ["ab"]
    model = _Fused()
    rec = _load(model, names[:-1] + ["model.head.weight"])  # the SGLang EAGLE-3 lm_head fault
    assert rec.stored["model.head.weight"] == []
    assert torch.isnan(model.head).all() and not torch.isnan(model.qk).any()


def test_hot_token_mapping_places_draft_logits_at_target_ids():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    full = fwd.to_target_vocab(logits, torch.tensor([4, 0, 7]), 8)
    assert full[0, 4] == 1.0 and full[0, 0] == 3.0 and full[0, 7] == 2.0
    assert torch.isinf(full[0, [1, 2, 3, 5, 6]]).all()
    assert int(fwd.greedy_token(logits, torch.tensor([4, 0, 7]))) == 0
    no_map = fwd.to_target_vocab(logits, None, 8)  # SGLang without d2t: draft id i is target id i
    assert no_map[0, 1] == 3.0 and torch.isinf(no_map[0, 3:]).all()
    assert "draft id i as target id i" in wts.vocab_warnings(None, 3, 8)[0]
    assert wts.vocab_warnings(torch.arange(8), 8, 8) == []


@pytest.mark.parametrize("name,expect", [("model.layers.3.eh_proj.weight", True), ("mtp.fc.weight", True),
                                         ("model.layers.2.mlp.up_proj.weight", False),
                                         ("model.embed_tokens.weight", False)])
def test_mtp_module_names(name, expect):
    assert wts.module_names(probe_kinds.KINDS["mtp"], name, SimpleNamespace(num_hidden_layers=3)) is expect
