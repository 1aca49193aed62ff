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


@pytest.mark.parametrize("from_anchor", [False, True])
def test_training_logits_are_the_block_logits(target, from_anchor):
    """The loss scores exactly lm_head(out) + bias(prev = the token before each drafted token): the
    Markov input of the first draft is the anchor, of draft s the token at a+s-1 (either layout)."""
    head = make_head(target, randomize=True, markov_head_type="rnn", sample_from_anchor=from_anchor).eval()
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
    assert out.shape[2] == 3 and (pos[..., 0] - 1 >= 0).all()  # G drafted slots; a+1.. predicted
    prev = ids[0][(pos - 1).clamp(max=11)]  # [1, N, G]; slots past the end are not scored
    logits = head.block_logits(out, prev, target.lm_head.weight)
    labels = inputs["labels"][0][pos.clamp(max=11)]
    inside = pos < 12
    ce = torch.nn.functional.cross_entropy(logits[inside], labels[inside], reduction="none")
    s = torch.arange(3).expand_as(pos)[inside]
    per_slot = torch.zeros(3, dtype=ce.dtype).index_add_(0, s, ce) / torch.bincount(s, minlength=3).clamp(min=1)
    torch.testing.assert_close(res.step_losses.double(), per_slot.detach().float().double(), atol=1e-5, rtol=1e-5)


# --- drafting and verification (verify/dspark_proposers.py) --------------------------------------
def greedy(target, proposer, prompt: torch.Tensor, n: int, k: int):
    from specheads.verify.loop import decode, greedy_decode

    return decode(target, proposer, prompt, n, k) if proposer else greedy_decode(target, prompt, n)


@pytest.mark.parametrize("kind,from_anchor", [(kind, False) for kind in TYPES] + [("vanilla", True)])
def test_greedy_speculation_equals_plain_greedy(target, kind, from_anchor):
    from specheads.verify.dspark_proposers import DSparkProposer

    head = make_head(target, seed=1, randomize=True, markov_head_type=kind,
                     sample_from_anchor=from_anchor).to(target.dtype).eval()
    for seed in range(2):
        prompt = torch.randint(0, 95, (6,), generator=torch.Generator().manual_seed(seed))
        plain = greedy(target, None, prompt, 24, 0).tokens
        for k in (1, 3, 5):  # k > G drafts G
            assert greedy(target, DSparkProposer(head, target), prompt, 24, k).tokens == plain


@pytest.mark.parametrize("kind,from_anchor", [(kind, False) for kind in TYPES] + [("gated", True)])
def test_drafting_is_the_training_computation(target, kind, from_anchor):
    """Fed the data tokens as its previous tokens, the proposer's block at anchor a gives exactly the
    training logits of that block; the drafted tokens are each slot's argmax given the one before;
    confidence() is the head's on the slots drafted. In both layouts."""
    from specheads.verify.dspark_proposers import DSparkProposer

    head = make_head(target, seed=2, randomize=True, markov_head_type=kind, sample_from_anchor=from_anchor).eval()
    ids = torch.randint(0, 95, (1, 13), generator=torch.Generator().manual_seed(4))
    batch = batch_of(ids)
    inputs = head.expand(target, head.collect(target, batch), batch)
    captured = {}
    head._loss = lambda out, pos, *a: captured.update(out=out, pos=pos)
    head.train_forward(**inputs)
    del head._loss
    out = target.forward(ids, layers=head.required_layers())
    proposer = DSparkProposer(head, target)
    for n, a in enumerate((captured["pos"][0, :, 0] - 1).tolist()):
        if a + 3 >= ids.shape[1]:
            continue
        proposer.start(ids[0, :a], int(ids[0, a]), out)
        data = iter(ids[0, a + 1:a + 4])
        _, logits = proposer.draft_block(3, lambda row, data=data: next(data))
        prev = ids[0, a:a + 3]
        want = head.block_logits(captured["out"][:, n:n + 1], prev[None, None], target.lm_head.weight)[0, 0]
        torch.testing.assert_close(logits, want, atol=1e-9, rtol=1e-9)
        drafts = proposer.propose(3)
        states, used = proposer.last
        assert used.tolist() == [int(ids[0, a])] + drafts[:2].tolist()  # anchor, then each draft
        rows = head.block_logits(states[None, None], used[None, None], target.lm_head.weight)[0, 0]
        assert rows.argmax(-1).tolist() == drafts.tolist()
        torch.testing.assert_close(proposer.confidence(), head.confidence(states, used))


