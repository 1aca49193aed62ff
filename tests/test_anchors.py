"""bench/anchors.py: the parts that need no anchor venv (the drivers' hidden-state taps against the
target's own, the retry-with-adaptation rule, SpecForge's weight-index view and plain loss, the
table, argument errors); and, only where an anchor's venv exists under the user cache, that anchor
trained for a few steps on the tiny target and measured lossless by our verifier."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from bench_scripts import BENCH, load_bench

DRIVERS = BENCH / "anchor_drivers"


@pytest.fixture(scope="module")
def anchors():
    return load_bench("anchors.py")


@pytest.fixture(scope="module")
def drivers():
    """The driver modules (they import their sibling `capture` as the venvs run them: as scripts)."""
    sys.path.insert(0, str(DRIVERS))
    try:
        import capture
        import specforge_train

        yield capture, specforge_train
    finally:
        sys.path.remove(str(DRIVERS))
        for name in ("capture", "specforge_train"):
            sys.modules.pop(name, None)


# --- the drivers' capture, without any anchor ------------------------------------------------------
def test_driver_taps_equal_the_targets_own(drivers, tiny_target_dir):
    """aux layer i = HF hidden_states[i] (specheads' tap, vLLM's numbering); last = the last decoder
    layer's output before the norm; its norm gives the states the lm_head reads (target logits)."""
    from specheads.target import Target

    capture, _ = drivers
    target = Target.load(str(tiny_target_dir), device="cpu")
    model = capture.load_target(str(tiny_target_dir))
    ids = target.tokenizer("def f(x):\n    return x + 1")["input_ids"]
    aux, last = capture.hidden_states(model, ids, [2, 4, 5])
    ours = target.forward(torch.tensor([ids]), layers=[2, 4, 5])
    for got, layer in zip(aux, [2, 4, 5]):
        assert got.shape == (len(ids), target.hidden_size)
        torch.testing.assert_close(got, ours.hidden[layer][0])
    final = model.get_decoder().norm(last)
    torch.testing.assert_close(final, ours.final[0])
    torch.testing.assert_close(model.lm_head(final), ours.logits[0], rtol=1e-4, atol=1e-4)


def test_adaptation_only_after_its_own_error(drivers):
    capture, _ = drivers
    state = {"cpu_adaptations": [], "errors_before_adaptation": []}
    applied = []
    fixes = [("use the CPU", "no accelerator", lambda: applied.append("cpu"))]

    def attempt(n):
        if not applied:
            raise RuntimeError("Cannot run: no accelerator here")
        return n

    assert capture.with_adaptations(attempt, fixes, state) == 1
    assert state == {"cpu_adaptations": ["use the CPU"],
                     "errors_before_adaptation": ["RuntimeError: Cannot run: no accelerator here"]}

    def other(n):
        raise ValueError("something else")

    with pytest.raises(ValueError, match="something else"):
        capture.with_adaptations(other, [("unused", "no accelerator", lambda: None)], state)
    assert state["cpu_adaptations"] == ["use the CPU"]  # nothing applied for an error it does not name


def test_indexed_target_maps_every_weight(drivers, tiny_target_dir, tmp_path):
    from safetensors import safe_open

    _, sf = drivers
    view = sf.indexed_target({"target": str(tiny_target_dir), "work": str(tmp_path)})
    index = json.loads((view / "model.safetensors.index.json").read_text())
    with safe_open(str(tiny_target_dir / "model.safetensors"), framework="pt") as fh:
        keys = set(fh.keys())
    assert set(index["weight_map"]) == keys and set(index["weight_map"].values()) == {"model.safetensors"}
    assert (view / "config.json").resolve() == (tiny_target_dir / "config.json").resolve()


def test_plain_soft_cross_entropy_golden():
    """Uniform target over V on zero logits: log(V) at every supervised position, averaged over all."""
    sys.path.insert(0, str(DRIVERS))
    try:
        from specforge_train import PlainSoftCrossEntropy
    finally:
        sys.path.remove(str(DRIVERS))
    logits = torch.zeros(1, 4, 8, requires_grad=True)
    target = torch.full((1, 4, 8), 1 / 8)
    mask = torch.tensor([[[1.0], [1.0], [0.0], [1.0]]])
    loss = PlainSoftCrossEntropy.apply(logits, target, mask)
    assert loss.item() == pytest.approx(3 * math.log(8) / 4)
    loss.backward()  # softmax(0) = target: no gradient at the optimum
    assert logits.grad.abs().max().item() < 1e-7


