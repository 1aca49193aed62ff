"""Draft model: lossless greedy decoding, distillation lowers the loss, HF-folder export loads back."""

from __future__ import annotations

import json

import pytest
import torch

from specheads.export import export, load_with_meta
from specheads.export.checkpoint import save_checkpoint
from specheads.export.contract_rules import ContractError
from specheads.export.draft import validate
from specheads.heads.draft import DraftHead, DraftOptions
from specheads.provenance import provenance
from specheads.target import Target
from specheads.verify.draft_proposers import DraftModelProposer
from specheads.verify.loop import decode, greedy_decode


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return Target.load(str(tiny_target_dir), device="cpu")


def _head(target, seed=0):
    torch.manual_seed(seed)
    head = DraftHead.for_target(DraftOptions(num_layers=2, ttt_steps=3), target.config)
    head.init_from_target(target)
    return head.eval()


def test_greedy_speculative_equals_plain_and_init_copies_target(target):
    head = _head(target)
    assert torch.equal(head.model.model.layers[1].mlp.up_proj.weight, target.model.model.layers[1].mlp.up_proj.weight)
    for prompt in ([5, 9, 2, 7], [11]):
        ref = greedy_decode(target, prompt, 20)
        out = decode(target, DraftModelProposer(head, target), prompt, 20, k=3)
        assert out.tokens == ref.tokens and out.stats.drafts > 0


def test_distillation_lowers_the_loss(target):
    head = _head(target).train()
    ids = torch.randint(0, target.vocab_size, (2, 16))
    ones = torch.ones_like(ids)
    batch = {"input_ids": ids, "attention_mask": ones, "loss_mask": ones}
    inputs = head.expand(target, head.collect(target, batch), batch)
    opt = torch.optim.AdamW(head.parameters(), lr=2e-3)
    first = None
    for _ in range(15):
        out = head(**inputs)
        first = first if first is not None else out.loss.item()
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    assert out.loss.item() < 0.7 * first


@pytest.fixture(scope="module")
def draft_export(target, tiny_target_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    ckpt = save_checkpoint(root / "run", 1, _head(target), recipe={"target": {"path": str(tiny_target_dir)}},
                           provenance=provenance(target=target.fingerprint()), trainer_state={})
    return ckpt, {fmt: export(ckpt, fmt, root / fmt) for fmt in ("vllm", "sglang")}


def test_export_loads_back(target, draft_export):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, outs = draft_export
    head, meta = load_with_meta(outs["vllm"])
    assert meta.kind == "draft" and '"method":"draft_model"' in meta.serve_commands[0]
    assert "STANDALONE" in load_with_meta(outs["sglang"])[1].serve_commands[0]
    assert AutoModelForCausalLM.from_pretrained(outs["sglang"]).config.vocab_size == target.vocab_size
    assert AutoTokenizer.from_pretrained(outs["vllm"]).get_vocab() == target.tokenizer.get_vocab()
    for prompt in ([5, 9, 2, 7], [3]):
        assert decode(target, DraftModelProposer(head, target), prompt, 16, k=3).tokens == \
            greedy_decode(target, prompt, 16).tokens


def test_export_readme_names_the_method_it_serves_with(draft_export):
    _, outs = draft_export
    titles = {fmt: (out / "README.md").read_text().splitlines()[0] for fmt, out in outs.items()}
    assert "method draft_model" in titles["vllm"] and "speculators" not in titles["vllm"]
    assert "STANDALONE" in titles["sglang"]


def test_export_refuses_other_formats(draft_export, tmp_path):
    from specheads.export.plan import ExportRefused

    with pytest.raises(ExportRefused, match="plain HF causal LM"):
        export(draft_export[0], "vllm-native", tmp_path / "x")


def _cfg(folder, **kw):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(kw)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))


@pytest.mark.parametrize("breaks,match", [
    (lambda f: _cfg(f, vocab_size=100), "vocab_size"),
    (lambda f: _cfg(f, draft_vocab_size=64), "draft_vocab_size"),
    (lambda f: _cfg(f, architectures=["LlamaForCausalLMEagle3"]), "architectures"),
    (lambda f: _cfg(f, num_hidden_layers=3), "layers.2"),
    (lambda f: (f / "tokenizer.json").unlink(), "tokenizer"),
])
def test_contract_rules_break(draft_export, tmp_path, breaks, match):
    import shutil

    folder = shutil.copytree(draft_export[1]["vllm"], tmp_path / "copy")
    validate(folder, "vllm")
    breaks(folder)
    with pytest.raises(ContractError, match=match):
        validate(folder, "vllm")
