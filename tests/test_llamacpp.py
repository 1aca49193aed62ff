"""llama.cpp: the command lines built (no binaries needed), the refusals, and (engine-marked: with
SPECHEADS_ENGINE_TESTS=1 and llama.cpp built under the user cache) conversion of a tiny EAGLE-3 export,
speculative output equal to plain in llama.cpp with drafts accepted, and bad exports refused."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest
import torch

from specheads.engine_facts import LLAMA_CPP_BUILD
from specheads.engines import llamacpp as lc
from specheads.engines import llamacpp_check

FAKE = lc.LlamaCpp(Path("/opt/llama.cpp"))


# --- command lines (no binaries) ---------------------------------------------------------------------
def test_plain_server_command_has_no_speculative_flags():
    cmd = lc.server_command(FAKE, Path("t.gguf"), lc.SpecSettings(), 8123, 2, 1024)
    assert cmd[:3] == ["/opt/llama.cpp/build/bin/llama-server", "-m", "t.gguf"]
    assert cmd[cmd.index("--port") + 1] == "8123" and cmd[cmd.index("-t") + 1] == "2"
    assert cmd[cmd.index("-c") + 1] == "1024" and cmd[cmd.index("-np") + 1] == "1"
    assert not [a for a in cmd if a.startswith("--spec") or a == "-md"]


def test_parallel_slots_share_the_context_llama_server_splits():
    cmd = lc.server_command(FAKE, Path("t.gguf"), lc.SpecSettings(), 8123, 2, 1024, slots=8)
    assert cmd[cmd.index("-np") + 1] == "8" and cmd[cmd.index("-c") + 1] == "8192"  # 1024 tokens a slot


def test_eagle3_server_command_names_draft_type_and_k():
    spec = lc.SpecSettings(("draft-eagle3", "ngram-mod"), Path("d.gguf"), n_max=5)
    cmd = lc.server_command(FAKE, Path("t.gguf"), spec, 1, 4, 2048)
    assert cmd[cmd.index("-md") + 1] == "d.gguf" and cmd[cmd.index("-td") + 1] == "4"
    assert cmd[cmd.index("--spec-type") + 1] == "draft-eagle3,ngram-mod"
    assert cmd[cmd.index("--spec-draft-n-max") + 1] == "5"
    assert spec.label == "draft-eagle3+ngram-mod" and lc.SpecSettings().label == "plain"


def test_completion_is_greedy_uncached_and_returns_tokens():
    body = lc.completion_body([1, 2, 3], 16)
    assert body == {"prompt": [1, 2, 3], "n_predict": 16, "temperature": 0, "cache_prompt": False,
                    "return_tokens": True, "stream": False}


def test_build_commands_come_from_the_facts():
    cfg = lc.configure_command(Path("/s"), ninja=True)
    assert cfg[:5] == ["cmake", "-S", "/s", "-B", "/s/build"] and cfg[5:7] == ["-G", "Ninja"]
    assert "-DGGML_NATIVE=OFF" in cfg and "-DLLAMA_CURL=OFF" in cfg and tuple(cfg[7:]) == LLAMA_CPP_BUILD.configure
    assert "-G" not in lc.configure_command(Path("/s"), ninja=False)
    assert lc.build_command(Path("/s"), 2)[-3:] == ["--target", "llama-server", "llama-cli"]
    dl = lc.download_command(Path("/d"))
    assert "llama-cpp-python==0.3.36" in dl and dl[dl.index("--no-binary") + 1] == ":all:" and "--no-deps" in dl


def test_convert_command_runs_the_vendored_converter_through_the_shim():
    cmd = lc.convert_command(FAKE, Path("/e"), Path("/o.gguf"), "f16", Path("/t"))
    assert cmd[1] == str(lc.CONVERT_SHIM) and cmd[2] == "/opt/llama.cpp" and cmd[3] == "/e"
    assert cmd[cmd.index("--outtype") + 1] == "f16" and cmd[cmd.index("--target-model-dir") + 1] == "/t"
    assert "--target-model-dir" not in lc.convert_command(FAKE, Path("/t"), Path("/o.gguf"))


def test_the_shim_never_imports_specheads():
    """It runs the converter, under any Python: no specheads imports."""
    tree = ast.parse(lc.CONVERT_SHIM.read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.split(".")[0] == "specheads"]


def test_pre_tokenizer_rule_matches_only_gpt2_byte_level(tmp_path, tiny_target_dir):
    name, why = lc.pre_tokenizer(tiny_target_dir)
    assert name == "gpt-2" and "ByteLevel(use_regex=True, add_prefix_space=False)" in why
    (tmp_path / "tokenizer.json").write_text(json.dumps({"pre_tokenizer": {"type": "Metaspace"}}))
    assert lc.pre_tokenizer(tmp_path) is None
    assert lc.pre_tokenizer(tmp_path / "nowhere") is None


# --- refusals (no binaries) ------------------------------------------------------------------------------
def fake_export(folder: Path, kind: str = "eagle3", fmt: str = "vllm", layers=(2, 4, 5)) -> Path:
    folder.mkdir(parents=True)
    (folder / "specheads.json").write_text(json.dumps({"kind": kind, "format": fmt, "num_speculative_tokens": 3}))
    cfg = {"model_type": "qwen3"} if kind in ("dflash", "dspark") else {"eagle_aux_hidden_state_layer_ids": list(layers)}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_refusals_name_what_to_pass(tmp_path):
    assert lc.draft_spec(fake_export(tmp_path / "ok"))[0] == "draft-eagle3"
    assert lc.draft_spec(fake_export(tmp_path / "dfl", "dflash", "vllm-native", ()))[0] == "draft-dflash"
    assert lc.draft_spec(fake_export(tmp_path / "dsp", "dspark", "vllm", ()))[0] == "draft-dspark"
    with pytest.raises(lc.RefusedExport, match="no config.json / specheads.json; pass a folder written by"):
        lc.draft_spec(tmp_path)
    with pytest.raises(lc.RefusedExport, match=r"a eagle3 export in format sglang; .* eagle3 \(--format vllm\)"):
        lc.draft_spec(fake_export(tmp_path / "sg", fmt="sglang"))
    with pytest.raises(lc.RefusedExport, match="a dflash export in format vllm"):  # DFlashSpeculator: unsupported
        lc.draft_spec(fake_export(tmp_path / "df", kind="dflash"))
    with pytest.raises(lc.RefusedExport, match="a medusa export in format vllm-0.32"):
        lc.draft_spec(fake_export(tmp_path / "me", kind="medusa", fmt="vllm-0.32"))
    peagle = fake_export(tmp_path / "pe")
    (peagle / "config.json").write_text(json.dumps({"speculators_model_type": "peagle"}))
    with pytest.raises(lc.RefusedExport, match="has no P-EAGLE"):
        lc.draft_spec(peagle)
    with pytest.raises(lc.RefusedExport, match=r"eagle_aux_hidden_state_layer_ids \[1, 2, 3, 4\] taps 4 target layers; "
                       r"llama.cpp 0c1e570 says \"EAGLE3 requires exactly 3 entries in 'extract_layers'\""):
        lc.draft_spec(fake_export(tmp_path / "four", layers=(1, 2, 3, 4)))


def test_dflash_dspark_and_mtp_refusals_quote_the_converter(tmp_path):
    llama = fake_export(tmp_path / "llama", "dflash", "vllm-native", ())
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(lc.RefusedExport, match=r"config.json: model_type 'llama'; .* Qwen3 stack only .*"
                       r"class DFlashModel\(Qwen3Model\)"):
        lc.draft_spec(llama)
    qwen = fake_export(tmp_path / "qwen", "dflash", "vllm-native", ())
    (qwen / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert lc.draft_spec(qwen)[0] == "draft-dflash"
    gated = fake_export(tmp_path / "gated", "dspark", "vllm", ())
    (gated / "config.json").write_text(json.dumps({"transformer_layer_config": {"model_type": "qwen3"},
                                                   "markov_head_type": "gated"}))
    with pytest.raises(lc.RefusedExport, match=r"unsupported markov_head_type 'gated' \(only 'vanilla' is supported\)"):
        lc.draft_spec(gated)
    mtp = fake_export(tmp_path / "mtp", "mtp", "vllm", ())
    (mtp / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"]}))
    with pytest.raises(lc.RefusedExport, match=r"architectures \['DeepseekV3ForCausalLM'\]; .* \(supports_mtp_export\)"):
        lc.draft_spec(mtp)
    (mtp / "config.json").write_text(json.dumps({"architectures": ["Qwen3NextForCausalLM"]}))
    assert lc.draft_spec(mtp)[0] == "draft-mtp"
    qwen35 = {"architectures": ["Qwen3_5ForCausalLM"], "head_dim": 256, "hidden_size": 1024, "num_attention_heads": 8,
              "rope_parameters": {"partial_rotary_factor": 0.25}}  # 64 rotary dims hold the default 11 + 11 + 10
    (mtp / "config.json").write_text(json.dumps(qwen35))
    assert lc.draft_spec(mtp)[0] == "draft-mtp"
    (mtp / "config.json").write_text(json.dumps({**qwen35, "head_dim": 8}))  # 2 rotary dims: llama.cpp aborts
    with pytest.raises(lc.RefusedExport, match=r"mrope_section \[11, 11, 10\] .* gives 2 rotary dims; .*"
                       r"GGML_ASSERT\(sect_dims <= ne0\) failed"):
        lc.draft_spec(mtp)


def test_cli_refuses_a_bad_export_before_building_anything(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    assert lc.main(["check", str(fake_export(tmp_path / "sg", fmt="sglang")), "--target", str(tmp_path)]) == 2
    assert "llama.cpp: " in capsys.readouterr().err and not (tmp_path / "cache").exists()


def test_missing_build_and_missing_tools_say_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    with pytest.raises(lc.LlamaCppError, match="is not built under .*specheads.engines.llamacpp ensure"):
        lc.ensure(build=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(lc.LlamaCppError, match=r"needs cmake, a C compiler .*apt-get install cmake build-essential"):
        lc.ensure(progress=lambda m: None)
    assert not (tmp_path / "engines").exists()  # nothing downloaded


def test_bench_rows_and_table():
    from bench.llamacpp import DRAFTLESS_ROWS, markdown, rows_to_run, summarize

    rows = rows_to_run("draft-eagle3", Path("d.gguf"), 3, "ngram-mod")
    assert [r.label for r in rows] == ["plain", *DRAFTLESS_ROWS, "draft-eagle3", "draft-eagle3+ngram-mod", "plain"]
    plain = [lc.Completion("", [1, 2], {"predicted_n": 2, "predicted_ms": 100.0})]
    spec = [lc.Completion("", [1, 3], {"predicted_n": 2, "predicted_ms": 50.0, "draft_n": 4, "draft_n_accepted": 1})]
    load = {"before": [1.0, 1.0, 1.0], "after": [2.0, 1.0, 1.0]}
    a, b = summarize("plain", rows[0], plain, None, load, 2), summarize("x", rows[1], spec, plain, load, 2)
    assert a["tok_s"] == 20.0 and b["tok_s"] == 40.0 and b["greedy_equal"] is False and b["accepted_per_drafted"] == 0.25
    table = markdown({"version": "v", "prompts": 1, "n_predict": 2, "threads": 2, "omp_wait_policy": "(unset)",
                      "rows": [a, b]})
    assert "| plain | 20.0 | 1.00x | - | reference | 1.0 / 2.0 |" in table and "| x | 40.0 | 2.00x | 1/4 = 0.250 | 0/1 |" in table
    again = summarize("plain (again)", rows[-1], [lc.Completion("", [1, 2], {"predicted_n": 2, "predicted_ms": 200 / 3})],
                      plain, load, 2)  # 30 tok/s: the reference is the mean of plain's runs, 25
    table = markdown({"version": "v", "prompts": 1, "n_predict": 2, "threads": 2, "omp_wait_policy": "(unset)",
                      "rows": [a, b, again]})
    assert "| plain | 20.0 | 0.80x |" in table and "| x | 40.0 | 1.60x |" in table and "| plain (again) | 30.0 | 1.20x |" in table


def test_rows_are_interleaved_per_pass_and_the_mix_resolved_once():
    """Pass by pass, every row in turn (a fresh decode each); "auto" becomes the draftless type that
    was fastest in the first pass and stays so; the last plain row is "plain (again)"."""
    from bench.llamacpp import DRAFTLESS_ROWS, interleaved_rows, rows_to_run

    order = []  # ngram-map-k decodes two tokens in 20 ms, every other row in 40: the fastest draftless row

    def decode(spec):
        order.append(spec.label)
        ms = 20.0 if spec.types == ("ngram-map-k",) else 40.0
        return [lc.Completion("", [1, 2], {"predicted_n": 2, "predicted_ms": ms})]

    rows = interleaved_rows(rows_to_run("draft-eagle3", Path("d.gguf"), 3, "auto"), 2, decode, 2, None)
    one_pass = ["plain", *DRAFTLESS_ROWS, "draft-eagle3", "draft-eagle3+ngram-map-k", "plain"]
    assert order == one_pass * 2
    assert [r["row"] for r in rows] == [*one_pass[:-1], "plain (again)"]
    assert rows[0]["tokens"] == 4 and rows[0]["greedy_equal"] is None and rows[-1]["greedy_equal_prompts"] == "2/2"
    assert rows[2]["tok_s"] == 100.0 and rows[1]["tok_s"] == 50.0


def test_the_auto_mix_takes_the_fastest_draftless_row():
    from bench.llamacpp import resolve_mix, rows_to_run

    rows = rows_to_run("draft-eagle3", Path("d.gguf"), 3, "auto")
    measured = [{"spec_types": [], "tok_s": 100.0}, {"spec_types": ["ngram-simple"], "tok_s": 90.0},
                {"spec_types": ["ngram-mod"], "tok_s": 104.0}, {"spec_types": ["draft-eagle3"], "tok_s": 200.0}]
    mix = resolve_mix(rows[-2], measured)
    assert mix.types == ("draft-eagle3", "ngram-mod") and mix.draft == Path("d.gguf") and mix.n_max == 3
    assert resolve_mix(rows[1], measured) is rows[1]  # nothing to resolve
    with pytest.raises(lc.LlamaCppError, match="--mix auto needs the draftless rows"):
        resolve_mix(rows[-2], measured[:1])


# --- with llama.cpp (SPECHEADS_ENGINE_TESTS=1 and the build under the user cache) ----------------------------
needs_build = pytest.mark.skipif(not lc.built(lc.home() / "sdist" / "vendor" / "llama.cpp"),
                                 reason="llama.cpp is not built: python -m specheads.engines.llamacpp ensure")


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    """A random-weight EAGLE-3 head (scattered draft vocabulary of V / 2) on the tiny test target,
    exported in the speculators format."""
    from specheads.builtin.tiny_target import cached_tiny_target
    from specheads.engines.matrix import fingerprint_provenance, save_example
    from specheads.export import export
    from specheads.kinds import KINDS
    from specheads.target import Target

    tiny = cached_tiny_target("test", progress=False)
    target = Target.load(str(tiny), device="cpu")
    root = tmp_path_factory.mktemp("llamacpp")
    example = KINDS["eagle3"].example
    ckpt = save_example(root, example.build(target, example.seed), tiny, fingerprint_provenance(target))
    return export(ckpt, "vllm", root / "export"), tiny


def always_drafting(export_dir: Path, dest: Path, token: int) -> Path:
    """The export with weights that make the draft propose `token` at every step, with no tie: the MLP
    with gate = up (silu(g) * g >= 0) and a positive down_proj row 0 drives feature 0 of the final
    state above zero (fc and o_proj write nothing there), norm keeps only feature 0, lm_head row 0
    reads it, and d2t maps draft id 0 to `token`. Accepted only if llama.cpp runs the layer, the norm,
    the lm_head and the d2t map as we do."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(export_dir, dest)
    t = load_file(export_dir / "model.safetensors")
    targets = torch.arange(len(t["d2t"])) + t["d2t"]
    hit = (targets == token).nonzero().flatten()
    if len(hit):
        targets[int(hit[0])] = targets[0]
    targets[0] = token
    t["d2t"] = targets - torch.arange(len(targets))
    p = "layers.0."
    t[p + "mlp.up_proj.weight"] = t[p + "mlp.gate_proj.weight"].clone()
    t[p + "mlp.down_proj.weight"][0] = t[p + "mlp.down_proj.weight"][0].abs() + 0.1
    t["fc.weight"][0] = 0
    t[p + "self_attn.o_proj.weight"][0] = 0
    t["norm.weight"] = torch.zeros_like(t["norm.weight"])
    t["norm.weight"][0] = 1
    t["lm_head.weight"] = torch.zeros_like(t["lm_head.weight"])
    t["lm_head.weight"][0, 0] = 1
    save_file(t, dest / "model.safetensors")
    return dest


