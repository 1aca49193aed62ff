"""Medusa-2: joint heads + LoRA training, self-distillation, merge / ship export, lossless decoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from random_models import make_target  # noqa: E402

from specheads.config import load_recipe  # noqa: E402
from specheads.export import export, load_with_meta  # noqa: E402
from specheads.export.checkpoint import Checkpoint, save_checkpoint  # noqa: E402
from specheads.heads.medusa import MedusaHead  # noqa: E402
from specheads.heads.medusa2 import Medusa2Head, Medusa2Options  # noqa: E402
from specheads.provenance import provenance  # noqa: E402
from specheads.target import Target  # noqa: E402
from specheads.train import train  # noqa: E402
from specheads.verify.loop import decode, greedy_decode  # noqa: E402
from specheads.verify.medusa_proposers import MedusaProposer  # noqa: E402

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "medusa2" / "demo.yaml"


def batch_for(vocab: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, 16), generator=g)
    loss_mask = torch.ones_like(ids)
    loss_mask[:, :4] = 0  # a prompt
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}


def new_head(target, seed: int = 0, **opts) -> Medusa2Head:
    torch.manual_seed(seed)
    head = Medusa2Head.for_target(Medusa2Options(num_heads=3, lora_r=4, **opts), target.config)
    head.init_from_target(target)
    return head.to(target.dtype)


def train_steps(head, target, batch, steps: int, lr: float = 1e-2) -> list:
    """A few AdamW steps the way specheads.train runs them: collect / expand under no_grad, then forward."""
    optim = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr)
    outs = []
    for _ in range(steps):
        with torch.no_grad():
            inputs = head.expand(target, head.collect(target, batch), batch)
        out = head(**inputs)
        out.loss.backward()
        optim.step()
        optim.zero_grad()
        outs.append(out)
    return outs


@pytest.fixture(scope="module")
def target():
    return make_target()


def test_only_lora_and_heads_train_and_the_target_is_left_as_it_was(target):
    head = new_head(target)
    batch = batch_for(target.vocab_size)
    base_state = {n: t.clone() for n, t in target.model.state_dict().items()}
    base_logits = target.forward(batch["input_ids"]).logits
    assert all(n.startswith(("medusa.", "lora.")) for n in head.state_dict())
    assert len(head.config.lora_modules) == 7 * target.num_layers  # q k v o gate up down per layer
    assert not any(p.requires_grad for p in target.model.parameters())
    trainable = {id(p) for p in head.parameters() if p.requires_grad}
    assert trainable == {id(p) for p in head.parameters()}
    outs = train_steps(head, target, batch, 8)
    losses = [float(o.loss.detach()) for o in outs]
    assert losses[-1] < 0.8 * losses[0]  # it learns on one batch
    assert abs(float(outs[0].distill)) < 1e-6  # LoRA B = 0: the adapted target is the target
    assert float(outs[-1].distill) > 1e-4  # the adapters moved it: the KL now pulls back
    assert any(float(head.lora[k]["B"].weight.detach().abs().sum()) > 0 for k in head.lora)
    after = target.model.state_dict()
    assert list(after) == list(base_state)  # module tree and names unchanged (no peft layers left in)
    assert all(torch.equal(after[n], base_state[n]) for n in base_state)
    assert torch.equal(target.forward(batch["input_ids"]).logits, base_logits)
    adapted = head.adapted_logits(batch["input_ids"])
    assert (adapted - base_logits).abs().max() > 1e-3  # the adapters do act inside train_forward


def test_copy_rebinds_with_its_own_adapters(target):
    """The validation copy (deepcopy) binds its own LoRA weights, and gives the same loss."""
    import copy

    head = new_head(target)
    batch = batch_for(target.vocab_size)
    train_steps(head, target, batch, 2)
    twin = copy.deepcopy(head)
    with torch.no_grad():
        a = head(**head.expand(target, head.collect(target, batch), batch)).loss
        b = twin(**twin.expand(target, twin.collect(target, batch), batch)).loss
    assert twin.binding.wrappers[next(iter(head.config.lora_modules))] is not \
        head.binding.wrappers[next(iter(head.config.lora_modules))]
    assert torch.allclose(a, b)


@pytest.fixture(scope="module")
def trained(tiny_target_dir, tmp_path_factory):
    """A Medusa-2 checkpoint on the real tiny target folder, a few steps trained (LoRA non-zero)."""
    target = Target.load(str(tiny_target_dir), device="cpu")
    head = new_head(target, seed=3)
    ids = target.tokenizer("The quick brown fox jumps over the lazy dog. The cat sat on the mat and looked "
                           "out of the window.", return_tensors="pt").input_ids.repeat(2, 1)  # [2, T]
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    train_steps(head, target, batch, 4, lr=5e-3)
    root = tmp_path_factory.mktemp("medusa2")
    ckpt = save_checkpoint(root / "run", 4, head, {"target": {"path": str(tiny_target_dir)}},
                           provenance(target=target.fingerprint()), {"num_samples": 2})
    return target, head, ckpt, root


def test_merge_export_is_the_adapted_target_and_decodes_losslessly(trained):
    target, head, ckpt, root = trained
    out = export(ckpt, "vllm-0.32", root / "merge")
    record = json.loads((out / "specheads.json").read_text())
    assert record["kind"] == "medusa2" and record["adapter"]["mode"] == "merge"
    assert "merged" in (out / "README.md").read_text()
    merged = Target.load(str(out / "target"), device="cpu")
    ids = batch_for(target.vocab_size, seed=5)["input_ids"]
    with torch.no_grad():
        expect = head.adapted_logits(ids)
        got = merged.forward(ids).logits
        assert not torch.allclose(target.forward(ids).logits, expect, atol=1e-4)  # LoRA matters
    assert torch.allclose(got, expect, atol=1e-4)
    heads, meta = load_with_meta(out)
    assert isinstance(heads, MedusaHead)
    meta.check_target(merged)
    accepted = 0
    for seed in range(3):
        prompt = torch.randint(0, target.vocab_size, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        plain = greedy_decode(merged, prompt, 20).tokens
        spec = decode(merged, MedusaProposer(heads, merged), prompt, 20, k=3)
        assert spec.tokens == plain
        accepted += sum(spec.stats.accepted_per_pos)
    assert accepted > 0


def test_ship_export_loads_with_peft_and_gives_the_adapted_logits(trained, tiny_target_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    target, head, ckpt, root = trained
    out = export(ckpt, "medusa", root / "ship", adapter="ship")
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert not (out / "target").exists()
    record = json.loads((out / "specheads.json").read_text())
    assert record["adapter"]["mode"] == "ship" and "peft" in (out / "README.md").read_text()
    base = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, out / "adapter").eval()
    ids = batch_for(target.vocab_size, seed=6)["input_ids"]
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, head.adapted_logits(ids), atol=1e-5)
    heads, _ = load_with_meta(out)
    assert torch.equal(heads.lm_heads[0].weight, head.medusa.lm_heads[0].weight.detach())


def test_adapter_option_is_refused_for_other_kinds(tmp_path, trained):
    _, head, ckpt, _ = trained
    with pytest.raises(ValueError, match="adapter 'keep'"):
        export(ckpt, "vllm-0.32", tmp_path / "bad", adapter="keep")
    plain = MedusaHead(head.config.medusa_config())  # a Medusa-1 head has no adapter to merge or ship
    run = save_checkpoint(tmp_path / "m1", 1, plain, {"target": {"path": "x"}}, {"target": {}}, {})
    with pytest.raises(ValueError, match="medusa2"):
        export(run, "vllm-0.32", tmp_path / "m1-out", adapter="ship")
    assert not (tmp_path / "bad").exists() and not (tmp_path / "m1-out").exists()


def test_train_end_to_end_through_the_recipe(tiny_target_dir, demo_data_dir, tmp_path):
    out = tmp_path / "run"
    over = {"target.path": str(tiny_target_dir), "data.train": f"[{demo_data_dir / 'train.jsonl'}]",
            "data.max_length": 64, "head.num_heads": 2, "head.lora_r": 2, "train.output_dir": str(out),
            "train.batch_size": 2, "train.max_steps": 3, "train.log_every": 1, "train.save_every": 3,
            "train.warmup_steps": 1}
    ckpt = train(load_recipe(RECIPE, [f"{k}={v}" for k, v in over.items()]))
    loaded = Checkpoint(ckpt)
    assert loaded.kind == "medusa2" and loaded.trainer_state["step"] == 3
    assert all(n.startswith(("medusa.", "lora.")) for n in loaded.weights)
    assert any(float(t.abs().sum()) > 0 for n, t in loaded.weights.items() if n.endswith("B.weight"))
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
