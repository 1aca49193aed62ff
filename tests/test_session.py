"""The speculation session (specheads/session.py): one fingerprint policy for every verb, the
default draft length chosen once, and decodes through it equal to plain greedy decoding."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from bench_scripts import load_bench, unload_bench

from specheads.cli import main as cli
from specheads.data.prompts import encode_chat
from specheads.export import export, read_export_meta
from specheads.export.checkpoint import save_checkpoint
from specheads.heads.eagle3 import Eagle3Head, Eagle3Options
from specheads.mixing import Mixing
from specheads.provenance import provenance
from specheads.serve.server import load_engine
from specheads.session import Session, eos_ids, load_draft
from specheads.target import Target, TargetError
from specheads.verify.loop import greedy_decode
from specheads.verify.settings import Sampling, TreeSpec, make_tree_spec
from specheads.verify.text import TextStream

PROMPT = "def add(a, b):"
FLAG = "--allow-missing-fingerprint"


@pytest.fixture(scope="module")
def verifier():
    """bench/verifier.py loaded as a module (bench/ is scripts, not a package)."""
    module = load_bench("verifier.py", "bench_verifier_session")
    yield module
    unload_bench(module)


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return Target.load(str(tiny_target_dir), device="cpu")


def edited_export(src: Path, dst: Path, edit) -> Path:
    """A copy of an export whose specheads.json is changed by `edit(record)`."""
    shutil.copytree(src, dst)
    record = json.loads((dst / "specheads.json").read_text())
    edit(record)
    (dst / "specheads.json").write_text(json.dumps(record))
    return dst


@pytest.fixture(scope="module")
def drafts(random_export_dir, tmp_path_factory):
    """The fixture export as written, one whose fingerprint names another target, one with none."""
    root = tmp_path_factory.mktemp("fingerprints")

    def other(record):
        record["target"]["embedding_sketch"] = [[-v for v in row] for row in record["target"]["embedding_sketch"]]

    return {"ok": Path(random_export_dir),
            "other": edited_export(random_export_dir, root / "other", other),
            "bare": edited_export(random_export_dir, root / "bare", lambda r: r.pop("target"))}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    (root / "prompts.jsonl").write_text(json.dumps({"id": "a", "prompt": PROMPT}) + "\n")
    (root / "data.jsonl").write_text(json.dumps({"messages": [
        {"role": "user", "content": PROMPT}, {"role": "assistant", "content": "return a + b"}]}) + "\n")
    return root


def verb_args(verb: str, target_dir, draft: Path, inputs: Path, out: Path) -> list[str]:
    """The cheapest run of each verb that loads a draft (CLI flags as users pass them)."""
    common = ["--target", str(target_dir), "--draft", str(draft), "--device", "cpu"]
    return {
        "generate": ["generate", *common, "--prompt", PROMPT, "--max-new-tokens", "3"],
        "eval": ["eval", *common, "--prompts", str(inputs / "prompts.jsonl"), "--out", str(out),
                 "--max-new-tokens", "3", "--no-predict", "--quiet"],
        "eval-offline": ["eval", *common, "--offline", "--data", str(inputs / "data.jsonl"), "--out", str(out)],
        "serve": ["serve", *common, "--port", "0"],  # refused before it serves
        "bench-verifier": [*common, "--prompts", str(inputs / "prompts.jsonl"), "--out", str(out),
                           "--limit", "1", "--max-new-tokens", "3", "--chain-ks", "1", "--eagle2", "1:1:2",
                           "--static-tree", str(inputs / "tree.json")],
    }[verb]


def run_verb(verb: str, args: list[str], verifier) -> int:
    if verb == "bench-verifier":
        return verifier.main(args)
    return cli(args)


VERBS = ["generate", "eval", "eval-offline", "serve", "bench-verifier"]


@pytest.mark.parametrize("verb", VERBS)
def test_every_verb_refuses_another_targets_draft_and_one_without_a_fingerprint(
        verb, verifier, tiny_target_dir, drafts, inputs, tmp_path, capsys):
    (inputs / "tree.json").write_text("[[0]]")
    refusals = [("other", [], "embedding_sketch"), ("other", [FLAG], "embedding_sketch"), ("bare", [], FLAG)]
    for which, extra, needle in refusals:  # the override lets a missing fingerprint through, never another's
        args = verb_args(verb, tiny_target_dir, drafts[which], inputs, tmp_path / which) + extra
        assert run_verb(verb, args, verifier) == 1, (verb, which, extra)
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, (verb, which, extra, err)
        assert not (tmp_path / which).exists()  # nothing written
    if verb == "serve":
        return
    args = verb_args(verb, tiny_target_dir, drafts["bare"], inputs, tmp_path / "allowed")
    assert run_verb(verb, args + [FLAG], verifier) == 0, capsys.readouterr().err
    if verb.startswith("eval"):
        metrics = json.loads((tmp_path / "allowed" / "metrics.json").read_text())
        assert metrics["provenance"]["fingerprint_checked"] is False
        assert metrics["draft_weights"]["sha256"]  # which weights were measured, online or offline


def test_serve_applies_the_same_policy(tiny_target_dir, drafts):
    chain = TreeSpec("chain")
    with pytest.raises(TargetError, match="embedding_sketch"):
        load_engine(str(tiny_target_dir), str(drafts["other"]), chain, "cpu", None, None, True)
    with pytest.raises(TargetError, match=FLAG):
        load_engine(str(tiny_target_dir), str(drafts["bare"]), chain, "cpu", None, None)
    engine = load_engine(str(tiny_target_dir), str(drafts["bare"]), chain, "cpu", None, None, True)
    assert engine.session.draft.fingerprint_checked is False
    assert load_engine(str(tiny_target_dir), str(drafts["ok"]), chain, "cpu", None, None).session.draft.fingerprint_checked


@pytest.fixture(scope="module")
def k2_export(tiny_target_dir, tmp_path_factory):
    """An export whose num_speculative_tokens (2) differs from the head's TTT steps (3)."""
    target = Target.load(str(tiny_target_dir), device="cpu")
    torch.manual_seed(0)
    head = Eagle3Head.for_target(Eagle3Options(ttt_steps=3, draft_vocab_size=256), target.config)
    root = tmp_path_factory.mktemp("k2")
    ckpt = save_checkpoint(root / "run", 1, head, recipe={}, provenance=provenance(target=target.fingerprint()),
                           trainer_state={})
    return export(ckpt, "vllm", root / "export", num_speculative_tokens=2)


