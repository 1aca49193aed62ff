"""The loader-contract checker: each broken rule is named (file, tensor or key, what to do)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_export import make_head, save

from specheads.export import ContractError, export, load, validate
from specheads.export.contract import expected_shape
from specheads.export.contract_rules import CONTRACTS
from specheads.export.folder import SHA_KEY
from specheads.export.foreign import detect_eagle3_format
from specheads.integrity import IntegrityError


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """One clean export per format (copied per test before it is broken)."""
    tmp = tmp_path_factory.mktemp("exports")
    head = make_head()
    ckpt = save(tmp, head)
    return head, {fmt: export(ckpt, fmt, tmp / fmt) for fmt in ("vllm", "vllm-native", "sglang")}


@pytest.fixture()
def folder(exports, tmp_path, request):
    """A fresh copy of the export for the format named by the test's `fmt` parameter (default vllm)."""
    import shutil

    fmt = getattr(request, "param", "vllm")
    dest = tmp_path / fmt
    shutil.copytree(exports[1][fmt], dest)
    return dest


def edit_config(folder, change):
    cfg = json.loads((folder / "config.json").read_text())
    change(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))


def edit_tensors(folder, change):
    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


def violations(folder, fmt, expected=None) -> str:
    with pytest.raises(ContractError) as err:
        validate(folder, fmt, expected=expected)
    return str(err.value)


def test_clean_exports_pass(exports):
    head, folders = exports
    for fmt, path in folders.items():
        validate(path, fmt, expected=head.config)
        assert detect_eagle3_format(json.loads((path / "config.json").read_text())) == fmt


def test_renamed_tensor(folder):
    edit_tensors(folder, lambda t: t.__setitem__("layers.0.mlp.upproj.weight", t.pop("layers.0.mlp.up_proj.weight")))
    msg = violations(folder, "vllm")
    assert "model.safetensors: layers.0.mlp.up_proj.weight: expected the tensor, found no tensor" in msg
    assert "model.safetensors: layers.0.mlp.upproj.weight: expected no such tensor" in msg


def test_float_d2t(folder):
    edit_tensors(folder, lambda t: t.__setitem__("d2t", t["d2t"].float()))
    msg = violations(folder, "vllm")
    assert "model.safetensors: d2t: expected dtype I64 (int64), found F32" in msg


def test_missing_draft_vocab_size(folder):
    edit_config(folder, lambda c: c.pop("draft_vocab_size"))
    assert "config.json: draft_vocab_size: expected a positive integer, found no key" in violations(folder, "vllm")


@pytest.mark.parametrize("folder", ["sglang"], indirect=True)
def test_sglang_ids_in_vllm_numbering(folder, exports):
    edit_config(folder, lambda c: c["eagle_config"].__setitem__("eagle_aux_hidden_state_layer_ids", [2, 4, 5]))
    msg = violations(folder, "sglang", expected=exports[0].config)
    assert "config.json: eagle_config.eagle_aux_hidden_state_layer_ids: expected [1, 3, 4]" in msg
    assert "these are the ids in vLLM numbering" in msg


def test_vllm_ids_in_sglang_numbering_caught_from_specheads_json(folder):
    edit_config(folder, lambda c: c.__setitem__("eagle_aux_hidden_state_layer_ids", [1, 3, 4]))
    assert "these are the ids in SGLang numbering" in violations(folder, "vllm")  # expected from specheads.json


@pytest.mark.parametrize("folder", ["vllm-native"], indirect=True)
def test_model_prefixed_name(folder):
    edit_tensors(folder, lambda t: t.__setitem__("model.fc.weight", t.pop("fc.weight")))
    msg = violations(folder, "vllm-native")
    assert "model.safetensors: model.fc.weight" in msg and "`model.`-prefixed name" in msg
    assert "model.safetensors: fc.weight: expected the tensor, found no tensor" in msg


@pytest.mark.parametrize("folder", ["sglang"], indirect=True)
def test_extra_bias_and_nested_lm_head(folder):
    def change(t):
        t["midlayer.self_attn.o_proj.bias"] = torch.zeros(32)
        t["model.lm_head.weight"] = t.pop("lm_head.weight")
    edit_tensors(folder, change)
    msg = violations(folder, "sglang")
    assert "midlayer.self_attn.o_proj.bias" in msg and "bias tensor" in msg
    assert "model.lm_head.weight" in msg and "SGLang silently drops it" in msg


