"""A draft that accepts nothing is called out end to end: the real `specheads eval` and
`specheads generate` CLIs, on an export whose weights are finite (so every integrity check passes)
but whose vocabulary map (d2t) names only tokens the target never emits for these prompts, so
no drafted token can be accepted."""

from __future__ import annotations

import json

import pytest
import torch
from test_integrity import cli

from specheads.data.prompts import encode_chat
from specheads.session import eos_ids
from specheads.verify.loop import greedy_decode

PROMPTS = ["def add(a, b):", "class Stack:"]
NEW_TOKENS = 24  # per prompt: at least 20 drafts in all, the warning's threshold


@pytest.fixture(scope="module")
def broken_export(tiny_target_dir, tmp_path_factory):
    """A random EAGLE-3 head for the tiny target whose d2t maps every draft id to a token absent
    from the target's greedy answers to PROMPTS (what a shuffled or foreign d2t amounts to)."""
    from specheads.export import export
    from specheads.export.checkpoint import save_checkpoint
    from specheads.heads.eagle3 import Eagle3Head, Eagle3Options
    from specheads.heads.vocab import build_vocab_map
    from specheads.provenance import provenance
    from specheads.target import Target

    target = Target.load(str(tiny_target_dir), device="cpu")
    emitted = set()
    for prompt in PROMPTS:
        ids = encode_chat(target.tokenizer, [{"role": "user", "content": prompt}])
        tokens = greedy_decode(target, ids, NEW_TOKENS, eos_ids(target)).tokens
        assert len(tokens) >= 12, "the target stops too early to draft meaningfully"
        emitted |= set(map(int, tokens))
    vocab = target.config.vocab_size
    counts = torch.ones(vocab)
    counts[sorted(emitted)] = 0  # the map keeps the most frequent ids: never the emitted ones
    torch.manual_seed(0)
    head = Eagle3Head.for_target(Eagle3Options(ttt_steps=2, draft_vocab_size=32), target.config)
    head.set_vocab_map(*build_vocab_map(counts, 32))
    used = set((torch.arange(32) + head.d2t).tolist())
    assert not used & emitted and all(bool(torch.isfinite(p).all()) for p in head.parameters())
    root = tmp_path_factory.mktemp("broken")
    ckpt = save_checkpoint(root / "run", 1, head, recipe={}, provenance=provenance(target=target.fingerprint()),
                           trainer_state={})
    return export(ckpt, "vllm", root / "export")


def test_eval_prints_and_stores_the_broken_draft_warning(tiny_target_dir, broken_export, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    out = tmp_path / "eval"
    run = cli("eval", "--target", str(tiny_target_dir), "--draft", str(broken_export), "--prompts", str(prompts),
              "--out", str(out), "--max-new-tokens", str(NEW_TOKENS), "--k", "3")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["tau"] == pytest.approx(1.0) and metrics["greedy_equal"] is True
    warning = metrics["draft_warning"]
    assert warning and "looks broken" in warning and "d2t" in warning and "NaN" in warning
    assert warning in run.stderr  # printed, not only stored
    assert metrics["speculative"]["num_drafts"] >= 20


def test_generate_prints_the_broken_draft_warning(tiny_target_dir, broken_export):
    run = cli("generate", "--target", str(tiny_target_dir), "--draft", str(broken_export), "--prompt", PROMPTS[0],
              "--max-new-tokens", str(NEW_TOKENS + 8), "--k", "3")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Traceback" not in run.stderr + run.stdout
    text = run.stdout + run.stderr
    assert "tau=1.000" in text and "identical to plain greedy: True" in text
    assert "warning: the draft looks broken: 0 token(s) accepted" in text and "d2t" in text
