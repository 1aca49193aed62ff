"""P-EAGLE (EAGLE-3 with `parallel_drafting`): training rows equal the one-forward proposer,
learning, lossless greedy and sampled decoding, exports (vLLM yes, SGLang refused) and rules."""

from __future__ import annotations

import json

import pytest
import torch
from random_models import make_target

from specheads.heads.eagle3 import Eagle3Head, Eagle3Options
from specheads.heads.peagle import depth_anchors, parallel_mask, parallel_rows
from specheads.verify.eagle3_proposers import Eagle3Proposer
from specheads.verify.loop import decode, greedy_decode
from specheads.verify.peagle_proposers import PEagleProposer, SampledPEagleProposer

FINGERPRINT = {"name": "random-llama", "vocab_size": 96, "hidden_size": 32}


@pytest.fixture(scope="module")
def target():
    return make_target()


def random_head(target, seed: int = 3, **opts) -> Eagle3Head:
    torch.manual_seed(seed)
    options = Eagle3Options(**{"ttt_steps": 3, "draft_vocab_size": 96, "parallel_drafting": True, **opts})
    head = Eagle3Head.for_target(options, target.config)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.3)
    return head.to(target.dtype).eval()


def batch_of(ids):
    ones = torch.ones_like(ids)
    return {"input_ids": ids, "attention_mask": ones, "loss_mask": ones}


def test_layout_and_mask_golden(target):
    head = random_head(target)
    assert tuple(head.state_dict()["mask_hidden"].shape) == (3 * 32,)  # n_aux * H, fed through fc
    assert head.config.mask_token_id == 95
    assert "mask_hidden" not in Eagle3Head.for_target(Eagle3Options(), target.config).state_dict()
    anchor, depth = torch.tensor([0, 1, 2, 1, 1]), torch.tensor([0, 0, 0, 1, 2])
    allow = parallel_mask(anchor, depth, torch.ones(1, 3, dtype=torch.bool), torch.float32)[0, 0] == 0
    assert allow.int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 0, 1, 0],  # depth 1 of anchor 1: real rows 0..1 and itself
        [1, 1, 0, 1, 1],  # depth 2: its chain's depths 1..2
    ]
    sets = depth_anchors(100, 4, 0.7, 0.2, True, "cpu")
    assert [s.numel() for s in sets] == [70, 49, 34]
    assert set(sets[2].tolist()) <= set(sets[1].tolist()) <= set(sets[0].tolist())


def test_training_rows_equal_the_parallel_proposer(target):
    """Depth d of anchor i in training == draft d+1 proposed after prefix x_<=i+1 in one forward."""
    head = random_head(target)
    torch.manual_seed(0)
    ids = torch.randint(0, 95, (1, 12))
    batch = batch_of(ids)
    inputs = head.expand(target, head.collect(target, batch), batch)
    T = ids.shape[1]
    sets = depth_anchors(T, 3, 0.7, 0.2, False, "cpu")
    rows = parallel_rows(head, inputs["aux"], inputs["embeds"], inputs["mask_embed"], torch.ones(1, T, dtype=torch.bool), sets)
    out = target.forward(ids, layers=head.required_layers())
    for i in (0, 4, 8):
        proposer = PEagleProposer(Eagle3Proposer(head, target))
        proposer.start(ids[0, : i + 1], int(ids[0, i + 1]), out)
        logits = proposer._draft_logits(3)
        for d in range(3):
            torch.testing.assert_close(logits[d], head.logits(rows[0, d * T + i]), atol=1e-9, rtol=1e-9)


def test_one_batch_overfits(target):
    torch.manual_seed(0)
    head = Eagle3Head.for_target(Eagle3Options(ttt_steps=3, draft_vocab_size=96, parallel_drafting=True),
                                 target.config).double()
    ids = torch.randint(0, 95, (2, 16))
    batch = batch_of(ids)
    inputs = head.expand(target, head.collect(target, batch), batch)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    head.train()
    first = None
    for _ in range(400):
        res = head(**inputs)
        opt.zero_grad()
        res.loss.backward()
        opt.step()
        first = first if first is not None else float(res.loss.detach())
    res = head.eval()(**inputs)
    assert float(res.loss.detach()) < 0.01 * first
    # the random target's distributions are nearly flat (argmax near-ties), so not every row flips
    assert (res.counts["reached"] >= 0.8 * res.counts["rows"]).all()
    assert head.mask_hidden.grad is not None and head.mask_hidden.grad.abs().sum() > 0


