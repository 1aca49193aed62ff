"""Export round trips: every format passes its contract and loads back into an identical head."""

import json
from dataclasses import asdict

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig

from specheads.export import CheckpointError, ExportRefused, export, load, load_with_meta, read_export_meta, validate
from specheads.export.checkpoint import save_checkpoint
from specheads.export.eagle3 import FORMATS_WRITTEN as FORMATS
from specheads.heads.eagle3 import Eagle3Head, Eagle3Options
from specheads.heads.vocab import build_vocab_map

FINGERPRINT = {"name": "tiny-target", "vocab_size": 96, "hidden_size": 32, "num_layers": 8,
               "tokenizer_sha256": "ab" * 32, "embedding_sha256": "cd" * 32}


def tiny_target_config(**kw) -> LlamaConfig:
    base = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=8,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    return LlamaConfig(**{**base, **kw})


def make_head(seed: int = 0, target=None, **options) -> Eagle3Head:
    """A tiny EAGLE-3 head with random weights (norms too) and a non-trivial vocab map."""
    torch.manual_seed(seed)
    opts = Eagle3Options(**{"draft_vocab_size": 40, "ttt_steps": 2, **options})
    head = Eagle3Head.for_target(opts, target or tiny_target_config())
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
    d2t, t2d = build_vocab_map(torch.randint(0, 50, (96,)), head.config.draft_vocab_size)
    head.set_vocab_map(d2t, t2d)
    return head


def save(tmp_path, head, target=None, recipe=None):
    prov = {"specheads_version": "test", "target": target or FINGERPRINT}
    return save_checkpoint(tmp_path / "run", 7, head, recipe or {"target": {"path": "builtin:tiny"}}, prov,
                           {"num_samples": 1})


@pytest.fixture()
def trained(tmp_path):
    head = make_head()
    return head, save(tmp_path, head)


def same_outputs(a: Eagle3Head, b: Eagle3Head) -> None:
    """fuse, step, logits and the vocab map agree exactly on random inputs."""
    torch.manual_seed(1)
    cfg = a.config
    aux = [torch.randn(2, 5, cfg.target_hidden_size) for _ in cfg.aux_layers]
    embeds = torch.randn(2, 5, cfg.hidden_size)
    pos = torch.arange(5).expand(2, 5)
    mask = torch.triu(torch.full((5, 5), float("-inf")), 1)[None, None].expand(2, 1, 5, 5)
    with torch.no_grad():
        ha, hb = a.fuse(aux), b.fuse(aux)
        oa, ob = a.step(ha, embeds, pos, mask), b.step(hb, embeds, pos, mask)
        assert torch.equal(ha, hb) and torch.equal(oa, ob)
        assert torch.equal(a.logits(oa), b.logits(ob))
    assert torch.equal(a.d2t, b.d2t) and torch.equal(a.t2d, b.t2d)


@pytest.mark.parametrize("fmt", FORMATS)
def test_export_passes_contract_and_round_trips(trained, tmp_path, fmt):
    head, ckpt = trained
    out = export(ckpt, fmt, tmp_path / fmt)
    validate(out, fmt, expected=head.config)
    loaded, meta = load_with_meta(out)
    assert asdict(loaded.config) == asdict(head.config)
    same_outputs(head.eval(), loaded)
    assert meta.format == fmt and meta.target == FINGERPRINT
    assert meta.num_speculative_tokens == head.config.ttt_steps
    assert not list(tmp_path.glob(f".{fmt}.tmp-*"))