@pytest.mark.engine
@needs_build
def test_tiny_eagle3_export_converts(tiny_export, tmp_path):
    import gguf

    export_dir, tiny = tiny_export
    rec = lc.convert_draft(export_dir, tiny, tmp_path / "draft.gguf")
    assert rec["spec_type"] == "draft-eagle3" and rec["pre_tokenizer"]["fallback_applied"] == "gpt-2"
    assert json.loads((tmp_path / "draft.gguf.json").read_text())["command"] == rec["command"]
    reader = gguf.GGUFReader(tmp_path / "draft.gguf")
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    assert arch == "eagle3"
    layers = reader.fields["eagle3.target_layers"]
    assert [int(layers.parts[i][0]) for i in layers.data] == [2, 4, 5]
    names = {t.name for t in reader.tensors}
    assert "d2t" in names and "t2d" not in names


@pytest.mark.engine
@needs_build
def test_speculative_equals_plain_and_drafts_are_accepted(tiny_export, tmp_path):
    export_dir, tiny = tiny_export
    random = llamacpp_check.check(export_dir, tiny, tmp_path / "random", n_predict=24, limit=2, require_accepted=False,
                      progress=lambda m: None)
    assert random["verdict"] == "PASS" and random["greedy_equal"] and random["drafted"] > 0
    # the tiny target's greedy continuation of these prompts: draft its most frequent token
    plain, _ = lc.decode_all(lc.ensure(progress=lambda m: None), tmp_path / "random" / "target-f32.gguf",
                             lc.SpecSettings(), lc.prompt_ids(tiny, None, 2), 24, 2, tmp_path / "plain.log")
    tokens = [t for o in plain for t in o.tokens]
    token = max(set(tokens), key=tokens.count)
    accepting = always_drafting(export_dir, tmp_path / "accepting", token)
    r = llamacpp_check.check(accepting, tiny, tmp_path / "accept", n_predict=24, limit=2, progress=lambda m: None)
    assert r["verdict"] == "PASS", r["problems"]
    assert r["greedy_equal"] and r["accepted"] > 0 and r["accepted_per_drafted"] > 0.5