def test_default_k_is_the_exports_in_every_verb(verifier, tiny_target_dir, k2_export, inputs, tmp_path, capsys):
    assert read_export_meta(k2_export).num_speculative_tokens == 2
    target = Target.load(str(tiny_target_dir), device="cpu")
    draft = load_draft(k2_export, target)
    assert draft.head.config.ttt_steps == 3 and draft.k == 2
    assert Session(target, draft).spec == TreeSpec("chain", k=2)
    assert Session(target, draft, TreeSpec("chain", k=1)).spec.k == 1  # --k wins
    tree = make_tree_spec("eagle2", depth=1, top_k=2, total_tokens=4)
    assert (Session(target, draft, tree).spec, Session(target, draft, tree).k) == (tree, 2)
    draft.meta.num_speculative_tokens = None  # nothing recorded: the TTT steps
    assert draft.k == 3

    (inputs / "tree.json").write_text("[[0]]")
    args = verb_args("generate", tiny_target_dir, k2_export, inputs, tmp_path / "g")
    assert cli(args) == 0 and "draft: chain k=2 " in capsys.readouterr().err
    assert cli(verb_args("eval", tiny_target_dir, k2_export, inputs, tmp_path / "e")) == 0
    assert json.loads((tmp_path / "e" / "metrics.json").read_text())["k"] == 2
    engine = load_engine(str(tiny_target_dir), str(k2_export), TreeSpec("chain"), "cpu", None, None)
    assert engine.spec == TreeSpec("chain", k=2)
    assert verifier.main(verb_args("bench-verifier", tiny_target_dir, k2_export, inputs, tmp_path / "b")) == 0
    capsys.readouterr()
    names = [m["method"] for m in json.loads((tmp_path / "b" / "verifier.json").read_text())["methods"]]
    assert names[-1] == "ngram k=2"