def test_greedy_parallel_decoding_equals_plain(target):
    head = random_head(target, draft_vocab_size=64)
    for seed in range(3):
        torch.manual_seed(seed)
        prompt = torch.randint(0, 95, (6,))
        plain = greedy_decode(target, prompt, 24).tokens
        for k in (1, 3, 5):
            assert decode(target, PEagleProposer(Eagle3Proposer(head, target)), prompt, 24, k=k).tokens == plain


@pytest.mark.parametrize("warping", [{"temperature": 1.0}, {"temperature": 1.0, "top_p": 0.9}])
def test_sampled_parallel_decoding_keeps_the_target_distribution(warping):
    from test_sampling import P_MIN, V_SMALL, build_small, chi2_pvalue, exact_first_tokens, flat_index

    from specheads.verify.loop import decode

    target = build_small()[0]
    torch.manual_seed(2)
    head = Eagle3Head.for_target(Eagle3Options(ttt_steps=3, draft_vocab_size=5, aux_layers=[1, 2, 3],
                                               parallel_drafting=True), target.config).double().eval()
    with torch.no_grad():
        head.lm_head.weight.mul_(4.0)
    prompt = torch.tensor([1, 3, 0, 2, 5, 4, 1])
    exact = exact_first_tokens(target, prompt, 3, **warping)
    counts = torch.zeros(V_SMALL ** 3, dtype=torch.long)
    accepted = rejected = 0
    for seed in range(300):
        proposer = SampledPEagleProposer(Eagle3Proposer(head, target))
        res = decode(target, proposer, prompt, 5, k=3, seed=seed, **warping, rule="exact")
        counts[flat_index(torch.tensor([res.tokens[:3]]), V_SMALL)] += 1
        first = res.step_tokens[0] - 1
        accepted += first
        rejected += first < res.step_proposed[0]
    assert chi2_pvalue(counts, exact) > P_MIN
    assert accepted > 30 and rejected > 30


# --- exports -----------------------------------------------------------------------------------
def checkpoint(tmp_path, head):
    from specheads.export.checkpoint import save_checkpoint

    return save_checkpoint(tmp_path / "run", 3, head.float(), {"target": {"path": "random-llama"}},
                           {"target": FINGERPRINT}, {"num_samples": 1})


@pytest.mark.parametrize("fmt", ["vllm", "vllm-native"])
def test_export_round_trip_decodes_losslessly(tmp_path, target, fmt):
    from safetensors.torch import load_file

    from specheads.export import export, load_with_meta

    head = random_head(target, draft_vocab_size=64)
    out = export(checkpoint(tmp_path, head), fmt, tmp_path / fmt)
    cfg = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    assert tuple(tensors["mask_hidden"].shape) == (96,)
    if fmt == "vllm":
        assert cfg["speculators_model_type"] == "peagle" and cfg["mask_token_id"] == 95
    else:
        assert cfg["parallel_drafting"] is True and cfg["mask_token_id"] == 95
    assert '"parallel_drafting":true' in (out / "README.md").read_text()
    loaded, meta = load_with_meta(out)
    assert loaded.config.parallel_drafting and loaded.config.mask_token_id == 95
    assert torch.equal(loaded.mask_hidden, head.float().mask_hidden)
    loaded = loaded.to(target.dtype)
    prompt = torch.tensor([5, 1, 4, 1, 5, 9, 2])
    from specheads.verify.registry import make_proposer
    from specheads.verify.settings import TreeSpec

    proposer = make_proposer(TreeSpec("chain", k=3), loaded, target)
    assert isinstance(proposer, PEagleProposer)
    assert decode(target, proposer, prompt, 20, k=3).tokens == greedy_decode(target, prompt, 20).tokens


