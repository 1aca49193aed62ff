"""DSpark: layout, strict config round-trip, zero-start Markov bias, each Markov type against the
engines' formula (docs/dspark_format.md §1), confidence targets and loss golden, learning."""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import pytest
import torch
from random_models import make_target

from specheads.config import ConfigError, from_dict
from specheads.heads import HEADS
from specheads.heads.dspark import (
    DSparkConfig,
    DSparkHead,
    DSparkOptions,
    acceptance_targets,
    survival_bce,
)

TYPES = ("vanilla", "gated", "rnn")


@pytest.fixture(scope="module")
def target():
    return make_target()


def make_head(target, seed: int = 0, randomize: bool = False, **opts) -> DSparkHead:
    torch.manual_seed(seed)
    options = DSparkOptions(**{"num_layers": 1, "block_size": 3, "num_anchors": 8, "markov_rank": 8,
                               "enable_confidence_head": True, "confidence_head_with_markov": True, **opts})
    head = DSparkHead.for_target(options, target.config).double()
    if randomize:
        with torch.no_grad():
            for name, p in head.named_parameters():
                if "norm" not in name:
                    p.normal_(0, 0.3)
    return head


def batch_of(ids: torch.Tensor) -> dict:
    ones = torch.ones_like(ids)
    return {"input_ids": ids, "attention_mask": ones, "loss_mask": ones}


def test_registered_and_layout(target):
    assert HEADS["dspark"] is DSparkHead
    head = make_head(target, markov_head_type="rnn")
    shapes = {n: tuple(t.shape) for n, t in head.state_dict().items()}
    H, V, r = 32, 96, 8
    assert shapes["dflash.fc.weight"] == (H, H)  # DFlash part (1 layer: 1 tap), engine names after the prefix
    assert shapes["markov_head.markov_w1.weight"] == (V, r)
    assert shapes["markov_head.markov_w2.weight"] == (V, r)
    assert shapes["markov_head.joint_proj.weight"] == (3 * r, 2 * r + H)
    assert shapes["markov_head.joint_proj.bias"] == (3 * r,)
    assert shapes["confidence_head.proj.weight"] == (1, H + r) and shapes["confidence_head.proj.bias"] == (1,)
    gated = {n: tuple(t.shape) for n, t in make_head(target, markov_head_type="gated").state_dict().items()}
    assert gated["markov_head.gate_proj.weight"] == (r, H + r) and gated["markov_head.gate_proj.bias"] == (r,)
    plain = make_head(target, enable_confidence_head=False, confidence_head_with_markov=False)
    assert not any(n.startswith(("confidence_head", "markov_head.gate", "markov_head.joint"))
                   for n in plain.state_dict())
    assert head.config.block_size == 3 and head.config.dflash.block_size == 4  # G drafts; anchor + G
    assert head.required_layers() == head.dflash.required_layers()


def test_config_round_trips_through_json_and_refuses_unknown_keys(target):
    head = make_head(target, markov_head_type="gated")
    data = json.loads(json.dumps(asdict(head.config)))
    again = DSparkConfig(**data)
    assert again == head.config
    DSparkHead(again).load_state_dict(head.state_dict())  # same architecture
    with pytest.raises(TypeError):
        DSparkConfig(**{**data, "markov_bogus": 1})
    with pytest.raises(TypeError):
        DSparkConfig(**{**data, "dflash": {**data["dflash"], "bogus": 1}})
    with pytest.raises(ConfigError, match="unknown key 'head.markov_bogus'"):
        from_dict(DSparkOptions, {"kind": "dspark", "markov_bogus": 1}, "head")
    with pytest.raises(ValueError, match="markov_head_type 'lstm'"):
        DSparkConfig(**{**data, "markov_head_type": "lstm"})
    with pytest.raises(ValueError, match="markov_rank 0"):
        DSparkHead.for_target(DSparkOptions(markov_rank=0), target.config)


@pytest.mark.parametrize("kind", TYPES)
def test_markov_bias_starts_at_zero(target, kind):
    """markov_w2 = 0 at init: the head starts as plain DFlash, for every type (w1 is random so w2's
    gradient is not zero: zeroing both would be a stationary point)."""
    head = make_head(target, markov_head_type=kind)
    torch.manual_seed(1)
    out = torch.randn(2, 3, 3, 32, dtype=torch.float64)
    prev = torch.randint(0, 96, (2, 3, 3))
    assert torch.count_nonzero(head.markov_head.bias(head.markov_head.latent(out, prev))) == 0
    assert head.markov_head.markov_w1.weight.std() > 0


