"""Training options as recipe fields: the optimizer (AdamW | Muon), the per-step loss (KL | TV | NLA |
LK), feature noise and draft-layer dropout. Each changes the update exactly as documented, and each
off (the defaults) leaves training bit-identical to before."""

from __future__ import annotations

import copy

import pytest
import torch
from random_models import overfit
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from specheads.bounds import ConfigError
from specheads.config import recipe_from_dict
from specheads.heads.eagle3 import Eagle3Head, Eagle3Options
from specheads.heads.losses import LOSSES, acceptance, add_feature_noise, forward_kl, total_variation
from specheads.heads.vocab import build_vocab_map
from specheads.metrics import ttt_summary
from specheads.optim import MuonAdamW, build_optimizer, muon_split
from specheads.target import Target


class _Tok:
    def get_vocab(self):
        return {f"t{i}": i for i in range(97)}


def batch(**options):
    """A tiny target, an EAGLE-3 head with `options`, and one batch of its training inputs."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    target = Target(LlamaForCausalLM(cfg), _Tok(), "tiny")
    head = Eagle3Head.for_target(Eagle3Options(ttt_steps=3, draft_vocab_size=50, **options), cfg)
    ids = torch.randint(0, 97, (2, 12))
    out = target.forward(ids, layers=head.required_layers())
    aux = torch.cat([out.hidden[i] for i in head.required_layers()], -1)
    head.set_vocab_map(*build_vocab_map(torch.bincount(ids.flatten(), minlength=97), 50))
    mask = torch.ones_like(ids)
    return head, dict(aux=aux, embeds=target.embed(ids), target_logits=out.logits, loss_mask=mask,
                      attention_mask=mask)


# --- the optimizer ---------------------------------------------------------------------------
class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 4)
        self.norm = LlamaRMSNorm(4)
        self.lm_head = nn.Linear(4, 5, bias=False)


def one_step(optimizer_of, seed=0):
    """A Tiny module after one step of `optimizer_of(module)` on a fixed gradient; (before, after) states."""
    torch.manual_seed(seed)
    m = Tiny()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    opt = optimizer_of(m)
    g = torch.Generator().manual_seed(1)
    for p in m.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    m.proj.weight.grad = torch.diag(torch.tensor([10.0, 1.0, 0.1, 0.01])) @ torch.randn(4, 6, generator=g)
    opt.step()
    return before, {n: p.detach().clone() for n, p in m.named_parameters()}


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    assert muon_split(Tiny()) == (["proj.weight"], [], ["proj.bias", "norm.weight", "lm_head.weight"])
    head, _ = batch()
    muon, muon32, adamw = muon_split(head)
    assert muon32 == []
    assert set(muon) == {"fc.weight", *(f"layers.0.{m}.weight" for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))}
    assert "lm_head.weight" in adamw and all(n.endswith("norm.weight") for n in adamw if n != "lm_head.weight")


def test_muon_runs_dspark_markov_factors_in_float32_and_leaves_vectors_to_adamw():
    """DSpark's Markov factors ([V, r], vocabulary-wide) are Muon's in float32; its confidence projection
    is a [1, H + r] vector (AdamW's); its DFlash layers' matrices are torch Muon's."""
    from random_models import make_target

    from specheads.heads.dspark import DSparkHead, DSparkOptions

    options = DSparkOptions(num_layers=1, block_size=3, markov_rank=8, enable_confidence_head=True,
                            confidence_head_with_markov=True)
    muon, muon32, adamw = muon_split(DSparkHead.for_target(options, make_target().config))
    assert muon32 == ["markov_head.markov_w1.weight", "markov_head.markov_w2.weight"]
    assert "confidence_head.proj.weight" in adamw
    assert "dflash.fc.weight" in muon and "dflash.layers.0.self_attn.q_proj.weight" in muon
    assert not any(n.startswith(("markov_head", "confidence_head")) for n in muon)


def test_float32_muon_is_torch_muons_update_without_bfloat16():
    """Float32Muon's step equals torch.optim.Muon's (same momentum, Newton-Schulz polynomial, decay and
    step size) up to torch's bfloat16 rounding, on a wide vocabulary-factor shape; a second step carries
    the momentum the same way."""
    from specheads.optim import Float32Muon, orthogonalise_float32

    g = torch.Generator().manual_seed(3)
    w0 = torch.randn(2000, 8, generator=g)
    grads = [torch.randn(2000, 8, generator=g) * torch.logspace(0, -2, 8) for _ in range(2)]
    ours, theirs = nn.Parameter(w0.clone()), nn.Parameter(w0.clone())
    opts = (Float32Muon([ours], lr=0.01, weight_decay=0.1),
            torch.optim.Muon([theirs], lr=0.01, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"))
    for grad in grads:
        for p, opt in zip((ours, theirs), opts):
            p.grad = grad.clone()
            opt.step()
        step_ours, step_theirs = ours.detach() - w0, theirs.detach() - w0
        assert torch.nn.functional.cosine_similarity(step_ours.flatten(), step_theirs.flatten(), 0) > 0.999
        assert (step_ours - step_theirs).norm() < 0.02 * step_theirs.norm()
    s = torch.linalg.svdvals(orthogonalise_float32(grads[0]))  # the gradient's spread is two decades
    assert s.min() / s.max() > 0.5 and orthogonalise_float32(grads[0]).dtype == torch.float32


def test_muon_differs_from_adamw_on_a_matrix_and_equals_it_elsewhere():
    lr, wd = 0.01, 0.05
    b0, muon = one_step(lambda m: build_optimizer(m, "muon", lr, wd))
    _, adamw = one_step(lambda m: build_optimizer(m, "adamw", lr, wd))
    for name in ("proj.bias", "norm.weight", "lm_head.weight"):
        assert torch.equal(muon[name], adamw[name]), name
    assert not torch.allclose(muon["proj.weight"], adamw["proj.weight"])
    # Muon's step is the orthogonalised gradient: its singular values are close to one another although
    # the gradient's span three decades (decoupled weight decay removed first)
    delta = muon["proj.weight"] - b0["proj.weight"] * (1 - lr * wd)
    s = torch.linalg.svdvals(delta)
    assert s.min() / s.max() > 0.5
    # scaled to AdamW's RMS (match_rms_adamw): lr * 0.2 * sqrt(max(rows, cols)) per unit singular value
    assert 0.5 < float(s.max() / (lr * 0.2 * 6 ** 0.5)) < 1.5


def test_muon_state_round_trips_and_one_schedule_drives_both():
    torch.manual_seed(0)
    m = Tiny()
    opt = build_optimizer(m, "muon", 0.01, 0.0)
    assert isinstance(opt, MuonAdamW)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    sched.step()
    assert set(opt.inner) == {"muon", "adamw"}
    assert opt.inner["muon"].param_groups[0]["lr"] == opt.inner["adamw"].param_groups[0]["lr"] == 0.005
    twin = Tiny()
    twin.load_state_dict(m.state_dict())
    opt2 = build_optimizer(twin, "muon", 0.01, 0.0)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))  # as from a file: no tensor shared
    for mod, o in ((m, opt), (twin, opt2)):
        for p in mod.parameters():
            p.grad = torch.full_like(p, 0.3)
        o.step()
    for (n, a), b in zip(m.named_parameters(), twin.parameters()):
        assert torch.equal(a, b), n
    with pytest.raises(ValueError, match=r"holds the groups \['adamw'\], but this head's Muon optimizer has "
                                         r"\['adamw', 'muon'\]: .* without resuming"):
        opt2.load_state_dict({"adamw": opt.state_dict()["adamw"]})


# --- the losses -------------------------------------------------------------------------------
def test_tv_value_and_gradient_by_hand():
    """q = softmax(0) = 1/3 each, p = (.5, .3, .2): TV = 1/6; dTV/dq = sign(q - p)/2 = (-1, 1, 1)/2,
    through the softmax dTV/dz_i = q_i (g_i - sum_j q_j g_j) = (-2/9, 1/9, 1/9)."""
    z = torch.zeros(1, 3, requires_grad=True)
    p = torch.tensor([[0.5, 0.3, 0.2]])
    loss = total_variation(z, p)
    loss.backward()
    assert loss.item() == pytest.approx(1 / 6, abs=1e-7)
    torch.testing.assert_close(z.grad, torch.tensor([[-2 / 9, 1 / 9, 1 / 9]]))


def test_nla_gradient_is_tv_scaled_by_one_over_alpha():
    torch.manual_seed(0)
    z = torch.randn(4, 7)
    p = torch.softmax(torch.randn(4, 7), -1)
    grads = {}
    for name in ("tv", "nla"):
        zz = z.clone().requires_grad_(True)
        LOSSES[name](zz[:1], p[:1]).backward()
        grads[name] = zz.grad[:1]
    alpha = acceptance(z[:1], p[:1])
    torch.testing.assert_close(grads["nla"], grads["tv"] / alpha[:, None])


def test_lk_mixes_kl_and_acceptance_with_a_stopped_weight():
    torch.manual_seed(0)
    z = torch.randn(1, 5, requires_grad=True)
    p = torch.softmax(torch.randn(1, 5), -1)
    alpha = acceptance(z, p)
    lam = torch.exp(-3.0 * alpha.detach())
    want = lam * forward_kl(z, p) + (1 - lam) * (1 - alpha)
    got = LOSSES["lk"](z, p)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    (g_got,) = torch.autograd.grad(got, z)
    (g_want,) = torch.autograd.grad(want.sum(), z)  # lambda is a constant: no gradient through it
    torch.testing.assert_close(g_got, g_want)


def test_every_loss_is_zero_at_a_match_and_keeps_the_graph_without_rows():
    p = torch.softmax(torch.randn(3, 6), -1)
    for name, fn in LOSSES.items():
        assert fn(p.log(), p).item() == pytest.approx(0.0, abs=1e-6), name
        empty = torch.zeros(0, 6, requires_grad=True)
        out = fn(empty, torch.zeros(0, 6))
        out.backward()
        assert out.item() == 0.0 and empty.grad is not None, name


# --- noise and dropout ---------------------------------------------------------------------------
def test_defaults_are_bit_identical_to_before_and_draw_no_randomness():
    """The loss of the default head on this batch, as the code before these options computed it."""
    head, inputs = batch()
    rng = torch.get_rng_state()
    res = head(**inputs)
    assert torch.equal(torch.get_rng_state(), rng)  # no noise, no dropout drawn
    assert res.loss.item() == pytest.approx(0.34932348132133484, rel=1e-6)
    explicit, _ = batch(loss="kl", feature_noise="uniform", feature_noise_scale=0.0, dropout=0.0)
    torch.manual_seed(5)
    assert torch.equal(explicit(**inputs).loss, res.loss)  # U(-0, 0) noise adds exactly zero


def test_noise_is_bounded_and_only_in_training():
    x = torch.zeros(2000, 8)
    torch.manual_seed(0)
    u = add_feature_noise(x, "uniform", 0.1)
    g = add_feature_noise(x, "gaussian", 0.1)
    assert u.abs().max() <= 0.1 and u.abs().max() > 0.09
    assert g.std().item() == pytest.approx(0.1, rel=0.05)
    assert add_feature_noise(x, "none", 0.1) is x
    head, inputs = batch(feature_noise="gaussian", feature_noise_scale=0.5)
    plain, _ = batch()
    assert head(**inputs).loss.item() != plain(**inputs).loss.item()
    head.eval()
    plain.eval()
    torch.testing.assert_close(head(**inputs).loss, plain(**inputs).loss, rtol=0, atol=0)


def test_dropout_acts_in_training_only():
    head, inputs = batch(dropout=0.3)
    plain, _ = batch()
    plain.load_state_dict(head.state_dict())
    torch.manual_seed(0)
    assert head(**inputs).loss.item() != plain(**inputs).loss.item()
    head.eval()
    plain.eval()
    assert torch.equal(head(**inputs).loss, plain(**inputs).loss)


# --- each option still learns ----------------------------------------------------------------------
@pytest.mark.parametrize("options, optimizer", [
    ({"loss": "tv"}, "adamw"), ({"loss": "nla"}, "adamw"), ({"loss": "lk"}, "adamw"),
    ({"feature_noise": "uniform", "feature_noise_scale": 0.05}, "adamw"), ({"dropout": 0.1}, "adamw"),
    ({}, "muon"), ({"parallel_drafting": True, "loss": "tv"}, "muon"), ({"init_lm_head": True}, "adamw"),
])
def test_each_option_overfits_one_batch(options, optimizer):
    head, inputs = batch(**options)
    if options.get("parallel_drafting"):
        inputs["mask_embed"] = torch.zeros(32)
    opt = build_optimizer(head, optimizer, 3e-3, 0.0)
    first, _ = overfit(head, inputs, opt)
    head.eval()
    res = head(**inputs)
    assert res.loss.item() < 0.5 * first
    summary = ttt_summary(*[res.counts[k].tolist() for k in ("rows", "reached", "cond_rows")])
    assert summary["acc_uncond"][0] > (0.3 if options.get("parallel_drafting") else 0.5)  # P-EAGLE: 0.4-0.5 measured here


def test_init_lm_head_starts_on_the_target_rows_of_the_draft_vocabulary():
    """build_head's order (init_from_target, then the vocab map) leaves lm_head = the target's rows of
    the draft vocabulary in draft-id order and norm = the target's final norm; off, neither is copied."""
    from specheads.train import build_head

    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    target = Target(LlamaForCausalLM(cfg), _Tok(), "tiny")
    with torch.no_grad():
        target.final_norm.weight.uniform_(0.5, 1.5)
    samples = [type("S", (), {"input_ids": list(range(0, 97, 2)) * 3 + [5], "loss_mask": [1] * 148})()]
    heads = {}
    for on in (True, False):
        recipe = recipe_from_dict({"head": {"kind": "eagle3", "ttt_steps": 2, "draft_vocab_size": 50,
                                            "init_lm_head": on}})
        heads[on] = build_head(recipe, target, samples)
    d2t, t2d = build_vocab_map(torch.bincount(torch.tensor(samples[0].input_ids), minlength=97), 50)
    assert torch.equal(heads[True].d2t, d2t)
    draft_rows = torch.arange(50) + d2t  # [Vd] target ids
    assert torch.equal(heads[True].lm_head.weight, target.lm_head.weight[draft_rows])
    assert torch.equal(heads[True].norm.weight, target.final_norm.weight)
    assert not torch.equal(heads[False].lm_head.weight, target.lm_head.weight[draft_rows])
    assert torch.equal(heads[False].norm.weight, torch.ones(32))
    assert heads[True].config.init_lm_head and not heads[False].config.init_lm_head


def test_freeze_lm_head_keeps_the_target_rows_and_the_rest_learns():
    """freeze_lm_head: after training steps lm_head and the final norm are still the target's rows
    (the optimizer never sees them), while fc and the layer move; without init_lm_head it is refused."""
    from specheads.train import build_head

    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    target = Target(LlamaForCausalLM(cfg), _Tok(), "tiny")
    ids = list(range(0, 97, 2)) * 3 + [5]
    samples = [type("S", (), {"input_ids": ids, "loss_mask": [1] * len(ids)})()]
    recipe = recipe_from_dict({"head": {"kind": "eagle3", "ttt_steps": 2, "draft_vocab_size": 50,
                                        "init_lm_head": True, "freeze_lm_head": True}})
    head = build_head(recipe, target, samples)
    lm_head, norm, fc = (head.lm_head.weight.clone(), head.norm.weight.clone(), head.fc.weight.clone())
    opt = build_optimizer(head, "muon", 3e-3, 0.1)  # weight decay would move a tensor it was given
    x = torch.tensor([ids[:40]])
    out = target.forward(x, layers=head.required_layers())
    inputs = dict(aux=torch.cat([out.hidden[i] for i in head.required_layers()], -1), embeds=target.embed(x),
                  target_logits=out.logits, loss_mask=torch.ones_like(x), attention_mask=torch.ones_like(x))
    first, _ = overfit(head, inputs, opt)
    assert head(**inputs).loss.item() < first  # it still learns
    assert torch.equal(head.lm_head.weight, lm_head) and torch.equal(head.norm.weight, norm)
    assert not torch.equal(head.fc.weight, fc)
    with pytest.raises(ConfigError, match=r"head.freeze_lm_head .* set head.init_lm_head=true"):
        recipe_from_dict({"head": {"kind": "eagle3", "freeze_lm_head": True}})


def test_bad_values_name_the_field():
    with pytest.raises(ConfigError, match=r"head.loss 'jsd': expected one of kl, tv, nla, lk"):
        recipe_from_dict({"head": {"kind": "eagle3", "loss": "jsd"}})
    with pytest.raises(ConfigError, match=r"head.feature_noise 'salt': expected one of none, uniform, gaussian"):
        recipe_from_dict({"head": {"kind": "eagle3", "feature_noise": "salt"}})
    with pytest.raises(ConfigError, match=r"train.optimizer 'sgd': expected one of adamw, muon"):
        recipe_from_dict({"train": {"optimizer": "sgd"}})
    with pytest.raises(ConfigError, match=r"head.dropout"):
        recipe_from_dict({"head": {"kind": "eagle3", "dropout": 1.5}})


# --- what the loss supervises (data.supervise) ------------------------------------------------
def test_supervise_all_distils_the_target_on_every_real_token():
    """data.supervise: all puts the user turns and template under the loss (padding never); the
    default keeps the assistant mask; the head then trains on more rows of the same batch."""
    from specheads.data.tokenize import TokenizedSample
    from specheads.train import make_batch

    with pytest.raises(ConfigError, match=r"data.supervise 'prompts': expected one of assistant, all"):
        recipe_from_dict({"data": {"supervise": "prompts"}})
    assert recipe_from_dict({"data": {"supervise": "all"}}).data.supervise == "all"
    samples = [TokenizedSample("a", list(range(3, 15)), [0] * 6 + [1] * 6),
               TokenizedSample("b", list(range(3, 11)), [0] * 5 + [1] * 3)]
    plain, every = (make_batch(samples, [0, 1], 0, "cpu", s) for s in ("assistant", "all"))
    assert plain["loss_mask"][1].tolist() == [0] * 5 + [1] * 3 + [0] * 4
    assert torch.equal(every["loss_mask"], every["attention_mask"]) and every["loss_mask"][1].tolist() == [1] * 8 + [0] * 4
    assert torch.equal(plain["input_ids"], every["input_ids"])
    head, inputs = batch()
    inputs["loss_mask"] = torch.zeros_like(inputs["loss_mask"])
    inputs["loss_mask"][:, 8:] = 1
    part = head(**inputs).counts["rows"].sum()
    inputs["loss_mask"] = inputs["attention_mask"].clone()
    assert head(**inputs).counts["rows"].sum() > part
