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