def test_speculators_verifier_is_never_a_bare_folder_name(tmp_path):
    """No hub id anywhere: the config names the local target folder by its absolute path (an engine
    would look a bare basename such as "smollm2" up on the hub); a recorded hub id wins."""
    head = make_head()
    folder = tmp_path / "models" / "smollm2"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    ckpt = save(tmp_path, head, target=dict(FINGERPRINT, name="smollm2"), recipe={"target": {"path": str(folder)}})
    cfg = json.loads((export(ckpt, "vllm", tmp_path / "v") / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(folder.resolve())
    assert cfg["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    ckpt = save(tmp_path / "b", head, target=dict(FINGERPRINT, name="HuggingFaceTB/SmolLM2-135M-Instruct"),
                recipe={"target": {"path": str(folder)}})
    cfg = json.loads((export(ckpt, "vllm", tmp_path / "w") / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_vllm_speculators_config(trained, tmp_path):
    head, ckpt = trained
    out = export(ckpt, "vllm", tmp_path / "v", num_speculative_tokens=4, verifier="acme/tiny-chat")
    cfg = json.loads((out / "config.json").read_text())
    assert "model_type" not in cfg and cfg["speculators_model_type"] == "eagle3"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == head.config.aux_layers == [2, 4, 5]
    assert cfg["norm_before_residual"] is False and cfg["draft_vocab_size"] == 40
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "acme/tiny-chat"
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["vocab_size"] == 96 and layer["num_hidden_layers"] == 1
    assert layer["rope_parameters"]["rope_theta"] == 5000.0 and layer["rope_theta"] == 5000.0
    readme = (out / "README.md").read_text()
    assert f"vllm serve {out}" in readme


def test_vllm_local_target_readme_uses_speculative_config(trained, tmp_path):
    _, ckpt = trained
    out = export(ckpt, "vllm", tmp_path / "v")
    meta = read_export_meta(out)
    assert len(meta.serve_commands) == 1
    cmd = meta.serve_commands[0]
    assert cmd.startswith("vllm serve /path/to/tiny-target --speculative-config")
    assert '"method":"eagle3"' in cmd and '"num_speculative_tokens":2' in cmd
    assert "remote model repository" in (out / "README.md").read_text()


def test_native_and_sglang_configs(trained, tmp_path):
    head, ckpt = trained
    native = json.loads((export(ckpt, "vllm-native", tmp_path / "n") / "config.json").read_text())
    assert native["architectures"] == ["LlamaForCausalLM"] and native["model_type"] == "llama"
    assert native["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and native["num_aux_hidden_states"] == 3
    assert native["tie_word_embeddings"] is False and "norm_before_residual" in native
    out = export(ckpt, "sglang", tmp_path / "s", num_speculative_tokens=3, verifier="acme/tiny-chat")
    sg = json.loads((out / "config.json").read_text())
    assert sg["architectures"] == ["LlamaForCausalLMEagle3"] and sg["draft_vocab_size"] == 40
    assert sg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}
    assert "eagle_aux_hidden_state_layer_ids" not in sg and not sg.get("norm_output")
    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        names = set(fh.keys())
        assert fh.get_slice("d2t").get_dtype() == "I64"
    assert "midlayer.self_attn.q_proj.weight" in names and "lm_head.weight" in names
    assert not any(n.startswith(("layers.", "model.")) or n.endswith(".bias") for n in names)
    cmd = read_export_meta(out).serve_commands[0]
    assert cmd == (f"python -m sglang.launch_server --model-path acme/tiny-chat --speculative-algorithm EAGLE3 "
                   f"--speculative-draft-model-path {out} --speculative-num-steps 3 "
                   "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4")


def test_bf16_export_keeps_integer_buffers(trained, tmp_path):
    head, ckpt = trained
    out = export(ckpt, "vllm-native", tmp_path / "b", dtype="bfloat16")
    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        assert fh.get_slice("fc.weight").get_dtype() == "BF16"
        assert fh.get_slice("d2t").get_dtype() == "I64" and fh.get_slice("t2d").get_dtype() == "BOOL"
    loaded = load(out)
    assert torch.equal(loaded.d2t, head.d2t)
    assert torch.equal(loaded.fc.weight, head.fc.weight.to(torch.bfloat16).float())


def test_norm_before_residual_head(tmp_path):
    head = make_head(norm_before_residual=True)
    ckpt = save(tmp_path, head)
    with pytest.raises(ExportRefused, match="raw fc output as the residual"):
        export(ckpt, "sglang", tmp_path / "s")
    assert not (tmp_path / "s").exists() and not list(tmp_path.glob(".s.*"))
    out = export(ckpt, "vllm", tmp_path / "v")
    assert json.loads((out / "config.json").read_text())["norm_before_residual"] is True
    same_outputs(head.eval(), load(out))


def test_non_default_aux_layers_round_trip(tmp_path):
    head = make_head(aux_layers=[1, 3, 5, 6])
    ckpt = save(tmp_path, head)
    for fmt in FORMATS:
        loaded = load(export(ckpt, fmt, tmp_path / fmt))
        assert loaded.config.aux_layers == [1, 3, 5, 6]
        same_outputs(head.eval(), loaded)
    spec = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert spec["transformer_layer_config"]["num_aux_hidden_states"] == 4


def test_truncated_checkpoint_names_the_file(trained, tmp_path):
    _, ckpt = trained
    weights = ckpt / "head.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="head.safetensors"):
        export(ckpt, "vllm", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_failed_validation_leaves_nothing(trained, tmp_path, monkeypatch):
    from specheads.export import ContractError, eagle3

    _, ckpt = trained
    real = eagle3.config_json
    monkeypatch.setattr(eagle3, "config_json", lambda *a, **k: {**real(*a, **k), "norm_output": True})
    with pytest.raises(ContractError, match="norm_output"):
        export(ckpt, "vllm-native", tmp_path / "bad")
    assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".bad.*"))


def test_meta_refuses_a_different_target(trained, tmp_path):
    from specheads.target import TargetError

    class FakeTarget:
        path = tmp_path / "other"

        def fingerprint(self):
            return {**FINGERPRINT, "tokenizer_sha256": "ef" * 32}

    _, ckpt = trained
    _, meta = load_with_meta(export(ckpt, "sglang", tmp_path / "s"))
    with pytest.raises(TargetError, match="tokenizer_sha256"):
        meta.check_target(FakeTarget())


def test_scaled_rope_round_trips_with_legacy_mirrors(tmp_path):
    rope = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 4.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    head = make_head(target=tiny_target_config(rope_parameters=rope))
    ckpt = save(tmp_path, head)
    for fmt in FORMATS:
        out = export(ckpt, fmt, tmp_path / fmt)
        cfg = json.loads((out / "config.json").read_text())
        layer = cfg.get("transformer_layer_config", cfg)
        assert layer["rope_parameters"] == rope and layer["rope_theta"] == 50000.0
        assert layer["rope_scaling"] == {k: v for k, v in rope.items() if k != "rope_theta"}
        loaded = load(out)
        assert loaded.config.rope_parameters == rope
        same_outputs(head.eval(), loaded)


def test_load_names_a_folder_that_is_no_export(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="config.json: architectures"):
        load(tmp_path)


SPECULATORS_TITLED = {("eagle3", "vllm"), ("dflash", "vllm"), ("dspark", "vllm")}  # the speculators formats


def test_readme_title_names_each_kind_s_own_format():
    """Only EAGLE-3 and DFlash in `vllm` are speculators formats; every (kind, format) pair has its title."""
    from specheads.export import WRITERS
    from specheads.export.readme import readme_title

    for kind, writer in WRITERS.items():
        for fmt in writer.FORMATS_WRITTEN:
            title = readme_title(fmt, kind)
            assert ("speculators" in title) == ((kind, fmt) in SPECULATORS_TITLED), (kind, fmt, title)
    assert readme_title("sglang", "mtp") == "SGLang 0.5.23, NEXTN"


# --- a draft vocabulary equal to the target's (Vd == V): no d2t / t2d (vLLM rejects them) -------------
def full_vocab_names(out) -> set[str]:
    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        return set(fh.keys())


@pytest.mark.parametrize("fmt", FORMATS)
def test_full_vocab_head_ships_no_vocab_map_and_loads_as_identity(tmp_path, fmt):
    """vLLM builds draft_id_to_target_id only when Vd != V and raises "There is no module or parameter
    named 'draft_id_to_target_id'" on a d2t otherwise; our loader reads the folder as identity offsets."""
    head = make_head(draft_vocab_size=96)
    head.set_vocab_map(torch.zeros(96, dtype=torch.int64), torch.ones(96, dtype=torch.bool))
    out = export(save(tmp_path, head), fmt, tmp_path / fmt)
    names = full_vocab_names(out)
    assert "d2t" not in names and "t2d" not in names and "lm_head.weight" in names
    validate(out, fmt, expected=head.config)
    loaded = load(out)
    assert torch.equal(loaded.d2t, torch.zeros(96, dtype=torch.int64)) and bool(loaded.t2d.all())
    same_outputs(head.eval(), loaded)


def test_full_vocab_head_with_a_permuted_map_keeps_its_logits(tmp_path):
    """A Vd == V head whose d2t permutes the ids: lm_head rows are written in target order instead."""
    head = make_head(draft_vocab_size=96).eval()
    perm = torch.randperm(96, generator=torch.Generator().manual_seed(3))
    head.set_vocab_map(perm - torch.arange(96), torch.ones(96, dtype=torch.bool))
    loaded = load(export(save(tmp_path, head), "vllm-native", tmp_path / "out"))
    out = torch.randn(2, 5, head.config.hidden_size)

    def in_target_order(h):
        full = torch.empty(2, 5, 96)
        full[..., h.to_target_ids(torch.arange(96))] = h.logits(out)
        return full
    with torch.no_grad():
        assert torch.allclose(in_target_order(head), in_target_order(loaded), atol=1e-6)


def test_contract_refuses_a_vocab_map_with_a_full_draft_vocab(tmp_path):
    """A Vd == V folder that still carries d2t is what vLLM 0.33 rejects at weight load."""
    from safetensors.torch import load_file, save_file

    from specheads.export import ContractError

    head = make_head(draft_vocab_size=96)
    head.set_vocab_map(torch.zeros(96, dtype=torch.int64), torch.ones(96, dtype=torch.bool))
    out = export(save(tmp_path, head), "vllm", tmp_path / "v")
    tensors = load_file(str(out / "model.safetensors"))
    tensors["d2t"] = torch.zeros(96, dtype=torch.int64)
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ContractError, match="draft_id_to_target_id"):
        validate(out, "vllm")


def test_full_vocab_export_decodes_greedy_equal(tiny_target_dir, tmp_path):
    from specheads.provenance import provenance
    from specheads.target import Target
    from specheads.verify.eagle3_proposers import Eagle3Proposer
    from specheads.verify.loop import decode, greedy_decode

    target = Target.load(str(tiny_target_dir), device="cpu")
    torch.manual_seed(0)
    head = Eagle3Head.for_target(Eagle3Options(ttt_steps=3, draft_vocab_size=target.vocab_size), target.config)
    ckpt = save_checkpoint(tmp_path / "run", 1, head, recipe={}, provenance=provenance(target=target.fingerprint()),
                           trainer_state={})
    out = export(ckpt, "vllm", tmp_path / "export")
    assert "d2t" not in full_vocab_names(out)
    prompt = target.tokenizer("def add(a, b):\n    return")["input_ids"]
    ref = greedy_decode(target, prompt, 24)
    got = decode(target, Eagle3Proposer(load(out), target), prompt, 24, k=3)
    assert got.tokens == ref.tokens and got.stats.drafts > 0


def test_t2d_is_rebuilt_from_d2t_as_the_vocab_map_builds_it():
    from specheads.heads.vocab import t2d_from_d2t

    counts = torch.tensor([5, 0, 3, 9, 1, 0, 7, 2])
    d2t, t2d = build_vocab_map(counts, 4)
    assert torch.equal(t2d_from_d2t(d2t, 8), t2d)


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_serve_commands_use_absolute_paths(tiny_target_dir, tmp_path, monkeypatch, capsys, fmt):
    """Relative --out and a recipe's relative target.path: the printed and README commands name
    both absolutely (they must work from any directory)."""
    from specheads.cli import main as cli

    (tmp_path / "tgt").symlink_to(tiny_target_dir)
    ckpt = save(tmp_path, make_head(), recipe={"target": {"path": "tgt"}})
    monkeypatch.chdir(tmp_path)
    assert cli(["export", str(ckpt), "--format", fmt, "--out", "rel/out"]) == 0
    printed = capsys.readouterr().out
    assert f"exported {fmt} -> {tmp_path / 'rel' / 'out'}" in printed
    commands = read_export_meta(tmp_path / "rel" / "out").serve_commands
    readme = (tmp_path / "rel" / "out" / "README.md").read_text()
    for cmd in commands:
        assert cmd in printed and cmd in readme
        assert str(tmp_path / "tgt") in cmd and str(tmp_path / "rel" / "out") in cmd
        assert " tgt " not in cmd and " rel/out" not in cmd and '"rel/out"' not in cmd