def engine_reference(kind: str, sd: dict, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """The engines' step loop (SGLang dspark.py VanillaMarkov / GatedMarkovHead / RNNHead), written
    from their formula: one row, slot by slot. hidden [G, H], prev [G] -> bias [G, V]."""
    w1, w2 = sd["markov_head.markov_w1.weight"], sd["markov_head.markov_w2.weight"]
    r = w1.shape[1]
    state = torch.zeros(r, dtype=w1.dtype)
    rows = []
    for i in range(len(prev)):
        e = w1[prev[i]]
        if kind == "vanilla":
            latent = e
        elif kind == "gated":
            gate = torch.sigmoid(sd["markov_head.gate_proj.weight"] @ torch.cat([hidden[i], e])
                                 + sd["markov_head.gate_proj.bias"])
            latent = gate * e
        else:
            z = torch.cat([state, e, hidden[i]])
            y = sd["markov_head.joint_proj.weight"] @ z + sd["markov_head.joint_proj.bias"]
            g, c, o = torch.sigmoid(y[:r]), torch.tanh(y[r:2 * r]), y[2 * r:]
            state = g * state + (1 - g) * c
            latent = torch.tanh(o)
        rows.append(w2 @ latent)
    return torch.stack(rows)


@pytest.mark.parametrize("kind", TYPES)
def test_markov_head_equals_the_engine_formula(target, kind):
    head = make_head(target, randomize=True, markov_head_type=kind)
    sd = head.state_dict()
    torch.manual_seed(2)
    out = torch.randn(2, 2, 3, 32, dtype=torch.float64)  # [B, N, G, H]
    prev = torch.randint(0, 96, (2, 2, 3))
    got = head.markov_head.bias(head.markov_head.latent(out, prev))  # [B, N, G, V]
    for b in range(2):
        for n in range(2):
            torch.testing.assert_close(got[b, n], engine_reference(kind, sd, out[b, n], prev[b, n]),
                                       atol=1e-12, rtol=1e-12)
    base = head.dflash.logits(out, target.lm_head.weight)
    torch.testing.assert_close(head.block_logits(out, prev, target.lm_head.weight), base + got)


def test_confidence_is_a_probability_and_matches_the_engine(target):
    head = make_head(target, randomize=True)
    with torch.no_grad():
        head.confidence_head.proj.weight.mul_(50)  # saturate: still inside [0, 1]
    torch.manual_seed(3)
    out, prev = torch.randn(4, 5, 32, dtype=torch.float64), torch.randint(0, 96, (4, 5))
    c = head.confidence(out, prev)
    assert c.shape == (4, 5) and bool(((c >= 0) & (c <= 1)).all())
    sd = head.state_dict()
    x = torch.cat([out, sd["markov_head.markov_w1.weight"][prev]], -1)  # cat[h, W1[prev]] (vLLM/SGLang)
    want = torch.sigmoid(x @ sd["confidence_head.proj.weight"][0] + sd["confidence_head.proj.bias"][0])
    torch.testing.assert_close(c, want)


def sg(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_acceptance_targets_and_survival_bce_golden():
    correct = torch.tensor([[[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]]], dtype=torch.bool)
    scored = torch.tensor([[[1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 1, 1]]], dtype=torch.bool)
    prefix_ok, usable = acceptance_targets(correct, scored)
    assert prefix_ok.int().tolist() == [[[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]]]
    assert usable.int().tolist() == [[[1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0]]]
    c = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [2.0, -1.0, 0.0, 0.0], [1.0, 5.0, 5.0, 5.0]]])
    # survival of row 0: 1/2, 1/4, 1/8, 1/16; targets 1, 1, 0, 0
    # row 1: s1 = sigmoid(2), s2 = sigmoid(2) sigmoid(-1), then * 1/2, * 1/4; targets all 0
    # row 2: one scored slot, s = sigmoid(1), target 1
    s1 = [sg(2), sg(2) * sg(-1), sg(2) * sg(-1) / 2, sg(2) * sg(-1) / 4]
    terms = ([-math.log(0.5), -math.log(0.25), -math.log(1 - 1 / 8), -math.log(1 - 1 / 16)]
             + [-math.log(1 - s) for s in s1] + [-math.log(sg(1))])
    got = survival_bce(c, prefix_ok, usable)
    assert abs(float(got) - sum(terms) / 9) < 1e-6


@pytest.mark.parametrize("kind", TYPES)
def test_train_forward_loss_decreases(target, kind):
    head = make_head(target, seed=5, markov_head_type=kind)
    torch.manual_seed(0)
    ids = torch.randint(0, 95, (2, 16))
    batch = batch_of(ids)
    inputs = head.expand(target, head.collect(target, batch), batch)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    head.train()
    losses = []
    for _ in range(40):
        res = head(**inputs)
        opt.zero_grad()
        res.loss.backward()
        opt.step()
        losses.append(float(res.loss.detach()))
    assert losses[-1] < 0.5 * losses[0], losses
    assert res.step_losses.shape == (3,) and res.counts["rows"].shape == (3,)
    assert head.markov_head.markov_w2.weight.abs().sum() > 0  # the bias learned something
    assert head.confidence_head.proj.weight.grad is not None


def test_training_logits_are_the_block_logits(target):
    """The loss scores exactly lm_head(out) + bias(prev = the token before each slot): the Markov
    input of slot 1 is the anchor, of slot s the token at a+s-1."""
    head = make_head(target, randomize=True, markov_head_type="rnn").eval()
    torch.manual_seed(0)
    ids = torch.randint(0, 95, (1, 12))
    batch = batch_of(ids)
    inputs = head.expand(target, head.collect(target, batch), batch)
    captured = {}
    real = head._loss
    head._loss = lambda out, pos, *a: captured.update(out=out, pos=pos) or real(out, pos, *a)
    res = head.train_forward(**inputs)
    del head._loss
    out, pos = captured["out"], captured["pos"]
    prev = ids[0][(pos - 1).clamp(max=11)]  # [1, N, G]; slots past the end are not scored
    logits = head.block_logits(out, prev, target.lm_head.weight)
    labels = inputs["labels"][0][pos.clamp(max=11)]
    inside = pos < 12
    ce = torch.nn.functional.cross_entropy(logits[inside], labels[inside], reduction="none")
    s = torch.arange(3).expand_as(pos)[inside]
    per_slot = torch.zeros(3, dtype=ce.dtype).index_add_(0, s, ce) / torch.bincount(s, minlength=3).clamp(min=1)
    torch.testing.assert_close(res.step_losses.double(), per_slot.detach().float().double(), atol=1e-5, rtol=1e-5)