@pytest.mark.engine
@needs_build
def test_bad_exports_are_refused_with_the_reason(tiny_export, tmp_path):
    from safetensors.torch import load_file, save_file

    export_dir, tiny = tiny_export
    bad = tmp_path / "bad"
    shutil.copytree(export_dir, bad)
    t = load_file(bad / "model.safetensors")
    t["d2t"][-1] = 10_000  # a draft id mapped past the target vocabulary: the converter's own check
    save_file(t, bad / "model.safetensors")
    with pytest.raises(lc.LlamaCppError, match="d2t target ids out of range"):
        lc.convert_draft(bad, tiny, tmp_path / "bad.gguf")
    meta = json.loads((export_dir / "specheads.json").read_text())
    sg = tmp_path / "sglang"
    shutil.copytree(export_dir, sg)
    (sg / "specheads.json").write_text(json.dumps({**meta, "format": "sglang"}))
    with pytest.raises(lc.RefusedExport, match="format sglang"):
        lc.convert_draft(sg, tiny, tmp_path / "sg.gguf")


def test_omp_wait_policy_is_passed_and_recorded(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert lc.omp_env(None) == {} and lc.omp_label(None) == "(unset)"
    assert lc.omp_env("PASSIVE") == {"OMP_WAIT_POLICY": "PASSIVE"} and lc.omp_label("PASSIVE") == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert lc.omp_label(None) == "ACTIVE"
    server = lc.Server(FAKE, Path("/m.gguf"), env=lc.omp_env("PASSIVE"))
    assert server.env == {"OMP_WAIT_POLICY": "PASSIVE"} and FAKE.env(**server.env)["OMP_WAIT_POLICY"] == "PASSIVE"
    assert FAKE.env()["LD_LIBRARY_PATH"].split(":")[0] == "/opt/llama.cpp/build/bin"


# --- the cost curve (bench/llamacpp.py --cost): arithmetic on llama.cpp's counters, no binaries ---------
def test_cost_curve_from_llama_cpp_counters():
    from bench.llamacpp import cond_acceptance, cost_curve, draft_step_ms, fit_draft_costs

    assert cond_acceptance({"drafts": 10, "accepted_per_pos": [8, 4, 1]}) == [0.8, 0.5, 0.25]
    assert cond_acceptance({"drafts": 0, "accepted_per_pos": [0]}) == [0.0]
    outs = [lc.Completion("", [], {"predicted_n": 11, "predicted_ms": 40.0, "draft_n": 12, "draft_n_accepted": 2}),
            lc.Completion("", [], {"predicted_n": 5, "predicted_ms": 40.0}),
            lc.Completion("", [], {"predicted_n": 3, "predicted_ms": 1.0})]
    # 11 tokens = the first + 8 steps (+ 2 accepted over them): 5 ms a step; plain 4 steps of 10 ms, 2 of 0.5
    assert draft_step_ms(outs) == (5.0, 14)
    verify = {2: 3.0, 3: 4.0, 4: 5.0}
    fixed, per = fit_draft_costs({1: 3.5, 2: 5.0, 3: 6.5}, verify)  # step - verify = 0.5 + 0.5 k
    assert fixed == pytest.approx(0.0) and per == pytest.approx(0.5)
    run = {"plain_tok_s": 500.0, "plain_step_ms": 2.0, "verify_samples_ms": {1: [2.9, 3.0, 3.1], 2: [4.0], 3: [5.0]},
           "spec": {1: {"step_ms": 5.0, "steps": 10}, 2: {"step_ms": 6.2, "steps": 10}}}
    c = cost_curve(run)  # plain step 2 ms, request overhead 3 - 2 = 1 ms taken off every t(n)
    assert c["request_overhead_ms"] == pytest.approx(1.0) and c["t_ms"] == pytest.approx({1: 2.0, 2: 3.0, 3: 4.0})
    assert c["v"] == pytest.approx({1: 1.0, 2: 1.5, 3: 2.0})
    assert c["c_per_k"] == pytest.approx({1: 1.0, 2: 0.55})  # (5 - 3) / 1 / 2, (6.2 - 4) / 2 / 2


def test_cost_prediction_says_no_speculation_when_the_draft_costs_more_than_it_saves():
    from bench.llamacpp import predicted, recommendation

    flat = {"t_ms": {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3}, "plain_step_ms": 1.0, "draft_fixed_ms": 0.0,
            "draft_per_token_ms": 0.14}  # verifying 4 tokens barely costs more than 1
    cheap = predicted(flat, [0.9, 0.85, 0.8], [1, 2, 3])
    # k = 3: 3.28 tokens per step / (1.3 + 3 x 0.14)
    assert cheap.speculate() and recommendation(cheap) == "--spec-draft-n-max 3 (predicted 1.91x of plain llama.cpp)"
    # the hand measurement on SmolLM2 Q4_1 (v(2) 1.8, v(3) 2.4, v(4) 3.3, c 0.14): even 90% acceptance loses
    cpu = {**flat, "t_ms": {1: 1.0, 2: 1.8, 3: 2.4, 4: 3.3}}
    dear = predicted(cpu, [0.9, 0.85, 0.8], [1, 2, 3])
    assert not dear.speculate() and recommendation(dear) == (
        "no speculation (best predicted: k=1 at 0.98x of plain llama.cpp)")


@pytest.mark.engine
@needs_build
def test_regeneration_through_llama_server_answers_like_local_generation(tiny_export, tmp_path):
    """bench/regenerate_endpoint.py: `specheads regenerate`'s OpenAI backend against llama-server (an f32
    GGUF of the tiny target, 1 and 2 slots) answers every prompt as local greedy generation does."""
    from bench.regenerate_endpoint import main as endpoint_bench

    _, tiny = tiny_export
    gguf = tmp_path / "tiny-f32.gguf"
    lc.convert(tiny, gguf, "f32")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n"
                               for i, p in enumerate(["Name three colours.", "Count to five.", "Say hello."])))
    rc = endpoint_bench(["--target", str(tiny), "--gguf", str(gguf), "--prompts", str(prompts), "--out",
                         str(tmp_path / "out"), "--max-new-tokens", "12", "--slots", "1,2", "--batch-size", "2"])
    r = json.loads((tmp_path / "out" / "regenerate_endpoint.json").read_text())
    assert rc == 0 and [m["answers"] for m in r["methods"]] == [3, 3, 3]
    assert [m["equal_to_local"] for m in r["methods"][1:]] == [3, 3] and r["methods"][0]["tokens"] > 0
    assert "| llama-server tiny-f32, 2 slots |" in (tmp_path / "out" / "regenerate_endpoint.md").read_text()


