"""Offline acceptance sums TTT counts; parity flags an online tau far from the offline one."""

from __future__ import annotations

import pytest
import torch
from random_models import VOCAB, make_head, make_target

from specheads.data.tokenize import TokenizedSample, collate
from specheads.eval.offline import offline_acceptance, parity
from specheads.metrics import ttt_summary


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
    # the same counts as the head's own training forward over one collated batch
    batch = collate(samples, 0)
    out = target.forward(batch["input_ids"], layers=head.required_layers(), attention_mask=batch["attention_mask"])
    aux = torch.cat([out.hidden[i] for i in head.required_layers()], dim=-1)
    with torch.no_grad():
        res = head.train_forward(aux, target.embed(batch["input_ids"]), out.logits, batch["loss_mask"],
                                 batch["attention_mask"])
    direct = ttt_summary(*[res.counts[k].tolist() for k in ("rows", "reached", "cond_rows")])
    assert whole["tau_est"] == pytest.approx(direct["tau_est"])
    assert whole["rows"] == pytest.approx(res.counts["rows"].tolist())
    assert 1.0 <= whole["tau_est"] <= 1.0 + head.config.ttt_steps


def test_parity_flags_a_gap():
    assert parity(2.4, 2.25)["ok"] is True
    broken = parity(2.35, 1.0)
    assert broken["ok"] is False and broken["relative_gap"] == pytest.approx(-0.5745, abs=1e-3)
    assert any("d2t" in cause for cause in broken["likely_causes"])
