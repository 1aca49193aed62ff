"""`--hybrid` / `--adaptive` of generate, serve and regenerate --draft: the default read from the eval
next to the export, explicit settings, clear refusals, and greedy-equal decodes through the session."""

from __future__ import annotations

import io
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from refusals import refused, write_data

from specheads.cli import main as cli
from specheads.eval.online import evaluate
from specheads.eval_identity import draft_weights
from specheads.generate import run_generate
from specheads.mixing import SETTINGS, resolve_mixing
from specheads.session import Session
from specheads.verify.settings import SettingsError, TreeSpec


@pytest.fixture(scope="module")
def evaluated_export(tiny_target_dir, random_export_dir, tmp_path_factory):
    """A copy of the random export with an eval attached (EXPORT/eval/metrics.json)."""
    root = tmp_path_factory.mktemp("mixing")
    export = shutil.copytree(random_export_dir, root / "export")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n"
                               for i, p in enumerate(["def add(a, b):", "import os", "for i in range(3):"])))
    evaluate(str(tiny_target_dir), str(export), str(prompts), str(root / "eval"), max_new_tokens=16, k=2,
             attach=True, quiet=True)
    return export


def fake_eval(folder, use: str, with_costs: bool = True, predicted: dict | None = None):
    """An export folder holding only eval/metrics.json whose advice names `use` for specheads (the
    weights it records: the folder's, none)."""
    (folder / "eval").mkdir(parents=True)
    predicted = {"drafter": 1.1, **(predicted or {}), use: 1.4}
    metrics = {"k": 2, "advice": {"engines": {"specheads": {"use": use, "predicted": predicted}}},
               "speculative": {"acceptance_per_position_conditional": [0.7, 0.5]}, "adaptive": {"k_max": 4},
               "calibration": {"map": {"bins": [0.1 * b for b in range(10)], "counts": [1] * 10}},
               "draft_weights": draft_weights(folder)}
    if with_costs:
        metrics["adaptive"]["length_costs"] = {"verify": [1.0, 1.1, 1.2, 1.3, 1.4], "draft": 0.2, "fixed": 0.1}
    (folder / "eval" / "metrics.json").write_text(json.dumps(metrics))
    return folder


@pytest.mark.parametrize("use", list(SETTINGS))
def test_auto_takes_what_the_eval_predicts_fastest(tmp_path, use):
    mixing = resolve_mixing("auto", None, fake_eval(tmp_path / "export", use))
    assert (mixing.hybrid, mixing.adaptive) == SETTINGS[use] and f"predicts {use} fastest (1.40x" in mixing.reason
    if mixing.adaptive:
        assert mixing.k_max == 4 and mixing.costs.verify[0] == 1.0 and mixing.costs.draft == pytest.approx(0.2)
        assert mixing.free_k_max == 4  # a file written before free_k_max was kept: the free draft as long as k_max
        assert mixing.calibration(0.95, 1) == pytest.approx(0.9) and mixing.calibration(None, 2) == 0.5


# (--hybrid, --adaptive) -> what is served, with an eval that advises adaptive (and predicts union
# the fastest of the settings without adaptive draft length)
SERVED = {("auto", None): ("choose", True), ("auto", True): ("choose", True), ("auto", False): ("union", False),
          ("choose", None): ("choose", False), ("choose", True): ("choose", True), ("choose", False): ("choose", False),
          ("union", None): ("union", False), ("union", False): ("union", False), ("off", None): ("off", False),
          ("off", True): ("off", True), ("off", False): ("off", False)}


@pytest.mark.parametrize("hybrid,adaptive", list(SERVED))
def test_an_explicit_flag_is_always_what_is_served(tmp_path, hybrid, adaptive):
    export = fake_eval(tmp_path / "export", "adaptive", predicted={"hybrid": 1.2, "union": 1.3})
    mixing = resolve_mixing(hybrid, adaptive, export)
    assert (mixing.hybrid, mixing.adaptive) == SERVED[hybrid, adaptive]
    line = mixing.describe()
    flags = f"--hybrid {hybrid}" + {None: "", True: " --adaptive", False: " --no-adaptive"}[adaptive]
    assert line.startswith(mixing.label() + (" (as asked: " + flags + ")" if mixing.reason == "as asked"
                                             else " (asked: " + flags + ";")), line
    assert not mixing.reason.startswith(mixing.label()) and line.count("the drafter alone (") <= 1, line
    assert ("predicts" in line) == (hybrid == "auto" and adaptive is not True), line
    if (hybrid, adaptive) == ("auto", False):
        assert "predicts union fastest of drafter, hybrid, union (1.30x" in line


