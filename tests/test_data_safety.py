"""Nothing lost: an output folder is replaced only when it is one we wrote for the same purpose; a
user's folder, a training run or a checkpoint given as --out is refused and left byte for byte
(mode included) as it was; a re-export keeps its eval attachments or refuses to drop them."""

from __future__ import annotations

import json
import shutil

import pytest
from test_atomic import tree_state, user_tree
from test_export import make_head, save
from test_integrity import cli

from specheads.atomic import OutputRefused
from specheads.export import export


def refused(args: list[str], root, *names: str) -> str:
    """Run the CLI, expect a clean refusal that names `names`; returns stderr."""
    run = cli(*args)
    assert run.returncode != 0, run.stdout
    assert "Traceback" not in run.stderr, run.stderr
    for name in names:
        assert name in run.stderr, run.stderr
    return run.stderr


@pytest.fixture()
def ckpt(tmp_path):
    return save(tmp_path, make_head())


def test_export_over_a_users_folder_is_refused_and_changes_nothing(ckpt, tmp_path):
    mine = user_tree(tmp_path / "mine")
    before = tree_state(tmp_path)
    err = refused(["export", str(ckpt), "--format", "vllm", "--out", str(mine)], tmp_path, str(mine),
                  "data.bin", "choose another --out")
    assert "not an export folder" in err
    refused(["export", str(ckpt), "--format", "vllm", "--out", str(mine), "--overwrite"], tmp_path, str(mine))
    assert tree_state(tmp_path) == before


@pytest.mark.parametrize("where", ["run", "checkpoint"])
def test_export_into_the_training_run_or_a_checkpoint_is_refused(ckpt, tmp_path, where):
    out = ckpt.parent if where == "run" else ckpt
    before = tree_state(tmp_path)
    refused(["export", str(ckpt), "--format", "sglang", "--out", str(out)], tmp_path, str(out), "head.safetensors")
    assert tree_state(tmp_path) == before


def attach(out, section: str = "k=3 predicted 1.40x") -> None:
    """What `eval --attach` leaves in an export: eval/ and a README section."""
    (out / "eval").mkdir()
    (out / "eval" / "metrics.json").write_text('{"tau": 2.0}')
    readme = out / "README.md"
    readme.write_text(readme.read_text() + f"\n## Recommended settings\n\n{section}\n")


def test_re_exporting_the_same_checkpoint_keeps_the_attachments(ckpt, tmp_path):
    out = export(ckpt, "vllm", tmp_path / "out")
    attach(out)
    export(ckpt, "vllm", out, num_speculative_tokens=2)
    assert json.loads((out / "eval" / "metrics.json").read_text()) == {"tau": 2.0}
    readme = (out / "README.md").read_text()
    assert readme.count("## Recommended settings") == 1 and "k=3 predicted 1.40x" in readme
    assert json.loads((out / "config.json").read_text())["speculators_config"]["proposal_methods"][0][
        "speculative_tokens"] == 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_re_exporting_other_weights_refuses_to_drop_attachments_without_overwrite(ckpt, tmp_path):
    out = export(ckpt, "vllm", tmp_path / "out")
    attach(out)
    other = save(tmp_path / "other", make_head(seed=1))
    before = tree_state(out)
    err = refused(["export", str(other), "--format", "vllm", "--out", str(out)], tmp_path, str(out), "eval/",
                  "Recommended settings", "--overwrite")
    assert "checkpoint_sha256" in err
    refused(["export", str(ckpt), "--format", "sglang", "--out", str(out)], tmp_path, "format")  # other format
    assert tree_state(out) == before
    run = cli("export", str(other), "--format", "vllm", "--out", str(out), "--overwrite")
    assert run.returncode == 0, run.stderr
    assert not (out / "eval").exists() and "Recommended settings" not in (out / "README.md").read_text()


def test_files_a_user_added_to_an_export_are_not_dropped_silently(ckpt, tmp_path):
    out = export(ckpt, "vllm", tmp_path / "out")
    (out / "my_notes.md").write_text("serving notes")
    before = tree_state(tmp_path)
    with pytest.raises(OutputRefused, match=r"my_notes\.md.*--overwrite"):
        export(ckpt, "vllm", out)
    assert tree_state(tmp_path) == before
    export(ckpt, "vllm", out, overwrite=True)
    assert not (out / "my_notes.md").exists()


def test_an_export_by_an_older_version_is_replaced(ckpt, tmp_path):
    out = export(ckpt, "vllm", tmp_path / "out")
    record = json.loads((out / "specheads.json").read_text())
    for key in ("purpose", "checkpoint_sha256", "export_dtype", "sha256"):
        del record[key]
    (out / "specheads.json").write_text(json.dumps(record))
    export(ckpt, "vllm", out)
    assert json.loads((out / "specheads.json").read_text())["purpose"] == "export"


def test_eval_and_capture_refuse_a_users_folder_before_loading_anything(tmp_path, tiny_target_dir, demo_data_dir):
    mine = user_tree(tmp_path / "mine")
    (mine / "metrics.json").write_text('{"mine": true}')  # a name eval would write
    before = tree_state(tmp_path)
    refused(["eval", "--target", str(tmp_path / "absent"), "--draft", str(tmp_path / "absent"),
             "--prompts", str(tmp_path / "absent.jsonl"), "--out", str(mine)], tmp_path, str(mine), "metrics.json")
    refused(["capture", "recipes/demo/eagle3.yaml", f"target.path={tiny_target_dir}", "data.max_length=96",
             f"data.train=[{demo_data_dir / 'train.jsonl'}]", "--out", str(mine)], tmp_path, str(mine),
            "not a feature capture")
    assert tree_state(tmp_path) == before


def test_a_killed_exports_temporary_folder_is_removed_by_the_next_export(ckpt, tmp_path):
    stale = tmp_path / ".out.tmp-999999999-abcdefgh"  # no such process
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    export(ckpt, "vllm", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", "run"])
    shutil.rmtree(tmp_path / "out")
