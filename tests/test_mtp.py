"""MTP heads: teacher-forced training rows equal the verifier's drafts, lossless greedy decoding on
Llama / DeepSeek-V3 targets, export into Qwen3-Next / Qwen3.5 / DeepSeek-V3 checkpoints, load back, contracts."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from random_models import make_target, save_family_target
from safetensors.torch import load_file, save_file

from specheads.export import export, load_with_meta
from specheads.export.checkpoint import save_checkpoint
from specheads.export.contract_rules import ContractError
from specheads.export.mtp import INDEX_FILE, MTP_FILE, validate
from specheads.export.plan import ExportRefused
from specheads.heads.losses import shift
from specheads.heads.mtp import MtpHead, MtpOptions, causal_padding_mask
from specheads.provenance import provenance
from specheads.target import Target
from specheads.verify.loop import decode, greedy_decode
from specheads.verify.mtp_proposers import MtpProposer


def _head(target, layers=2, steps=3, seed=1, dtype=torch.float64):
    torch.manual_seed(seed)
    head = MtpHead.for_target(MtpOptions(num_layers=layers, ttt_steps=steps), target.config).to(dtype)
    head.init_from_target(target)
    with torch.no_grad():  # break the pass-through init so the embedding half matters
        for m in head.layers:
            m.eh_proj.weight.add_(torch.randn_like(m.eh_proj.weight) * 0.3)
    return head.eval()


def _family_target(tmp_path, family):
    folder = save_family_target(tmp_path / family, family, vocab=96)
    return Target(__import__("transformers").AutoModelForCausalLM.from_pretrained(folder), None, folder), folder


def test_proposer_drafts_equal_teacher_forced_rows():
    target = make_target()
    head = _head(target)
    seq = torch.tensor([greedy_decode(target, [5, 9, 2], 20).tokens])
    seq = torch.cat([torch.tensor([[5, 9, 2]]), seq], 1)
    T = seq.shape[1]
    hidden, embeds = target.forward(seq).final, target.embed(seq)
    mask = causal_padding_mask(torch.ones(1, T, dtype=torch.bool), hidden.dtype)
    rows = []
    with torch.no_grad():
        for j in range(3):
            pos = torch.arange(T)[None] + j
            hidden = head.step(j, hidden, head.embed_rows(shift(embeds, j + 1), pos), pos, mask)
            rows.append((hidden @ target.lm_head.weight.T).argmax(-1)[0])
    checked = 0
    for P in range(2, T - 4):
        prop = MtpProposer(head, target)
        prop.start(seq[0, :P], int(seq[0, P]), target.forward(seq[:, :P]))
        drafts = prop.propose(3).tolist()
        for j in range(3):  # row P-1 at step j predicts x_{P+j+1}; equal while earlier drafts are right
            assert drafts[j] == int(rows[j][P - 1]), (P, j)
            checked += 1
            if drafts[j] != int(seq[0, P + j + 1]):
                break
    assert checked > len(range(2, T - 4))  # some later steps were compared too


# Qwen3-Next and Qwen3.5 are left out: their linear-attention cache layers cannot be rolled back, so the
# verifier's target loop cannot run them (the MTP side is covered by the export test below).
@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_greedy_speculative_equals_plain(tmp_path, family):
    if family == "llama":
        target, dtype = make_target(), torch.float64
    else:  # MoE grouped matmuls have no float64 kernel
        (target, _), dtype = _family_target(tmp_path, family), torch.float32
    head = _head(target, layers=1 if family == "qwen3_next" else 2, dtype=dtype)
    for prompt in ([3, 1, 4, 1, 5], [9], [7, 7, 7, 2, 8, 1, 0, 4]):
        ref = greedy_decode(target, prompt, 24)
        out = decode(target, MtpProposer(head, target), prompt, 24, k=3)
        assert out.tokens == ref.tokens
        assert out.stats.drafts > 0


def test_training_lowers_the_loss():
    target = make_target(dtype=torch.float32)
    head = _head(target, dtype=torch.float32).train()
    ids = torch.randint(0, 96, (2, 16))
    ones = torch.ones_like(ids)
    batch = {"input_ids": ids, "attention_mask": ones, "loss_mask": ones}
    inputs = head.expand(target, head.collect(target, batch), batch)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    first = None
    for _ in range(30):
        out = head(**inputs)
        first = first if first is not None else out.loss.item()
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    assert out.loss.item() < 0.6 * first
    assert torch.all(out.counts["reached"] <= out.counts["cond_rows"])


def _checkpoint(tmp_path, target, folder, head):
    fp = {"vocab_size": target.vocab_size, "hidden_size": target.hidden_size, "name": "tiny"}
    return save_checkpoint(tmp_path / "run", 1, head.float(), recipe={"target": {"path": str(folder)}},
                           provenance=provenance(target=fp), trainer_state={})


COUNT_KEY = {"deepseek_v3": "num_nextn_predict_layers", "qwen3_next": "num_nextn_predict_layers",
             "qwen3_5": "mtp_num_hidden_layers", "qwen3_5_moe": "mtp_num_hidden_layers"}


@pytest.mark.parametrize("family,layers", [("deepseek_v3", 2), ("qwen3_next", 1), ("qwen3_5", 1), ("qwen3_5_moe", 1)])
def test_export_loads_back_and_stays_lossless(tmp_path, family, layers):
    target, folder = _family_target(tmp_path, family)
    head = _head(target, layers=layers, dtype=torch.float32)
    ckpt = _checkpoint(tmp_path, target, folder, head)
    out = export(ckpt, "vllm", tmp_path / "export")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg[COUNT_KEY[family]] == layers
    assert set(cfg) & set(COUNT_KEY.values()) == {COUNT_KEY[family]}  # only the key this family's engines read
    names = json.loads((out / INDEX_FILE).read_text())["weight_map"]
    if family == "deepseek_v3":
        assert "model.layers.3.eh_proj.weight" in names and "model.layers.4.mlp.experts.3.down_proj.weight" in names
    else:
        assert "mtp.fc.weight" in names and "mtp.layers.0.self_attn.q_norm.weight" in names
    loaded, meta = load_with_meta(out)
    assert meta.kind == "mtp"
    for name, t in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    # the exported folder still loads as the plain target, with identical logits
    again = __import__("transformers").AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(again(ids).logits, target.model(ids).logits, rtol=0, atol=0)
    for prompt in ([3, 1, 4, 1, 5], [8, 2]) if family == "deepseek_v3" else ():
        ref = greedy_decode(target, prompt, 16)
        assert decode(target, MtpProposer(loaded, target), prompt, 16, k=2).tokens == ref.tokens
    assert "--speculative-config" in meta.serve_commands[0] and '"method":"mtp"' in meta.serve_commands[0]
    title = (out / "README.md").read_text().splitlines()[0]
    assert "method mtp" in title and "speculators" not in title
    # fine-tuning the shipped layers: a head initialised from the export equals the trained one
    shipped = MtpHead.for_target(MtpOptions(num_layers=layers, init="shipped"), target.config)
    shipped.init_from_target(Target(again, None, out))
    for name, t in head.state_dict().items():
        assert torch.equal(shipped.state_dict()[name], t), name
    # re-exporting on top of a checkpoint that already ships MTP layers replaces them
    ckpt2 = _checkpoint(tmp_path / "b", target, out, _head(target, layers=layers, seed=7, dtype=torch.float32))
    validate(export(ckpt2, "vllm", tmp_path / "export2"), "vllm")


def test_refusals(tmp_path, tiny_target_dir):
    target, folder = _family_target(tmp_path, "deepseek_v3")
    ckpt = _checkpoint(tmp_path, target, folder, _head(target, layers=2, dtype=torch.float32))
    with pytest.raises(ExportRefused, match="SGLang 0.5.23 asserts num_nextn_predict_layers == 1"):
        export(ckpt, "sglang", tmp_path / "s")
    with pytest.raises(ExportRefused, match="inside the target checkpoint"):
        export(ckpt, "vllm-native", tmp_path / "n")
    llama = Target.load(str(tiny_target_dir), device="cpu")
    ckpt = _checkpoint(tmp_path / "l", llama, tiny_target_dir, _head(llama, dtype=torch.float32))
    with pytest.raises(ExportRefused, match="'llama' .* has no MTP draft class"):
        export(ckpt, "vllm", tmp_path / "x")
    assert not (tmp_path / "s").exists() and not (tmp_path / "x").exists()


@pytest.fixture()
def good_export(tmp_path):
    target, folder = _family_target(tmp_path, "deepseek_v3")
    ckpt = _checkpoint(tmp_path, target, folder, _head(target, layers=1, dtype=torch.float32))
    out = export(ckpt, "sglang", tmp_path / "export")
    validate(out, "sglang")
    validate(out, "vllm")
    return out


def _edit_config(out, **kw):
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(kw)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (out / "config.json").write_text(json.dumps(cfg))


def _edit_mtp(out, fn):
    tensors = load_file(str(out / MTP_FILE))
    fn(tensors)
    save_file(tensors, str(out / MTP_FILE))


@pytest.mark.parametrize("breaks,match", [
    (lambda o: _edit_config(o, num_nextn_predict_layers=None), "num_nextn_predict_layers"),
    (lambda o: _edit_config(o, num_nextn_predict_layers=2), "asserts one NextN layer"),
    (lambda o: _edit_config(o, model_type="llama"), "no MTP draft class"),
    (lambda o: _edit_mtp(o, lambda t: t.pop("model.layers.3.eh_proj.weight")), "eh_proj"),
    (lambda o: _edit_mtp(o, lambda t: t.update({"model.layers.3.hnorm.weight": torch.ones(31)})), "hnorm"),
    (lambda o: _edit_mtp(o, lambda t: t.pop("model.layers.3.self_attn.o_proj.weight")), "o_proj"),
    (lambda o: _edit_mtp(o, lambda t: t.update({"model.layers.4.enorm.weight": torch.ones(32)})), "beyond|model.layers.4"),
    (lambda o: shutil.copy(o / MTP_FILE, o / "model-extra.safetensors"), "unlisted|one copy"),
    (lambda o: (o / INDEX_FILE).unlink(), "index"),
])
def test_contract_rules_break(good_export, breaks, match):
    breaks(good_export)
    with pytest.raises(ContractError, match=match):
        validate(good_export, "sglang")


def test_qwen3_5_trains(tmp_path):
    """A Qwen3.5 (gated attention, 1+w norms, partial M-RoPE) MTP block learns on its own target."""
    target, _ = _family_target(tmp_path, "qwen3_5")
    head = _head(target, layers=1, steps=2, dtype=torch.float32).train()
    assert type(head.layers[0].block).__name__ == "Qwen3_5DecoderLayer" and hasattr(head.layers[0].block, "self_attn")
    ids = torch.randint(0, 96, (2, 12))
    ones = torch.ones_like(ids)
    batch = {"input_ids": ids, "attention_mask": ones, "loss_mask": ones}
    inputs = head.expand(target, head.collect(target, batch), batch)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        out = head(**inputs)
        losses.append(out.loss.item())
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    assert losses[-1] < 0.6 * losses[0]


@pytest.fixture()
def qwen3_5_export(tmp_path):
    target, folder = _family_target(tmp_path, "qwen3_5")
    out = export(_checkpoint(tmp_path, target, folder, _head(target, layers=1, dtype=torch.float32)), "sglang",
                 tmp_path / "export")
    validate(out, "sglang")
    validate(out, "vllm")
    return out


@pytest.mark.parametrize("breaks,match", [
    (lambda o: _edit_config(o, mtp_num_hidden_layers=None), "mtp_num_hidden_layers"),
    (lambda o: _edit_config(o, mtp_num_hidden_layers=None, num_nextn_predict_layers=1), "mtp_num_hidden_layers"),
    (lambda o: _edit_config(o, mtp_num_hidden_layers=2), "asserts one NextN layer"),
    (lambda o: _edit_mtp(o, lambda t: t.pop("mtp.fc.weight")), "mtp.fc.weight"),
    (lambda o: _edit_mtp(o, lambda t: t.update({"mtp.pre_fc_norm_hidden.weight": torch.ones(31)})),
     "pre_fc_norm_hidden"),
    (lambda o: _edit_mtp(o, lambda t: t.pop("mtp.layers.0.self_attn.q_norm.weight")), "mtp.layers.0"),
    (lambda o: _edit_mtp(o, lambda t: t.update({"mtp.layers.1.input_layernorm.weight": torch.ones(32)})),
     "beyond|mtp.layers.1"),
])
def test_qwen3_5_contract_rules_break(qwen3_5_export, breaks, match):
    breaks(qwen3_5_export)
    with pytest.raises(ContractError, match=match):
        validate(qwen3_5_export, "sglang")


# deepseek-ai/DeepSeek-V3 config.json, the values that are not sizes (the engines build modules from them)
RELEASED_DEEPSEEK_V3 = {
    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1, "ep_size": 1,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "hidden_act": "silu", "tie_word_embeddings": False,
    "max_position_embeddings": 163840,
}
RELEASED_DEEPSEEK_V3_YARN = {"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def test_tiny_deepseek_v3_is_the_released_config_scaled_down(tmp_path):
    """vLLM creates `gate.e_score_correction_bias` only for topk_method noaux_tc (KeyError on the tensor
    otherwise) and SGLang reads moe_layer_freq: the tiny copy keeps every released switch."""
    from safetensors import safe_open

    folder = save_family_target(tmp_path / "ds", "deepseek_v3", vocab=96)
    cfg = json.loads((folder / "config.json").read_text())
    assert {k: cfg.get(k) for k in RELEASED_DEEPSEEK_V3} == RELEASED_DEEPSEEK_V3
    rope = cfg.get("rope_parameters") or {}
    assert {k: rope.get(k) for k in RELEASED_DEEPSEEK_V3_YARN} == RELEASED_DEEPSEEK_V3_YARN
    with safe_open(str(folder / "model.safetensors"), "pt") as fh:
        assert any(n.endswith("mlp.gate.e_score_correction_bias") for n in fh.keys())
