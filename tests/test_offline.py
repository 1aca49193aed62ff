"""Offline acceptance sums TTT counts; parity flags an online tau far from the offline one."""

from __future__ import annotations

import pytest
import torch
from random_models import VOCAB, make_head, make_target

from specheads.data.tokenize import TokenizedSample, collate
from specheads.eval.offline import offline_acceptance, parity
from specheads.metrics import decode_walk, ttt_summary, walk_summary


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


def test_decode_walk_replays_rows_in_the_order_a_chain_decoder_visits_them():
    """Golden: a decoder drafting k = 3 at row i accepts a drafts and drafts next at row i + a + 1,
    or at the next start after it (a turn's end); rows it jumps over are never counted."""
    accepted = [3, 0, 1, 2, 0, 0, 3, 1, 0, 2, 0, 0]  # per row: how many of its drafts match
    starts = [True] * 9 + [False, False, True]  # rows 9-10: the turn ended; row 11: the next turn
    walk = torch.zeros(4, 1, 12, dtype=torch.bool)
    walk[0, 0] = torch.tensor(starts)
    for i, a in enumerate(accepted):
        walk[1:1 + a, 0, i] = True
    # row 0: 3 -> row 4: 0 -> row 5: 0 -> row 6: 3 -> row 10 is no start -> row 11: 0
    assert decode_walk(walk) == {"starts": 5, "reached": [2, 2, 2]}
    summary = walk_summary(5, [2, 2, 2])
    assert summary["tau"] == pytest.approx(1 + 6 / 5) and summary["acceptance_per_position"] == [0.4] * 3
    # teacher-forced, every start row counts alike: another tau (2.0 over the 10 start rows)
    tf = 1 + sum(a for a, s in zip(accepted, starts) if s) / sum(starts)
    assert tf == pytest.approx(2.0) and tf != pytest.approx(summary["tau"])


def test_offline_acceptance_replays_a_chain_heads_rows_in_decode_order():
    """EAGLE-3 (a head that drafts at every position) reports `decode_order` from the same rows:
    its starts are the rows whose next two tokens are answer tokens, at most one per row."""
    target = make_target()
    target.tokenizer = _Tok()
    head = make_head(target)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (30,), generator=g).tolist()
    samples = [TokenizedSample("a", ids, [0] * 5 + [1] * 25)]
    out = offline_acceptance(target, head, samples)
    walk = out["decode_order"]
    # rows 4..27 may start (x_{i+1} and x_{i+2} answer tokens); each draft moves 1..k+1 rows
    assert 24 / (head.config.ttt_steps + 1) <= walk["starts"] <= 24
    assert len(walk["acceptance_per_position"]) == head.config.ttt_steps
    assert 1.0 <= walk["tau"] <= 1.0 + head.config.ttt_steps