@pytest.mark.parametrize("spec", [TreeSpec("chain"), make_tree_spec("eagle2", depth=2, top_k=2, total_tokens=6),
                                  TreeSpec("static", choices=((0,), (1,), (0, 0)))], ids=["chain", "eagle2", "static"])
def test_session_decodes_equal_plain_greedy_and_streams_the_same_text(target, random_export_dir, spec):
    session = Session(target, load_draft(random_export_dir, target), spec)
    ids = encode_chat(target.tokenizer, [{"role": "user", "content": PROMPT}])
    pieces: list[str] = []
    decoded = session.decode(ids, 16, stream=TextStream(target.tokenizer, pieces.append))
    plain = greedy_decode(target, ids, 16, eos_ids(target))
    assert decoded.result.tokens == plain.tokens == session.plain(ids, 16).tokens
    assert decoded.result.stats.decode_forwards <= plain.stats.decode_forwards
    assert "".join(pieces) == target.tokenizer.decode(plain.tokens, skip_special_tokens=True)
    assert decoded.stream_s > 0
    assert session.decode(ids, 16).result.tokens == plain.tokens  # no stream: same tokens


def test_session_without_a_draft_is_plain_decoding(target):
    session = Session(target)
    ids = encode_chat(target.tokenizer, [{"role": "user", "content": PROMPT}])
    assert session.head is None and session.k is None
    result = session.decode(ids, 12).result
    assert result.tokens == greedy_decode(target, ids, 12, eos_ids(target)).tokens
    assert result.stats.proposed_tokens == 0
    sampling = Sampling(temperature=0.8, seed=5)
    assert session.decode(ids, 12, sampling).result.tokens == session.plain(ids, 12, sampling).tokens


def test_sampled_session_decodes_are_reproducible(target, random_export_dir):
    session = Session(target, load_draft(random_export_dir, target))
    ids = encode_chat(target.tokenizer, [{"role": "user", "content": PROMPT}])
    sampling = Sampling(temperature=0.9, top_p=0.95, seed=3)
    first, second = (session.decode(ids, 12, sampling).result for _ in range(2))
    assert first.tokens == second.tokens and first.tokens


@pytest.mark.parametrize("mixing", [Mixing(), Mixing("choose"), Mixing("union")], ids=["drafter", "hybrid", "union"])
def test_decode_many_equals_each_prompt_decoded_alone(target, random_export_dir, mixing):
    """A batch of requests (each with its own proposer and its own view of the free proposer) gives
    every prompt its decode alone: greedy token for token; sampled with the same seed where no
    state is shared (the suffix cache's drafts depend on which requests finished before)."""
    session = Session(target, load_draft(random_export_dir, target), mixing=mixing)
    prompts = [encode_chat(target.tokenizer, [{"role": "user", "content": text}])
               for text in (PROMPT, "print('hi')", "for i in range(3):", "x = [1, 2, 3]", "class A:")]
    many = session.decode_many(prompts, 14, batch_size=3)
    for ids, result in zip(prompts, many):
        assert result.tokens == greedy_decode(target, ids, 14, eos_ids(target)).tokens
    assert sum(r.stats.proposed_tokens for r in many) > 0
    plain = session.decode_many(prompts, 14, batch_size=4, drafted=False)
    assert [r.stats.proposed_tokens for r in plain] == [0] * len(prompts)
    assert [r.tokens for r in plain] == [r.tokens for r in many]
    if mixing.active:
        return
    sampling = Sampling(temperature=0.9, seed=7)
    sampled = session.decode_many(prompts[:3], 10, sampling, batch_size=3)
    assert [r.tokens for r in sampled] == [session.decode(ids, 10, sampling).result.tokens for ids in prompts[:3]]
