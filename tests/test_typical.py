"""Medusa typical acceptance from the CLI: runs with a Medusa head, is labelled lossy, refuses
settings where it means nothing, and accepts fewer drafts the stricter its threshold."""

from __future__ import annotations

import json

import pytest
import torch

from specheads.cli import main as cli
from specheads.export import export
from specheads.export.checkpoint import save_checkpoint
from specheads.heads.medusa import MedusaHead, MedusaOptions
from specheads.provenance import provenance
from specheads.target import Target
from specheads.verify.loop import decode
from specheads.verify.medusa_proposers import MedusaProposer
from specheads.verify.sampling import typical_accept
from specheads.verify.trees import tree_from_choices

TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return Target.load(str(tiny_target_dir), device="cpu")


@pytest.fixture(scope="module")
def medusa_export(target, tiny_target_dir, tmp_path_factory):
    """Three Medusa heads started from the target's own head (so drafts are often right)."""
    torch.manual_seed(0)
    head = MedusaHead.for_target(MedusaOptions(num_heads=3), target.config)
    head.init_from_target(target)
    root = tmp_path_factory.mktemp("medusa")
    ckpt = save_checkpoint(root / "run", 1, head, recipe={"target": {"path": str(tiny_target_dir)}},
                           provenance=provenance(target=target.fingerprint()), trainer_state={})
    out = export(ckpt, "medusa", root / "export")
    (root / "tree.json").write_text(json.dumps(TREE))
    (root / "prompts.jsonl").write_text("".join(
        json.dumps({"id": str(i), "prompt": p}) + "\n"
        for i, p in enumerate([PROMPT, "Sort a list in Python.", "What is a tuple?"])))
    return out, root


def test_accepted_length_never_grows_with_the_threshold():
    """For a fixed tree and target distributions, a stricter epsilon accepts a prefix of what a
    looser one accepts; epsilon 1 accepts nothing."""
    gen = torch.Generator().manual_seed(0)
    tree = tree_from_choices(TREE)
    for trial in range(20):
        p = torch.softmax(torch.randn(tree.size, 50, generator=gen) * 3, -1).double()  # [N, V]
        tokens = torch.cat([torch.tensor([0]), p.topk(3, dim=-1).indices[tree.parents[1:], tree.ranks[1:]]])
        lengths = [len(typical_accept(tree, tokens, p, None, eps, 1e9).path) - 1
                   for eps in (1e-9, 0.01, 0.05, 0.1, 0.2, 0.4, 1.0)]
        assert lengths == sorted(lengths, reverse=True), (trial, lengths)
        assert lengths[0] == tree.max_depth and lengths[-1] == 0


def test_chain_typical_is_flagged_lossy_and_strictness_costs_drafts(target):
    torch.manual_seed(0)
    head = MedusaHead.for_target(MedusaOptions(num_heads=3), target.config)
    head.init_from_target(target)
    accepted = {}
    for eps in (1e-6, 1.0):
        res = decode(target, MedusaProposer(head, target), [5, 9, 2, 7], 24, 3,
                              temperature=0.8, seed=1, rule="typical", epsilon=eps, delta=1e9)
        assert res.lossy and res.rule == "typical" and len(res.tokens) == 24
        accepted[eps] = sum(res.stats.accepted_per_pos)
    assert accepted[1.0] < accepted[1e-6]


def _eval(target_dir, export_dir, root, name, *extra):
    """`specheads eval` with sampled static trees -> (exit code, metrics.json or None)."""
    out = root / name
    rc = cli(["eval", "--target", str(target_dir), "--draft", str(export_dir), "--prompts",
              str(root / "prompts.jsonl"), "--out", str(out), "--max-new-tokens", "24", "--k", "3",
              "--tree", str(root / "tree.json"), "--temperature", "0.8", *extra])
    return rc, json.loads((out / "metrics.json").read_text()) if rc == 0 else None


def test_eval_typical_is_labelled_lossy_and_threshold_orders_acceptance(medusa_export,
                                                                        tiny_target_dir, capsys):
    export_dir, root = medusa_export
    rc, exact = _eval(tiny_target_dir, export_dir, root, "exact")
    assert rc == 0 and exact["lossless"] is True and exact["acceptance"] == "exact"
    rc, loose = _eval(tiny_target_dir, export_dir, root, "loose", "--acceptance", "typical",
                      "--typical-epsilon", "0.000001", "--typical-delta", "1000")
    assert rc == 0 and "LOSSY" in capsys.readouterr().out
    assert loose["lossless"] is False and loose["acceptance"] == "typical"
    assert loose["sampling"]["epsilon"] == 1e-6 and loose["sampling"]["delta"] == 1000
    rc, strict = _eval(tiny_target_dir, export_dir, root, "strict", "--acceptance", "typical",
                       "--typical-epsilon", "0.9", "--typical-delta", "1000")
    assert rc == 0 and strict["lossless"] is False
    assert strict["speculative"]["tau"] < loose["speculative"]["tau"]
    assert loose["speculative"]["tau"] > 1.0  # the loose threshold does accept drafts


def test_generate_typical_says_lossy(medusa_export, tiny_target_dir, capsys):
    export_dir, root = medusa_export
    rc = cli(["generate", "--target", str(tiny_target_dir), "--draft", str(export_dir), "--prompt",
              PROMPT, "--tree", str(root / "tree.json"), "--max-new-tokens", "12", "--device", "cpu",
              "--temperature", "0.7", "--acceptance", "typical"])
    err = capsys.readouterr().err
    assert rc == 0 and "LOSSY" in err and "typical acceptance eps=0.09 delta=0.3" in err


@pytest.mark.parametrize("args,message", [
    (["--acceptance", "typical"], "needs --temperature > 0"),
    (["--temperature", "0.7", "--typical-epsilon", "0.1"], "only apply with --acceptance typical"),
    (["--temperature", "0.7", "--acceptance", "typical", "--typical-epsilon", "0"],
     "0 < --typical-epsilon <= 1"),
    (["--temperature", "0.7", "--acceptance", "typical", "--typical-delta", "-1"],
     "--typical-delta > 0"),
])
def test_refusals(medusa_export, tiny_target_dir, capsys, args, message):
    export_dir, root = medusa_export
    for verb in (["generate", "--prompt", PROMPT, "--device", "cpu"],
                 ["eval", "--prompts", str(root / "prompts.jsonl"), "--out", str(root / "x")]):
        rc = cli(verb + ["--target", str(tiny_target_dir), "--draft", str(export_dir), *args])
        assert rc == 1 and message in capsys.readouterr().err