# --- report and arguments --------------------------------------------------------------------------
REPORT = {
    "settings": {"command": "python bench/anchors.py --run r --out o", "target": "r/target", "data": "r/data/t.jsonl",
                 "train_samples": 10, "num_prompts": 2, "max_new_tokens": 8, "k": 3, "threads": 2, "niceness": 19,
                 "loadavg_at_end": [1.0, 1.5, 2.0], "plain_tokens_per_s": 50.0, "heldout_answers": 5},
    "budgets": {
        "eagle3": {"steps": 4, "batch_size": 2, "tokens_per_step": 100, "aux_layers": [2, 4, 5],
                   "draft_vocab_size": 64, "ttt_steps": 3, "step_decay": 0.8, "lr": 0.002, "warmup_steps": 1},
        "dspark": {"steps": 4, "batch_size": 2, "tokens_per_step": 100, "aux_layers": [2, 6], "draft_vocab_size": 512,
                   "ttt_steps": None, "step_decay": None, "lr": 0.002, "warmup_steps": 1, "kind": "dspark",
                   "block": {"num_layers": 2, "block_size": 4, "causal": False, "num_anchors": 16, "markov_rank": 32,
                             "markov_head_type": "vanilla", "enable_confidence_head": True,
                             "confidence_head_with_markov": True}}},
    "rows": [
        {"toolkit": "specheads", "version": "0.1.0", "tau": 2.5, "acceptance_per_position": [0.8, 0.5, 0.2],
         "greedy_equal": True, "speedup": 1.5, "train_tokens_per_s": 1000.0, "train_s": 4.0, "heldout_tau": 2.2},
        {"toolkit": "speculators", "version": "0.9.0", "tau": 2.25, "acceptance_per_position": [0.75, 0.4, 0.1],
         "heldout_tau": 2.0,
         "greedy_equal": True, "speedup": 1.25, "train_tokens_per_s": 2000.0, "train_tokens_per_s_with_capture": 500.0,
         "train_s": 2.0, "install_notes": ["pip install torch==2.13.0 (CPU) first"],
         "errors_before_adaptation": ["RuntimeError: Cannot access accelerator device when none is available."],
         "cpu_adaptations": ["get_local_rank -> 'cpu'"], "export": "OUT/speculators/train-1/0",
         "fingerprint_checked": False},
        {"toolkit": "specforge", "version": "0.2.0", "stage": "train", "error": "RuntimeError: 0 active drivers ([]).",
         "install_notes": ["--no-deps"]},
        {"toolkit": "specheads", "kind": "dspark", "version": "0.1.0", "tau": 3.0,
         "acceptance_per_position": [0.9, 0.7, 0.4], "greedy_equal": True, "speedup": 1.2, "train_s": 4.0},
        {"toolkit": "speculators", "kind": "dspark", "version": "0.9.0", "tau": 2.0,
         "acceptance_per_position": [0.6, 0.3, 0.1], "greedy_equal": True, "speedup": 1.0, "train_s": 2.0,
         "install_notes": ["pip install torch==2.13.0 (CPU) first"]},
        {"toolkit": "specforge", "kind": "dspark", "version": "0.2.0", "stage": "not driven",
         "error": "SpecForge 0.2.0 ships DFlash and DSpark trainers", "install_notes": ["--no-deps"]},
    ],
}