def test_adaptive_over_union_is_refused_only_when_asked(tmp_path):
    export = fake_eval(tmp_path / "export", "adaptive")
    with pytest.raises(SettingsError, match="--adaptive verifies chains"):
        resolve_mixing("union", True, export)


def test_no_eval_means_the_drafter_alone_said_once(tmp_path):
    alone = resolve_mixing("auto", None, tmp_path)  # no eval/metrics.json
    assert not alone.active and "specheads eval --attach" in alone.reason
    assert alone.describe().count("the drafter alone") == 1, alone.describe()
    export = fake_eval(tmp_path / "export", "adaptive")
    assert not resolve_mixing("auto", None, export, chain=False).active  # a tree: the hybrids draft chains
    assert not resolve_mixing("auto", None, None).active  # no drafter


@pytest.mark.parametrize("args,needle", [
    (("best", None, True), "--hybrid 'best': expected one of auto, choose, union, off"),
    (("choose", None, None), "pass --draft"),
    (("union", True, True), "--adaptive verifies chains"),
    (("off", True, "nocosts"), "--adaptive needs the calibration and step costs"),
    (("off", True, "none"), "--adaptive needs the calibration and step costs"),
    (("choose", False, "tree"), "--hybrid choose and --adaptive draft chains"),
    (("auto", None, "broken"), "not a readable eval metrics file"),
])
def test_bad_mixing_is_refused_by_name(tmp_path, args, needle):
    hybrid, adaptive, where = args
    export, chain = tmp_path / "export", True
    if where is True or where == "tree":
        fake_eval(export, "hybrid")
        chain = where is True
    elif where == "nocosts":
        fake_eval(export, "hybrid", with_costs=False)
    elif where == "broken":
        (export / "eval").mkdir(parents=True)
        (export / "eval" / "metrics.json").write_text("{not json")
    elif where == "none":
        export.mkdir()
    with pytest.raises(SettingsError, match=needle):
        resolve_mixing(hybrid, adaptive, None if where is None else export, chain)


@pytest.mark.parametrize("hybrid,adaptive", [("auto", None), ("choose", False), ("union", False), ("choose", True),
                                             ("off", True)])
def test_generate_with_each_setting_is_greedy_equal(tiny_target_dir, evaluated_export, hybrid, adaptive):
    mixing = resolve_mixing(hybrid, adaptive, evaluated_export)
    err = io.StringIO()
    r = run_generate(str(tiny_target_dir), str(evaluated_export), "def add(a, b):", TreeSpec("chain"), 24,
                     device="cpu", out=io.StringIO(), err=err, mixing=mixing)
    assert r["greedy_equal"] is True and r["mixing"] == mixing.label()
    assert f"speculation: {mixing.label()}" in err.getvalue()


def test_the_cli_refuses_adaptive_without_an_eval(tmp_path, tiny_target_dir, random_export_dir):
    refused(["generate", "--target", tiny_target_dir, "--draft", random_export_dir, "--prompt", "hi", "--adaptive"],
            ["--adaptive needs the calibration and step costs", "specheads eval --attach"], tmp_path,
            watch=(tiny_target_dir, random_export_dir))
    data = write_data(tmp_path)
    refused(["regenerate", data, "--out", tmp_path / "out.jsonl", "--target", tiny_target_dir, "--hybrid", "union"],
            ["--hybrid and --adaptive combine a drafter", "pass --draft"], tmp_path, watch=(tiny_target_dir,))