def test_side_by_side_rows_are_predicted_from_the_cost_curve():
    """bench/llamacpp.py --cost-json: a row's step mix priced at t(n) (linear), the drafter's cost on every
    step of a model row; the recommendation is the best predicted row, plain when none beats it."""
    from bench.llamacpp import add_row_predictions, markdown, row_prediction

    curve = {"t_ms": {"1": 10.0, "2": 14.0, "3": 18.0, "4": 22.0}, "plain_step_ms": 10.0,
             "draft_fixed_ms": 1.0, "draft_per_token_ms": 2.0}

    def row(name, types, draft, k, tok_s, prompts):
        return {"row": name, "spec_types": types, "draft": draft, "spec_draft_n_max": k, "tok_s": tok_s,
                "drafted": sum(p["draft_n"] for p in prompts), "accepted": sum(p["draft_n_accepted"] for p in prompts),
                "per_prompt": prompts, "greedy_equal_prompts": "1/1", "greedy_equal": True,
                "accepted_per_drafted": 0.5, "load_average": {"before": [0.1], "after": [0.1]}}

    # 11 tokens after the first: 6 steps (5 accepted), 10 drafted -> 6 * 10 + 10 * 4 = 100 ms for 11 tokens
    lookup = row("ngram-mod", ["ngram-mod"], None, None, 110.0,
                 [{"predicted_n": 12, "predicted_ms": 0, "draft_n": 10, "draft_n_accepted": 5}])
    assert row_prediction(lookup, curve, None) == 11 * 10.0 / 100.0
    # the model row: + 6 steps x (1 + 3 x 2) ms = 142 ms for the same 11 tokens
    model = row("draft-eagle3", ["draft-eagle3"], "d.gguf", 3, 70.0,
                [{"predicted_n": 12, "predicted_ms": 0, "draft_n": 10, "draft_n_accepted": 5}])
    assert abs(row_prediction(model, curve, 3) - 110.0 / 142.0) < 1e-12
    # a model row drafting k on every step (6 steps x 3 = 18) is priced at the cost run's own step at k = 3
    full = row("draft-eagle3", ["draft-eagle3"], "d.gguf", 3, 70.0,
               [{"predicted_n": 12, "predicted_ms": 0, "draft_n": 18, "draft_n_accepted": 5}])
    assert row_prediction(full, {**curve, "step_ms": {"3": 25.0}}, 3) == 11 * 10.0 / (6 * 25.0)
    assert row_prediction(full, curve, 3) == 11 * 10.0 / (6 * 10.0 + 18 * 4.0 + 6 * 7.0)  # no timed step: the parts
    plain = row("plain", [], None, None, 100.0, [{"predicted_n": 12, "predicted_ms": 0, "draft_n": 0, "draft_n_accepted": 0}])
    result = {"version": "v", "prompts": 1, "n_predict": 12, "threads": 2, "omp_wait_policy": "(unset)",
              "rows": [plain, lookup, model, {**plain, "row": "plain (again)"}]}
    add_row_predictions(result, {"curve": curve, "source": "cost.json"})
    assert [r["within_10pct"] for r in result["rows"][:3]] == [True, True, False]  # 1.10 vs 1.10; 0.77 vs 0.70
    assert result["recommended"] == result["fastest_measured"] == "ngram-mod"
    assert "**Recommended: ngram-mod**" in markdown(result) and "| 1.10x (within 10%) |" in markdown(result)
    lookup["tok_s"], lookup["per_prompt"][0]["draft_n_accepted"] = 50.0, 0  # nothing accepted: plain wins
    add_row_predictions(result, {"curve": curve, "source": "cost.json"})
    assert result["recommended"] == result["fastest_measured"] == "plain"
    assert "**Recommended: no speculation (plain)**" in markdown(result)
    # a predicted gain under MIN_GAIN (here 1.02x) is noise: plain is recommended, and a row measured 2%
    # faster than plain is within the drift of plain's two runs (3%), so the recommendation still holds
    lookup["tok_s"], lookup["drafted"], lookup["per_prompt"][0]["draft_n_accepted"] = 102.0, 2, 1  # 110 / 108 ms
    result["rows"][-1]["tok_s"] = 97.0
    add_row_predictions(result, {"curve": curve, "source": "cost.json"})
    assert 1.0 < lookup["predicted_speedup"] < 1.05 and result["fastest_measured"] == "ngram-mod"
    assert result["recommended"] == "plain" and result["recommended_is_fastest"]
    lookup["tok_s"] = 120.0  # 20% faster than plain is no longer noise
    add_row_predictions(result, {"curve": curve, "source": "cost.json"})
    assert not result["recommended_is_fastest"] and "is NOT the fastest measured" in markdown(result)


