"""Medusa-1: loss alignment, export to both layouts (and refusals), contract rules, lossless decoding."""

from __future__ import annotations

import json

import pytest
import torch
from random_models import make_target
from safetensors.torch import load_file, save_file

from specheads.export import ContractError, ExportRefused, export, load_with_meta
from specheads.export import medusa as medusa_export
from specheads.export.checkpoint import save_checkpoint
from specheads.heads.medusa import MedusaHead, MedusaOptions
from specheads.verify.loop import decode, greedy_decode
from specheads.verify.medusa_proposers import MedusaProposer, MedusaStaticTreeProposer
from specheads.verify.registry import make_proposer
from specheads.verify.settings import TreeSpec
from specheads.verify.trees import SettingsError, TreeError

FINGERPRINT = {"name": "random-llama", "vocab_size": 96, "hidden_size": 32}


def random_heads(target, bias: bool = True, seed: int = 2, **opts) -> MedusaHead:
    """Medusa heads initialised like training (blocks ~identity, output = the target's head), then
    perturbed so that every tensor matters."""
    torch.manual_seed(seed)
    head = MedusaHead.for_target(MedusaOptions(bias=bias, **opts), target.config)
    head.init_from_target(target)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return head.to(target.dtype).eval()


@pytest.fixture(scope="module")
def target():
    return make_target()


def checkpoint(tmp_path, head):
    return save_checkpoint(tmp_path / "run", 3, head.float(), {"target": {"path": "random-llama"}},
                           {"target": FINGERPRINT}, {"num_samples": 1})


def test_blocks_are_distinct_and_output_layers_start_as_target_head(target):
    head = MedusaHead.for_target(MedusaOptions(num_heads=3, num_layers=2), target.config)
    head.init_from_target(target)
    assert head.blocks[0].layers[0] is not head.blocks[0].layers[1]
    assert head.blocks[0].layers[0].weight.data_ptr() != head.blocks[0].layers[1].weight.data_ptr()
    for lm in head.lm_heads:
        assert torch.equal(lm.weight.double(), target.lm_head.weight)
    assert all(float(layer.weight.detach().abs().sum()) == 0 for b in head.blocks for layer in b.layers)
    assert sorted(head.state_dict())[:3] == ["blocks.0.layers.0.bias", "blocks.0.layers.0.weight",
                                             "blocks.0.layers.1.bias"]


def test_loss_is_per_head_ce_with_decay_and_counts_golden(target):
    """Golden: head k at row i is scored on x_{i+k+2}, weighted 0.8**k; counts follow greedy acceptance."""
    head = random_heads(target, num_heads=2)
    torch.manual_seed(0)
    ids = torch.randint(0, 96, (1, 7))
    mask = torch.ones_like(ids)
    out = target.forward(ids)
    res = head(final=out.final, input_ids=ids, target_argmax=out.logits.argmax(-1), loss_mask=mask,
               attention_mask=mask)
    manual = []
    for k in range(2):
        logits = head.head_logits(k, out.final[0, : 7 - k - 2])
        manual.append(torch.nn.functional.cross_entropy(logits.float(), ids[0, k + 2:]))
    torch.testing.assert_close(res.step_losses, torch.stack(manual))
    torch.testing.assert_close(res.loss, manual[0] + 0.8 * manual[1])
    assert res.counts["rows"].tolist() == [5.0, 4.0]
    hit0 = head.head_logits(0, out.final[0, :5]).argmax(-1) == out.logits[0, 1:6].argmax(-1)
    assert res.counts["reached"][0] == hit0.sum()


def test_heads_learn_on_one_batch(target):
    head = random_heads(target, num_heads=2).float()
    t = make_target(dtype=torch.float32)
    torch.manual_seed(3)
    ids = torch.randint(0, 96, (2, 16))
    mask = torch.ones_like(ids)
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": mask}
    inputs = head.expand(t, head.collect(t, batch), batch)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    first = None
    for _ in range(40):
        res = head(**inputs)
        first = first if first is not None else res.loss.item()
        opt.zero_grad()
        res.loss.backward()
        opt.step()
    assert res.loss.item() < 0.5 * first


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("fmt", ["medusa", "vllm-0.32"])
def test_export_round_trip(tmp_path, target, fmt, bias):
    head = random_heads(target, bias=bias, num_heads=3, num_layers=2)
    out = export(checkpoint(tmp_path, head), fmt, tmp_path / fmt)
    loaded, meta = load_with_meta(out)
    assert meta.kind == "medusa" and meta.format == fmt
    assert loaded.config.bias == bias and loaded.config.num_heads == 3 and loaded.config.num_layers == 2
    x = torch.randn(4, 32)
    torch.testing.assert_close(loaded.all_logits(x), head.float().all_logits(x), rtol=0, atol=0)
    cfg = json.loads((out / "config.json").read_text())
    if fmt == "medusa":
        names = set(load_file(str(out / "medusa_lm_head.safetensors")))
        assert {"0.0.linear.weight", "0.0.linear.bias", "0.1.linear.weight", "2.2.weight"} <= names
        assert cfg["medusa_num_heads"] == 3 and cfg["medusa_num_layers"] == 2
        assert not (out / "model.safetensors").exists()
    else:
        names = set(load_file(str(out / "model.safetensors")))
        assert "blocks.2.layers.1.weight" in names and "lm_heads.2.weight" in names
        assert ("blocks.0.layers.0.bias" in names) == bias and cfg["medusa_fc_bias"] == bias
        assert cfg["architectures"] == ["MedusaModel"] and cfg["num_heads"] == 3
    assert "Medusa" in (out / "README.md").read_text()


