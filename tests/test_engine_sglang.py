"""SGLang 0.5.23's own code loads our SGLang exports and its draft modules give our heads' numbers.

Runs the probe (specheads/engines/probe_sglang.py) in the SGLang virtualenv as a subprocess; needs
that virtualenv, so it is skipped unless SPECHEADS_ENGINE_TESTS=1 and the venv exists (`make test`
stays engine-free).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specheads.engines.venvs import python_of

SGLANG_PYTHON = python_of("sglang")
PROBE = Path(__file__).resolve().parents[1] / "specheads" / "engines" / "probe_sglang.py"
# `engine`: skipped in `make test`, run by `make engine-check` (which creates the venv first)
pytestmark = [pytest.mark.engine, pytest.mark.skipif(
    os.environ.get("SPECHEADS_ENGINE_TESTS") != "1" or not SGLANG_PYTHON.exists(),
    reason="needs the SGLang 0.5.23 virtualenv and SPECHEADS_ENGINE_TESTS=1")]


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    from specheads.target import Target

    return Target.load(str(tiny_target_dir), device="cpu")


def _checkpoint(root, head, target, tiny_target_dir):
    from specheads.export.checkpoint import save_checkpoint
    from specheads.provenance import provenance

    return save_checkpoint(root / "run", 1, head.float(), recipe={"target": {"path": str(tiny_target_dir)}},
                           provenance=provenance(target=target.fingerprint()), trainer_state={})


def _eagle3(target):
    from specheads.heads.eagle3 import Eagle3Head, Eagle3Options

    torch.manual_seed(0)
    head = Eagle3Head.for_target(Eagle3Options(ttt_steps=3, draft_vocab_size=256), target.config)
    used = torch.sort(torch.randperm(target.vocab_size)[:256]).values  # a scattered draft vocabulary
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[used] = True
    head.set_vocab_map(used - torch.arange(256), t2d)
    return head


def _eagle1(target):
    from specheads.heads.eagle import EagleHead, EagleOptions

    torch.manual_seed(1)
    return EagleHead.for_target(EagleOptions(fc_bias=True, ttt_steps=3), target.config)


def _draft(target):
    from specheads.heads.draft import DraftHead, DraftOptions

    torch.manual_seed(2)
    head = DraftHead.for_target(DraftOptions(num_layers=2, ttt_steps=3), target.config)
    head.init_from_target(target)
    with torch.no_grad():  # a draft that differs from the target
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return head


HEADS = {"eagle3": _eagle3, "eagle": _eagle1, "draft": _draft}


@pytest.fixture(scope="module")
def exports(target, tiny_target_dir, tmp_path_factory):
    from specheads.export import export

    root = tmp_path_factory.mktemp("sglang-exports")
    return {kind: export(_checkpoint(root / kind, make(target), target, tiny_target_dir), "sglang", root / kind / "out")
            for kind, make in HEADS.items()}


@pytest.fixture(scope="module")
def inputs(target, tmp_path_factory):
    """Held-fixed prompt [1, T] and the target's greedy token after it."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(6, target.vocab_size, (1, 96), generator=g)
    nxt = target.forward(ids).logits[0, -1].argmax().reshape(1)
    path = tmp_path_factory.mktemp("inputs") / "inputs.safetensors"
    save_file({"input_ids": ids, "next_token": nxt}, str(path))
    return path


