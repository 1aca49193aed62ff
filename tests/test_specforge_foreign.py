"""SpecForge 0.2.0's DFlash / DSpark folders (what its `export --to hf` writes for its DFlash family,
as bench/anchor_drivers/specforge_train.py drives it) read by the verifier without SpecForge: specheads'
own SGLang export rewritten the way SpecForge writes the folder. DFlash loads as the same head and
decodes losslessly, and DSpark (anchor-as-first, its only layout) loads as the same anchor-first head;
what the head cannot run (sliding-window layers, an unknown mask token) is refused by name. A folder
SpecForge's own exporter wrote (tests/fixtures/specforge_dspark, make_specforge_dspark_fixture.py)
computes the logits and confidence SpecForge's DSpark training forward computed for it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from random_models import make_target
from safetensors.torch import load_file, save_file
from test_byod import check_dspark_golden

from specheads.export import export, load_with_meta
from specheads.export.checkpoint import save_checkpoint
from specheads.export.foreign import ForeignDraftError, read_foreign_meta
from specheads.heads.dflash import DFlashHead, DFlashOptions
from specheads.heads.dspark import DSparkHead, DSparkOptions
from specheads.verify.dflash_proposers import DFlashProposer
from specheads.verify.loop import decode, greedy_decode

FINGERPRINT = {"name": "random-llama", "vocab_size": 96, "hidden_size": 32}
QWEN3_EXTRAS = {"dtype": "bfloat16", "max_window_layers": 28, "use_cache": True, "sliding_window": None,
                "use_sliding_window": False, "transformers_version": "5.8.1"}


@pytest.fixture(scope="module")
def target():
    return make_target()


def randomized(head):
    """Weights away from their init (norms kept), so a misread tensor changes the drafts."""
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.3)
    return head.eval()


def sglang_export(tmp_path: Path, head) -> Path:
    ckpt = save_checkpoint(tmp_path / "run", 3, head.float(), {"target": {"path": "random-llama"}},
                           {"target": FINGERPRINT}, {"num_samples": 1})
    return export(ckpt, "sglang", tmp_path / "theirs")


def as_specforge_writes_it(folder: Path, architecture: str, method: dict) -> dict:
    """Rewrite an SGLang export as SpecForge's HF exporter writes its draft (observed from its 0.2.0
    trainer): config.json and model.safetensors only (no specheads.json / README.md), the Qwen3 keys
    save_pretrained writes, `method` as dflash_config (no causal / is_causal / sample_from_anchor /
    use_swa: SpecForge writes none of them) and bfloat16 weights."""
    cfg = json.loads((folder / "config.json").read_text())
    for name in ("specheads.json", "README.md"):
        (folder / name).unlink(missing_ok=True)
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_parameters", "rope_theta", "vocab_size",
            "num_hidden_layers", "layer_types", "num_target_layers", "block_size", "model_type", "draft_vocab_size",
            "tie_word_embeddings", "attention_bias")
    out = {"architectures": [architecture], **{k: cfg[k] for k in keep if k in cfg}, **QWEN3_EXTRAS,
           "dflash_config": method}
    (folder / "config.json").write_text(json.dumps(out))
    tensors = {n: t.to(torch.bfloat16) for n, t in load_file(str(folder / "model.safetensors")).items()}
    save_file(tensors, str(folder / "model.safetensors"))
    return out


def test_specforge_dflash_folder_loads_as_the_same_head(tmp_path, target):
    """block_size counts the anchor, taps are DFlash layer-output ids, the mask id sits in dflash_config,
    and its full-attention layers run bidirectionally in the block (its training mask)."""
    torch.manual_seed(4)
    options = DFlashOptions(num_layers=2, block_size=4, num_anchors=8, target_layer_ids=[1, 3, 5])
    head = randomized(DFlashHead.for_target(options, target.config).to(target.dtype))
    folder = sglang_export(tmp_path, head)
    cfg = as_specforge_writes_it(folder, "DFlashDraftModel", {"mask_token_id": 95, "target_layer_ids": [1, 3, 5]})
    meta = read_foreign_meta(folder)
    assert (meta.kind, meta.format) == ("dflash", "sglang")
    loaded, meta = load_with_meta(folder)
    c = loaded.config
    assert (c.block_size, c.causal, c.mask_token_id, c.target_layer_ids, c.num_target_layers) == (4, False, 95,
                                                                                                   [1, 3, 5], 8)
    for (n, a), b in zip(loaded.state_dict().items(), head.float().state_dict().values()):
        assert torch.equal(a, b.to(torch.bfloat16).float()), n  # its bfloat16 weights, exactly
    prompt = torch.randint(0, 95, (7,), generator=torch.Generator().manual_seed(5))
    res = decode(target, DFlashProposer(loaded.to(target.dtype), target), prompt, 20, 3)
    assert res.tokens == greedy_decode(target, prompt, 20).tokens
    refused = [({"dflash_config": {**cfg["dflash_config"], "sample_from_anchor": True}}, "sample_from_anchor: true"),
               ({"layer_types": ["sliding_attention"] * 2, "use_sliding_window": True, "sliding_window": 64},
                "sliding-window layers"),
               ({"dflash_config": {"target_layer_ids": [1, 3, 5]}}, "mask_token_id is missing"),
               ({"dflash_config": {**cfg["dflash_config"], "projector_type": "domino"}}, "not DFlash")]
    for change, words in refused:
        (folder / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ForeignDraftError, match=words):
            load_with_meta(folder)


def test_specforge_dspark_folder_loads_as_the_same_anchor_first_head(tmp_path, target):
    """SpecForge 0.2.0 trains DSpark anchor-as-first only (block slot j learns the token at anchor + 1 + j)
    and writes no sample_from_anchor: read as SGLang's worker reads it (sample_from_anchor defaults to
    true, gamma = block_size), with the Markov / confidence fields from dflash_config, the folder is the
    same head and decodes losslessly; a missing Markov rank or another projector is refused by name."""
    from specheads.verify.dspark_proposers import DSparkProposer

    torch.manual_seed(0)
    options = DSparkOptions(num_layers=1, block_size=3, num_anchors=8, markov_rank=8, enable_confidence_head=True,
                            confidence_head_with_markov=True, sample_from_anchor=True)
    head = randomized(DSparkHead.for_target(options, target.config).double())
    folder = sglang_export(tmp_path, head)
    method = {"mask_token_id": 95, "target_layer_ids": head.config.dflash.target_layer_ids, "markov_rank": 8,
              "markov_head_type": "vanilla", "enable_confidence_head": True, "confidence_head_with_markov": True,
              "projector_type": "dspark", "attention_mode": "mha"}
    cfg = as_specforge_writes_it(folder, "DSparkDraftModel", method)
    for key in ("markov_rank", "sample_from_anchor", "enable_confidence_head"):
        cfg.pop(key, None)  # SpecForge keeps them in dflash_config (or, the layout, nowhere)
    (folder / "config.json").write_text(json.dumps(cfg))
    meta = read_foreign_meta(folder)
    assert (meta.kind, meta.format) == ("dspark", "sglang")
    loaded, meta = load_with_meta(folder)
    c = loaded.config
    assert (c.block_size, c.sample_from_anchor, c.dflash.block_size, c.markov_rank, c.enable_confidence_head,
            c.confidence_head_with_markov) == (3, True, 3, 8, True, True)
    for (n, a), b in zip(loaded.state_dict().items(), head.float().state_dict().values()):
        assert torch.equal(a, b.to(torch.bfloat16).float()), n  # its bfloat16 weights, exactly
    prompt = torch.randint(0, 95, (7,), generator=torch.Generator().manual_seed(5))
    res = decode(target, DSparkProposer(loaded.to(target.dtype), target), prompt, 20, 3)
    assert res.tokens == greedy_decode(target, prompt, 20).tokens
    refused = [({"dflash_config": {k: v for k, v in method.items() if k != "markov_rank"}}, "markov_rank None"),
               ({"dflash_config": {**method, "projector_type": "domino"}}, "projector is 'dspark'")]
    for change, words in refused:
        (folder / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ForeignDraftError, match=words):
            load_with_meta(folder)


FIXTURES = Path(__file__).parent / "fixtures"


def test_specforge_dspark_export_computes_its_training_forward():
    """A DSparkDraftModel folder written by SpecForge 0.2.0's own HF exporter (bfloat16, attention_mode mha,
    no sample_from_anchor key): read as SGLang reads it (anchor-as-first, G = block_size = 4), our proposer's
    block at the golden anchor, each slot's previous token teacher-forced ([anchor, target_ids[:-1]], as its
    training forward takes them), gives the base + Markov logits and the confidence SpecForge computed (in
    float32, on the folder's bfloat16 values)."""
    folder = FIXTURES / "specforge_dspark"
    assert "sample_from_anchor" not in json.loads((folder / "config.json").read_text())
    head, meta = load_with_meta(folder, num_target_layers=8)
    c = head.config
    assert (meta.kind, meta.format, c.sample_from_anchor, c.block_size, c.dflash.block_size) == (
        "dspark", "sglang", True, 4, 4)
    assert (c.dflash.causal, c.dflash.target_layer_ids, c.dflash.mask_token_id, c.markov_rank) == (
        False, [1, 3, 5], 95, 8)
    assert c.enable_confidence_head and c.confidence_head_with_markov
    check_dspark_golden(head, load_file(str(FIXTURES / "specforge_golden" / "specforge_dspark.safetensors")))
