"""check-engine for DSpark: vLLM 0.33's and SGLang 0.5.23's own draft modules (DFlash's context write and
block forward, then their Markov head slot by slot from the greedy token before each slot) equal our
proposer's, their confidence heads give our confidence(), and exports the engines read differently
from the trained head fail.

The engine-marked tests need the engines' virtualenvs (SPECHEADS_ENGINE_TESTS=1, `make engine-check`);
the others run in `make test`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_engine_dflash import example_exports

from specheads.engines import check

FORMATS = {"vllm": ("vllm", "vllm-native"), "sglang": ("sglang",)}


def edit_config(change):
    def apply(folder: Path) -> None:
        cfg = json.loads((folder / "config.json").read_text())
        change(cfg)
        (folder / "config.json").write_text(json.dumps(cfg))
    return apply


def other_mask(cfg: dict) -> None:
    """Another mask token where each engine reads it: the engine drafts from other mask embeddings."""
    cfg["mask_token_id"] -= 1
    if "dflash_config" in cfg:
        cfg["dflash_config"]["mask_token_id"] -= 1


FAULTS = {  # config.json edited after export (the weights' checksums still hold): engine and trained head differ
    "mask_token": edit_config(other_mask),
    "anchor_first": edit_config(lambda cfg: cfg.update(sample_from_anchor=True)),  # the layout we do not train
}


@pytest.fixture(scope="module")
def dspark_exports(tmp_path_factory):
    """The descriptor's example (vanilla Markov rank 8, confidence head, block 3) in every format."""
    return example_exports("dspark", tmp_path_factory.mktemp("dspark-engine"))


def test_our_block_at_the_prompt_end_is_the_greedy_chain(dspark_exports):
    exports, tiny = dspark_exports
    ours = check.Ours(exports["sglang"], tiny)
    ids = torch.arange(30)[None] % 400 + 5
    out, _ = ours.features(ids)
    logits = ours.draft_logits(ids, 9, out, [12, 30], 3)  # [2 * 3, V]
    assert logits.shape == (6, ours.target.vocab_size)
    assert logits[3:].argmax(-1).tolist() == ours.chain(ids, 9, out, 3)
    want = check.expected_config(ours, "sglang", 3)
    assert (want["block_size"], want["markov_rank"], want["sample_from_anchor"], want["confidence_head"]) == \
        (3, 8, False, True)


def run_engine(engine: str, dspark_exports, root: Path) -> dict:
    """Reports and the probe's tensors for the clean exports and each fault (on the last format)."""
    exports, tiny = dspark_exports
    folders = {fmt: exports[fmt] for fmt in FORMATS[engine]}
    for name, fault in FAULTS.items():
        folders[name] = Path(shutil.copytree(exports[FORMATS[engine][-1]], root / name))
        fault(folders[name])
    jobs = [check.prepare(folder, engine, tiny, work=root / "work" / name) for name, folder in folders.items()]
    return {name: (report, job) for name, report, job in zip(folders, check.run_jobs(jobs), jobs)}


@pytest.fixture(scope="module", params=["vllm", "sglang"])
def engine_runs(request, dspark_exports, tmp_path_factory):
    return request.param, run_engine(request.param, dspark_exports, tmp_path_factory.mktemp(f"{request.param}-dspark"))


def our_confidence(job) -> torch.Tensor:
    """Our proposer's confidence() over the job's anchors, slot by slot [n * k]."""
    from specheads.verify.dspark_proposers import DSparkProposer

    ours, ids = job.ours, job.inputs["input_ids"]
    out, _ = ours.features(ids)
    proposer, T, rows = DSparkProposer(ours.head, ours.target), ids.shape[1], []
    for a in job.inputs["anchors"].tolist():
        proposer.start(ids[0, :a], int(job.inputs["next_token"][0]) if a == T else int(ids[0, a]), out)
        proposer.propose(job.k)
        rows.append(proposer.confidence().float())
    return torch.cat(rows)


@pytest.mark.engine
def test_engine_drafts_equal_ours_with_the_confidence_head(engine_runs):
    engine, runs = engine_runs
    for fmt in FORMATS[engine]:
        report, job = runs[fmt]
        text = check.format_report(report)
        assert [report.stages[s].status for s in ("config", "weights", "layers", "forward")] == [check.PASS] * 4, text
        n = report.numbers
        assert n["argmax_equal"] == n["positions"] == 3 * check.ANCHORS and n["chain_engine"] == n["chain_ours"], text
        assert report.engine_config["confidence_head"] is True and report.engine_config["sample_from_anchor"] is False
        theirs = load_file(str(job.out / "tensors.safetensors"))["confidence"]
        torch.testing.assert_close(theirs, our_confidence(job), atol=1e-5, rtol=1e-5)


@pytest.mark.engine
def test_engine_fails_exports_it_reads_differently(engine_runs):
    runs = engine_runs[1]
    report = runs["mask_token"][0]
    text = check.format_report(report)
    assert report.stages["weights"].status == check.PASS and report.stages["forward"].status == check.FAIL, text
    assert report.numbers["logits_max_abs_diff"] > 1e-3 and "mask_token_id" in report.stages["config"].detail, text
    report = runs["anchor_first"][0]
    assert report.stages["config"].status == check.FAIL, check.format_report(report)
    assert "sample_from_anchor" in report.stages["config"].detail