# --- what llama-server does per step, priced (bench/llamacpp.py): llama.cpp's own log lines, no binaries --
def log_lines(requests: list[dict]) -> str:
    """A llama-server log at -lv 4, in llama.cpp's own format: per request its timings, the cumulative
    `graphs reused` and, per implementation, the cumulative statistics."""
    out = ["$ llama-server -m m.gguf", "0.00.001.000 I srv  llama_server: initializing ..."]
    for i, r in enumerate(requests):
        out += [f"0.00.3{i:02d}.450 I slot print_timing: id  0 | task {10 * i} | prompt eval time =      "
                f"{r['prompt_ms']:.2f} ms /    {r['prompt_n']} tokens (    0.26 ms per token,  3804.25 tokens per second)",
                f"0.00.3{i:02d}.455 I slot print_timing: id  0 | task {10 * i} |        eval time =      "
                f"{r.get('eval_ms', 12.0):.2f} ms /    {r['eval_n']} tokens (    0.81 ms per token,  1236.50 tokens per second)",
                f"0.00.3{i:02d}.460 I slot print_timing: id  0 | task {10 * i} |    graphs reused =          {r['reused']}"]
        for impl, (calls, drafts, tokens, acc, ms) in r.get("stats", {}).items():
            out.append(f"0.00.3{i:02d}.509 I spec common_specu: statistics {impl:>16}: #calls(b,g,a) =    {i + 1}  "
                       f"{calls:5d}      0, #gen drafts =  {drafts:5d}, #acc drafts =     0, #gen tokens =  {tokens:5d}, "
                       f"#acc tokens =  {acc:4d}, dur(b,g,a) = 0.001, {ms:.3f}, 0.000 ms")
        out.append(f"0.00.3{i:02d}.567 I slot      release: id  0 | task {10 * i} | stop processing: n_tokens = 59")
    return "\n".join(out) + "\n"


