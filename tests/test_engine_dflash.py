"""check-engine for DFlash: the block forward run by vLLM 0.33's and SGLang 0.5.23's own draft modules
(their context K/V write and block forward) equals our proposer's, and an export whose config.json
makes the engine draft differently from the trained head fails the forward.

The engine-marked tests need the engines' virtualenvs (SPECHEADS_ENGINE_TESTS=1, `make engine-check`);
the others run in `make test`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from specheads.engines import check

FAULTS = {  # name -> a change to config.json that the engine reads and our trained head does not
    "mask_token": lambda cfg: cfg["dflash_config"].update(mask_token_id=cfg["dflash_config"]["mask_token_id"] - 1),
    "causal": lambda cfg: cfg.update(is_causal=True),  # engines read is_causal before dflash_config.causal
}


@pytest.fixture(scope="module")
def dflash_exports(tmp_path_factory):
    """A perturbed random DFlash head (block 4) on the tiny target, exported in all three formats."""
    return example_exports("dflash", tmp_path_factory.mktemp("dflash-engine"))


def example_exports(kind: str, root: Path) -> tuple[dict[str, Path], Path]:
    """The kind descriptor's first example on the tiny target, exported in vllm, vllm-native and sglang
    under `root`, and the target folder."""
    from specheads.builtin.tiny_target import cached_tiny_target
    from specheads.engines.matrix import fingerprint_provenance, save_example
    from specheads.export import export
    from specheads.kinds import KINDS
    from specheads.target import Target

    tiny = cached_tiny_target("test", progress=False)
    target = Target.load(str(tiny), device="cpu")
    example = KINDS[kind].example
    ckpt = save_example(root, example.build(target, example.seed), tiny, fingerprint_provenance(target))
    return {fmt: export(ckpt, fmt, root / fmt) for fmt in ("vllm", "vllm-native", "sglang")}, tiny


def faulty(src: Path, dest: Path, change) -> Path:
    shutil.copytree(src, dest)
    cfg = json.loads((dest / "config.json").read_text())
    change(cfg)
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


# --- our side (no engine needed) ------------------------------------------------------------------------
def test_prepare_writes_block_anchors_for_dflash(dflash_exports, tmp_path):
    exports, tiny = dflash_exports
    job = check.prepare(exports["vllm-native"], "vllm", tiny, work=tmp_path)
    T = job.inputs["input_ids"].shape[1]
    anchors = job.inputs["anchors"].tolist()
    assert anchors == sorted(set(anchors)) and anchors[0] >= 1 and anchors[-1] == T
    assert len(anchors) == check.ANCHORS and T > 200  # blocks spread over a long prompt


def test_our_side_is_the_trained_head_not_config_json(dflash_exports, tmp_path):
    """A config.json edited after export does not move our side: the engine reads it, we compare
    with the head as trained (otherwise both sides would agree on the fault)."""
    exports, tiny = dflash_exports
    folder = faulty(exports["vllm-native"], tmp_path / "f", FAULTS["mask_token"])
    clean, edited = check.Ours(exports["vllm-native"], tiny), check.Ours(folder, tiny)
    assert edited.head.config.mask_token_id == clean.head.config.mask_token_id
    ids = torch.arange(40)[None] % 500 + 3
    out, _ = clean.features(ids)
    anchors = [10, 40]
    a = clean.draft_logits(ids, 7, out, anchors, 3)
    b = edited.draft_logits(ids, 7, out, anchors, 3)
    assert a.shape == (len(anchors) * 3, clean.target.vocab_size) and torch.equal(a, b)


def test_block_logits_are_the_proposers_drafts(dflash_exports):
    """Our compared block at the prompt's end is what the verifier proposes from the same state."""
    exports, tiny = dflash_exports
    ours = check.Ours(exports["vllm"], tiny)
    ids = torch.arange(30)[None] % 400 + 5
    out, feats = ours.features(ids)
    assert feats.shape == (30, len(ours.head.config.target_layer_ids) * ours.target.hidden_size)
    logits = ours.draft_logits(ids, 9, out, [30], 3)
    assert logits.argmax(-1).tolist() == ours.chain(ids, 9, out, 3)


# --- inside the engines -----------------------------------------------------------------------------------
def _reports(engine: str, formats, dflash_exports, root: Path) -> dict:
    exports, tiny = dflash_exports
    folders = {fmt: exports[fmt] for fmt in formats}
    for name, change in FAULTS.items():
        folders[name] = faulty(exports[formats[-1]], root / name, change)
    jobs = [check.prepare(folder, engine, tiny, work=root / "work" / name) for name, folder in folders.items()]
    return dict(zip(folders, check.run_jobs(jobs)))


@pytest.fixture(scope="module")
def vllm_reports(dflash_exports, tmp_path_factory):
    return _reports("vllm", ("vllm", "vllm-native"), dflash_exports, tmp_path_factory.mktemp("vllm-dflash"))


@pytest.fixture(scope="module")
def sglang_reports(dflash_exports, tmp_path_factory):
    return _reports("sglang", ("sglang",), dflash_exports, tmp_path_factory.mktemp("sglang-dflash"))


def _assert_clean(report):
    text = check.format_report(report)
    assert [report.stages[s].status for s in ("config", "weights", "layers", "forward")] == [check.PASS] * 4, text
    n = report.numbers
    assert n["logits_max_abs_diff"] <= 1e-4 and n["argmax_equal"] == n["positions"] == 3 * check.ANCHORS, text
    assert n["chain_engine"] == n["chain_ours"] and len(n["chain_ours"]) == 3, text


def _assert_fault(report, fault):
    text = check.format_report(report)
    assert not report.passed and report.stages["forward"].status == check.FAIL, text
    assert report.stages["weights"].status == check.PASS and report.stages["layers"].status == check.PASS, text
    assert report.numbers["logits_max_abs_diff"] > 1e-3, text
    if fault == "mask_token":  # the engine resolves the edited id, and says so at config
        assert report.stages["config"].status == check.FAIL and "mask_token_id" in report.stages["config"].detail, text
    else:  # causality is not a config-stage fact: only the forward shows it
        assert report.stages["config"].status == check.PASS, text


@pytest.mark.engine
@pytest.mark.parametrize("fmt", ["vllm", "vllm-native"])
def test_vllm_block_forward_equals_ours(vllm_reports, fmt):
    _assert_clean(vllm_reports[fmt])
    assert any("precompute_and_store_context_kv" in r for r in vllm_reports[fmt].replaced_kernels)


@pytest.mark.engine
@pytest.mark.parametrize("fault", list(FAULTS))
def test_vllm_forward_fails_an_export_the_engine_reads_differently(vllm_reports, fault):
    _assert_fault(vllm_reports[fault], fault)


@pytest.mark.engine
def test_sglang_block_forward_equals_ours(sglang_reports):
    _assert_clean(sglang_reports["sglang"])
    assert sglang_reports["sglang"].engine_config["block_size"] == 4


@pytest.mark.engine
@pytest.mark.parametrize("fault", list(FAULTS))
def test_sglang_forward_fails_an_export_the_engine_reads_differently(sglang_reports, fault):
    _assert_fault(sglang_reports[fault], fault)