@pytest.mark.parametrize("hybrid,adaptive", [("union", False), ("choose", True)])
def test_serve_with_a_hybrid_answers_plain_greedy(tiny_target_dir, evaluated_export, hybrid, adaptive):
    from test_serve import PREFIX, get, post, reference, text_of

    from specheads.serve.metrics import parse_metrics
    from specheads.serve.server import load_engine, serve_in_thread

    mixing = resolve_mixing(hybrid, adaptive, evaluated_export)
    engine = load_engine(str(tiny_target_dir), str(evaluated_export), TreeSpec("chain"), "cpu", None, "mixed",
                         mixing=mixing)
    assert engine.session.mixing == mixing
    with serve_in_thread(engine) as url:
        prompt = "def read_config(path):"
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 20, "temperature": 0}
        answer = post(f"{url}/v1/chat/completions", body)["choices"][0]["message"]["content"]
        assert answer == text_of(engine.target, reference(engine.target, prompt, 20))
        metrics = parse_metrics(get(f"{url}/metrics"))
        assert metrics[PREFIX + 'drafts_total{engine="0",model_name="mixed"}'] > 0


@pytest.mark.parametrize("flags,line", [
    (["--hybrid", "union"], "speculation: union (asked: --hybrid union; adaptive draft length only with --adaptive)"),
    (["--hybrid", "off"], "speculation: the drafter alone (asked: --hybrid off; adaptive draft length only with"),
    ([], "speculation: adaptive draft length (k <= "),
])
def test_serve_serves_the_explicit_flag_over_the_evals_advice(tiny_target_dir, evaluated_export, tmp_path, flags,
                                                              line):
    """A real `specheads serve` whose attached eval advises adaptive: --hybrid union starts (no refusal of an
    --adaptive never passed) and serves union, --hybrid off the drafter alone; the line says it once."""
    from servers import launch

    export = shutil.copytree(evaluated_export, tmp_path / "export")
    metrics = json.loads((export / "eval" / "metrics.json").read_text())
    metrics["advice"]["engines"]["specheads"]["use"] = "adaptive"
    (export / "eval" / "metrics.json").write_text(json.dumps(metrics))
    proc = launch(["--target", str(tiny_target_dir), "--draft", str(export), "--device", "cpu", *flags])
    try:
        out = []
        for text in proc.stdout:
            out.append(text)
            if "listening on" in text:
                break
        start = next((t for t in out if "speculation:" in t), "")
        assert line in start and start.count("the drafter alone") <= 1 and "(asked: --hybrid auto;" in (
            start if not flags else "(asked: --hybrid auto;"), "".join(out) + proc.stderr.read() * (proc.poll() is not None)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_eval_keeps_the_free_drafts_length_for_adaptive(evaluated_export):
    """eval's adaptive row lets free drafts run to COST_K, prices them (one cost per length), and
    `--adaptive` reads it back: the loop verifies that long with the free draft, k_max without it."""
    from specheads.eval.online import COST_K

    row = json.loads((evaluated_export / "eval" / "metrics.json").read_text())["adaptive"]
    assert row["free_k_max"] == max(row["k_max"], COST_K) and len(row["length_costs"]["verify"]) == row["free_k_max"] + 1
    with_free, alone = resolve_mixing("choose", True, evaluated_export), resolve_mixing("off", True, evaluated_export)
    assert with_free.free_loop_k() == row["free_k_max"] and f"up to {row['free_k_max']}" in with_free.label()
    assert alone.free_loop_k() == row["k_max"]


def test_outputs_keep_each_methods_decode_of_each_turn(evaluated_export):
    """outputs.jsonl holds every method's tokens / forwards / seconds per turn, the hybrid rows and
    their own plain pass included; summed, they give metrics.json's rows exactly."""
    root = evaluated_export.parent
    rows = [json.loads(line) for line in (root / "eval" / "outputs.jsonl").read_text().splitlines()]
    metrics = json.loads((root / "eval" / "metrics.json").read_text())
    assert {*rows[0]["methods"]} == {"plain", "speculative", "ngram", "suffix", "mix_plain", "mix_hybrid",
                                     "mix_union", "mix_adaptive"}
    for method, key in (("speculative", "speculative"), ("mix_union", "union"), ("mix_adaptive", "adaptive")):
        tokens = sum(r["methods"][method]["tokens"] for r in rows)
        forwards = sum(r["methods"][method]["forwards"] for r in rows)
        assert tokens / forwards == pytest.approx(metrics[key]["tau"]), method
    plain_wall = sum(r["methods"]["mix_plain"]["wall_s"] for r in rows)
    union_wall = sum(r["methods"]["mix_union"]["wall_s"] for r in rows)
    assert plain_wall / union_wall == pytest.approx(metrics["union"]["measured_speedup"])


SLICE = Path(__file__).parent / "fixtures" / "sharegpt_slice.json"  # ShareGPT-format rows, 1-3 turns


