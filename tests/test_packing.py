"""Packed ragged forwards (`attention.packed`): rows of unequal length run as one row of their real
tokens through the linear layers, and every row still gets exactly what it gets alone."""

from __future__ import annotations

import pytest
import torch
from random_models import VOCAB, make_target

from specheads.attention import Packing
from specheads.verify.ragged import batch_forward, merge_rows, packing_for
from specheads.verify.steps import new_cache


def chain(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


def prefilled(target, prompts: list[torch.Tensor]):
    """Each prompt prefilled alone, the caches stacked (right-padded) -> the batch cache."""
    cache = None
    for ids in prompts:
        one = new_cache(target)
        target.forward(ids[None], cache=one, use_cache=True)
        cache = merge_rows(cache, one)
    return cache


def alone(target, prompt: torch.Tensor, tokens: torch.Tensor):
    """The prompt prefilled alone, then its tokens as one chain -> (logits [n, V], cache)."""
    cache = new_cache(target)
    target.forward(prompt[None], cache=cache, use_cache=True)
    pos = torch.arange(prompt.numel(), prompt.numel() + tokens.numel())[None]
    out = target.forward(tokens[None], position_ids=pos, cache=cache, use_cache=True)
    return out.logits[0], cache


def test_packing_golden_and_round_trip():
    pack = Packing.of([2, 1, 3], "cpu")
    assert pack.index.tolist() == [0, 1, 3, 6, 7, 8] and (pack.rows, pack.width) == (3, 3)
    x = torch.arange(1, 19, dtype=torch.float32).view(3, 3, 2)  # [B, N, 2]
    packed = pack.pack(x)
    assert packed.shape == (1, 6, 2) and packed[0, :, 0].tolist() == [1, 3, 7, 13, 15, 17]
    back = pack.unpack(packed)
    keep = torch.zeros(9, dtype=torch.bool)
    keep[pack.index] = True
    assert torch.equal(back.view(9, 2)[keep], x.view(9, 2)[keep])
    assert not back.view(9, 2)[~keep].any()  # padding slots are zero
    heads = torch.randn(1, 4, 6, 5)  # [1, heads, T, d]
    assert torch.equal(pack.unpack_heads(heads).transpose(1, 2).reshape(9, 4, 5)[pack.index],
                       heads[0].transpose(0, 1))


def test_a_packed_ragged_step_gives_every_row_its_logits_and_cache_alone():
    target = make_target()
    torch.manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,)) for n in (7, 4, 9)]
    tokens = [torch.randint(0, VOCAB, (n,)) for n in (3, 1, 2)]
    cache = prefilled(target, prompts)
    cache_len = cache.get_seq_length()
    assert packing_for(target, [t.numel() for t in tokens], cache) is not None  # this runs packed
    out = batch_forward(target, tokens, [torch.arange(t.numel()) for t in tokens],
                        [chain(t.numel()) for t in tokens], [p.numel() for p in prompts], cache, [2])
    assert out.logits.shape == (3, 3, VOCAB) and out.hidden[2].shape[:2] == (3, 3)
    for b, (prompt, toks) in enumerate(zip(prompts, tokens)):
        logits, own = alone(target, prompt, toks)
        n, P = toks.numel(), prompt.numel()
        torch.testing.assert_close(out.logits[b, :n], logits, rtol=0, atol=1e-10)
        for mine, theirs in zip(cache.layers, own.layers):  # prefix slots, then the new ones
            torch.testing.assert_close(mine.keys[b, :, :P], theirs.keys[0, :, :P], rtol=0, atol=1e-12)
            torch.testing.assert_close(mine.keys[b, :, cache_len: cache_len + n], theirs.keys[0, :, P:],
                                       rtol=0, atol=1e-10)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_prefill_keeps_each_rows_last_logits_only(attn):
    target = make_target(attn)
    torch.manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (n,)) for n in (5, 11, 8)]
    cache = new_cache(target)
    out = batch_forward(target, prompts, [torch.arange(p.numel()) for p in prompts],
                        [chain(p.numel()) for p in prompts], [0, 0, 0], cache, [1], last_only=True)
    assert out.logits.shape == (3, 1, VOCAB) and out.hidden[1].shape[:2] == (3, 11)
    for b, ids in enumerate(prompts):
        full = target.forward(ids[None]).logits[0, -1]
        torch.testing.assert_close(out.logits[b, 0], full, rtol=0, atol=1e-10)


def test_rows_are_not_packed_when_padding_costs_nothing_or_the_kernel_cannot():
    cache = new_cache(make_target())
    assert packing_for(make_target(), [2, 2, 2], cache) is None
    assert packing_for(make_target(), [2, 1], cache) is not None
    assert packing_for(make_target("eager"), [2, 1], new_cache(make_target("eager"))) is None