def test_a_confidence_warper_records_the_confidence_head(target):
    """Drafted through a `ConfidenceWarper` (eval's calibration probe, the adaptive length rule), each
    slot records the confidence head's P(accepted | earlier accepted), not the draft's top probability;
    a head without one records the top probability; the drafts stay the greedy chain either way."""
    from specheads.verify.calibration import ConfidenceWarper
    from specheads.verify.dspark_proposers import DSparkProposer, SampledDSparkProposer

    ids = torch.randint(0, 95, (1, 9), generator=torch.Generator().manual_seed(5))
    for with_head in (True, False):
        head = make_head(target, seed=2, randomize=True, enable_confidence_head=with_head).eval()
        out = target.forward(ids, layers=head.required_layers())
        sampled, greedy_ = SampledDSparkProposer(head, target), DSparkProposer(head, target)
        for p in (sampled, greedy_):
            p.start(ids[0, :8], int(ids[0, 8]), out)
        warper = ConfidenceWarper()
        drafts, _ = sampled.propose_sampled(3, warper, torch.Generator().manual_seed(0))
        assert drafts.tolist() == greedy_.propose(3).tolist()
        states, prev = sampled.last
        top = torch.softmax(head.block_logits(states[None, None], prev[None, None], target.lm_head.weight)[0, 0], -1)
        want = head.confidence(states, prev) if with_head else top.amax(-1)  # [3]
        assert warper.seen == pytest.approx(want.tolist(), abs=1e-12)
        assert with_head != (warper.seen == pytest.approx(top.amax(-1).tolist(), abs=1e-12))


def test_sampled_speculation_keeps_the_target_distribution():
    """The first 3 sampled tokens over many seeds (one block of k = 3, every slot biased by the token
    sampled before it) pass a chi-square test against the target's exact joint distribution."""
    from test_sampling import P_MIN, V_SMALL, build_small, chi2_pvalue, exact_first_tokens, flat_index

    from specheads.verify.dspark_proposers import SampledDSparkProposer
    from specheads.verify.loop import ChainShape, run_loop
    from specheads.verify.rules import sampled_rule

    small = build_small()[0]
    head = make_head(small, seed=3, randomize=True, target_layer_ids=[0, 2], markov_rank=4).eval()
    prompt = torch.tensor([[1, 3, 0, 2, 5, 4, 1]])
    exact = exact_first_tokens(small, prompt[0], 3, temperature=1.0)
    counts = torch.zeros(V_SMALL ** 3, dtype=torch.long)
    first_steps = []
    for seed in range(300):
        rule = sampled_rule("leviathan", small.device, 1.0, 1.0, 0, seed)
        res = run_loop(small, SampledDSparkProposer(head, small), prompt, 5, rule, ChainShape(3))[0]
        counts[flat_index(torch.tensor([res.tokens[:3]]), V_SMALL)] += 1
        first_steps.append((res.step_tokens[0] - 1, res.step_proposed[0]))
    assert chi2_pvalue(counts, exact) > P_MIN
    assert sum(a for a, _ in first_steps) > 30 and sum(a < p for a, p in first_steps) > 30  # both branches


def test_trees_are_refused(target):
    from specheads.verify.registry import make_proposer
    from specheads.verify.settings import TreeSpec
    from specheads.verify.trees import SettingsError

    head = make_head(target)
    with pytest.raises(SettingsError, match="one chain"):
        make_proposer(TreeSpec("static", choices=((0,), (1,))), head, target)


# --- exports (export/dspark.py) ------------------------------------------------------------------
FINGERPRINT = {"name": "random-llama", "vocab_size": 96, "hidden_size": 32}


def checkpoint(tmp_path, head, step: int = 3):
    from specheads.export.checkpoint import save_checkpoint

    return save_checkpoint(tmp_path / "run", step, head.float(), {"target": {"path": "random-llama"}},
                           {"target": FINGERPRINT}, {"num_samples": 1})


@pytest.mark.parametrize("fmt,from_anchor", [(f, False) for f in ("vllm", "vllm-native", "sglang")]
                         + [(f, True) for f in ("vllm", "sglang")])
