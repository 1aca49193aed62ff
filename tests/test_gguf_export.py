"""`specheads export --format gguf`: what llama.cpp cannot run is refused in its own words before
anything is looked for or built (no binaries needed); and (engine-marked: SPECHEADS_ENGINE_TESTS=1 with
llama.cpp built under the user cache) every kind llama.cpp serves exports to a folder llama-server
decodes greedy-equal, whose sidecar matches the export, with each injected fault caught."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from specheads.cli import main as cli_main
from specheads.engine_facts import LLAMA_CPP_SPEC
from specheads.engines import llamacpp as lc
from specheads.engines import llamacpp_check, llamacpp_gguf
from specheads.engines.matrix import fingerprint_provenance, save_example
from specheads.export import ExportRefused, export
from specheads.export.checkpoint import Checkpoint
from specheads.export.gguf import serve_command
from specheads.heads.eagle3 import Eagle3Head, Eagle3Options
from specheads.kinds import KINDS
from specheads.kinds.base import random_head
from specheads.target import Target

needs_build = pytest.mark.skipif(not lc.built(lc.home() / "sdist" / "vendor" / "llama.cpp"),
                                 reason="llama.cpp is not built: python -m specheads.engines.llamacpp ensure")


@pytest.fixture(scope="module")
def ckpts(tiny_target_dir, tmp_path_factory):
    """Random-weight checkpoints on the tiny test target: every kind's first example, P-EAGLE, and an
    EAGLE-3 head tapping 4 target layers."""
    target = Target.load(str(tiny_target_dir), device="cpu")
    root, prov = tmp_path_factory.mktemp("gguf"), fingerprint_provenance(target)
    heads = {kind: KINDS[kind].example.build(target, KINDS[kind].example.seed)
             for kind in ("eagle3", "medusa", "dflash", "dspark", "draft")}
    heads["peagle"] = next(e for e in KINDS["eagle3"].examples if e.name == "peagle").build(target, 7)
    for name in ("eagle31", "eagle3-qwen3"):  # EAGLE 3.1 norms / a Qwen3 layer llama.cpp's graph does not run
        heads[name] = next(e for e in KINDS["eagle3"].examples if e.name == name).build(target, 7)
    heads["qwen3-layer"] = random_head(Eagle3Head, Eagle3Options(ttt_steps=3, qk_norm=True), target, 3, 0.05)
    heads["four"] = random_head(Eagle3Head, Eagle3Options(ttt_steps=3, aux_layers=[1, 2, 3, 4]), target, 3, 0.05)
    return {name: save_example(root / name, head, tiny_target_dir, prov) for name, head in heads.items()}


REFUSALS = {
    "medusa": r"llama.cpp 0c1e570 has no speculative type for a 'medusa' head; --format gguf exports eagle3, dflash, "
              r"dspark, draft, mtp",
    "peagle": r"a P-EAGLE head \(parallel drafting\); llama.cpp 0c1e570 has no P-EAGLE",
    "eagle31": r"fc_norm, norm_output true; llama.cpp 0c1e570's EAGLE-3 graph \(src/models/eagle3.cpp\) reads only "
               r"norm_before_residual and norm_before_fc",
    "eagle3-qwen3": r"norm_output true; llama.cpp 0c1e570's EAGLE-3 graph",
    "qwen3-layer": r"transformer_layer_config.model_type 'qwen3'; llama.cpp 0c1e570's converter reads an EAGLE-3 "
                   r"draft layer as llama",
    "four": r"eagle_aux_hidden_state_layer_ids \[1, 2, 3, 4\] taps 4 target layers; llama.cpp 0c1e570 says "
            r"\"EAGLE3 requires exactly 3 entries in 'extract_layers'\"",
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_refused_before_anything_is_built_or_written(ckpts, tiny_target_dir, tmp_path, monkeypatch, name):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ExportRefused, match=REFUSALS[name]):
        export(ckpts[name], "gguf", tmp_path / "out", verifier=str(tiny_target_dir))
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()
    assert not list(tmp_path.glob(".out*"))  # no temp folder left either


def test_the_cli_says_it_in_one_line(ckpts, tiny_target_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    rc = cli_main(["export", str(ckpts["four"]), "--format", "gguf", "--out", str(tmp_path / "out"),
                   "--verifier", str(tiny_target_dir)])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err.startswith("specheads export: error: ") and "exactly 3 entries" in err
    assert "Traceback" not in err and "the vllm export" in err and len(err.splitlines()) == 1


def test_without_a_build_it_asks_before_building(ckpts, tiny_target_dir, tmp_path, monkeypatch, capsys):
    """No llama.cpp built, no flag: refused before any download or build, naming both ways to choose."""
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECHEADS_LLAMA_CPP", raising=False)
    rc = cli_main(["export", str(ckpts["eagle3"]), "--format", "gguf", "--out", str(tmp_path / "out"),
                   "--verifier", str(tiny_target_dir)])
    err = capsys.readouterr().err
    assert rc == 1 and "--build-llama-cpp" in err and "--llama-cpp PATH" in err and "SPECHEADS_LLAMA_CPP" in err
    assert "about 12 min" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache" / "engines").exists()


def test_a_llama_cpp_path_that_is_not_a_build_is_named(ckpts, tiny_target_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    (tmp_path / "llama.cpp").mkdir()
    rc = cli_main(["export", str(ckpts["eagle3"]), "--format", "gguf", "--out", str(tmp_path / "out"),
                   "--verifier", str(tiny_target_dir), "--llama-cpp", str(tmp_path / "llama.cpp")])
    err = capsys.readouterr().err
    assert rc == 1 and f"llama.cpp at {tmp_path / 'llama.cpp'}" in err and "build/bin/llama-server" in err
    assert not (tmp_path / "out").exists()


def test_serve_command_is_llama_server_with_the_sidecar():
    assert serve_command("draft-eagle3", "/o/target.gguf", "/o/draft.gguf", 3) == (
        "llama-server -m /o/target.gguf -md /o/draft.gguf --spec-type draft-eagle3 --spec-draft-n-max 3 "
        "--host 127.0.0.1 --port 8080")
    assert serve_command("draft-dflash", "/o/t.gguf", "/o/d.gguf", None) == (
        "llama-server -m /o/t.gguf -md /o/d.gguf --spec-type draft-dflash --host 127.0.0.1 --port 8080")
    assert serve_command("draft-mtp", "/o/t.gguf", None, 2).startswith("llama-server -m /o/t.gguf --spec-type draft-mtp")


# --- with llama.cpp -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def eagle3_gguf(ckpts, tiny_target_dir, tmp_path_factory):
    return export(ckpts["eagle3"], "gguf", tmp_path_factory.mktemp("eagle3") / "gguf", verifier=str(tiny_target_dir))


@pytest.mark.engine
@needs_build
def test_eagle3_gguf_folder_serves_greedy_equal(eagle3_gguf, tiny_target_dir, tmp_path):
    out = eagle3_gguf
    record = json.loads((out / "specheads.json").read_text())
    assert {p.name for p in out.iterdir()} >= {"draft.gguf", "target.gguf", "source", "README.md", "specheads.json",
                                               "draft.gguf.json", "target.gguf.json"}
    assert (record["format"], record["source_format"], record["spec_type"]) == ("gguf", "vllm", "draft-eagle3")
    assert set(record["gguf_sha256"]) == {"draft.gguf", "target.gguf"}
    cmd = f"llama-server -m {out / 'target.gguf'} -md {out / 'draft.gguf'} --spec-type draft-eagle3 --spec-draft-n-max 3"
    assert record["serve_commands"][0].startswith(cmd) and cmd in (out / "README.md").read_text()
    conv = json.loads((out / "draft.gguf.json").read_text())
    assert str(out) in conv["command"] and ".tmp" not in json.dumps(conv), "paths of the temp folder were recorded"
    assert llamacpp_gguf.sidecar_problems(out / "draft.gguf", out / "source") == []
    r = llamacpp_check.check(out, tiny_target_dir, tmp_path, limit=2, n_predict=24, require_accepted=False,
                             progress=lambda m: None)
    assert r["verdict"] == "PASS", r["problems"]
    assert r["greedy_equal"] and r["drafted"] > 0 and r["tok_s"]["plain"] and r["tok_s"]["spec"]
    # the gpt-2 pre-tokenizer named for the tiny target's unknown hash splits text as the HF tokenizer does
    assert r["conversions"]["target"]["pre_tokenizer"]["fallback_applied"] == "gpt-2"
    assert r["tokenizer_agreement"] == {"texts": 3, "equal": 3, "differ": []}


@pytest.mark.engine
@needs_build
@pytest.mark.parametrize("kind", ["dflash", "dspark", "draft"])
def test_every_other_kind_llama_cpp_serves_exports_and_decodes(ckpts, tiny_target_dir, tmp_path, kind):
    out = export(ckpts[kind], "gguf", tmp_path / "gguf", verifier=str(tiny_target_dir), target_gguf=False)
    record = json.loads((out / "specheads.json").read_text())
    assert record["spec_type"] == LLAMA_CPP_SPEC[(kind, record["source_format"])]
    assert not (out / "target.gguf").exists() and "target.gguf` was not written" in (out / "README.md").read_text()
    r = llamacpp_check.check(out, tiny_target_dir, tmp_path / "work", limit=2, n_predict=24, require_accepted=False,
                             progress=lambda m: None)
    assert r["verdict"] == "PASS", r["problems"]
    assert r["greedy_equal"] and r["drafted"] > 0


@pytest.mark.engine
@needs_build
def test_a_rewrite_without_changes_keeps_the_sidecar(eagle3_gguf, tmp_path):
    src = eagle3_gguf / "draft.gguf"
    copy = llamacpp_gguf.rewrite(src, tmp_path / "copy.gguf")
    a, b = llamacpp_gguf.read_sidecar(src), llamacpp_gguf.read_sidecar(copy)
    assert a["tensors"] == b["tensors"] and a["target_layers"] == b["target_layers"]
    assert np.array_equal(a["d2t"], b["d2t"]) and src.stat().st_size == copy.stat().st_size


@pytest.mark.engine
@needs_build
@pytest.mark.parametrize("fault", sorted(llamacpp_gguf.FAULTS))
def test_each_injected_fault_is_caught(eagle3_gguf, tiny_target_dir, tmp_path, fault):
    r = llamacpp_check.fault_check(eagle3_gguf, tiny_target_dir, tmp_path, fault, limit=1, n_predict=16,
                                   require_accepted=False, progress=lambda m: None)
    assert r["caught"], r
    want = {"renamed-tensor": r"tensor 'blk.0.attn_q.weight' not found", "wrong-d2t": r"d2t 2 of \d+ entries differ",
            "wrong-aux-layers": r"eagle3.target_layers \[1, 3, 4\] but the export's eagle_aux_hidden_state_layer_ids"}
    assert re.search(want[fault], r["how"]), r["how"]


def test_a_verifier_that_is_not_a_target_folder_is_named(ckpts, tiny_target_dir, tmp_path, monkeypatch, capsys):
    """--verifier meant as a folder must be one (it was dropped for the recipe's path); a hub id
    is tried when the recipe's target is not here, and named when that fails too."""
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "afile").write_text("x")
    (tmp_path / "empty").mkdir()
    for verifier, state in ((tmp_path / "afile", "is not a folder"), (tmp_path / "missing", "does not exist"),
                            (tmp_path / "empty", "is a folder without config.json")):
        rc = cli_main(["export", str(ckpts["eagle3"]), "--format", "gguf", "--out", str(tmp_path / "out"),
                       "--verifier", str(verifier)])
        err = capsys.readouterr().err
        assert rc == 1 and f"specheads export: error: --verifier {verifier} {state}: --format gguf converts " \
                           "eagle3 with the target's HF folder" in err, err
        assert "Traceback" not in err and not (tmp_path / "out").exists()
    ckpt = Checkpoint(ckpts["eagle3"])
    ckpt.recipe = {"target": {"path": "runs/nowhere/target"}}  # relative to a training directory elsewhere
    with pytest.raises(ExportRefused, match=r"^--verifier someorg/not-cached: .*and the recipe's target.path "
                                            r"'runs/nowhere/target' is not here either"):
        export(ckpt, "gguf", tmp_path / "out", verifier="someorg/not-cached")
