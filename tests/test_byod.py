"""Bring your own drafter: EAGLE-3 folders written by the speculators package and in SpecForge's
SGLang layout load into our head, compute speculators' own logits, and decode losslessly.

The folders under tests/fixtures/ were written by `speculators` 0.9.0 itself
(tests/fixtures/make_speculators_fixture.py); the golden logits are what its TTT forward
computed for recorded inputs, so no second virtualenv is needed here.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from random_models import VOCAB, make_target
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from specheads.export import load, load_with_meta
from specheads.export.foreign import ForeignDraftError
from specheads.heads.eagle3 import ttt_attention_mask
from specheads.verify.loop import decode, greedy_decode
from specheads.verify.registry import make_proposer
from specheads.verify.settings import make_tree_spec

FIXTURES = Path(__file__).parent / "fixtures"
VARIANTS = ["speculators_eagle3", "speculators_eagle3_fcnorm"]


def ttt_logits(head, aux: torch.Tensor, ids: torch.Tensor, embed: torch.Tensor, steps: int) -> torch.Tensor:
    """Our head run in speculators' TTT layout: step j reads ids[j:] (zero-padded) at positions
    i + j, over step-0 causal keys plus its own diagonal. -> [steps, T, Vd]."""
    T = ids.shape[1]
    hidden = head.fuse(aux)  # [1, T, H]
    cache, out = DynamicCache(), []
    valid = torch.ones(1, T, dtype=torch.bool)
    for j in range(steps):
        step_ids = torch.cat([ids[:, j:], ids.new_zeros(1, j)], dim=1)  # [1, T]
        mask = ttt_attention_mask(valid, j, hidden.dtype)  # [1, 1, T, (j+1)T]
        hidden = head.step(hidden, embed[step_ids], torch.arange(T)[None] + j, mask, cache)
        out.append(head.logits(hidden)[0])
    return torch.stack(out)


def golden(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / "speculators_golden" / f"{name}.safetensors"))


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_logits_equal_speculators_forward(name, attn):
    head, meta = load_with_meta(FIXTURES / name, attn_implementation=attn)
    gold = golden(name)
    embed = load_file(str(FIXTURES / name / "model.safetensors"))["embed_tokens.weight"]
    with torch.no_grad():
        ours = ttt_logits(head, gold["aux"], gold["input_ids"], embed, gold["logits"].shape[0])
    torch.testing.assert_close(ours, gold["logits"], rtol=1e-4, atol=1e-4)
    assert meta.format == "vllm" and meta.num_speculative_tokens == 3


def test_options_are_read_from_the_speculators_config():
    strict = load(FIXTURES / "speculators_eagle3").config
    assert (strict.norm_before_residual, strict.norm_before_fc, strict.fc_norm, strict.norm_output) == (
        True, True, False, True)
    assert strict.aux_layers == [2, 4, 5] and strict.draft_vocab_size == 64 and strict.vocab_size == VOCAB
    loose = load(FIXTURES / "speculators_eagle3_fcnorm").config
    assert (loose.norm_before_residual, loose.norm_before_fc, loose.fc_norm, loose.norm_output) == (
        False, False, True, False)
    assert loose.draft_vocab_size == VOCAB  # speculators wrote no d2t: identity offsets


def test_each_option_changes_the_logits():
    """A loader that ignored an option would still pass a weak test; flipping each one must move
    the logits away from speculators' golden values."""
    gold = golden("speculators_eagle3")
    embed = load_file(str(FIXTURES / "speculators_eagle3" / "model.safetensors"))["embed_tokens.weight"]
    for option in ("norm_before_residual", "norm_output"):
        head = load(FIXTURES / "speculators_eagle3")
        setattr(head.config, option, not getattr(head.config, option))
        head.layers[0].norm_before_residual = head.config.norm_before_residual
        with torch.no_grad():
            ours = ttt_logits(head, gold["aux"], gold["input_ids"], embed, 3)
        assert (ours - gold["logits"]).abs().max() > 1e-2, option


@pytest.fixture(scope="module")
def target():
    return make_target("sdpa")


def prompts(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g)
            for _ in range(n)]


@pytest.mark.parametrize("name", VARIANTS)
def test_speculative_decoding_equals_plain_greedy(target, name):
    head = load(FIXTURES / name).to(target.dtype)
    for tree in ("chain", "eagle2"):
        spec = make_tree_spec(tree, k=3, depth=3, top_k=3, total_tokens=8)
        for prompt in prompts(2, seed=4):
            ref = greedy_decode(target, prompt, 20)
            res = decode(target, make_proposer(spec, head, target), prompt, 20, spec.k or 0, ())
            assert res.tokens == ref.tokens, (name, tree, prompt.tolist())
            assert res.stats.drafts > 0


# --- SpecForge / SGLang layout ------------------------------------------------------------------