def test_markdown_rows_and_failures(anchors):
    md = anchors.markdown(REPORT)
    eagle3, dspark = md.split("## EAGLE-3 (chain k = 3)")[1].split("## DSpark (chain k = 3)")
    assert "| specheads 0.1.0 | 2.50 |  | 0.80 / 0.50 / 0.20 | yes | 1.50x | 2.200 |  | 1000 |  | 4 |" in eagle3
    assert "| speculators 0.9.0 | 2.25 | 1.11x | 0.75 / 0.40 / 0.10 | yes | 1.25x | 2.000 | 1.10x | 2000 | 500 | 2 |" in eagle3
    assert "all 5 held-out conversations" in md
    assert "| specforge 0.2.0 | train | | `RuntimeError: 0 active drivers ([]).` |" in eagle3
    assert "one layer, TTT 3 (decay 0.8)" in eagle3 and "4 steps x batch 2 (packed trainers: 100 tokens a step)" in eagle3
    assert "| speculators 0.9.0 | 2.00 | 1.50x | 0.60 / 0.30 / 0.10 |" in dspark  # its own kind's specheads row
    assert "| specforge 0.2.0 | not driven | | `SpecForge 0.2.0 ships DFlash and DSpark trainers` |" in dspark
    assert "2 layers, up to 16 anchor blocks a sample, blocks of anchor + 3 (fill-in layout)" in dspark
    assert "Markov head rank 32 (vanilla)" in dspark
    assert ("failed with `RuntimeError: Cannot access accelerator device when none is available.`; then adapted: "
            "get_local_rank -> 'cpu'") in md
    assert "setup: --no-deps" in md and "loaded as is by our verifier from `OUT/speculators/train-1/0`" in md
    assert "train: `RuntimeError: 0 active drivers ([]).`" in md
    assert md.count("setup: --no-deps") == 1  # a toolkit's setup notes once, under its first kind
    assert "earlier call" not in md
    assert "- **specheads, EAGLE-3**: trained online" in md and "- **specheads, DSpark**: trained online" in md
    again = anchors.markdown({**REPORT, "rows": [{**r, "reused": True} if i == 1 else r for i, r in enumerate(REPORT["rows"])]})
    assert "measured again here: speculators EAGLE-3; their training seconds and tokens/s are that call's" in again


def test_argument_errors(anchors, tmp_path, capsys):
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("{}")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "heldout_prompts.jsonl").write_text("{}\n")
    for argv, words in [(["--anchors", "medusa"], "--anchors: unknown 'medusa'; expected some of speculators, specforge"),
                        (["--steps", "0"], "--steps must be at least 1 (got 0)"),
                        (["--target", str(tmp_path / "nope")], "no config.json there"),
                        (["--recipe", str(tmp_path / "r.yaml")], "--recipe"),
                        (["--recipe", "recipes/medusa/demo.yaml"], "head.kind 'medusa' has no anchor to compare with"),
                        (["--recipe", "recipes/dspark/demo.yaml", "--recipe", "recipes/dspark/smollm2-135m-cpu.yaml"],
                         "two recipes of one kind"), ]:
        args = ["--run", str(tmp_path), "--out", str(tmp_path / "o"), *argv]
        with pytest.raises(SystemExit) as exc:
            anchors.parse_args(args)
        assert exc.value.code == 2
        assert words in capsys.readouterr().err


def test_missing_training_data_is_named(anchors, tmp_path):
    (tmp_path / "data").mkdir()
    with pytest.raises(FileNotFoundError, match="neither train_regen.jsonl nor train.jsonl"):
        anchors.train_file(tmp_path, tmp_path / "o", None)


def test_shared_samples_and_budget(anchors, tiny_target_dir, demo_data_dir, tmp_path, demo_run_dir):
    """The first N conversations, tokenised once (training split only); tokens a step = batch x mean length."""
    from specheads.target import Target

    run = demo_run_dir
    out = tmp_path / "out"
    data = anchors.train_file(run, out, 20)
    assert len(data.read_text().splitlines()) == 20
    recipe = anchors.load_recipe_for(anchors.RECIPE, run / "target", data, out, 5,
                                     ["train.batch_size=3", "train.val_samples=2", "head.draft_vocab_size=64"])
    target = Target.load(str(run / "target"), device="cpu")
    samples = anchors.write_samples(recipe, target, out / "samples.jsonl")
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == len(samples) == 17  # 20, less 1 with no supervised token, less 2 held out
    assert all(len(r["input_ids"]) == len(r["loss_mask"]) and any(r["loss_mask"]) for r in rows)
    b = anchors.budget_of(recipe, target, samples)
    mean = sum(len(r["input_ids"]) for r in rows) / len(rows)
    assert (b.steps, b.batch_size, b.tokens_per_step) == (5, 3, round(3 * mean))
    assert b.aux_layers == [2, 4, 5] and b.draft_vocab_size == 64 and b.ttt_steps == 3
    assert b.kind == "eagle3" and b.block is None and b.k is None