def test_export_writes_what_the_engines_read_and_loads_back_exactly(tmp_path, target, fmt, from_anchor):
    from safetensors import safe_open

    from specheads.export import export, load_with_meta
    from specheads.verify.dspark_proposers import DSparkProposer

    head = make_head(target, randomize=True, target_layer_ids=[1, 3, 5], sample_from_anchor=from_anchor)
    assert head.config.dflash.block_size == (3 if from_anchor else 4)  # query slots
    out = export(checkpoint(tmp_path, head), fmt, tmp_path / fmt)
    cfg = json.loads((out / "config.json").read_text())
    for key, value in {"architectures": ["Qwen3DSparkModel"], "block_size": 3, "mask_token_id": 95,
                       "markov_rank": 8, "markov_head_type": "vanilla", "enable_confidence_head": True,
                       "confidence_head_with_markov": True, "sample_from_anchor": from_anchor}.items():
        assert cfg[key] == value, key
    if fmt == "vllm":
        assert "model_type" not in cfg and cfg["speculators_model_type"] == "dspark"
        assert cfg["aux_hidden_state_layer_ids"] == [2, 4, 6]  # DFlash id + 1
        assert cfg["transformer_layer_config"]["is_causal"] is False and "sliding_window_non_causal" not in cfg
        assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    else:
        assert cfg["model_type"] == "qwen3" and cfg["target_layer_ids"] == [1, 3, 5]
        assert cfg["dflash_config"]["target_layer_ids"] == [1, 3, 5] and cfg["dflash_config"]["block_size"] == 3
        assert cfg["dflash_config"]["sample_from_anchor"] is from_anchor and cfg["logit_scale"] == 1.0
    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        dtypes = {n: fh.get_slice(n).get_dtype() for n in fh.keys()}  # noqa: SIM118 - a safe_open handle, not a dict
    assert dtypes["confidence_head.proj.weight"] == dtypes["confidence_head.proj.bias"] == "F32"
    assert {"fc.weight", "markov_head.markov_w1.weight", "markov_head.markov_w2.weight"} <= set(dtypes)
    assert not any(n.startswith(("dflash.", "lm_head", "embed_tokens", "d2t")) for n in dtypes)
    readme = (out / "README.md").read_text()
    assert ("--speculative-algorithm DSPARK" in readme) if fmt == "sglang" else ('"method":"dspark"' in readme)
    loaded, meta = load_with_meta(out)
    assert meta.kind == "dspark" and loaded.config == head.config
    for (n, a), b in zip(loaded.state_dict().items(), head.float().state_dict().values()):
        assert torch.equal(a, b), n
    prompt = torch.randint(0, 95, (7,), generator=torch.Generator().manual_seed(5))
    loaded = loaded.to(target.dtype)
    assert greedy(target, DSparkProposer(loaded, target), prompt, 20, 3).tokens == greedy(target, None, prompt, 20, 0).tokens


