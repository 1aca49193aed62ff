"""Every other path a command writes or deletes: replaced only when it is ours, refused (byte for
byte intact, before the slow part) otherwise. train.output_dir has its own file (test_run_dir.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from test_atomic import tree_state, user_tree
from test_data_safety import refused
from test_export import make_head

from specheads.atomic import OutputRefused
from specheads.export.checkpoint import save_checkpoint


def test_pruning_and_best_spare_a_users_copy_of_a_checkpoint(tmp_path):
    head = make_head()
    save_checkpoint(tmp_path, 1, head, {}, {}, {"val_tau": 1.5}, keep_last=1)
    backup = tmp_path / "checkpoint-000001-backup"  # the user's copy, rated best by its (edited) tau
    shutil.copytree(tmp_path / "checkpoint-000001", backup)
    state = json.loads((backup / "trainer_state.json").read_text())
    (backup / "trainer_state.json").write_text(json.dumps({**state, "val_tau": 9.0}))
    (tmp_path / "checkpoint-000002.bak").write_text("notes")
    kept = {k: v for k, v in tree_state(tmp_path).items() if k.startswith(("checkpoint-000001-", "checkpoint-000002."))}
    for step, tau in ((2, 2.0), (3, 1.7), (4, 1.6)):
        save_checkpoint(tmp_path, step, head, {}, {}, {"val_tau": tau}, keep_last=1)
    assert tree_state(tmp_path).items() >= kept.items()  # the copy and the note survive, unchanged
    assert (tmp_path / "best").read_text().strip() == "checkpoint-000002"
    assert sorted(p.name for p in tmp_path.glob("checkpoint-0*[0-9]")) == ["checkpoint-000002", "checkpoint-000004"]


def test_tiny_target_out_refuses_a_users_folder_and_replaces_an_earlier_build(tmp_path, tiny_target_dir):
    from specheads.builtin.tiny_target import BUILD_INFO, build_tiny_target

    mine = user_tree(tmp_path / "mine")
    before = tree_state(tmp_path)
    refused(["tiny-target", "--out", str(mine), "--preset", "test"], tmp_path, str(mine), "data.bin",
            "not a tiny target folder")
    assert tree_state(tmp_path) == before
    earlier = tmp_path / "tiny"
    shutil.copytree(tiny_target_dir, earlier)
    (earlier / "stale-weights.bin").write_bytes(b"from an earlier build")
    killed = tmp_path / ".tiny.tmp-999999999-abcdefgh"  # a build cut short (no such process)
    killed.mkdir()
    build_tiny_target(earlier, preset="test", progress=False)
    assert (earlier / BUILD_INFO).is_file() and not (earlier / "stale-weights.bin").exists()
    assert not killed.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".tiny")]


def test_demo_refuses_a_folder_that_merely_holds_a_target_or_data(tmp_path):
    from specheads.demo import is_demo_run, link_target

    mine = user_tree(tmp_path / "mine")
    (mine / "target").write_text("my notes about the target")
    (mine / "data").mkdir()
    (mine / "data" / "heldout_prompts.jsonl").write_text('{"prompt": "mine"}\n')
    assert not is_demo_run(mine)
    before = tree_state(tmp_path)
    refused(["demo", "--run", str(mine), "--preset", "test"], tmp_path, str(mine), "not a demo run folder")
    with pytest.raises(OutputRefused, match=r"mine/target is not the link the demo makes.*file"):
        link_target(mine, tmp_path)
    assert tree_state(tmp_path) == before


def test_regenerate_refuses_a_users_file_before_loading_and_writes_nothing_beside_it(tmp_path):
    mine = tmp_path / "answers.jsonl"
    mine.write_text('{"messages": [{"role": "user", "content": "mine"}]}\n')
    before = tree_state(tmp_path)
    err = refused(["regenerate", str(mine), "--out", str(mine), "--target", str(tmp_path / "absent")],
                  tmp_path, str(mine), "answers.jsonl.index", "nothing was changed")
    assert "absent" not in err  # refused before the target is looked at
    refused(["regenerate", str(mine), "--out", str(tmp_path), "--target", str(tmp_path / "absent")],
            tmp_path, "is a folder")
    assert tree_state(tmp_path) == before  # no answers.jsonl.meta.json either


def test_vocab_stats_replaces_only_an_earlier_count(tmp_path, tiny_target_dir, demo_data_dir):
    from specheads.data.vocab_stats import check_stats_output, save_vocab_stats

    mine = tmp_path / "model.safetensors"
    mine.write_bytes(b"the user's weights")
    before = tree_state(tmp_path)
    recipe = ["recipes/demo/eagle3.yaml", f"target.path={tiny_target_dir}",
              f"data.train=[{demo_data_dir / 'train.jsonl'}]", "data.max_length=96"]
    refused(["vocab-stats", *recipe, "--out", str(mine)], tmp_path, str(mine), "not a vocab-stats file",
            "Nothing was changed")
    refused(["vocab-stats", *recipe, "--out", str(tmp_path)], tmp_path, "is a folder")
    assert tree_state(tmp_path) == before
    earlier = save_vocab_stats(tmp_path / "stats.safetensors", torch.ones(8, dtype=torch.int64), {"n": 1})
    check_stats_output(earlier)  # ours: may be replaced


def test_attaching_an_eval_again_removes_what_a_killed_attach_left(tmp_path):
    from specheads.eval.report import attach_to_export
    from specheads.export import export

    out = export(save_checkpoint(tmp_path / "run", 1, make_head(), {}, {}, {}), "vllm", tmp_path / "export")
    ev = tmp_path / "eval"
    ev.mkdir()
    (ev / "metrics.json").write_text(json.dumps({"tau": 2.0}))
    (out / "eval").mkdir()
    killed = out / "eval" / ".metrics.json.tmp-999999999-abcdefgh"  # an attach cut short mid-copy
    killed.write_text('{"ta')
    attach_to_export(out, ev)
    assert sorted(p.name for p in (out / "eval").iterdir()) == ["metrics.json"]
    assert json.loads((out / "eval" / "metrics.json").read_text()) == {"tau": 2.0}
