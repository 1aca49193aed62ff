"""An eval is tied to the weights it measured and says what its suffix history already held: an eval
copied beside other weights is ignored by serve's automatic choice (named with both hashes), refused by
--adaptive and by push; a history holding the evaluated prompts is flagged in metrics.json, report.md,
serve's start line and the card; a history nothing reads is said to be ignored; a huge one is bounded."""

from __future__ import annotations

import json
import logging
import shutil
import time

import pytest
from refusals import refused

from specheads.data.suffix_history import History, history_overlap, read_history
from specheads.eval.online import evaluate
from specheads.eval_identity import draft_weights, short
from specheads.hub import PushError, push
from specheads.mixing import Mixing, resolve_mixing, with_history
from specheads.verify.settings import SettingsError

PROMPTS = ["def add(a, b): return the sum", "import os and list the files", "for i in range(3): print it"]


def other_export(target_dir, root):
    """The conftest's random export, with other random weights (seed 1)."""
    import torch

    from specheads.export import export
    from specheads.export.checkpoint import save_checkpoint
    from specheads.heads.eagle3 import Eagle3Head, Eagle3Options
    from specheads.provenance import provenance
    from specheads.target import Target

    target = Target.load(str(target_dir), device="cpu")
    torch.manual_seed(1)
    head = Eagle3Head.for_target(Eagle3Options(ttt_steps=3, draft_vocab_size=256), target.config)
    ckpt = save_checkpoint(root / "run", 1, head, recipe={}, provenance=provenance(target=target.fingerprint()),
                           trainer_state={})
    return export(ckpt, "vllm", root / "export")


@pytest.fixture(scope="module")
def exports(tiny_target_dir, random_export_dir, tmp_path_factory):
    """(export A with an eval attached whose suffix history held its prompts, export B: other weights)."""
    root = tmp_path_factory.mktemp("identity")
    a = shutil.copytree(random_export_dir, root / "a")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    history = root / "history.jsonl"
    history.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p},
                                                        {"role": "assistant", "content": "some answer " * 4}]}) + "\n"
                               for p in PROMPTS))
    evaluate(str(tiny_target_dir), str(a), str(prompts), str(root / "eval"), max_new_tokens=8, k=2, attach=True,
             quiet=True, suffix_history=str(history))
    return a, other_export(tiny_target_dir, root / "b")


def test_the_eval_records_the_weights_it_measured(exports):
    a, b = exports
    metrics = json.loads((a / "eval" / "metrics.json").read_text())
    assert metrics["draft_weights"] == draft_weights(a) and "model.safetensors" in metrics["draft_weights"]["files"]
    assert draft_weights(b)["sha256"] != metrics["draft_weights"]["sha256"]


def test_an_eval_copied_beside_other_weights_is_ignored_or_refused(exports, tmp_path, caplog):
    a, b = exports
    b2 = shutil.copytree(b, tmp_path / "b")
    shutil.copytree(a / "eval", b2 / "eval")
    ours, theirs = short(draft_weights(b2)["sha256"]), short(draft_weights(a)["sha256"])
    with caplog.at_level(logging.WARNING):
        auto = resolve_mixing("auto", None, b2)
    assert not auto.active and "measured other weights" in auto.describe()
    assert ours in caplog.text and theirs in caplog.text and "ignored" in caplog.text
    with pytest.raises(SettingsError, match=f"--adaptive needs .* {theirs}.*{ours}"):
        resolve_mixing("off", True, b2)
    with pytest.raises(PushError, match=f"other weights \\(sha256 {theirs}\\).*{ours}.*another drafter"):
        push(b2, "org/x", dry_run=True, out=lambda s: None)


def test_a_history_holding_the_evaluated_prompts_is_flagged_everywhere(exports, caplog):
    a, _ = exports
    metrics = json.loads((a / "eval" / "metrics.json").read_text())
    history = metrics["suffix_history"]
    assert history["overlap"]["prompts_in_history"] == len(PROMPTS) and "read high" in history["warning"]
    assert "**Warning:**" in (a / "eval" / "report.md").read_text()
    lines = []
    push(a, "org/x", dry_run=True, out=lines.append, license_id="apache-2.0")
    card = "\n".join(lines)
    assert "**Warning:**" in card and "holds 3 of the 3 evaluated prompts" in card
    assert "Measured with these weights" in card
    assert metrics["advice"]["engines"]["specheads"]  # serve's automatic choice reads it
    assert "WARNING: the --suffix-history" in resolve_mixing("auto", None, a).describe()


def test_overlap_counts_prompts_and_answers():
    history = History(prompts=["What is the capital of France?"],
                      answers=["The capital of France is Paris, a city on the Seine."])
    got = history_overlap(history, ["What is the capital of France?", "Something else entirely here"],
                          ["The capital of France is Paris", "hi"])
    assert got == {"prompts_in_history": 1, "answers_in_history": 1, "prompts": 2, "answers": 2}


@pytest.mark.parametrize("mixing,words", [(Mixing(reason="no drafter"), "no --draft"),
                                          (Mixing(asked="--hybrid off --no-adaptive"), "--hybrid off --no-adaptive")])
def test_a_history_nothing_reads_is_said_to_be_ignored(caplog, tmp_path, mixing, words):
    path = tmp_path / "hist.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}))
    with caplog.at_level(logging.WARNING):
        assert with_history(mixing, str(path)).history is None
    assert f"--suffix-history {path} is ignored" in caplog.text and words in caplog.text
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}))
    with pytest.raises(ValueError, match="no assistant"):  # ignored or not, a broken file is named
        with_history(mixing, str(path))


def test_a_huge_one_line_history_is_bounded_by_the_context(tiny_target_dir, tmp_path, capsys):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_target_dir))
    path = tmp_path / "huge.jsonl"
    rows = [{"messages": [{"role": "user", "content": "hi " * 2_000_000}, {"role": "assistant", "content": "a"}]},
            {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "ab " * 3_000_000}]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    t0 = time.monotonic()
    history = read_history(path, tok, context=256)
    assert time.monotonic() - t0 < 20
    assert history.skipped == 1 and history.cut == 1 and len(history.pairs) == 1 and len(history.pairs[0][1]) <= 256
    assert "suffix history huge.jsonl" in capsys.readouterr().err  # progress


def test_a_training_checkpoint_as_draft_names_the_export_command(exports, tiny_target_dir, tmp_path):
    """`--draft` at what `specheads train` wrote (a checkpoint, or its run folder): not the loader contract's
    placeholder, but what it is and the `specheads export` command that makes an export of it."""
    _, b = exports
    run = b.parent / "run"
    checkpoint = next(p for p in run.iterdir() if p.name.startswith("checkpoint-"))
    for folder in (checkpoint, run):
        text = refused(["generate", "--target", tiny_target_dir, "--draft", folder, "--prompt", "hi"],
                       ["training", f"specheads export {folder} --format vllm --out"], tmp_path, watch=(folder,))
        assert "'?'" not in text and "loader contract" not in text