def test_bfloat16_export_keeps_the_confidence_head_in_float32(tmp_path, target):
    from safetensors import safe_open

    from specheads.export import export

    out = export(checkpoint(tmp_path, make_head(target)), "vllm-native", tmp_path / "bf16", dtype="bfloat16")
    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        dtypes = {n: fh.get_slice(n).get_dtype() for n in fh.keys()}  # noqa: SIM118 - a safe_open handle, not a dict
    assert {d for n, d in dtypes.items() if n.startswith("confidence_head.")} == {"F32"}
    assert {d for n, d in dtypes.items() if not n.startswith("confidence_head.")} == {"BF16"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_refusals_name_the_engine(tmp_path, target):
    from specheads.export import ExportRefused, export, load_with_meta
    from specheads.heads.vocab import build_vocab_map

    gated = checkpoint(tmp_path / "g", make_head(target, markov_head_type="gated"))
    for fmt in ("vllm", "vllm-native"):
        with pytest.raises(ExportRefused, match="vLLM 0.33 runs only the vanilla Markov head"):
            export(gated, fmt, tmp_path / fmt)
    assert load_with_meta(export(gated, "sglang", tmp_path / "sglang"))[0].config.markov_head_type == "gated"
    reduced = make_head(target, draft_vocab_size=60)
    reduced.set_vocab_map(*build_vocab_map(torch.arange(96).flip(0), 60))
    ckpt = checkpoint(tmp_path / "r", reduced)
    with pytest.raises(ExportRefused, match="SGLang 0.5.23 skips a DSpark draft's lm_head"):
        export(ckpt, "sglang", tmp_path / "rs")
    loaded, _ = load_with_meta(export(ckpt, "vllm-native", tmp_path / "rn"))
    assert torch.equal(loaded.dflash.d2t, reduced.dflash.d2t)
    with pytest.raises(ValueError, match="use at most 3"):
        export(ckpt, "vllm", tmp_path / "k", num_speculative_tokens=4)


def test_llama_cpp_refuses_a_confidence_head_without_the_markov_embedding(tmp_path, target):
    """llama.cpp builds conf_proj [n_embd + markov_rank, 1] whatever the config says: the real export of a
    head whose confidence head reads h alone is refused by name before any conversion; with the Markov
    embedding (the engine-check example) the same export passes."""
    from specheads.export import export
    from specheads.export import llamacpp_tool as lc

    plain = export(checkpoint(tmp_path / "p", make_head(target, confidence_head_with_markov=False)), "vllm-native",
                   tmp_path / "plain")
    with pytest.raises(lc.RefusedExport, match=r"config.json: a confidence head without the Markov embedding .* "
                       r"\[n_embd \+ markov_rank, 1\] .* head.confidence_head_with_markov: true"):
        lc.draft_spec(plain)
    assert lc.draft_spec(export(checkpoint(tmp_path / "m", make_head(target)), "vllm-native", tmp_path / "with"))[0] \
        == "draft-dspark"


def _edit(folder, config=None, tensors=None):
    from safetensors.torch import load_file, save_file

    cfg, weights = json.loads((folder / "config.json").read_text()), load_file(str(folder / "model.safetensors"))
    if config:
        config(cfg)
    if tensors:
        tensors(weights)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(weights, str(folder / "model.safetensors"))


@pytest.mark.parametrize("fmt,config,tensors,needle", [
    ("vllm-native", lambda c: c.update(sample_from_anchor=True), None, "sample_from_anchor"),
    ("sglang", lambda c: c.pop("markov_head_type"), None, "markov_head_type"),
    ("vllm-native", lambda c: c.update(markov_head_type="rnn"), None, "vanilla"),
    ("vllm", lambda c: c["transformer_layer_config"].pop("is_causal"), None, "is_causal"),
    ("vllm", lambda c: c.update(speculators_model_type="dflash"), None, "speculators_model_type"),
    ("sglang", lambda c: c["dflash_config"].update(block_size=4), None, "dflash_config.block_size"),
    ("sglang", lambda c: c.update(markov_rank=4), None, "markov_head.markov_w1.weight: expected shape [96, 4]"),
    ("vllm-native", None, lambda w: w.update({"confidence_head.proj.weight": w["confidence_head.proj.weight"].half()}),
     "confidence_head.proj.weight: expected dtype F32"),
    ("sglang", None, lambda w: w.pop("confidence_head.proj.bias"), "confidence_head.proj.bias: expected the tensor"),
    ("sglang", None, lambda w: w.update({"markov_head.gate_proj.weight": torch.zeros(8, 40)}), "unexpected markov"),
    ("vllm", None, lambda w: w.update({"dflash.norm.weight": w.pop("norm.weight")}), "norm.weight"),
])
def test_contract_rules_break(tmp_path, target, fmt, config, tensors, needle):
    from specheads.export import ContractError, export
    from specheads.export import dspark as dspark_export

    out = export(checkpoint(tmp_path, make_head(target)), fmt, tmp_path / fmt)
    dspark_export.validate(out, fmt)
    _edit(out, config, tensors)
    with pytest.raises(ContractError, match="violation") as err:
        dspark_export.validate(out, fmt)
    assert needle in str(err.value)


def fit(head, target, ids: torch.Tensor, steps: int, lr: float = 1e-2) -> None:
    """`steps` AdamW steps of the head on one batch of ids [B, T], every token supervised."""
    batch = batch_of(ids)
    inputs = head.expand(target, head.collect(target, batch), batch)
    opt = torch.optim.AdamW(head.parameters(), lr=lr)
    head.train()
    for _ in range(steps):
        opt.zero_grad()
        head(**inputs).loss.backward()
        opt.step()
    head.eval()


@pytest.mark.parametrize("from_anchor", [False, True])
def test_trained_export_loads_and_decodes_losslessly(tmp_path, target, from_anchor):
    """Train on the target's own greedy continuation, export, load back: greedy speculation from the
    folder equals plain greedy decoding and accepts more than one token per forward (either layout)."""
    from specheads.export import export, load_with_meta
    from specheads.verify.dspark_proposers import DSparkProposer

    head = make_head(target, seed=6, num_anchors=64, sample_from_anchor=from_anchor)
    prompt = torch.randint(0, 95, (5,), generator=torch.Generator().manual_seed(0))
    ids = torch.cat([prompt, torch.tensor(greedy(target, None, prompt, 40, 0).tokens)])[None]
    fit(head, target, ids, steps=150)
    loaded, _ = load_with_meta(export(checkpoint(tmp_path, head.eval()), "sglang", tmp_path / "s"))
    res = greedy(target, DSparkProposer(loaded.to(target.dtype), target), prompt, 30, 3)
    assert res.tokens == greedy(target, None, prompt, 30, 0).tokens
    assert res.stats.decode_tokens > 1.5 * res.stats.decode_forwards


# --- speculators' own checkpoints (export/foreign.py) ----------------------------------------------
def as_speculators_trainer_writes_it(folder):
    """Our speculators-format export rewritten the way speculators 0.9.0's trainer saves a DSpark
    checkpoint (seen on its CPU run in bench/anchors.py): no specheads.json, its architecture name,
    block_size counting the query slots (speculative_tokens = block_size - 1 without sample_from_anchor,
    block_size with it),
    sliding-window layers with in-block causality as sliding_window_non_causal, and its optimizer
    state beside."""
    (folder / "specheads.json").unlink()
    cfg = json.loads((folder / "config.json").read_text())
    layer = dict(cfg["transformer_layer_config"])
    causal = layer.pop("is_causal")
    layer.update(layer_types=["sliding_attention"] * layer["num_hidden_layers"], sliding_window=2048,
                 use_sliding_window=True)  # its trainer's layers: causal in the block unless non-causal is set
    cfg.update(architectures=["DSparkDraftModel"], block_size=cfg["block_size"] + (not cfg["sample_from_anchor"]),
               sliding_window_non_causal=not causal, transformer_layer_config=layer)
    (folder / "config.json").write_text(json.dumps(cfg))
    torch.save({}, folder / "optimizer_state_dict.pt")
    return cfg


@pytest.mark.parametrize("causal,from_anchor", [(False, False), (True, False), (False, True)])
def test_speculators_trainer_checkpoint_loads_as_the_same_head(tmp_path, target, causal, from_anchor):
    from specheads.export import export, load_with_meta
    from specheads.export.foreign import ForeignDraftError
    from specheads.verify.dspark_proposers import DSparkProposer

    head = make_head(target, randomize=True, target_layer_ids=[1, 3, 5], causal=causal, sample_from_anchor=from_anchor)
    folder = export(checkpoint(tmp_path, head), "vllm", tmp_path / "theirs")
    cfg = as_speculators_trainer_writes_it(folder)
    assert cfg["block_size"] == (3 if from_anchor else 4)
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    loaded, meta = load_with_meta(folder, num_target_layers=target.num_layers)
    assert meta.kind == "dspark" and meta.record == {} and meta.num_speculative_tokens == 3
    assert loaded.config.block_size == 3 and loaded.config.dflash.causal is causal
    assert loaded.config.sample_from_anchor is from_anchor
    assert loaded.config.dflash.target_layer_ids == [1, 3, 5] and loaded.config.dflash.num_target_layers == 8
    for (n, a), b in zip(loaded.state_dict().items(), head.float().state_dict().values()):
        assert torch.equal(a, b), n
    prompt = torch.randint(0, 95, (7,), generator=torch.Generator().manual_seed(5))
    res = greedy(target, DSparkProposer(loaded.to(target.dtype), target), prompt, 20, 3)
    assert res.tokens == greedy(target, None, prompt, 20, 0).tokens
    cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 4  # more than the block drafts
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ForeignDraftError, match="speculative_tokens 4 but block_size .* drafts 3"):
        load_with_meta(folder)