@pytest.mark.parametrize("flags,label", [(["--hybrid", "choose", "--no-adaptive"], "hybrid choose"),
                                         (["--hybrid", "union", "--no-adaptive"], "union"),
                                         (["--hybrid", "choose", "--adaptive"], "adaptive draft length (k <= ")])
def test_regenerate_with_a_hybrid_gives_plain_greedy_answers(tiny_target_dir, evaluated_export, tmp_path, capsys,
                                                             flags, label):
    """`specheads regenerate --draft EXPORT --hybrid ...` through the CLI: every answer (later turns see
    the earlier new ones) is the one plain regenerate writes, batched two prompts per forward."""
    common = ["regenerate", str(SLICE), "--max-new-tokens", "10", "--limit", "5", "--target", str(tiny_target_dir),
              "--device", "cpu", "--batch-size", "2"]
    assert cli([*common, "--out", str(tmp_path / "plain.jsonl")]) == 0
    assert cli([*common, "--out", str(tmp_path / "mixed.jsonl"), "--draft", str(evaluated_export), *flags]) == 0
    err = capsys.readouterr().err
    assert f"regenerate: speculation: {label}" in err and f"(as asked: {' '.join(flags)})" in err
    plain, mixed = ([json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
                    for name in ("plain", "mixed"))
    assert len(mixed) == len(plain) == 5 and sum(r["regenerated"]["turns"] for r in mixed) > 5
    assert [(r["id"], r["messages"], r["regenerated"]) for r in mixed] == [
        (r["id"], r["messages"], r["regenerated"]) for r in plain]


def test_eval_and_generate_take_a_suffix_history_and_eval_the_rows_asked(tmp_path, tiny_target_dir, evaluated_export):
    """`eval --suffix-history F --mix-rows adaptive`: suffix decoding starts from F's answers (counted in
    metrics.json), only the adaptive row is decoded (the others say why not), outputs stay plain's;
    `generate --suffix-history F` decodes greedy-equal; an unknown row or a file without answers is refused."""
    history = tmp_path / "history.jsonl"
    history.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p},
                                                        {"role": "assistant", "content": a}]}) + "\n"
                               for p, a in [("def add(a, b):", "return a + b"), ("import os", "import sys")]))
    prompts = evaluated_export.parent / "prompts.jsonl"
    out = tmp_path / "eval"
    assert cli(["eval", "--target", str(tiny_target_dir), "--draft", str(evaluated_export), "--prompts", str(prompts),
                "--out", str(out), "--max-new-tokens", "12", "--k", "2", "--quiet", "--suffix-history", str(history),
                "--mix-rows", "adaptive"]) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert (m["suffix_history"]["file"], m["suffix_history"]["answers"]) == ("history.jsonl", 2)
    assert m["suffix_history"]["overlap"]["prompts_in_history"] == 2 and "read high" in m["suffix_history"]["warning"]
    assert m["hybrid"] == {"skipped": "not asked (--mix-rows)"} == m["union"]
    assert m["adaptive"]["greedy_equal"] is True and m["suffix"]["greedy_equal"] is True
    mixing = replace(resolve_mixing("choose", True, evaluated_export), history=str(history))
    session = Session.open(str(tiny_target_dir), evaluated_export, TreeSpec("chain"), device="cpu", mixing=mixing)
    assert len(session.free.cache.cached_requests) == 2  # the two answers, before any request
    r = run_generate(str(tiny_target_dir), str(evaluated_export), "def add(a, b):", TreeSpec("chain"), 16, device="cpu",
                     out=io.StringIO(), err=io.StringIO(), mixing=mixing)
    assert r["greedy_equal"] is True
    refused(["eval", "--target", tiny_target_dir, "--draft", evaluated_export, "--prompts", prompts,
             "--out", tmp_path / "e2", "--mix-rows", "adaptive,best"],
            ["--mix-rows best", "expected rows from hybrid, union, adaptive"], tmp_path, watch=(evaluated_export,))
    history.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    refused(["generate", "--target", tiny_target_dir, "--draft", evaluated_export, "--prompt", "hi",
             "--hybrid", "choose", "--adaptive", "--suffix-history", history],
            ["history.jsonl", "no assistant"], tmp_path, watch=(evaluated_export,))