def run_probe(kind, target_dir, draft_dir, inputs, out, k=3) -> tuple[dict, dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    proc = subprocess.run([str(SGLANG_PYTHON), str(PROBE), "--target", str(target_dir), "--draft", str(draft_dir),
                           "--kind", kind, "--inputs", str(inputs), "--out", str(out), "--k", str(k)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    tensors = load_file(str(out / "tensors.safetensors")) if (out / "tensors.safetensors").exists() else {}
    return result, tensors


def ours(folder, tiny_target_dir, inputs, k):
    """Our loaded export's aux states [T, *] (None: it reads none), logits over the target vocab [T, V]
    and chain [k], computed the way `make engine-check` computes our side."""
    from specheads.engines.check import Ours

    side, t = Ours(Path(folder), Path(tiny_target_dir)), load_file(str(inputs))
    ids, first = t["input_ids"], int(t["next_token"][0])
    out, aux = side.features(ids)
    return aux, side.draft_logits(ids, first, out, None, k), torch.tensor(side.chain(ids, first, out, k))


def _eagle3_layout(cfg: dict, weights: dict, folder: Path) -> None:
    """SGLang numbers the aux layers one lower than we do and reads d2t as hot_token_id."""
    intended = json.loads((folder / "specheads.json").read_text())["head_config"]["aux_layers"]
    assert cfg["aux_layer_ids_specheads"] == intended and cfg["aux_layer_ids"] == [a - 1 for a in intended]
    assert cfg["draft_vocab_size"] == 256 and weights["consumed"] == {"d2t": "hot_token_id (d2t + arange)"}


LAYOUT_CHECKS = {"eagle3": _eagle3_layout}  # kind -> its own config assertions


@pytest.mark.parametrize("kind", list(HEADS))
def test_sglang_runs_our_export_like_our_head(kind, target, tiny_target_dir, exports, inputs, tmp_path):
    from specheads.engine_facts import SERVING

    result, tensors = run_probe(kind, tiny_target_dir, exports[kind], inputs, tmp_path / "probe")
    assert result["error"] is None, result["error"]
    cfg, w = result["config"], result["weights"]
    assert cfg["algorithm"] == SERVING[(kind, "sglang")].engine_method
    assert cfg["vocab_size"] == target.vocab_size and cfg["k"] == 3
    assert w["never_written"] == [] and w["dropped"] == [] and w["loaded"]
    aux, logits, chain = ours(exports[kind], tiny_target_dir, inputs, 3)
    LAYOUT_CHECKS.get(kind, lambda *args: None)(cfg, w, exports[kind])
    if aux is not None:
        assert result["layers"] == "ok"
        torch.testing.assert_close(tensors["aux_hidden"], aux, rtol=0, atol=1e-5)
    engine = tensors["draft_logits"]
    assert engine.shape == logits.shape
    finite = torch.isfinite(logits)
    assert torch.equal(torch.isfinite(engine), finite)
    assert (engine[finite] - logits[finite]).abs().max() <= 1e-4
    assert torch.equal(engine.argmax(-1), logits.argmax(-1))
    assert tensors["chain"].tolist() == chain.tolist()
    assert any("RadixAttention.forward" in r for r in result["replaced_kernels"])


def test_sglang_drops_a_model_prefixed_lm_head(target, tiny_target_dir, exports, inputs, tmp_path):
    """The fault our contract forbids: SGLang loads the folder without an error and leaves its
    lm_head unwritten; the probe names the dropped tensor and the parameter left unwritten."""
    folder = tmp_path / "fault"
    shutil.copytree(exports["eagle3"], folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.lm_head.weight"] = tensors.pop("lm_head.weight")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    result, _ = run_probe("eagle3", tiny_target_dir, folder, inputs, tmp_path / "probe")
    assert result["weights"]["dropped"] == ["model.lm_head.weight"]
    assert result["weights"]["never_written"] == ["lm_head.weight"]
    assert result["error"]["stage"] == "weights" and "model.lm_head.weight" in result["error"]["message"]
    assert result["forward"].startswith("not_run")
    from specheads.export import ContractError, validate

    with pytest.raises(ContractError, match="SGLang silently drops it"):
        validate(folder, "sglang")


def test_sglang_refuses_medusa(tiny_target_dir, exports, inputs, tmp_path):
    result, _ = run_probe("medusa", tiny_target_dir, exports["eagle3"], inputs, tmp_path / "probe")
    assert result["error"]["stage"] == "config"
    assert "Unknown speculative algorithm name: MEDUSA" in result["error"]["message"]