def test_heldout_answers_replayed_in_decode_order(anchors, tiny_target_dir, demo_data_dir, random_export_dir, tmp_path):
    """The run's held-out conversations, whole, tokenised once, when they are the target's regenerated
    answers; a chain drafter's replay is the offline acceptance's decode order (its drafts, and tau
    within 1..k+1); no held-out file, or one of source text: nothing."""
    from specheads.data.conversations import read_conversations
    from specheads.eval.offline import offline_acceptance
    from specheads.session import load_draft
    from specheads.target import Target

    target = Target.load(str(tiny_target_dir), device="cpu")
    run = tmp_path / "run"
    (run / "data").mkdir(parents=True)
    assert anchors.heldout_answers(run, target, 256) == []
    convs = (demo_data_dir / "train.jsonl").read_text().splitlines()[:6]
    (run / "data" / "heldout.jsonl").write_text("\n".join(convs) + "\n")
    assert anchors.heldout_answers(run, target, 256) == []  # source text, not the target's own answers
    marked = [json.dumps({**json.loads(c), "regenerated": {"turns": 1}}) for c in convs]
    (run / "data" / "heldout.jsonl").write_text("\n".join(marked) + "\n")
    answers = anchors.heldout_answers(run, target, 256)
    assert len(read_conversations(str(run / "data" / "heldout.jsonl"))[0]) == 6
    assert 0 < len(answers) <= 6  # tokenised like training: one with no answer token left in 256 is dropped
    head = load_draft(str(random_export_dir), target).head
    row = anchors.replay_heldout(head, target, answers)
    walk = offline_acceptance(target, head, answers)["decode_order"]
    assert row["heldout_tau"] == walk["tau"] and row["heldout_drafts"] == walk["starts"] > 0
    assert 1.0 <= row["heldout_tau"] <= 4.0 and anchors.replay_heldout(head, target, []) == {}


@pytest.mark.parametrize("kind, drafted", [("dflash", 7), ("dspark", 7)])
def test_block_budget(anchors, demo_run_dir, tmp_path, kind, drafted):
    """A DFlash / DSpark recipe's shared head: its layer outputs as vLLM taps (+1), anchor + G positions
    (DSpark's recipe counts G, DFlash's anchor + G), the target's vocabulary when the recipe has none."""
    from specheads.target import Target

    run, out = demo_run_dir, tmp_path / "out"
    data = anchors.train_file(run, out, 12)
    recipe = anchors.load_recipe_for(anchors.ROOT / "recipes" / kind / "demo.yaml", run / "target", data,
                                     anchors.work_root(out, kind), 5, [])
    target = Target.load(str(run / "target"), device="cpu")
    samples = anchors.write_samples(recipe, target, anchors.work_root(out, kind) / "samples.jsonl")
    b = anchors.budget_of(recipe, target, samples)
    assert b.kind == kind and b.k == drafted and b.block["block_size"] == drafted + 1 and b.ttt_steps is None
    assert b.aux_layers == [2, 6]  # the recipes' default outputs of layers [1, 5] of 8
    assert b.draft_vocab_size == target.vocab_size and b.block["num_layers"] == 2 and b.block["causal"] is False
    assert b.block["num_anchors"] == 32  # the recipes' blocks a sample: the anchors train as many
    assert ("markov_rank" in b.block) == (kind == "dspark")
    # the DSpark demo recipe drafts anchor-as-first and shares that layout (the block still counts anchor + G)
    assert b.block.get("sample_from_anchor", False) is (kind == "dspark")
    assert anchors.work_root(out, kind) == out / kind and anchors.work_root(out, "eagle3") == out
    if kind == "dspark":  # fill-in: no key, as every earlier run's budget key has it
        recipe.head.sample_from_anchor = False
        fill_in = anchors.budget_of(recipe, target, samples)
        assert "sample_from_anchor" not in fill_in.block and fill_in.k == drafted


# --- the real anchors, only where their venvs exist ------------------------------------------------
def _venv_ready(name: str) -> bool:
    return load_bench("anchors.py", "bench_anchors_probe").is_ready(name)


