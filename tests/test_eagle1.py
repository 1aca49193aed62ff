"""EAGLE-1: training rows match inference, exports for vLLM / SGLang (and refusals), contract rules,
lossless decoding from the exported folder."""

from __future__ import annotations

import json

import pytest
import torch
from random_models import make_target
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from specheads.export import ContractError, ExportRefused, export, load_with_meta
from specheads.export import eagle1 as eagle1_export
from specheads.export.checkpoint import save_checkpoint
from specheads.heads.eagle1 import EagleHead, EagleOptions
from specheads.heads.eagle3 import ttt_attention_mask
from specheads.heads.losses import shift
from specheads.verify.eagle1_proposers import Eagle1Proposer, Eagle1StaticTreeProposer
from specheads.verify.loop import decode, greedy_decode
from specheads.verify.registry import make_proposer
from specheads.verify.settings import TreeSpec

FINGERPRINT = {"name": "random-llama", "vocab_size": 96, "hidden_size": 32}


@pytest.fixture(scope="module")
def target():
    return make_target()


def random_head(target, seed: int = 4, **opts) -> EagleHead:
    torch.manual_seed(seed)
    head = EagleHead.for_target(EagleOptions(**opts), target.config)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
    return head.to(target.dtype).eval()


def checkpoint(tmp_path, head):
    return save_checkpoint(tmp_path / "run", 3, head.float(), {"target": {"path": "random-llama"}},
                           {"target": FINGERPRINT}, {"num_samples": 1})


def test_layout_has_no_input_norm_final_norm_or_lm_head(target):
    names = set(random_head(target).state_dict())
    assert "fc.weight" in names and "fc.bias" not in names
    assert "layers.0.post_attention_layernorm.weight" in names
    assert not any("input_layernorm" in n or n.startswith("norm") or "lm_head" in n for n in names)
    assert "fc.bias" in random_head(target, fc_bias=True).state_dict()


def test_unrolled_rows_equal_step_by_step_inference(target):
    """Row i at training step j == the draft run as at inference after prefix x_<=i."""
    head = random_head(target)
    torch.manual_seed(0)
    ids = torch.randint(0, 96, (1, 10))
    out = target.forward(ids)
    emb, T = target.embed(ids), ids.shape[1]
    with torch.no_grad():
        outs, hidden, cache = [], out.final, DynamicCache()
        for j in range(3):
            mask = ttt_attention_mask(torch.ones(1, T, dtype=torch.bool), j, target.dtype)
            hidden = head.step(hidden, shift(emb, j + 1), torch.arange(T)[None] + j, mask, cache)
            outs.append(hidden)
        for i in (0, 4, 6):
            cache = DynamicCache()
            causal = torch.full((i + 1, i + 1), torch.finfo(target.dtype).min, dtype=target.dtype).triu(1)[None, None]
            y = head.step(out.final[:, : i + 1], emb[:, 1: i + 2], torch.arange(i + 1)[None], causal, cache)
            torch.testing.assert_close(y[0, i], outs[0][0, i])
            h = y[:, i: i + 1]
            for j in (1, 2):
                h = head.step(h, emb[:, i + j + 1: i + j + 2], torch.tensor([[i + j]]), None, cache)
                torch.testing.assert_close(h[0, 0], outs[j][0, i])


def test_loss_golden_and_learning(target):
    t = make_target(dtype=torch.float32)
    head = random_head(t, ttt_steps=2).float().train()
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (2, 12))
    mask = torch.ones_like(ids)
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": mask}
    inputs = head.expand(t, head.collect(t, batch), batch)
    res = head(**inputs)
    # step 0 by hand: regression to f_{i+1} + 0.1 * KL(target || draft) on x_{i+2}
    v = head.step(inputs["final"], shift(inputs["embeds"], 1), torch.arange(12).expand(2, 12),
                  ttt_attention_mask(mask.bool(), 0, torch.float32), DynamicCache())[:, :10]
    f = inputs["final"][:, 1:11]
    p = torch.softmax(f @ t.lm_head.weight.T, -1)
    logq = torch.log_softmax(v @ t.lm_head.weight.T, -1)
    kl = (p * (p.log() - logq)).sum(-1).mean()
    manual = torch.nn.functional.smooth_l1_loss(v, f) + 0.1 * kl
    torch.testing.assert_close(res.step_losses[0], manual, rtol=1e-4, atol=1e-5)
    assert res.counts["rows"].tolist() == [20.0, 18.0]
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    first = res.loss.item()
    for _ in range(40):
        res = head(**inputs)
        opt.zero_grad()
        res.loss.backward()
        opt.step()
    assert res.loss.item() < 0.5 * first


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_export_round_trip(tmp_path, target, fmt):
    head = random_head(target)
    out = export(checkpoint(tmp_path, head), fmt, tmp_path / fmt, num_speculative_tokens=3)
    names = set(load_file(str(out / "model.safetensors")))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == (["LlamaForCausalLM"] if fmt == "vllm" else ["LlamaForCausalLMEagle"])
    assert ("fc.bias" in names) == (fmt == "sglang")  # SGLang requires it: exact zeros
    assert not any("lm_head" in n or n == "norm.weight" or "input_layernorm" in n for n in names)
    if fmt == "sglang":
        assert float(load_file(str(out / "model.safetensors"))["fc.bias"].abs().sum()) == 0
    loaded, meta = load_with_meta(out)
    assert meta.kind == "eagle" and not loaded.config.fc_bias
    for a, b in zip(loaded.state_dict().values(), head.float().state_dict().values()):
        assert torch.equal(a, b)
    readme = (out / "README.md").read_text()
    assert ('"method":"eagle"' in readme) if fmt == "vllm" else ("--speculative-algorithm EAGLE " in readme)