@pytest.mark.parametrize("folder", ["sglang"], indirect=True)
def test_mixed_layer_spellings(folder):
    def copy(t):
        t["layers.0.hidden_norm.weight"] = t["midlayer.hidden_norm.weight"].clone()

    edit_tensors(folder, copy)
    assert "layers.0.* and midlayer.*: expected one spelling" in violations(folder, "sglang")


def test_missing_norm_before_residual(folder):
    edit_config(folder, lambda c: c.pop("norm_before_residual"))
    msg = violations(folder, "vllm")
    assert "config.json: norm_before_residual: expected true or false, found no key" in msg
    assert "speculators defaults to true" in msg


def test_short_max_position_embeddings(folder, exports):
    edit_config(folder, lambda c: c["transformer_layer_config"].__setitem__("max_position_embeddings", 64))
    msg = violations(folder, "vllm", expected=exports[0].config)
    key = "config.json: transformer_layer_config.max_position_embeddings"
    assert f"{key}: expected >= 256 (the target's), found 64" in msg


def test_speculators_top_level_model_type_and_missing_layer_config(folder):
    edit_config(folder, lambda c: [c.__setitem__("model_type", "llama"), c.pop("transformer_layer_config")])
    msg = violations(folder, "vllm")
    assert "config.json: model_type: expected no such key" in msg
    assert "config.json: transformer_layer_config: expected a JSON object, found no key" in msg
    assert 'config.json: transformer_layer_config.model_type: expected "llama" or "qwen3", found no key' in msg


@pytest.mark.parametrize("folder", ["vllm-native"], indirect=True)
def test_every_violation_is_listed(folder):
    edit_config(folder, lambda c: [c.pop("draft_vocab_size"), c.pop("norm_before_residual"),
                                   c.__setitem__("num_aux_hidden_states", 4)])
    edit_tensors(folder, lambda t: t.pop("norm.weight"))
    err = pytest.raises(ContractError, validate, folder, "vllm-native").value
    where = {v.where for v in err.violations}
    assert {"config.json: draft_vocab_size", "config.json: norm_before_residual",
            "config.json: num_aux_hidden_states", "model.safetensors: norm.weight"} <= where
    assert "violation(s)" in str(err) and str(folder) in str(err)


@pytest.mark.parametrize("folder", ["vllm-native"], indirect=True)
def test_stray_weights_file_and_truncated_weights(folder):
    (folder / "pytorch_model.bin").write_bytes(b"\0")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    msg = violations(folder, "vllm-native")
    assert "pytorch_model.bin" in msg and "model.safetensors: expected a readable safetensors file" in msg
    with pytest.raises(IntegrityError, match="truncated"):  # the recorded checksum catches it first
        load(folder)
    forget_checksums(folder)  # a hand-made folder: the contract itself names the unreadable file
    with pytest.raises(ContractError, match="truncated or corrupt"):
        load(folder)


def forget_checksums(folder):
    """Drop the recorded sha256 table, as in a folder written by an older version or by hand."""
    meta = json.loads((folder / "specheads.json").read_text())
    meta.pop(SHA_KEY, None)
    (folder / "specheads.json").write_text(json.dumps(meta))


def test_load_refuses_a_broken_export(folder):
    edit_tensors(folder, lambda t: t.__setitem__("d2t", t["d2t"].float()))
    with pytest.raises(IntegrityError, match="checksum"):
        load(folder)
    forget_checksums(folder)
    with pytest.raises(ContractError, match="d2t"):
        load(folder)


def test_contract_tables_are_consistent():
    for (fmt, kind), contract in CONTRACTS.items():
        assert contract.name == fmt and contract.kind == kind
        names = [r.name.format(layer=contract.layer_prefix) for r in contract.tensors]
        assert len(names) == len(set(names)) and all(not n.startswith("model.") for n in names)
    assert expected_shape(("nh*hd", "2*Hd"), {"nh": 4, "hd": 8, "Hd": 32}) == (32, 64)
    assert expected_shape(("Vd",), {}) is None