def test_driver_flags_of_each_kind():
    """speculators' flags: EAGLE-3's one layer and TTT; a block kind's layers, block and layout (fill-in:
    anchor + G slots, no sample-from-anchor; a DSpark recipe's anchor-as-first: G slots); DSpark's heads
    as shared."""
    sys.path.insert(0, str(DRIVERS))
    try:
        from speculators_train import head_argv
    finally:
        sys.path.remove(str(DRIVERS))
    assert head_argv({"ttt_steps": 3, "step_decay": 0.8}) == ["--num-layers", "1", "--draft-arch", "llama",
                                                            "--ttt-steps", "3", "--ttt-step-loss-decay", "0.8"]
    block = {"num_layers": 2, "block_size": 8, "causal": False, "num_anchors": 32, "markov_rank": 32,
             "markov_head_type": "vanilla", "enable_confidence_head": True, "confidence_head_with_markov": False}
    assert head_argv({"kind": "dflash", "block": block}) == ["--num-layers", "2", "--block-size", "8",
                                                            "--max-anchors", "32", "--no-sample-from-anchor"]
    assert head_argv({"kind": "dspark", "block": block})[5:] == [
        "32", "--no-sample-from-anchor", "--markov-rank", "32", "--markov-head-type", "vanilla",
        "--enable-confidence-head", "--no-confidence-head-with-markov"]
    first = head_argv({"kind": "dspark", "block": {**block, "sample_from_anchor": True}})  # G slots, its default layout
    assert first[2:7] == ["--block-size", "7", "--max-anchors", "32", "--sample-from-anchor"]


@pytest.mark.parametrize("name", ["speculators", "specforge"])
def test_anchor_trains_and_our_verifier_measures_it(name, anchors, tiny_target_dir, demo_data_dir, tmp_path, demo_run_dir,
                                                    monkeypatch):
    if not _venv_ready(name):
        pytest.skip(f"no {name} venv under the user cache: python bench/anchors.py creates it")
    run = demo_run_dir
    monkeypatch.chdir(tmp_path)
    out = Path("out")  # relative, as a user types it: the driver runs inside OUT/<name> and still finds its job
    rc = anchors.main(["--run", str(run), "--out", str(out), "--anchors", name, "--no-specheads", "--steps", "3",
                       "--conversations", "24", "--limit", "2", "--max-new-tokens", "8", "--threads", "1",
                       "train.batch_size=2", "train.warmup_steps=1", "head.draft_vocab_size=64"])
    report = json.loads((out / "anchors.json").read_text())
    row = report["rows"][0]
    assert rc == 0 and row["toolkit"] == name and "error" not in row, row
    assert row["greedy_equal"] and 1.0 <= row["tau"] <= 4.0 and len(row["acceptance_per_position"]) == 3
    assert row["train_tokens_per_s"] > 0 and row["export"].startswith(f"OUT/{name}/")
    assert str(tmp_path) not in json.dumps(report["rows"])  # the rows name OUT and TARGET, no machine path