def test_server_log_gives_each_requests_own_counters(tmp_path):
    """llama-server's counters are cumulative over its life; each request gets its own (the first
    request's are its own), a missing log is no requests."""
    from specheads.engines import llamacpp_log

    path = tmp_path / "server.log"
    path.write_text(log_lines([
        {"prompt_ms": 11.57, "prompt_n": 44, "eval_n": 16, "reused": 4,
         "stats": {"ngram-simple": (6, 0, 0, 0, 0.004), "draft-eagle3": (6, 6, 15, 9, 2.268)}},
        {"prompt_ms": 9.5, "prompt_n": 44, "eval_n": 30, "reused": 19,
         "stats": {"ngram-simple": (10, 1, 12, 7, 0.010), "draft-eagle3": (9, 9, 24, 12, 3.5)}}]))
    first, second = llamacpp_log.read(path)
    assert (first["prompt_ms"], first["prompt_n"], first["eval_n"], first["graphs_reused"]) == (11.57, 44, 16, 4)
    assert first["stats"]["draft-eagle3"] == {"calls_begin": 1, "calls_draft": 6, "calls_accept": 0, "gen_drafts": 6,
                                              "acc_drafts": 0, "gen_tokens": 15, "acc_tokens": 9, "draft_ms": 2.268}
    assert second["graphs_reused"] == 15 and second["eval_n"] == 30
    assert second["stats"]["ngram-simple"] == {"calls_begin": 1, "calls_draft": 4, "calls_accept": 0, "gen_drafts": 1,
                                               "acc_drafts": 0, "gen_tokens": 12, "acc_tokens": 7, "draft_ms": 0.006}
    assert second["stats"]["draft-eagle3"]["calls_draft"] == 3 and second["stats"]["draft-eagle3"]["draft_ms"] == 1.232
    assert llamacpp_log.read(path, last=1) == [second] and llamacpp_log.read(tmp_path / "none.log") == []


def test_a_completion_gets_its_log_record_only_where_the_counts_agree():
    from bench.llamacpp import attach_log, request_log

    outs = [lc.Completion("", [], {"predicted_n": 16}), lc.Completion("", [], {"predicted_n": 30})]
    records = [{"eval_n": 16, "graphs_reused": 3, "stats": {}}, {"eval_n": 16, "graphs_reused": 4, "stats": {}},
               {"eval_n": 30, "graphs_reused": 9, "stats": {"x": {}}}]  # a warm-up first
    attach_log(outs, records)
    assert [request_log(o) for o in outs] == [{"graphs_reused": 4, "stats": {}}, {"graphs_reused": 9, "stats": {"x": {}}}]
    fresh = [lc.Completion("", [], {"predicted_n": 17})]
    attach_log(fresh, records[:1])  # 17 tokens asked, 16 logged: not this request's record
    assert fresh[0].server_log is None and request_log(fresh[0]) is None


def test_verification_samples_are_the_ones_llama_cpp_built_or_reused_a_graph_for():
    """t(n) from requests that evaluated exactly n tokens in a graph built for them; the graph build's
    reference from the second 1-token request in a row, when llama.cpp says it reused the first's graph."""
    from bench.llamacpp import split_verify

    requests = [{"n": 1, "again": False, "ms": 3.0, "prompt_n": 1}, {"n": 1, "again": True, "ms": 2.2, "prompt_n": 1},
                {"n": 2, "again": False, "ms": 4.0, "prompt_n": 2}, {"n": 3, "again": False, "ms": 9.0, "prompt_n": 2},
                {"n": 1, "again": False, "ms": 3.2, "prompt_n": 1}, {"n": 1, "again": True, "ms": 2.9, "prompt_n": 1}]
    # the prefix request first; then: built, reused, built, (evaluated 2, not 3), built, built (not reused)
    log = [{"graphs_reused": 0}, *({"graphs_reused": r} for r in (0, 1, 0, 0, 0, 0))]
    assert split_verify(requests, log) == ({1: [3.0, 3.2], 2: [4.0]}, [2.2])
    # without a log that covers every request, every sample counts
    assert split_verify(requests, []) == ({1: [3.0, 3.2], 2: [4.0]}, [2.2, 2.9])


def test_cost_run_measures_what_a_step_costs_beyond_verification():
    """The graph build (built less reused 1-token request), a speculative step's overhead (never-drafting
    step less plain's), the drafter's catch-up per token (prompt time with it less without), one accepted
    token (synthetic all-accepted less none-accepted step, per draft) and the logits of each verified token
    (slope over k of what the step leaves after the measured parts)."""
    from bench.llamacpp import accepted_token_ms, cost_curve, drafter_call_ms, process_per_token_ms

    assert process_per_token_ms([(10, 20.0), (20, 40.0)], [[(10, 25.0), (20, 50.0)], [(10, 23.0), (20, 46.0)]]) == 0.4
    assert process_per_token_ms([(10, 20.0)], [[(11, 25.0)]]) is None  # not the same prompts
    every = [lc.Completion("", [], {"predicted_n": 13, "predicted_ms": 36.0, "draft_n": 12, "draft_n_accepted": 9})]
    none = [lc.Completion("", [], {"predicted_n": 13, "predicted_ms": 300.0, "draft_n": 36, "draft_n_accepted": 0})]
    assert accepted_token_ms(none, every, 3) == 0.0  # 12 ms a step accepting all, 25 accepting none: clamped
    assert accepted_token_ms(none, [lc.Completion("", [], {"predicted_n": 13, "predicted_ms": 120.0, "draft_n": 12,
                                                           "draft_n_accepted": 9})], 3) == pytest.approx(5.0)
    stats = {"draft-eagle3": {"calls_draft": 4, "draft_ms": 10.0}, "ngram-simple": {"calls_draft": 9, "draft_ms": 1.0}}
    logged = [lc.Completion("", [], {}, {"stats": stats}), lc.Completion("", [], {}, {"stats": stats})]
    assert drafter_call_ms(logged) == 2.5 and drafter_call_ms([lc.Completion("", [], {})]) is None
    # plain step 10 ms; prompt requests: 1 token 12 (built) / 11 (reused), t(n) = 10 + 4 (n - 1)
    run = {"plain_tok_s": 100.0, "plain_step_ms": 10.0, "verify_reused_ms": [11.0, 11.2, 10.8],
           "verify_samples_ms": {1: [12.0], 2: [16.0], 3: [20.0], 4: [24.0]}, "nodraft_step_ms": 10.5,
           "process_per_token_ms": 0.25, "accepted_token_ms": 1.0,
           # step(k) = drafts 3k + t(k + 1) + (k + 1) 0.25 + 0.5 accepted + 0.5 overhead + 0.6 + 0.8 k (logits)
           "spec": {k: {"step_ms": 3 * k + 10 + 4 * k + (k + 1) * 0.25 + 0.5 + 0.5 + 0.6 + 0.8 * k, "steps": 10,
                        "accepted": 5, "draft_call_ms": 3.0 * k} for k in (1, 2, 3)}}
    c = cost_curve(run)
    assert c["graph_build_ms"] == pytest.approx(1.0) and c["spec_overhead_ms"] == pytest.approx(0.5)
    assert c["t_ms"] == pytest.approx({1: 10.0, 2: 14.0, 3: 18.0, 4: 22.0}) and c["accepted_per_step"] == {1: 0.5, 2: 0.5,
                                                                                                          3: 0.5}
    assert c["draft_call_ms"] == {1: 3.0, 2: 6.0, 3: 9.0} and c["output_row_ms"] == pytest.approx(0.8)
    assert cost_curve({**run, "accepted_token_ms": None})["output_row_ms"] is None  # a part unmeasured: no fit


