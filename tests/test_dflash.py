"""DFlash: golden layout and masks, training blocks equal the block proposer's forward, learning,
lossless greedy and sampled decoding (also from the exported folders), exports and contract rules."""

from __future__ import annotations

import pytest
import torch
from random_models import make_target

from specheads.heads.dflash import (
    DFlashHead,
    DFlashOptions,
    block_attention_mask,
    default_target_layer_ids,
    sample_anchors,
)
from specheads.verify.dflash_proposers import DFlashProposer, SampledDFlashProposer
from specheads.verify.loop import decode, greedy_decode

FINGERPRINT = {"name": "random-llama", "vocab_size": 96, "hidden_size": 32}


@pytest.fixture(scope="module")
def target():
    return make_target()


def random_head(target, seed: int = 4, **opts) -> DFlashHead:
    torch.manual_seed(seed)
    options = DFlashOptions(**{"num_layers": 2, "block_size": 4, "num_anchors": 64, **opts})
    head = DFlashHead.for_target(options, target.config)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.3)
    return head.to(target.dtype).eval()


def batch_of(ids: torch.Tensor) -> dict:
    ones = torch.ones_like(ids)
    return {"input_ids": ids, "attention_mask": ones, "loss_mask": ones}


def test_default_target_layers_golden():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # SpecForge / z-lab Qwen3-8B
    assert default_target_layer_ids(8, 1) == [4]
    assert default_target_layer_ids(8, 3) == [1, 2, 5] or default_target_layer_ids(8, 3) == [1, 3, 5]


def test_layout_and_shapes(target):
    head = random_head(target, target_layer_ids=[1, 3, 5])
    shapes = {n: tuple(t.shape) for n, t in head.state_dict().items()}
    assert shapes["fc.weight"] == (32, 3 * 32)
    assert shapes["hidden_norm.weight"] == (32,) and shapes["norm.weight"] == (32,)
    assert shapes["layers.1.self_attn.q_proj.weight"] == (4 * 8, 32)
    assert shapes["layers.1.self_attn.k_proj.weight"] == (2 * 8, 32)
    assert shapes["layers.0.self_attn.q_norm.weight"] == (8,) and shapes["layers.0.self_attn.k_norm.weight"] == (8,)
    assert not any(n.startswith(("lm_head", "embed", "d2t", "t2d")) for n in shapes)  # the target's are shared
    assert head.required_layers() == [2, 4, 6]  # HF hidden_states index = layer output id + 1
    reduced = random_head(target, draft_vocab_size=50).state_dict()
    assert tuple(reduced["lm_head.weight"].shape) == (50, 32) and reduced["d2t"].dtype == torch.int64