def test_specforge_block_draft_config(drivers, tiny_target_dir):
    """SpecForge's DFlash family: a Qwen3 draft of the target's shape with the shared layers and taps
    (DFlash numbering = tap - 1). DFlash's block counts the anchor (fill-in layout); its DSpark drafts
    block_size tokens from block_size slots (anchor-as-first), so it gets G; its GQA-only DSpark is told
    "mha" for a target with as many KV heads as query heads. Records carry its DFlash-family keys.
    (No SpecForge import: the venv-gated test below runs it.)"""
    _, sf = drivers
    block = {"num_layers": 2, "block_size": 8, "causal": False, "markov_rank": 32, "markov_head_type": "vanilla",
             "enable_confidence_head": True, "confidence_head_with_markov": False}
    job = {"target": str(tiny_target_dir), "aux_layers": [2, 6], "block": block}
    target = sf.target_config(job)
    dflash = sf.block_config({**job, "kind": "dflash"}, target)
    assert dflash["architectures"] == ["DFlashDraftModel"] and dflash["model_type"] == "qwen3"
    assert (dflash["block_size"], dflash["num_hidden_layers"], dflash["num_target_layers"]) == (8, 2, 8)
    assert dflash["dflash_config"] == {"target_layer_ids": [1, 5]} and dflash["layer_types"] == ["full_attention"] * 2
    dspark = sf.block_config({**job, "kind": "dspark"}, target)
    assert dspark["architectures"] == ["DSparkDraftModel"] and dspark["block_size"] == 7
    assert dspark["dflash_config"] == {"target_layer_ids": [1, 5], "markov_rank": 32, "markov_head_type": "vanilla",
                                       "enable_confidence_head": True, "confidence_head_with_markov": False,
                                       "attention_mode": "mha"}  # the tiny target: 2 query, 2 KV heads
    aux, final = [torch.ones(5, 4), torch.zeros(5, 4)], torch.ones(5, 4)
    assert sorted(sf.record("dspark", [1] * 5, [1] * 5, aux, final)) == [
        "hidden_states", "input_ids", "loss_mask", "target_last_hidden_states"]
    assert sf.record("dflash", [1] * 5, [1] * 5, aux, final)["hidden_states"].shape == (1, 5, 8)
    budget = {"steps": 4, "batch_size": 2, "lr": 2e-3, "warmup_steps": 1, "seed": 0, "max_length": 64}
    cfg = sf.run_config({**job, **budget, "kind": "dflash", "block": {**block, "num_anchors": 32}}, Path("w"),
                        Path("f"), Path("d"), Path("o"))
    assert cfg["training"]["num_anchors"] == 32 and cfg["training"]["strategy"] == "dflash"  # the shared anchors


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_block_drafters_train_and_our_verifier_measures_them(kind, anchors, tmp_path, demo_run_dir):
    """Each block-kind anchor whose venv exists trains on the shared samples; its checkpoint loads as is and
    decodes greedy-equal. The DSpark demo recipe drafts anchor-as-first, so speculators trains that layout
    too and SpecForge's only one is no difference."""
    names = [name for name in ("speculators", "specforge") if _venv_ready(name)]
    if not names:
        pytest.skip("no speculators or specforge venv under the user cache: python bench/anchors.py creates them")
    out = tmp_path / "out"
    rc = anchors.main(["--run", str(demo_run_dir), "--out", str(out), "--anchors", ",".join(names),
                       "--recipe", str(anchors.ROOT / "recipes" / kind / "demo.yaml"), "--steps", "3",
                       "--conversations", "24", "--limit", "2", "--max-new-tokens", "8", "--threads", "1",
                       "train.batch_size=2", "train.warmup_steps=1", "data.max_length=128"])
    report = json.loads((out / "anchors.json").read_text())
    ours, *rows = report["rows"]
    theirs = {r["toolkit"]: r for r in rows}
    assert rc == 0 and ours["export"].startswith(f"OUT/{kind}/specheads/") and ours["greedy_equal"]
    assert report["budgets"][kind]["block"]["block_size"] == 8
    assert report["budgets"][kind]["block"].get("sample_from_anchor", False) is (kind == "dspark")
    for name, row in theirs.items():
        assert row["kind"] == kind and row["export"].startswith(f"OUT/{kind}/{name}/"), row
        assert "error" not in row, row
        assert row["greedy_equal"] and len(row["acceptance_per_position"]) == 7
        assert "layout" not in row.get("toolkit_defaults_kept", {})  # the layout is shared, not a kept default



def test_a_finished_toolkit_is_reused_only_for_the_same_budget_and_samples(anchors, tmp_path):
    """row.json keys a finished row by budget and samples (not threads): the same key returns it
    before any venv is looked at; another budget, other samples or a vanished export train again."""
    out = tmp_path / "out"
    samples = out / "data" / "samples.jsonl"
    samples.parent.mkdir(parents=True)
    samples.write_text('{"input_ids": [1, 2], "loss_mask": [0, 1]}\n')
    budget = anchors.Budget(steps=4, batch_size=2, tokens_per_step=10, max_length=64, aux_layers=[2, 4, 5],
                            draft_vocab_size=64, ttt_steps=3, step_decay=0.8, lr=2e-3, warmup_steps=1, seed=0)
    work = out / "speculators"
    export_dir = work / "train-1" / "3"
    export_dir.mkdir(parents=True)
    key = {"target": str(tmp_path.resolve()), "samples": str(samples.resolve()), "work": str(work.resolve()),
           **budget.__dict__, "samples_sha256": anchors.sha256_of(samples)}
    row = {"toolkit": "speculators", "kind": "eagle3", "export": "OUT/speculators/train-1/3",
           "export_path": str(export_dir), "train_s": 1.0}
    (work / "row.json").write_text(json.dumps({"key": key, "row": row}))
    assert anchors.train_anchor("speculators", out, tmp_path, samples, budget, threads=3) == {**row, "reused": True}
    assert anchors.reused(work / "row.json", {**key, "steps": 5}) is None
    samples.write_text('{"input_ids": [1, 3], "loss_mask": [0, 1]}\n')
    assert anchors.reused(work / "row.json", {**key, "samples_sha256": anchors.sha256_of(samples)}) is None
    export_dir.rmdir()
    assert anchors.reused(work / "row.json", key) is None