def as_sglang_folder(src: Path, out: Path, legacy_names: bool) -> Path:
    """Re-lay a speculators folder the way SpecForge's `export --to sglang` writes one: a
    LlamaForCausalLMEagle3 config, midlayer.* names, ids in SGLang numbering (one lower)."""
    cfg = json.loads((src / "config.json").read_text())
    layer = cfg["transformer_layer_config"]
    sg = {**layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": cfg["draft_vocab_size"],
          "tie_word_embeddings": False, "fc_norm": cfg["fc_norm"], "norm_output": cfg["norm_output"],
          "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in cfg["eagle_aux_hidden_state_layer_ids"]],
                           "use_aux_hidden_state": True, "norm_before_fc": cfg["norm_before_fc"]}}
    legacy = {"fc_norm.0.": "aux_norm_low.", "fc_norm.1.": "aux_norm_mid.", "fc_norm.2.": "aux_norm_high."}
    tensors = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if name == "embed_tokens.weight":
            continue  # SpecForge drops embeddings on export
        name = name.replace("layers.0.", "midlayer.")
        for new, old in legacy.items():
            name = name.replace(new, old) if legacy_names else name
        tensors[name] = t.to(torch.bfloat16) if t.is_floating_point() else t
    out.mkdir()
    (out / "config.json").write_text(json.dumps(sg))
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_sglang_layout_computes_the_same_logits(tmp_path):
    name = "speculators_eagle3_fcnorm"  # raw residual: the only rule SGLang runs
    folder = as_sglang_folder(FIXTURES / name, tmp_path / "sglang", legacy_names=True)
    head, meta = load_with_meta(folder)
    assert meta.format == "sglang" and head.config.aux_layers == [2, 4, 5] and head.config.fc_norm
    gold = golden(name)
    embed = load_file(str(FIXTURES / name / "model.safetensors"))["embed_tokens.weight"]
    with torch.no_grad():
        ours = ttt_logits(head, gold["aux"], gold["input_ids"], embed, 3)
    torch.testing.assert_close(ours, gold["logits"], rtol=0, atol=0.1)  # bf16 weights, as SpecForge ships
    assert (ours.argmax(-1) == gold["logits"].argmax(-1)).float().mean() > 0.9


def test_sglang_layout_without_ids_uses_the_engine_default(tmp_path):
    folder = as_sglang_folder(FIXTURES / "speculators_eagle3_fcnorm", tmp_path / "sg", legacy_names=False)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ForeignDraftError, match="num_target_layers"):
        load(folder)
    assert load_with_meta(folder, num_target_layers=32)[0].config.aux_layers == [2, 16, 29]


# --- refusals -----------------------------------------------------------------------------------


def edited_copy(tmp_path: Path, edit_config=None, edit_tensors=None) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(FIXTURES / "speculators_eagle3", out)
    if edit_config:
        cfg = json.loads((out / "config.json").read_text())
        edit_config(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    if edit_tensors:
        tensors = load_file(str(out / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["transformer_layer_config"].update(model_type="qwen3"), "q_norm/k_norm"),
    (lambda c: c["transformer_layer_config"].update(num_hidden_layers=2), "num_hidden_layers 2"),
    (lambda c: c.update(target_hidden_size=64), "target_hidden_size 64"),
    (lambda c: c.update(fc_norm=True), "exclude each other"),
    (lambda c: c.update(speculators_model_type="mtp"), "speculators_model_type 'mtp'"),
])
def test_unsupported_options_are_refused_by_name(tmp_path, edit, message):
    with pytest.raises(ForeignDraftError, match=message):
        load(edited_copy(tmp_path, edit_config=edit))


def test_missing_d2t_with_a_reduced_vocab_is_refused(tmp_path):
    with pytest.raises(ForeignDraftError, match="no d2t"):
        load(edited_copy(tmp_path, edit_tensors=lambda t: t.pop("d2t")))


def test_nested_lm_head_is_refused(tmp_path):
    def nest(t):
        t["model.lm_head.weight"] = t.pop("lm_head.weight")

    with pytest.raises(ForeignDraftError, match="model.lm_head.weight"):
        load(edited_copy(tmp_path, edit_tensors=nest))


# --- speculators' DFlash checkpoints (tests/fixtures/make_speculators_dflash_fixture.py) ---------
DFLASH_VARIANTS = ["speculators_dflash", "speculators_dflash_full"]


def dflash_block_logits(head, gold: dict) -> torch.Tensor:
    """Our head's block at the golden anchor over the context before it, as DFlashProposer drafts it
    (with the golden's embedding and lm_head in place of a target's): [anchor, mask x (B-1)] -> logits
    [B, Vd] (speculators' training forward scores every slot)."""
    a, B = int(gold["anchor"]), head.config.block_size
    cache = DynamicCache()
    head.add_context(cache, head.context(gold["aux"][:, :a]), torch.arange(a)[None])
    ids = torch.tensor([int(gold["input_ids"][0, a])] + [head.config.mask_token_id] * (B - 1))
    mask = torch.zeros(B, a + B)
    if head.config.causal:
        mask[:, a:] = torch.full((B, B), torch.finfo(mask.dtype).min).triu(1)
    out = head.block_forward(gold["embed"][ids][None], torch.arange(a, a + B)[None], mask[None, None], cache)
    return head.logits(out[0], gold["lm_head"])


