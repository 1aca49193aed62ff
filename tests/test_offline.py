"""Offline acceptance sums TTT counts; parity flags an online tau far from the offline one."""

from __future__ import annotations

import pytest
import torch

from specheads.data.tokenize import TokenizedSample
from specheads.eval.offline import offline_acceptance, parity
from specheads.metrics import ttt_summary
from random_models import VOCAB, make_head, make_target


class _Tok:
    pad_token_id = 0


def test_offline_acceptance_equals_summed_batches():
    target = make_target()
    target.tokenizer = _Tok()
    head = make_head(target)
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(5):
        n = 8 + 3 * i
        ids = torch.randint(1, VOCAB, (n,), generator=g).tolist()
        samples.append(TokenizedSample(str(i), ids, [0] * 3 + [1] * (n - 3)))
    whole = offline_acceptance(target, head, samples, batch_size=5)
    split = offline_acceptance(target, head, samples, batch_size=2)
    assert whole["rows"] == pytest.approx(split["rows"])  # counts, not ratios, are summed
    assert whole["tau_est"] == pytest.approx(split["tau_est"])
    assert whole["tau_est"] == pytest.approx(ttt_summary(whole["rows"], [r * a for r, a in zip(
        whole["rows"], whole["acc_uncond"])], whole["rows"])["tau_est"])
    assert 1.0 <= whole["tau_est"] <= 1.0 + head.config.ttt_steps


def test_parity_flags_a_gap():
    assert parity(2.4, 2.25)["ok"] is True
    broken = parity(2.35, 1.0)
    assert broken["ok"] is False and broken["relative_gap"] == pytest.approx(-0.5745, abs=1e-3)
    assert any("d2t" in cause for cause in broken["likely_causes"])