def test_a_brought_checkpoint_names_what_differs_from_the_budget(anchors, tmp_path, tiny_target_dir):
    """--specheads-checkpoint: the row says it was not trained by this call and lists every shared
    setting its recipe.json differs in (data compared by content, a stored feature capture named)."""
    from specheads.export.checkpoint import Checkpoint, save_checkpoint
    from specheads.heads.eagle3 import Eagle3Head, Eagle3Options
    from specheads.target import Target

    data, other = tmp_path / "train.jsonl", tmp_path / "copy.jsonl"
    data.write_text('{"a": 1}\n')
    other.write_text('{"a": 1}\n')  # the same content under another name: the same data
    target = Target.load(str(tiny_target_dir), device="cpu")
    head = Eagle3Head.for_target(Eagle3Options(ttt_steps=3, draft_vocab_size=64), target.config)
    recipe = {"train": {"batch_size": 2, "lr": 2e-3, "warmup_steps": 22, "seed": 0},
              "data": {"max_length": 128, "train": [str(other)], "features": "runs/x/features"}}
    c = Checkpoint(save_checkpoint(tmp_path / "run", 7, head, recipe, {}, {"step": 7}))
    budget = anchors.Budget(steps=7, batch_size=2, tokens_per_step=1, max_length=128, aux_layers=head.config.aux_layers,
                            draft_vocab_size=64, ttt_steps=3, step_decay=head.config.step_decay, lr=2e-3,
                            warmup_steps=15, seed=0)
    diffs = anchors.checkpoint_differences(c, budget, data)
    assert diffs == ["warmup_steps 22 (budget 15)", "trained from a stored feature capture (runs/x/features), not online"]
    (tmp_path / "other.jsonl").write_text('{"a": 2}\n')
    assert anchors.checkpoint_differences(c, budget, tmp_path / "other.jsonl")[1].startswith("data [")
    row = {**REPORT["rows"][0], "brought": str(c.path), "differs_from_budget": diffs}
    md = anchors.markdown({**REPORT, "rows": [row]})
    assert f"not trained by this call: the checkpoint `{c.path}` exported and measured" in md
    assert "differs from the budget in: warmup_steps 22 (budget 15); trained from a stored feature capture" in md
    assert "own head options" not in md
    # the checkpoint's own head options against the recipe's (shared ones are the budget's business)
    recipe["head"] = {"norm_output": True, "norm_before_fc": True, "ttt_steps": 3}
    c = Checkpoint(save_checkpoint(tmp_path / "run2", 7, head, recipe, {}, {"step": 7}))
    own = anchors.head_differences(c, {"norm_output": False, "norm_before_fc": True, "ttt_steps": 5})
    assert own == ["norm_output true (recipe false)"]
    md = anchors.markdown({**REPORT, "rows": [{**row, "head_differs_from_recipe": own}]})
    assert "; its own head options differ from the recipe's in: norm_output true (recipe false)" in md
    # a block drafter's shared shape (named by checkpoint_differences in the budget's numbering) is not repeated
    block = SimpleNamespace(recipe={"head": {"kind": "dspark", "block_size": 8, "target_layer_ids": [1], "markov_rank": 16,
                                             "sample_from_anchor": True, "loss": "ce"}})
    assert anchors.head_differences(block, {"kind": "dspark", "block_size": 7, "target_layer_ids": [2], "markov_rank": 32,
                                            "sample_from_anchor": False, "loss": "kl"}) == ['loss "ce" (recipe "kl")']