def test_sglang_is_refused_and_trees_too(tmp_path, target):
    from specheads.export import ExportRefused, export
    from specheads.verify.registry import make_proposer
    from specheads.verify.settings import TreeSpec
    from specheads.verify.trees import SettingsError

    with pytest.raises(ExportRefused, match="SGLang 0.5.23 has no P-EAGLE loader"):
        export(checkpoint(tmp_path, random_head(target)), "sglang", tmp_path / "s")
    assert not (tmp_path / "s").exists()
    with pytest.raises(SettingsError, match="use --tree chain"):
        make_proposer(TreeSpec("eagle2", depth=2, top_k=2, total_tokens=6), random_head(target), target)


def _break(folder, what):
    from safetensors.torch import load_file, save_file

    cfg_path, wfile = folder / "config.json", folder / "model.safetensors"
    cfg, tensors = json.loads(cfg_path.read_text()), load_file(str(wfile))
    if what == "no_mask_hidden":
        tensors.pop("mask_hidden")
    elif what == "mask_hidden_shape":
        tensors["mask_hidden"] = tensors["mask_hidden"][:32].contiguous()
    elif what == "no_mask_token":
        cfg.pop("mask_token_id")
    elif what == "mask_outside":
        cfg["mask_token_id"] = 96
    elif what == "spec_type":
        cfg["speculators_model_type"] = "eagle3"
    elif what == "not_parallel":
        cfg["parallel_drafting"] = False
    cfg_path.write_text(json.dumps(cfg))
    save_file(tensors, str(wfile))


@pytest.mark.parametrize("fmt,what,needle", [
    ("vllm-native", "no_mask_hidden", "mask_hidden: expected the tensor"),
    ("vllm", "mask_hidden_shape", "mask_hidden: expected shape [96]"),
    ("vllm-native", "no_mask_token", "mask_token_id"),
    ("vllm", "no_mask_token", "mask_token_id"),
    ("vllm-native", "mask_outside", "< vocab_size 96"),
    ("vllm", "spec_type", "parallel_drafting"),
    ("vllm-native", "not_parallel", "parallel_drafting"),
])
def test_contract_rules_break(tmp_path, target, fmt, what, needle):
    from specheads.export import ContractError, export, validate

    out = export(checkpoint(tmp_path, random_head(target)), fmt, tmp_path / fmt)
    validate(out, fmt, "eagle3")
    _break(out, what)
    with pytest.raises(ContractError, match="violation") as err:
        validate(out, fmt, "eagle3")
    assert needle in str(err.value)


def test_sequential_export_rejects_a_stray_mask_hidden(tmp_path, target):
    """A mask_hidden in a sequential EAGLE-3 export is ignored by vLLM with a warning: refused."""
    from safetensors.torch import load_file, save_file

    from specheads.export import ContractError, export, validate

    torch.manual_seed(0)
    head = Eagle3Head.for_target(Eagle3Options(ttt_steps=3, draft_vocab_size=64), target.config)
    out = export(checkpoint(tmp_path, head), "vllm", tmp_path / "v")
    tensors = load_file(str(out / "model.safetensors"))
    tensors["mask_hidden"] = torch.zeros(96)
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ContractError, match="mask_hidden"):
        validate(out, "vllm", "eagle3")


def test_recipe_refuses_parallel_drafting_with_sglang():
    from specheads.config import recipe_from_dict
    from specheads.train import TrainError, check_export_compat

    recipe = recipe_from_dict({"head": {"kind": "eagle3", "parallel_drafting": True},
                               "export": {"formats": ["vllm", "sglang"]}})
    with pytest.raises(TrainError, match="no P-EAGLE loader"):
        check_export_compat(recipe)
    check_export_compat(recipe_from_dict({"head": {"kind": "eagle3", "parallel_drafting": True},
                                          "export": {"formats": ["vllm", "vllm-native"]}}))