# the cost run's prices: t(n) = 10 + 4 (n - 1) (measured to 8, linear beyond), the drafter's step at k = 3
# timed at 40 ms (its 3 draft decodes 9 ms, 1 accepted token per step), overhead 0.5, a graph build 2, an
# accepted token 1, the drafter's catch-up 0.25 and a verified token's logits 0.5 ms
PRICED = {"t_ms": {"1": 10.0, "2": 14.0, "3": 18.0, "4": 22.0, "8": 38.0}, "plain_step_ms": 10.0,
          "draft_fixed_ms": 1.0, "draft_per_token_ms": 2.0, "step_ms": {"3": 40.0}, "draft_call_ms": {"3": 9.0},
          "accepted_per_step": {"3": 1.0}, "spec_overhead_ms": 0.5, "graph_build_ms": 2.0, "accepted_token_ms": 1.0,
          "process_per_token_ms": 0.25, "output_row_ms": 0.5, "request_overhead_ms": 1.0}


def priced_row(name, types, draft, k, tokens, drafted, accepted, reused, stats, tok_s=50.0):
    """A side-by-side row of one request as bench/llamacpp.py saves it, with its server log record."""
    p = {"predicted_n": tokens + 1, "predicted_ms": 0.0, "draft_n": drafted, "draft_n_accepted": accepted,
         "server_log": None if reused is None else {"graphs_reused": reused, "stats": stats}}
    return {"row": name, "spec_types": types, "draft": draft, "spec_draft_n_max": k, "tok_s": tok_s, "drafted": drafted,
            "accepted": accepted, "per_prompt": [p], "greedy_equal_prompts": "1/1", "greedy_equal": True,
            "accepted_per_drafted": accepted / drafted if drafted else None,
            "load_average": {"before": [0.1], "after": [0.1]}}


def test_rows_are_priced_as_llama_server_ran_their_steps():
    """A draftless row: every step t(1) + overhead; each of its 2 drafts (llama.cpp's statistics: 10 tokens)
    t(1 + 5) - t(1), and each drafted token's logits; each accepted token; 3 graph builds beyond plain's on
    the prompt; the lookups' own 0.3 ms. A mixed row: the model's timed step on all 10 steps, corrected to
    the row's accepted tokens; on the 2 steps where the lookup drafted (20 tokens each), t(21) - t(4), 17
    more logits and 18 more tokens of catch-up instead of the 3 draft decodes; + 4 builds and 0.2 ms of
    lookups. The old pricing (t(n) and the drafter on every step) missed all of these."""
    from bench.llamacpp import row_prediction

    plain = priced_row("plain", [], None, None, 40, 0, 0, 39, {})  # 40 steps, 1 graph built: its own baseline
    lookup = priced_row("ngram-mod", ["ngram-mod"], None, None, 11, 10, 5, 2, {"ngram-mod": {
        "calls_draft": 6, "gen_drafts": 2, "gen_tokens": 10, "acc_tokens": 5, "draft_ms": 0.3}})
    plain11 = priced_row("plain", [], None, None, 11, 0, 0, 10, {})
    # 6 steps x 10.5 + 10 x 0.5 + 2 x (30 - 10) + 5 x 1 + (4 - 1) x 2 + 0.3 = 119.3 ms for 11 tokens
    assert row_prediction(lookup, PRICED, None, plain11) == pytest.approx(11 * 10.0 / 119.3)
    assert row_prediction(lookup, PRICED, None, plain11) != pytest.approx(11 * 10.0 / 100.0)  # the old price
    mixed = priced_row("draft-eagle3+ngram-simple", ["draft-eagle3", "ngram-simple"], "d.gguf", 3, 40, 64, 30, 5, {
        "ngram-simple": {"calls_draft": 10, "gen_drafts": 2, "gen_tokens": 40, "acc_tokens": 16, "draft_ms": 0.2},
        "draft-eagle3": {"calls_draft": 8, "gen_drafts": 8, "gen_tokens": 24, "acc_tokens": 14, "draft_ms": 72.0}})
    # a lookup step: t(21) 90 - t(4) 22 + 17 x 0.5 + 18 x 0.25 - 9 = 72 ms more than the model's step;
    # 10 x 40 + (30 - 10 x 1) x 1 + 2 x 72 + 4 x 2 + 0.2 = 572.2 ms for 40 tokens
    assert row_prediction(mixed, PRICED, 3, plain) == pytest.approx(40 * 10.0 / 572.2)
    assert row_prediction(mixed, PRICED, 3, plain) != pytest.approx(40 * 10.0 / (10 * 10 + 64 * 4 + 10 * 7))  # old
    # the model alone, drafting 3 on every step: its timed step, corrected to its 12 accepted tokens
    model = priced_row("draft-eagle3", ["draft-eagle3"], "d.gguf", 3, 22, 30, 12, 9, {})
    assert row_prediction(model, PRICED, 3, plain) == pytest.approx(22 * 10.0 / (10 * 40 + 2 * 1.0))
    # no per-implementation statistics (an older run): the mixed row as before, the drafter on every step
    older = priced_row("draft-eagle3+ngram-simple", ["draft-eagle3", "ngram-simple"], "d.gguf", 3, 40, 64, 30, 5, {})
    assert row_prediction(older, PRICED, 3, plain) == pytest.approx(40 * 10.0 / (10 * 10 + 64 * 4 + 10 * 7))