def test_a_brought_block_checkpoint_is_compared_by_its_block(anchors, tmp_path, tiny_target_dir):
    """A DSpark checkpoint's taps (layer outputs + 1), vocabulary and block read as the budget names them:
    nothing differs for the same head; another layout or Markov rank is named."""
    from specheads.export.checkpoint import Checkpoint, save_checkpoint
    from specheads.heads.dspark import DSparkHead, DSparkOptions
    from specheads.target import Target

    data = tmp_path / "train.jsonl"
    data.write_text('{"a": 1}\n')
    target = Target.load(str(tiny_target_dir), device="cpu")
    options = DSparkOptions(target_layer_ids=[1, 5], num_layers=2, block_size=7, num_anchors=32, markov_rank=8,
                            enable_confidence_head=True, sample_from_anchor=True)
    head = DSparkHead.for_target(options, target.config)
    recipe = {"train": {"batch_size": 2, "lr": 2e-3, "warmup_steps": 20, "seed": 0},
              "data": {"max_length": 128, "train": [str(data)]}}
    c = Checkpoint(save_checkpoint(tmp_path / "run", 7, head, recipe, {}, {"step": 7}))
    block = {"num_layers": 2, "block_size": 8, "causal": False, "num_anchors": 32, "markov_rank": 8,
             "markov_head_type": "vanilla", "enable_confidence_head": True, "confidence_head_with_markov": False,
             "sample_from_anchor": True}
    budget = anchors.Budget(steps=7, batch_size=2, tokens_per_step=1, max_length=128, aux_layers=[2, 6],
                            draft_vocab_size=target.vocab_size, ttt_steps=None, step_decay=None, lr=2e-3,
                            warmup_steps=20, seed=0, kind="dspark", block=block)
    assert anchors.checkpoint_differences(c, budget, data) == []
    fill_in = {k: v for k, v in block.items() if k != "sample_from_anchor"}
    assert anchors.checkpoint_differences(c, anchors.Budget(**{**budget.__dict__, "block": {**fill_in, "markov_rank": 4}}),
                                          data) == ["markov_rank 8 (budget 4)", "sample_from_anchor True (budget False)"]


def test_our_row_is_keyed_by_the_whole_recipe(anchors, demo_run_dir, tmp_path):
    """An option the anchors do not share (the optimizer) still retrains specheads' row."""
    out = tmp_path / "out"
    data = anchors.train_file(demo_run_dir, out, 4)
    budget = anchors.Budget(steps=4, batch_size=2, tokens_per_step=10, max_length=64, aux_layers=[2, 4, 5],
                            draft_vocab_size=64, ttt_steps=3, step_decay=0.8, lr=2e-3, warmup_steps=1, seed=0)
    keys = [anchors.ours_key(anchors.load_recipe_for(anchors.RECIPE, demo_run_dir / "target", data, out, 4, extra),
                             budget, "sha") for extra in ([], [], ["train.optimizer=muon"])]
    assert keys[0] == keys[1] != keys[2] and json.dumps(keys[0])  # stable, JSON-clean, and the optimizer counts


def test_our_online_row_counts_the_capture_in_its_rate(anchors, demo_run_dir, tmp_path):
    """specheads trains online (the target inside each step): its one rate is also its with-capture rate,
    the column the anchors' stored-state rates are compared in; a second call reuses the row."""
    out = tmp_path / "out"
    data = anchors.train_file(demo_run_dir, out, 8)
    recipe = anchors.load_recipe_for(anchors.RECIPE, demo_run_dir / "target", data, out, 2,
                                     ["train.batch_size=2", "train.warmup_steps=1", "head.draft_vocab_size=64",
                                      "data.max_length=64"])
    budget = anchors.Budget(steps=2, batch_size=2, tokens_per_step=40, max_length=64, aux_layers=[2, 4, 5],
                            draft_vocab_size=64, ttt_steps=3, step_decay=0.8, lr=2e-3, warmup_steps=1, seed=0)
    row = anchors.train_ours(recipe, out, budget, "sha")
    assert row["train_tokens_per_s"] == row["train_tokens_per_s_with_capture"]
    s = row["train_s"]  # rounded to 0.01 s, the rate is not
    assert 80 / (s + 0.005) - 0.05 <= row["train_tokens_per_s"] <= 80 / max(s - 0.005, 1e-3) + 0.05
    config = out / row["export"].removeprefix("OUT/") / "config.json"
    assert config.is_file()
    written = config.stat().st_mtime_ns
    assert anchors.train_ours(recipe, out, budget, "sha")["train_s"] == row["train_s"]
    assert config.stat().st_mtime_ns == written  # reused: neither trained nor exported again