@pytest.mark.parametrize("fmt", ["vllm", "vllm-native", "sglang"])
def test_current_engines_are_refused(tmp_path, target, fmt):
    ckpt = checkpoint(tmp_path, random_heads(target))
    with pytest.raises(ExportRefused, match="vLLM 0.33 removed Medusa.*SGLang 0.5.23 has no Medusa loader"):
        export(ckpt, fmt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _break(folder, fmt, what):
    """Apply one rule violation to an export folder."""
    wfile = folder / medusa_export.WEIGHTS_FILES[fmt]
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    tensors = load_file(str(wfile))
    if what == "renamed":
        name = "0.0.linear.weight" if fmt == "medusa" else "blocks.0.layers.0.weight"
        tensors["renamed." + name] = tensors.pop(name)
    elif what == "missing_key":
        cfg.pop("medusa_num_heads" if fmt == "medusa" else "model_type")
    elif what == "bias_forbidden":
        cfg["medusa_fc_bias"] = False
    elif what == "shape":
        name = "1.1.weight" if fmt == "medusa" else "lm_heads.1.weight"
        tensors[name] = tensors[name][:-1]
    elif what == "extra_file":
        save_file({"x": torch.zeros(1)}, str(folder / "extra.safetensors"))
    cfg_path.write_text(json.dumps(cfg))
    save_file(tensors, str(wfile))


@pytest.mark.parametrize("fmt,what,needle", [
    ("medusa", "renamed", "renamed.0.0.linear.weight"),
    ("medusa", "missing_key", "medusa_num_heads"),
    ("medusa", "shape", "1.1.weight"),
    ("medusa", "extra_file", "extra.safetensors"),
    ("vllm-0.32", "renamed", "blocks.0.layers.0.weight"),
    ("vllm-0.32", "missing_key", "model_type"),
    ("vllm-0.32", "bias_forbidden", "medusa_fc_bias is false"),
    ("vllm-0.32", "shape", "lm_heads.1.weight"),
])
def test_contract_rules_break(tmp_path, target, fmt, what, needle):
    out = export(checkpoint(tmp_path, random_heads(target, num_heads=2)), fmt, tmp_path / fmt)
    medusa_export.validate(out, fmt)  # the clean export passes
    _break(out, fmt, what)
    with pytest.raises(ContractError, match="violation") as err:
        medusa_export.validate(out, fmt)
    assert needle in str(err.value)


@pytest.mark.parametrize("fmt", ["medusa", "vllm-0.32"])
def test_exported_heads_decode_losslessly(tmp_path, target, fmt):
    """Greedy speculative output (chain and static tree) == plain greedy, from the exported folder."""
    head = random_heads(target, num_heads=3)
    loaded, _ = load_with_meta(export(checkpoint(tmp_path, head), fmt, tmp_path / fmt))
    loaded = loaded.to(target.dtype)
    tree = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    accepted = 0
    for seed in range(4):
        prompt = torch.randint(0, 96, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        plain = greedy_decode(target, prompt, 24).tokens
        chain = decode(target, MedusaProposer(loaded, target), prompt, 24, k=3)
        static = decode(target, MedusaStaticTreeProposer(loaded, target, tree), prompt, 24)
        assert chain.tokens == plain and static.tokens == plain
        accepted += sum(chain.stats.accepted_per_pos)
    assert accepted > 0  # heads started from the target's own head: some drafts are accepted


def test_chain_drafts_come_from_the_last_verified_row(target):
    head = random_heads(target, num_heads=3)
    prompt = torch.tensor([5, 9, 11, 2])
    out = target.forward(prompt[None])
    p = MedusaProposer(head, target)
    p.start(prompt, int(out.logits[0, -1].argmax()), out)
    expect = torch.stack([head.head_logits(k, out.final[0, -1]).argmax() for k in range(2)])
    assert torch.equal(p.propose(2), expect)


def test_tree_deeper_than_heads_and_dynamic_trees_are_refused(target):
    head = random_heads(target, num_heads=2)
    with pytest.raises(TreeError, match="only 2 Medusa heads"):
        MedusaStaticTreeProposer(head, target, [[0], [0, 0], [0, 0, 0]])
    with pytest.raises(SettingsError, match="Medusa heads cannot grow 'eagle2' trees.*static tree"):
        make_proposer(TreeSpec("eagle2"), head, target)
    assert isinstance(make_proposer(TreeSpec("chain", k=2), head, target), MedusaProposer)
