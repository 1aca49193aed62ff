"""EAGLE 3.1 options (norm_before_fc, fc_norm, norm_output) and the Qwen3-style draft layer (qk_norm):
trained, exported with the keys each engine reads, refused where a format cannot carry them, loaded
back identically, and every broken field caught by the contract."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from test_contract import edit_config, edit_tensors, violations
from test_export import make_head, same_outputs, save, tiny_target_config

from specheads.bounds import ConfigError
from specheads.config import recipe_from_dict
from specheads.export import ExportRefused, export, load, validate
from specheads.heads.eagle3 import Eagle3Head, Eagle3Options, shift, ttt_attention_mask
from specheads.train import TrainError, check_export_compat

OPTIONS = {  # name -> head options; each exported to every format listed
    "norm_before_fc": ({"norm_before_fc": True}, ("vllm", "vllm-native", "sglang")),
    "fc_norm": ({"fc_norm": True}, ("vllm", "vllm-native", "sglang")),
    "norm_output": ({"norm_output": True}, ("vllm", "vllm-native", "sglang")),
    "eagle31": ({"fc_norm": True, "norm_output": True}, ("vllm", "vllm-native", "sglang")),
    "qk_norm": ({"qk_norm": True}, ("vllm", "vllm-native")),
    "qwen3-eagle31": ({"qk_norm": True, "norm_before_fc": True, "norm_output": True}, ("vllm", "vllm-native")),
    "peagle-eagle31": ({"parallel_drafting": True, "fc_norm": True, "norm_output": True, "qk_norm": True},
                       ("vllm-native",)),
    "peagle-norm_before_fc": ({"parallel_drafting": True, "norm_before_fc": True}, ("vllm", "vllm-native")),
}


def tensor_names(folder) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), "pt") as fh:
        return set(fh.keys())


def config_of(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """name -> (head, {format: export folder}) for every entry of OPTIONS."""
    tmp = tmp_path_factory.mktemp("eagle31")
    out = {}
    for name, (options, formats) in OPTIONS.items():
        head = make_head(**options)
        ckpt = save(tmp / name, head)
        out[name] = head, {fmt: export(ckpt, fmt, tmp / name / fmt) for fmt in formats}
    return out


@pytest.mark.parametrize("name", OPTIONS)
def test_options_pass_the_contract_and_load_back_identically(exported, name):
    head, folders = exported[name]
    for fmt, folder in folders.items():
        validate(folder, fmt, expected=head.config)
        loaded = load(folder)
        for option in ("norm_before_fc", "fc_norm", "norm_output", "qk_norm", "parallel_drafting"):
            assert getattr(loaded.config, option) == getattr(head.config, option), (fmt, option)
        same_outputs(head.eval(), loaded)


def test_the_keys_each_engine_reads(exported):
    """vLLM speculators / native and SGLang read the three flags at the top level; the Qwen3 layer is
    transformer_layer_config.model_type qwen3 (speculators) or Qwen3ForCausalLM + qwen3 (native)."""
    _, folders = exported["eagle31"]
    for fmt in ("vllm", "vllm-native", "sglang"):
        cfg = config_of(folders[fmt])
        assert (cfg["norm_before_fc"], cfg["fc_norm"], cfg["norm_output"]) == (False, True, True), fmt
        assert {f"fc_norm.{j}.weight" for j in range(3)} <= tensor_names(folders[fmt])
        assert "input_norm.weight" not in tensor_names(folders[fmt])
    _, folders = exported["qwen3-eagle31"]
    spec, native = config_of(folders["vllm"]), config_of(folders["vllm-native"])
    assert spec["transformer_layer_config"]["model_type"] == "qwen3" and spec["norm_before_fc"] is True
    assert spec["architectures"] == ["Eagle3Speculator"]
    assert native["architectures"] == ["Qwen3ForCausalLM"] and native["model_type"] == "qwen3"
    for folder in folders.values():
        names = tensor_names(folder)
        assert {"layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight", "input_norm.weight"} <= names
    with safe_open(str(folders["vllm"] / "model.safetensors"), "pt") as fh:
        assert fh.get_slice("layers.0.self_attn.q_norm.weight").get_shape() == [8]  # head_dim 32 / 4
        assert fh.get_slice("input_norm.weight").get_shape() == [96]  # 3 aux x 32


def test_engines_that_cannot_carry_an_option_refuse_it(tmp_path):
    ckpt = save(tmp_path / "q", make_head(qk_norm=True))
    with pytest.raises(ExportRefused, match=r"qk_norm: true.*no Qwen3-style EAGLE-3 loader.*--format vllm"):
        export(ckpt, "sglang", tmp_path / "q-sglang")
    ckpt = save(tmp_path / "p", make_head(parallel_drafting=True, norm_output=True))
    with pytest.raises(ExportRefused, match=r"norm_output: true.*update_peagle.*--format vllm-native"):
        export(ckpt, "vllm", tmp_path / "p-vllm")
    assert not (tmp_path / "q-sglang").exists() and not (tmp_path / "p-vllm").exists()


def test_training_refuses_a_variant_its_export_formats_cannot_carry():
    recipe = recipe_from_dict({"head": {"kind": "eagle3", "qk_norm": True}})  # formats: vllm, sglang
    with pytest.raises(TrainError, match=r"head.qk_norm: true cannot be exported to sglang"):
        check_export_compat(recipe)
    check_export_compat(recipe_from_dict({"head": {"kind": "eagle3", "qk_norm": True},
                                          "export": {"formats": ["vllm"]}}))
    recipe = recipe_from_dict({"head": {"kind": "eagle3", "parallel_drafting": True, "fc_norm": True},
                               "export": {"formats": ["vllm"]}})
    with pytest.raises(TrainError, match=r"head.fc_norm: true cannot be exported to vllm .*vllm-native"):
        check_export_compat(recipe)
    with pytest.raises(ConfigError, match="norm_before_fc and head.fc_norm exclude each other"):
        recipe_from_dict({"head": {"kind": "eagle3", "norm_before_fc": True, "fc_norm": True}})


def _copy(exported, name, fmt, tmp_path):
    head, folders = exported[name]
    dest = tmp_path / fmt
    shutil.copytree(folders[fmt], dest)
    return head, dest


def test_a_flipped_or_missing_flag_is_caught(exported, tmp_path):
    head, folder = _copy(exported, "eagle31", "vllm", tmp_path)
    edit_config(folder, lambda c: c.update(fc_norm=False))
    msg = violations(folder, "vllm", expected=head.config)
    assert "config.json: fc_norm: expected fc_norm true (the trained head's), found fc_norm false" in msg
    assert "model.safetensors: fc_norm.0.weight: expected no such tensor" in msg
    edit_config(folder, lambda c: c.pop("fc_norm"))
    assert "config.json: fc_norm: expected true or false, found no key" in violations(folder, "vllm")


def test_a_missing_option_tensor_is_caught(exported, tmp_path):
    _, folder = _copy(exported, "eagle31", "sglang", tmp_path)
    edit_tensors(folder, lambda t: t.pop("fc_norm.2.weight"))
    assert "model.safetensors: fc_norm.2.weight: expected the tensor, found no tensor" in violations(folder, "sglang")
    _, folder = _copy(exported, "qk_norm", "vllm-native", tmp_path / "q")
    edit_tensors(folder, lambda t: t.pop("layers.0.self_attn.k_norm.weight"))
    msg = violations(folder, "vllm-native")
    assert "model.safetensors: layers.0.self_attn.k_norm.weight: expected the tensor, found no tensor" in msg


def test_a_wrong_layer_style_is_caught(exported, tmp_path):
    head, folder = _copy(exported, "qk_norm", "vllm", tmp_path)
    edit_config(folder, lambda c: c["transformer_layer_config"].update(model_type="llama"))
    msg = violations(folder, "vllm", expected=head.config)
    assert "config.json: transformer_layer_config.model_type: expected qk_norm true" in msg
    assert "layers.0.self_attn.q_norm.weight: expected no such tensor" in msg
    head, folder = _copy(exported, "qk_norm", "vllm-native", tmp_path / "n")
    edit_config(folder, lambda c: c.update(model_type="llama"))
    assert 'config.json: model_type: expected "qwen3" (to match architectures)' in violations(folder, "vllm-native")
    edit_config(folder, lambda c: c.update(architectures=["Qwen2ForCausalLM"]))
    assert "config.json: architectures: expected" in violations(folder, "vllm-native")


def test_sglang_spellings_and_both_norms_are_caught(exported, tmp_path):
    head, folder = _copy(exported, "norm_before_fc", "sglang", tmp_path)
    edit_config(folder, lambda c: c["eagle_config"].update(norm_before_fc=False))  # eagle_config wins in SGLang
    assert "norm_before_fc true (the trained head's), found norm_before_fc false" in violations(
        folder, "sglang", expected=head.config)
    edit_config(folder, lambda c: [c["eagle_config"].pop("norm_before_fc"), c.update(fc_norm=True, use_aux_norm=True)])
    msg = violations(folder, "sglang")
    assert "config.json: norm_before_fc, fc_norm: expected at most one of them true" in msg
    assert "config.json: use_aux_norm: expected no such key" in msg


def test_peagle_speculators_config_with_a_dropped_flag_is_caught(exported, tmp_path):
    _, folder = _copy(exported, "peagle-norm_before_fc", "vllm", tmp_path)
    edit_config(folder, lambda c: c.update(norm_output=True))
    assert "config.json: norm_output: expected false or absent, found true; vLLM 0.33's speculators `peagle` " \
        "reader copies only" in violations(folder, "vllm")


@pytest.mark.parametrize("options", [{"norm_output": True, "fc_norm": True}, {"qk_norm": True, "norm_before_fc": True}])
def test_ttt_rows_equal_sequential_inference_with_the_options(options):
    """Training's TTT step j at row i equals the draft run as at inference (what the engines carry)."""
    torch.manual_seed(0)
    head = make_head(**options).eval()
    cfg, T = head.config, 9
    aux = torch.randn(1, T, 3 * cfg.target_hidden_size)
    emb = torch.randn(1, T, cfg.hidden_size)
    with torch.no_grad():
        hidden, outs = head.fuse(aux), []
        from transformers import DynamicCache

        cache = DynamicCache()
        for j in range(2):
            mask = ttt_attention_mask(torch.ones(1, T, dtype=torch.bool), j, torch.float32)
            hidden = head.step(hidden, shift(emb, j + 1), torch.arange(T)[None] + j, mask, cache)
            outs.append(hidden)
        i, cache = 5, DynamicCache()
        causal = torch.full((i + 1, i + 1), torch.finfo(torch.float32).min).triu(1)[None, None]
        y = head.step(head.fuse(aux[:, : i + 1]), emb[:, 1: i + 2], torch.arange(i + 1)[None], causal, cache)
        y2 = head.step(y[:, i: i + 1], emb[:, i + 2: i + 3], torch.tensor([[i + 1]]), None, cache)
    torch.testing.assert_close(y[0, i], outs[0][0, i], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y2[0, 0], outs[1][0, i], atol=1e-5, rtol=1e-5)