@pytest.mark.parametrize("name, causal", [("speculators_dflash", True), ("speculators_dflash_full", False)])
def test_dflash_block_logits_equal_speculators_forward(name, causal):
    """Its trainer's default (sliding-window layers: causal in the block) and full-attention layers
    (bidirectional whatever sliding_window_non_causal says) read as the head speculators ran."""
    head, meta = load_with_meta(FIXTURES / name, num_target_layers=8)
    gold = golden(name)
    assert meta.kind == "dflash" and head.config.causal is causal and head.config.block_size == 4
    assert head.config.target_layer_ids == [1, 3, 5] and meta.num_speculative_tokens == 3
    with torch.no_grad():
        ours = dflash_block_logits(head, gold)
    torch.testing.assert_close(ours, gold["logits"], rtol=1e-4, atol=1e-4)


def test_mixed_block_masking_is_refused(tmp_path):
    folder = tmp_path / "mixed"
    shutil.copytree(FIXTURES / "speculators_dflash", folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["transformer_layer_config"]["layer_types"] = ["sliding_attention", "full_attention"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ForeignDraftError, match="causal sliding-window layers beside bidirectional"):
        load(folder)


# --- speculators' DSpark checkpoint (tests/fixtures/make_speculators_dspark_fixture.py) ----------
class GoldenTarget:
    """What a DFlash / DSpark proposer reads of its target, from a golden file: the embedding table and
    lm_head the toolkit's draft read, and the tapped states (aux, concatenated in tap order)."""

    def __init__(self, gold: dict, num_layers: int = 8):
        self.vocab_size, self.hidden_size = gold["embed"].shape
        self.num_layers, self.device = num_layers, torch.device("cpu")
        self.table = gold["embed"]
        self.lm_head = torch.nn.Linear(self.hidden_size, gold["lm_head"].shape[0], bias=False)
        self.lm_head.weight.data.copy_(gold["lm_head"])  # the draft's own lm_head for a reduced vocabulary

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[ids]


def dspark_drafted_logits(head, gold: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Our DSparkProposer's block at the golden anchor, its context the golden taps before it, each slot's
    previous token teacher-forced (slot 0: the anchor, slot s: the token at anchor + s, as the toolkits'
    training forwards take them) -> (logits [G, Vd] = lm_head + Markov bias, P(accepted) [G])."""
    from specheads.target import TargetOutput
    from specheads.verify.dspark_proposers import DSparkProposer

    a, ids, H = int(gold["anchor"]), gold["input_ids"][0], gold["embed"].shape[1]
    proposer = DSparkProposer(head, GoldenTarget(gold))
    taps = {layer: gold["aux"][:, :, i * H:(i + 1) * H] for i, layer in enumerate(head.required_layers())}
    proposer.start(ids[:a], int(ids[a]), TargetOutput(logits=None, hidden=taps))
    following = iter(ids[a + 1:].tolist())
    with torch.no_grad():
        rows = proposer.draft_block(head.config.block_size, lambda row: torch.tensor(next(following)))[1]
    return rows, proposer.confidence()


def check_dspark_golden(head, gold: dict) -> None:
    """Ours equals the toolkit's logits and confidence; read in the fill-in layout (G + 1 queries, slots
    1..G) the same folder would not (so the golden tells the layouts apart)."""
    ours, conf = dspark_drafted_logits(head, gold)
    torch.testing.assert_close(ours, gold["logits"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(conf, torch.sigmoid(gold["confidence"]), rtol=1e-4, atol=1e-5)
    assert (gold["logits"] - gold["base_logits"]).abs().max() > 0.1  # the Markov bias is part of what is compared
    fill_in = copy.deepcopy(head)  # the same weights and G, the block [anchor, mask x G] read from slot 1
    fill_in.config.sample_from_anchor = False
    fill_in.config.dflash.block_size += 1
    assert (dspark_drafted_logits(fill_in, gold)[0] - gold["logits"]).abs().max() > 0.1


def test_dspark_block_logits_equal_speculators_forward():
    """speculators' DSpark default (sample_from_anchor: G = block_size queries [anchor, mask x (G-1)], slot k
    drafts the token at anchor + 1 + k, its Markov bias from the token at anchor + k) with its trainer's
    sliding-window layers (causal in the block), a reduced vocabulary and a confidence head reading the
    Markov embedding: read as the head speculators ran, drafted as speculators' training forward scores it."""
    head, meta = load_with_meta(FIXTURES / "speculators_dspark", num_target_layers=8)
    c = head.config
    assert (meta.kind, c.sample_from_anchor, c.block_size, c.dflash.block_size, meta.num_speculative_tokens) == (
        "dspark", True, 4, 4, 4)
    assert (c.dflash.causal, c.dflash.target_layer_ids, c.dflash.draft_vocab_size, c.markov_rank) == (
        True, [1, 3, 5], 64, 8)
    assert c.enable_confidence_head and c.confidence_head_with_markov
    check_dspark_golden(head, golden("speculators_dspark"))
