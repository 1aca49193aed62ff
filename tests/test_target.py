"""Frozen target wrapper: loads a local HF folder, taps states by hooks, fingerprints, errors."""

from __future__ import annotations

import pytest
import torch

from specheads.target import Target, TargetError, check_fingerprint


def test_load_frozen_and_tap(tiny_target_dir):
    t = Target.load(str(tiny_target_dir), device="cpu")
    assert not any(p.requires_grad for p in t.model.parameters()) and not t.model.training
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    out = t.forward(ids, layers=[0, 2, t.num_layers - 1])
    ref = t.model(ids, output_hidden_states=True).hidden_states
    assert set(out.hidden) == {0, 2, t.num_layers - 1}
    for i, h in out.hidden.items():
        torch.testing.assert_close(h, ref[i], rtol=0, atol=0)
    with pytest.raises(TargetError, match="outside 0..7"):
        t.forward(ids, layers=[t.num_layers])
    # the final-norm tap is HF's last hidden state, and the output head maps it to the logits
    torch.testing.assert_close(out.final, ref[-1], rtol=0, atol=0)
    torch.testing.assert_close(t.lm_head(out.final), out.logits, rtol=0, atol=0)


def test_fingerprint_refuses_other_target(tiny_target_dir):
    t = Target.load(str(tiny_target_dir), device="cpu")
    fp = t.fingerprint()
    check_fingerprint(fp, t, "head")
    other = dict(fp, tokenizer_sha256="0" * 64)
    with pytest.raises(TargetError, match="tokenizer_sha256"):
        check_fingerprint(other, t, "the head in exports/x")


def test_missing_target_folder(tmp_path):
    with pytest.raises(TargetError, match="no config.json"):
        Target.load(str(tmp_path / "nowhere"))