def test_an_older_cost_run_prices_only_what_it_measured_and_says_what_it_lacked():
    from bench.llamacpp import add_row_predictions, markdown

    old_curve = {k: v for k, v in PRICED.items() if k not in ("spec_overhead_ms", "graph_build_ms", "accepted_token_ms",
                                                              "output_row_ms", "draft_call_ms", "accepted_per_step")}
    plain = priced_row("plain", [], None, None, 11, 0, 0, 10, {}, tok_s=100.0)
    lookup = priced_row("ngram-mod", ["ngram-mod"], None, None, 11, 10, 5, 2, {})  # a log, no statistics
    mixed = priced_row("draft-eagle3+ngram-simple", ["draft-eagle3", "ngram-simple"], "d.gguf", 3, 11, 18, 5, None, {})
    result = {"version": "v", "prompts": 1, "n_predict": 12, "threads": 2, "omp_wait_policy": "(unset)",
              "rows": [plain, lookup, mixed, {**plain, "row": "plain (again)"}]}
    add_row_predictions(result, {"curve": old_curve, "source": "cost.json"})
    # 6 steps x 10 + 10 x 4 (the slope: no statistics) + 5 x 0 + 3 builds x 0 = 100 ms: what it measured
    assert lookup["predicted_speedup"] == pytest.approx(1.1) and lookup["prediction_basis"] == "draftless"
    assert "upper bound" in mixed["prediction_basis"]
    note = markdown(result)
    for lacked in ("a speculative step's overhead", "a graph build", "an accepted token's sampling and emission",
                   "the logits of each verified token beyond the last", "some rows' server logs",
                   "which steps the mixed row's lookup drafted"):
        assert lacked in note
    assert "the drafter's catch-up per token" not in note  # this one it measured


def test_requests_a_shared_machine_slowed_are_named_and_left_out_of_a_second_measure():
    """A request whose steps took 1.5x longer against their price than the row's median request did was
    slowed from outside llama.cpp; the row's speed-up is also given without it (and plain's on the same
    prompts)."""
    from bench.llamacpp import add_row_predictions, markdown

    def rows(ms):
        return [{"predicted_n": 11, "predicted_ms": x, "draft_n": 0, "draft_n_accepted": 0} for x in ms]

    def row(name, types, ms):
        r = priced_row(name, types, None, None, 10, 0, 0, None, {})
        r["per_prompt"] = rows(ms)
        r["tok_s"] = 11 * len(ms) / (sum(ms) / 1000)
        return r

    plain = row("plain", [], [100.0, 100.0, 100.0, 100.0])
    slowed = row("ngram-mod", ["ngram-mod"], [100.0, 300.0, 110.0, 100.0])  # the second: 3x the others
    again = row("plain (again)", [], [100.0, 100.0, 100.0, 100.0])
    result = {"version": "v", "prompts": 4, "n_predict": 11, "threads": 2, "omp_wait_policy": "(unset)",
              "rows": [plain, slowed, again]}
    add_row_predictions(result, {"curve": {**PRICED, "t_ms": {"1": 10.0, "2": 14.0}}, "source": "cost.json"})
    assert slowed["disturbed"] == [1] and plain["disturbed"] == [] and again["disturbed"] == []
    assert slowed["measured_speedup"] == pytest.approx(400 / 610)
    assert slowed["measured_speedup_undisturbed"] == pytest.approx(300 / 310)
    assert "; 1 disturbed requests, 0.97x measured without them |" in markdown(result)


def test_a_finished_run_is_priced_again_from_its_files(tmp_path, capsys):
    """--reprice RUNDIR: an older run's JSON (no log records in it), cost curve and server logs (the last
    pass of each row, plain's overwritten by plain again's) priced again, the earlier prediction kept."""
    from bench.llamacpp import main

    run = tmp_path / "run"
    run.mkdir()
    curve = {k: v for k, v in PRICED.items() if k not in ("graph_build_ms", "process_per_token_ms")}

    def saved(name, types, draft, k, drafted, accepted):  # 2 passes of one prompt: 11 tokens each
        r = priced_row(name, types, draft, k, 11, drafted, accepted, None, {})
        p = {key: v for key, v in r["per_prompt"][0].items() if key != "server_log"}
        return {**r, "drafted": 2 * drafted, "accepted": 2 * accepted, "predicted_speedup": 0.5,
                "per_prompt": [dict(p), dict(p)]}

    rows = [saved("plain", [], None, None, 0, 0), saved("ngram-mod", ["ngram-mod"], None, None, 10, 5),
            saved("plain (again)", [], None, None, 0, 0)]
    (run / "llamacpp.json").write_text(json.dumps({"prompts": 1, "passes": 2, "n_predict": 11, "rows": rows,
                                                   "cost_curve_from": "llamacpp_cost.json"}))
    (run / "llamacpp_cost.json").write_text(json.dumps({"curve": curve}))
    # two warm-ups of 16 tokens (cumulative counters), then the last pass's request
    warm = [{"prompt_ms": 5.0, "prompt_n": 10, "eval_n": 16, "reused": 15 * i, "stats": {"ngram-mod": (0, 0, 0, 0, 0.0)}}
            for i in (1, 2)]
    (run / "server-plain.log").write_text(log_lines([*warm, {"prompt_ms": 5.0, "prompt_n": 10, "eval_n": 12,
                                                             "reused": 39}]))  # 10 steps, 1 graph built
    (run / "server-ngram-mod.log").write_text(log_lines([*warm, {"prompt_ms": 5.0, "prompt_n": 10, "eval_n": 12,
                                                                 "reused": 32, "stats": {"ngram-mod": (6, 2, 10, 5, 0.3)}}]))
    (run / "cost-plain.log").write_text(log_lines([*warm, {"prompt_ms": 20.0, "prompt_n": 10, "eval_n": 12, "reused": 1}]))
    (run / "cost-spec-k3.log").write_text(log_lines([warm[0], {"prompt_ms": 22.5, "prompt_n": 10, "eval_n": 12,
                                                               "reused": 1}]))
    assert main(["--reprice", str(run), "--out", str(tmp_path / "out")]) == 0
    r = json.loads((tmp_path / "out" / "llamacpp_repriced.json").read_text())
    lookup = r["rows"][1]
    assert lookup["per_prompt"][0].get("server_log") is None  # the first pass: its log was overwritten
    assert lookup["per_prompt"][1]["server_log"] == {"graphs_reused": 2, "stats": {"ngram-mod": {
        "calls_begin": 1, "calls_draft": 6, "calls_accept": 0, "gen_drafts": 2, "acc_drafts": 0, "gen_tokens": 10,
        "acc_tokens": 5, "draft_ms": 0.3}}}
    # the drafter's catch-up from the cost logs: (22.5 - 20) / 10; the last pass's counters stand for both:
    # 2 x [6 x 10.5 + 10 x 0.5 + 2 x 20 + 5 x 1 + 3 builds x 0 + 0.3] = 2 x 113.3 ms for 22 tokens
    assert r["rows"][1]["predicted_before"] == 0.5 and r["rows"][1]["predicted_speedup"] == pytest.approx(220 / 226.6)
    assert "| ngram-mod | " in (tmp_path / "out" / "llamacpp_repriced.md").read_text()
    assert main(["--reprice", str(tmp_path / "nothing")]) == 2
    assert "cannot re-price" in capsys.readouterr().err