def test_trained_fc_bias_goes_to_sglang_only(tmp_path, target):
    ckpt = checkpoint(tmp_path, random_head(target, fc_bias=True))
    with pytest.raises(ExportRefused, match="drops a trained one silently"):
        export(ckpt, "vllm", tmp_path / "vllm")
    loaded, _ = load_with_meta(export(ckpt, "sglang", tmp_path / "sglang"))
    assert loaded.config.fc_bias
    with pytest.raises(ExportRefused, match="--format vllm"):
        export(ckpt, "vllm-native", tmp_path / "native")


def test_recipe_refuses_fc_bias_with_vllm():
    from specheads.config import recipe_from_dict
    from specheads.train import TrainError, check_export_compat

    recipe = recipe_from_dict({"head": {"kind": "eagle", "fc_bias": True}})
    with pytest.raises(TrainError, match="fc_bias"):
        check_export_compat(recipe)
    check_export_compat(recipe_from_dict({"head": {"kind": "eagle", "fc_bias": True},
                                          "export": {"formats": ["sglang"]}}))


def _break(folder, what):
    cfg_path, wfile = folder / "config.json", folder / "model.safetensors"
    cfg, tensors = json.loads(cfg_path.read_text()), load_file(str(wfile))
    if what == "renamed":
        tensors["layers.0.mlp.gate.weight"] = tensors.pop("layers.0.mlp.gate_proj.weight")
    elif what == "missing_key":
        cfg.pop("intermediate_size")
    elif what == "bias":
        tensors["fc.bias"] = torch.zeros(32)
    elif what == "input_norm":
        tensors["layers.0.input_layernorm.weight"] = torch.ones(32)
    elif what == "lm_head":
        tensors["lm_head.weight"] = torch.zeros(96, 32)
    elif what == "final_norm":
        tensors["norm.weight"] = torch.ones(32)
    elif what == "model_prefix":
        tensors["model.fc.weight"] = tensors.pop("fc.weight")
    elif what == "architecture":
        cfg["architectures"] = ["LlamaForCausalLMEagle3"]
    elif what == "shape":
        tensors["fc.weight"] = tensors["fc.weight"][:, :32].contiguous()
    cfg_path.write_text(json.dumps(cfg))
    save_file(tensors, str(wfile))


@pytest.mark.parametrize("fmt,what,needle", [
    ("vllm", "renamed", "layers.0.mlp.gate_proj.weight"),
    ("vllm", "missing_key", "intermediate_size"),
    ("vllm", "bias", "fc.bias"),
    ("vllm", "input_norm", "no input norm"),
    ("vllm", "lm_head", "target's lm_head"),
    ("vllm", "final_norm", "no final norm"),
    ("vllm", "model_prefix", "model."),
    ("sglang", "architecture", "LlamaForCausalLMEagle"),
    ("sglang", "shape", "fc.weight"),
    ("sglang", "input_norm", "no input norm"),
])
def test_contract_rules_break(tmp_path, target, fmt, what, needle):
    out = export(checkpoint(tmp_path, random_head(target)), fmt, tmp_path / fmt)
    eagle1_export.validate(out, fmt)
    _break(out, what)
    with pytest.raises(ContractError, match="violation") as err:
        eagle1_export.validate(out, fmt)
    assert needle in str(err.value)


def test_missing_sglang_bias_is_reported(tmp_path, target):
    out = export(checkpoint(tmp_path, random_head(target)), "sglang", tmp_path / "s")
    tensors = load_file(str(out / "model.safetensors"))
    tensors.pop("fc.bias")
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ContractError, match="fc.bias: expected the tensor"):
        eagle1_export.validate(out, "sglang")


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_exported_head_decodes_losslessly(tmp_path, target, fmt):
    """Chain, static tree and EAGLE-2 tree from the exported folder == plain greedy decoding."""
    loaded, _ = load_with_meta(export(checkpoint(tmp_path, random_head(target)), fmt, tmp_path / fmt))
    loaded = loaded.to(target.dtype)
    for seed in range(3):
        prompt = torch.randint(0, 96, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        plain = greedy_decode(target, prompt, 20).tokens
        assert decode(target, Eagle1Proposer(loaded, target), prompt, 20, k=3).tokens == plain
        static = Eagle1StaticTreeProposer(loaded, target, [[0], [1], [0, 0], [0, 1], [0, 0, 0]])
        assert decode(target, static, prompt, 20).tokens == plain
        dynamic = make_proposer(TreeSpec("eagle2", depth=2, top_k=3, total_tokens=8), loaded, target)
        assert decode(target, dynamic, prompt, 20).tokens == plain


def test_chain_drafts_follow_the_draft_head(target):
    """The first draft is argmax lm_head(step(f_{P-1}, E(first))): the proposer uses the right rows."""
    head = random_head(target)
    prompt = torch.tensor([3, 8, 1, 7])
    out = target.forward(prompt[None])
    first = int(out.logits[0, -1].argmax())
    p = Eagle1Proposer(head, target)
    p.start(prompt, first, out)
    nxt = torch.cat([prompt[1:], torch.tensor([first])])
    causal = torch.full((4, 4), torch.finfo(target.dtype).min, dtype=target.dtype).triu(1)[None, None]
    v = head.step(out.final, target.embed(nxt[None]), torch.arange(4)[None], causal, DynamicCache())
    assert int(p.propose(1)[0]) == int((v[0, -1] @ target.lm_head.weight.T).argmax())