def test_each_option_is_in_the_computation():
    """The option's weights change the output (a module built but never applied would not)."""
    torch.manual_seed(0)
    aux = [torch.randn(1, 4, 32) for _ in range(3)]
    emb, pos = torch.randn(1, 4, 32), torch.arange(4)[None]
    for options, param in (({"qk_norm": True}, "layers.0.self_attn.q_norm.weight"),
                           ({"fc_norm": True}, "fc_norm.1.weight"), ({"norm_before_fc": True}, "input_norm.weight")):
        head = Eagle3Head.for_target(Eagle3Options(draft_vocab_size=40, **options), tiny_target_config()).eval()
        with torch.no_grad():
            before = head.logits(head.step(head.fuse(aux), emb, pos, None))
            dict(head.named_parameters())[param].mul_(torch.linspace(0.5, 2.0, dict(head.named_parameters())[param].numel()))
            after = head.logits(head.step(head.fuse(aux), emb, pos, None))
        assert not torch.allclose(before, after), options
    head = Eagle3Head.for_target(Eagle3Options(draft_vocab_size=40, norm_output=True), tiny_target_config()).eval()
    with torch.no_grad():
        out = head.step(head.fuse(aux), emb, pos, None)  # carried state = norm(out): unit RMS (weight 1)
    torch.testing.assert_close(out.pow(2).mean(-1), torch.ones(1, 4), atol=1e-4, rtol=1e-4)