def test_block_mask_golden():
    valid = torch.tensor([[True, True, True, False]])
    allow = block_attention_mask(torch.tensor([[1, 2]]), valid, 2, False, torch.float32)[0, 0] == 0
    expected = torch.tensor([  # keys: 4 context positions, then block 0 (2 slots), block 1
        [1, 0, 0, 0, 1, 1, 0, 0],
        [1, 0, 0, 0, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 0, 1, 1],
        [1, 1, 0, 0, 0, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(allow, expected)
    causal = block_attention_mask(torch.tensor([[1]]), valid, 2, True, torch.float32)[0, 0] == 0
    assert causal[0].tolist() == [True, False, False, False, True, False]


def test_anchors_need_a_supervised_next_token():
    supervised = torch.tensor([[0, 0, 0, 1, 1, 1, 0, 0]], dtype=torch.bool)
    valid = torch.ones_like(supervised)
    anchors, live = sample_anchors(supervised, valid, 10, random=False)
    assert anchors[live].tolist() == [2, 3, 4]  # a >= 1 and token a+1 supervised
    anchors, live = sample_anchors(supervised, valid, 2, random=True)
    assert live.all() and set(anchors[0].tolist()) <= {2, 3, 4} and anchors[0, 0] < anchors[0, 1]


def test_training_blocks_equal_the_block_proposer(target):
    """Slot s of the training block at anchor a == the proposer's draft after prefix x_<a."""
    head = random_head(target)
    torch.manual_seed(0)
    ids = torch.randint(0, 95, (1, 14))
    batch = batch_of(ids)
    inputs = head.expand(target, head.collect(target, batch), batch)
    out = target.forward(ids, layers=head.required_layers())
    captured = {}
    head._block_loss = lambda out, pos, *a: captured.update(out=out, pos=pos)  # see the states
    head.train_forward(**inputs)
    del head._block_loss
    for n, a in enumerate(captured["pos"][0, :, 0].tolist()):
        proposer = DFlashProposer(head, target)
        prefix = ids[0, :a]
        proposer.start(prefix, int(ids[0, a]), out)
        logits = proposer.block_logits(3)  # [3, V]
        expect = head.logits(captured["out"][0, n, 1:], target.lm_head.weight)
        torch.testing.assert_close(logits, expect, atol=1e-9, rtol=1e-9)


def test_one_batch_overfits(target):
    torch.manual_seed(0)
    head = DFlashHead.for_target(DFlashOptions(num_layers=1, block_size=4, num_anchors=8), target.config).double()
    ids = torch.randint(0, 95, (2, 16))
    batch = batch_of(ids)
    inputs = head.expand(target, head.collect(target, batch), batch)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    head.train()
    first = None
    for _ in range(200):
        res = head(**inputs)
        opt.zero_grad()
        res.loss.backward()
        opt.step()
        first = first if first is not None else float(res.loss.detach())
    head.eval()
    res = head(**inputs)
    assert float(res.loss.detach()) < 0.2 * first
    assert (res.counts["reached"] >= 0.9 * res.counts["rows"]).all()  # the whole block is right


@pytest.mark.parametrize("loss", ["ce", "dpace"])
def test_loss_weights(target, loss):
    """CE decays exp(-(s-1)/gamma); D-PACE weighs early slots at least as much as later ones."""
    head = random_head(target, loss=loss, loss_decay_gamma=2.0)
    torch.manual_seed(0)
    ids = torch.randint(0, 95, (1, 12))
    batch = batch_of(ids)
    res = head(**head.expand(target, head.collect(target, batch), batch))
    if loss == "ce":
        want = (res.step_losses * torch.exp(-torch.arange(3.0) / 2.0)).sum()
        torch.testing.assert_close(res.loss.float(), want.float(), atol=1e-5, rtol=1e-5)
    else:
        assert res.loss > 0 and torch.isfinite(res.loss)
        assert res.loss >= (res.step_losses * 0.5 ** torch.arange(1.0, 4.0)).sum() - 1e-6


def test_greedy_block_decoding_equals_plain(target):
    head = random_head(target)
    for seed in range(3):
        torch.manual_seed(seed)
        prompt = torch.randint(0, 95, (6,))
        plain = greedy_decode(target, prompt, 24).tokens
        for k in (1, 3, 5):  # k > block_size - 1 proposes block_size - 1
            res = decode(target, DFlashProposer(head, target), prompt, 24, k=k)
            assert res.tokens == plain


def test_a_trained_block_is_accepted(target):
    """Drafts that equal the target's continuation are accepted whole (tau = block size)."""
    torch.manual_seed(0)
    head = DFlashHead.for_target(DFlashOptions(num_layers=1, block_size=3, num_anchors=64), target.config).double()
    prompt = torch.randint(0, 95, (5,))
    ids = torch.tensor([greedy_decode(target, prompt, 40).tokens])
    ids = torch.cat([prompt[None], ids], 1)
    batch = batch_of(ids)
    inputs = head.expand(target, head.collect(target, batch), batch)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    head.train()
    for _ in range(300):
        res = head(**inputs)
        opt.zero_grad()
        res.loss.backward()
        opt.step()
    res = decode(target, DFlashProposer(head.eval(), target), prompt, 30, k=2)
    assert res.tokens == greedy_decode(target, prompt, 30).tokens
    assert res.stats.decode_tokens > 2.0 * res.stats.decode_forwards  # tau > 2 of at most 3


@pytest.mark.parametrize("warping", [{"temperature": 1.0}, {"temperature": 1.0, "top_p": 0.9}])
def test_sampled_block_decoding_keeps_the_target_distribution(warping):
    """The first 3 sampled tokens over many seeds (one block of k = 3 drafted and verified first)
    pass a chi-square test against the target's exact warped joint distribution."""
    from test_sampling import P_MIN, V_SMALL, build_small, chi2_pvalue, exact_first_tokens, flat_index

    from specheads.verify.loop import decode

    target = build_small()[0]
    torch.manual_seed(2)
    head = DFlashHead.for_target(DFlashOptions(num_layers=1, block_size=4, target_layer_ids=[0, 2]),
                                 target.config).double().eval()
    prompt = torch.tensor([1, 3, 0, 2, 5, 4, 1])
    exact = exact_first_tokens(target, prompt, 3, **warping)
    counts = torch.zeros(V_SMALL ** 3, dtype=torch.long)
    accepted = rejected = 0
    seeds = 300
    for seed in range(seeds):
        res = decode(target, SampledDFlashProposer(head, target), prompt, 5, k=3, seed=seed, **warping, rule="exact")
        counts[flat_index(torch.tensor([res.tokens[:3]]), V_SMALL)] += 1
        first = res.step_tokens[0] - 1
        accepted += first
        rejected += first < res.step_proposed[0]
    assert chi2_pvalue(counts, exact) > P_MIN
    assert accepted > seeds // 10 and rejected > seeds // 10  # both branches were exercised


# --- exports ---------------------------------------------------------------------------------
def checkpoint(tmp_path, head):
    from specheads.export.checkpoint import save_checkpoint

    return save_checkpoint(tmp_path / "run", 3, head.float(), {"target": {"path": "random-llama"}},
                           {"target": FINGERPRINT}, {"num_samples": 1})


@pytest.mark.parametrize("fmt", ["vllm", "vllm-native", "sglang"])
def test_export_round_trip_decodes_losslessly(tmp_path, target, fmt):
    """Each format's config is what its engine reads; the head loaded back from the folder is
    the trained one and decodes token-equal to plain greedy decoding."""
    import json

    from safetensors.torch import load_file

    from specheads.export import export, load_with_meta

    head = random_head(target, target_layer_ids=[1, 3, 5])
    out = export(checkpoint(tmp_path, head), fmt, tmp_path / fmt)
    cfg = json.loads((out / "config.json").read_text())
    names = set(load_file(str(out / "model.safetensors")))
    assert not any(n.startswith(("lm_head", "embed_tokens", "d2t", "mask_hidden")) for n in names)
    if fmt == "vllm":
        assert "model_type" not in cfg and cfg["speculators_model_type"] == "dflash"
        assert cfg["aux_hidden_state_layer_ids"] == [2, 4, 6] and cfg["mask_token_id"] == 95
        assert cfg["sliding_window_non_causal"] is True  # vLLM: causal = not this
        assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    else:
        assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
        assert cfg["dflash_config"]["target_layer_ids"] == [1, 3, 5] and cfg["block_size"] == 4
        assert cfg["is_causal"] is False and cfg["dflash_config"]["causal"] is False
    readme = (out / "README.md").read_text()
    assert ("--speculative-algorithm DFLASH" in readme) if fmt == "sglang" else ('"method":"dflash"' in readme)
    loaded, meta = load_with_meta(out)
    assert meta.kind == "dflash" and loaded.config == head.config
    for (n, a), b in zip(loaded.state_dict().items(), head.float().state_dict().values()):
        assert torch.equal(a, b), n
    loaded = loaded.to(target.dtype)
    torch.manual_seed(5)
    prompt = torch.randint(0, 95, (7,))
    plain = greedy_decode(target, prompt, 20).tokens
    assert decode(target, DFlashProposer(loaded, target), prompt, 20, k=3).tokens == plain


def test_reduced_vocabulary_is_vllm_only(tmp_path, target):
    from specheads.export import ExportRefused, export, load_with_meta
    from specheads.heads.vocab import build_vocab_map

    head = random_head(target, draft_vocab_size=60)
    head.set_vocab_map(*build_vocab_map(torch.arange(96).flip(0), 60))  # ids 0..59 kept
    ckpt = checkpoint(tmp_path, head)
    with pytest.raises(ExportRefused, match="SGLang 0.5.23 always drafts with the target's lm_head"):
        export(ckpt, "sglang", tmp_path / "sglang")
    for fmt in ("vllm", "vllm-native"):
        loaded, _ = load_with_meta(export(ckpt, fmt, tmp_path / fmt))
        assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
        loaded = loaded.to(target.dtype)
        prompt = torch.tensor([3, 1, 4, 1, 5, 9])
        assert decode(target, DFlashProposer(loaded, target), prompt, 16, k=3).tokens == \
            greedy_decode(target, prompt, 16).tokens


def test_export_refuses_a_longer_chain_than_the_block(tmp_path, target):
    from specheads.export import export

    with pytest.raises(ValueError, match="at most 3"):
        export(checkpoint(tmp_path, random_head(target)), "vllm", tmp_path / "x", num_speculative_tokens=4)


def _break(folder, what):
    import json

    from safetensors.torch import load_file, save_file

    cfg_path, wfile = folder / "config.json", folder / "model.safetensors"
    cfg, tensors = json.loads(cfg_path.read_text()), load_file(str(wfile))
    edits = {
        "architecture": lambda: cfg.update(architectures=["Qwen3ForCausalLM"]),
        "model_type": lambda: cfg.update(model_type="llama"),
        "no_mask": lambda: cfg["dflash_config"].pop("mask_token_id"),
        "mask_outside": lambda: cfg["dflash_config"].update(mask_token_id=96),
        "ids_unsorted": lambda: cfg["dflash_config"].update(target_layer_ids=[5, 1, 3]),
        "causal_disagree": lambda: cfg.update(is_causal=True),
        "anchor_sampling": lambda: cfg["dflash_config"].update(sample_from_anchor=True),
        "top_level_ids": lambda: cfg.update(eagle_aux_hidden_state_layer_ids=[1, 3, 5]),
        "auto_map": lambda: cfg.update(auto_map={"AutoModel": "dflash.DFlashDraftModel"}),
        "sglang_vocab": lambda: cfg.update(draft_vocab_size=50),
        "spec_model_type": lambda: cfg.update(model_type="qwen3"),
        "spec_ids": lambda: cfg.pop("aux_hidden_state_layer_ids"),
        "spec_causal": lambda: cfg.pop("sliding_window_non_causal"),
        "spec_layer": lambda: cfg["transformer_layer_config"].update(model_type="llama"),
        "mask_hidden": lambda: tensors.update(mask_hidden=torch.zeros(96)),
        "missing_k_norm": lambda: tensors.pop("layers.1.self_attn.k_norm.weight"),
        "fc_shape": lambda: tensors.update({"fc.weight": tensors["fc.weight"][:, :64].contiguous()}),
        "embed": lambda: tensors.update({"embed_tokens.weight": torch.zeros(96, 32)}),
        "stray_lm_head": lambda: tensors.update({"lm_head.weight": torch.zeros(96, 32)}),
        "d2t_float": lambda: tensors.update(d2t=tensors["d2t"].float()),
        "prefix": lambda: tensors.update({"model.norm.weight": tensors.pop("norm.weight")}),
    }
    edits[what]()
    cfg_path.write_text(json.dumps(cfg))
    save_file(tensors, str(wfile))


@pytest.mark.parametrize("fmt,what,needle", [
    ("vllm-native", "architecture", "DFlashDraftModel"),
    ("vllm-native", "model_type", "qwen3"),
    ("vllm-native", "no_mask", "dflash_config.mask_token_id"),
    ("vllm-native", "mask_outside", "< vocab_size 96"),
    ("vllm-native", "ids_unsorted", "dflash_config.target_layer_ids"),
    ("vllm-native", "causal_disagree", "is_causal"),
    ("vllm-native", "anchor_sampling", "sample_from_anchor"),
    ("vllm-native", "top_level_ids", "eagle_aux_hidden_state_layer_ids"),
    ("sglang", "auto_map", "auto_map"),
    ("sglang", "sglang_vocab", "draft_vocab_size"),
    ("vllm", "spec_model_type", "speculators detection"),
    ("vllm", "spec_ids", "aux_hidden_state_layer_ids"),
    ("vllm", "spec_causal", "sliding_window_non_causal"),
    ("vllm", "spec_layer", "transformer_layer_config.model_type"),
    ("vllm-native", "mask_hidden", "P-EAGLE tensor"),
    ("sglang", "missing_k_norm", "layers.1.self_attn.k_norm.weight: expected the tensor"),
    ("vllm", "fc_shape", "fc.weight: expected shape [32, 96]"),
    ("sglang", "embed", "target's table"),
    ("vllm-native", "stray_lm_head", "reduced-vocabulary tensor"),
    ("vllm-native", "prefix", "model.norm.weight"),
])
def test_contract_rules_break(tmp_path, target, fmt, what, needle):
    from specheads.export import ContractError, export
    from specheads.export import dflash as dflash_export

    out = export(checkpoint(tmp_path, random_head(target, target_layer_ids=[1, 3, 5])), fmt, tmp_path / fmt)
    dflash_export.validate(out, fmt)
    _break(out, what)
    with pytest.raises(ContractError, match="violation") as err:
        dflash_export.validate(out, fmt)
    assert needle in str(err.value)


def test_reduced_vocabulary_rules_break(tmp_path, target):
    from specheads.export import ContractError, export
    from specheads.export import dflash as dflash_export

    out = export(checkpoint(tmp_path, random_head(target, draft_vocab_size=60)), "vllm-native", tmp_path / "n")
    _break(out, "d2t_float")
    with pytest.raises(ContractError, match="d2t: expected dtype I64"):
        dflash_export.validate(out, "vllm-native")


@pytest.mark.parametrize("causal", [False, True])
def test_speculators_trainer_checkpoint_loads_as_the_same_head(tmp_path, target, causal):
    """A DFlash checkpoint as speculators 0.9.0's trainer saves it (no specheads.json; its optimizer
    state beside; sliding-window layers; block_size counting the anchor, as ours) is read by the
    verifier as that head."""
    import json

    from specheads.export import export, load_with_meta
    from specheads.export.foreign import ForeignDraftError

    head = random_head(target, target_layer_ids=[1, 3, 5], causal=causal)
    folder = export(checkpoint(tmp_path, head), "vllm", tmp_path / "theirs")
    (folder / "specheads.json").unlink()
    torch.save({}, folder / "optimizer_state_dict.pt")
    cfg = json.loads((folder / "config.json").read_text())
    layer = cfg["transformer_layer_config"]  # its trainer's layers: sliding-window, causal unless non-causal is set
    layer.update(layer_types=["sliding_attention"] * layer["num_hidden_layers"], sliding_window=2048,
                 use_sliding_window=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    loaded, meta = load_with_meta(folder, num_target_layers=target.num_layers)
    assert meta.kind == "dflash" and meta.record == {} and meta.num_speculative_tokens == 3
    assert loaded.config.block_size == 4 and loaded.config.causal is causal and loaded.config.num_target_layers == 8
    for (n, a), b in zip(loaded.state_dict().items(), head.float().state_dict().values()):
        assert torch.equal(a, b), n
    prompt = torch.randint(0, 95, (7,), generator=torch.Generator().manual_seed(5))
    res = decode(target, DFlashProposer(loaded.to(target.dtype), target), prompt, 20, 3)
    assert res.tokens == greedy_decode(target, prompt, 20).tokens
    (folder / "config.json").write_text(json.dumps({**cfg, "sample_from_anchor": True}))
    with pytest.raises(ForeignDraftError, match="sample_from_anchor: true"):
        load_with_meta(folder)
