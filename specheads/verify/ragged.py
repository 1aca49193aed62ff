"""The batched decode loop's target forward over ragged rows and its KV-cache layout.

Layout: one transformers `DynamicCache` of shape [B, heads, L, head_dim] per layer, right-padded
with a valid length per row. Row b's cached positions are slots 0 .. past_b - 1 (its prompt and
accepted tokens, in order); slots past_b .. L - 1 hold stale keys / values (another row is
longer, or rejected drafts) that no query may see. A step feeds every row's tokens (root first,
[N_b], padded to N = max N_b) into the new slots L .. L + N - 1 with

* position_ids past_b + depth (RoPE follows the row's own logical positions, siblings share one);
* an explicit additive 4-D mask [B, 1, N, L + N]: row b's node j sees slots 0 .. past_b - 1 and
  its tree ancestors (and itself) among the new slots; a padding query sees the prefix and its
  own slot (never an empty row, so sdpa gives no NaN; its output is ignored).

`keep_paths` then moves each row's accepted nodes to slots past_b .. past_b + m_b (only those
slots are copied) and crops the cache to the longest row, so the next step starts from the same
per-row cache plain decoding of that row alone would have built. Rows leave with `select_rows`
and join with `merge_rows` (a new row is prefilled on its own cache, then padded and stacked).
A draft group (`eagle3_proposers.draft_group`) runs its drafter over the same layout: its members'
one-row caches `stack_rows`-ed, and each member's rows taken back with `take_row`.
This needs a kernel that honours arbitrary 4-D masks (sdpa / eager); flash attention cannot
skip stale slots. With our sdpa kernel and growing cache layers, rows of unequal length are fed
packed (`attention.packed`): the linear layers and the output head run over the real tokens only,
the attention over the padded rows above. A prefill computes logits at each row's last position
only (the first token's; nothing reads the others). A single row without stale slots gets exactly the masks of a sequential
decode (none for one token), so batch size 1 is this same path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from specheads.attention import GQA_SDPA, Packing, packed
from specheads.target import TargetOutput
from specheads.verify.kv_cache import GrowingLayer
from specheads.verify.steps import TREE_ATTENTION, DecodeError, trim_cache


def check_batch_attention(config) -> None:
    """Refuse attention kernels that ignore a 4-D mask: ragged rows need one (stale slots)."""
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in TREE_ATTENTION:
        raise DecodeError(
            f"the target uses attn_implementation='{impl}': batched decoding needs per-row 4-D "
            "masks, which it does not honour. Load it with attn_implementation='sdpa' or "
            "'eager', or decode with batch size 1"
        )


def batch_inputs(tokens: list[torch.Tensor], depths: list[torch.Tensor], pasts: list[int],
                 device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row tokens [N_b] and depths [N_b] -> (input ids [B, N], position ids [B, N]).

    Padding slots get id 0 and the row's next position (any valid values: nothing reads them).
    """
    n = max(t.numel() for t in tokens)
    ids = torch.zeros(len(tokens), n, dtype=torch.long)
    pos = torch.tensor(pasts, dtype=torch.long)[:, None].repeat(1, n)  # [B, N]
    for b, (tok, dep) in enumerate(zip(tokens, depths)):
        ids[b, : tok.numel()] = tok.cpu()
        pos[b, : dep.numel()] += dep.cpu()
    return ids.to(device), pos.to(device)


def batch_mask(masks: list[torch.Tensor], pasts: list[int], cache_len: int, dtype: torch.dtype,
               device) -> torch.Tensor | None:
    """Per-row ancestor-or-self masks [N_b, N_b] -> additive mask [B, 1, N, cache_len + N].

    None when nothing needs masking (one token per row and no stale slots: sdpa's default).
    """
    n = max(m.shape[0] for m in masks)
    if n == 1 and all(p == cache_len for p in pasts):
        return None
    tree = torch.zeros(len(masks), n, n, dtype=torch.bool)  # [B, N, N]
    for b, mask in enumerate(masks):
        k = mask.shape[0]
        tree[b, :k, :k] = mask.cpu()
        pad = torch.arange(k, n)
        tree[b, pad, pad] = True  # a padding query sees its own slot
    past = torch.tensor(pasts, device=device)
    prefix = torch.arange(cache_len, device=device)[None, :] < past[:, None]  # [B, L]
    allow = torch.cat([prefix[:, None].expand(-1, n, -1), tree.to(device)], dim=-1)  # [B, N, L + N]
    out = torch.zeros(allow.shape, dtype=dtype, device=device)
    out.masked_fill_(~allow, torch.finfo(dtype).min)
    return out[:, None]


def packing_for(target, counts: list[int], cache) -> Packing | None:
    """The packing of rows of counts[b] tokens, or None when padding costs nothing (equal rows) or
    the target's kernel or cache cannot take packed rows."""
    if sum(counts) == len(counts) * max(counts):
        return None
    if getattr(target.config, "_attn_implementation", None) != GQA_SDPA:
        return None
    if not all(isinstance(layer, GrowingLayer) for layer in cache.layers):
        return None
    return Packing.of(counts, target.device)


def batch_forward(target, tokens: list[torch.Tensor], depths: list[torch.Tensor],
                  masks: list[torch.Tensor], pasts: list[int], cache, layers=(),
                  last_only: bool = False) -> TargetOutput:
    """One target forward over ragged rows (tokens [N_b], root first, after past_b cached
    positions each); appends N = max N_b slots to every row of `cache`.

    Returns logits [B, N, V]: row b, column j is the target's distribution for a child of node j
    (`last_only`: [B, 1, V], each row's last token's only); hidden states [B, N, H].
    """
    cache_len = cache.get_seq_length()
    counts = [t.numel() for t in tokens]
    ids, pos = batch_inputs(tokens, depths, pasts, target.device)  # [B, N], [B, N]
    mask = batch_mask(masks, pasts, cache_len, target.dtype, target.device)  # [B, 1, N, L + N]
    packing = packing_for(target, counts, cache)
    if packing is None:
        keep = _last_columns(counts, ids.device) if last_only else None
        out = target.forward(ids, layers=list(layers), attention_mask=mask, position_ids=pos,
                             cache=cache, use_cache=True, logits_to_keep=keep)
        return out if keep is None else _own_last(out, counts, keep)
    keep = torch.tensor(counts, device=ids.device).cumsum(0) - 1 if last_only else None  # [B]
    with packed(packing):
        out = target.forward(packing.pack(ids), layers=list(layers), attention_mask=mask,
                             position_ids=packing.pack(pos), cache=cache, use_cache=True,
                             logits_to_keep=keep)  # logits [1, T or B, V], hidden [1, T, H]
    logits = out.logits.view(-1, 1, out.logits.shape[-1]) if last_only else packing.unpack(out.logits)
    return TargetOutput(logits=logits, hidden={i: packing.unpack(h) for i, h in out.hidden.items()},
                        cache=out.cache, final=None if out.final is None else packing.unpack(out.final))


def _last_columns(counts: list[int], device) -> torch.Tensor:
    """The distinct last columns of padded rows of counts[b] tokens, ascending -> [U]."""
    return torch.tensor(sorted({n - 1 for n in counts}), device=device)


def _own_last(out: TargetOutput, counts: list[int], keep: torch.Tensor) -> TargetOutput:
    """Logits [B, U, V] at the columns `keep` -> [B, 1, V], each row's at its own last column."""
    at = torch.tensor([keep.tolist().index(n - 1) for n in counts], device=out.logits.device)
    logits = out.logits[torch.arange(len(counts), device=at.device), at][:, None]  # [B, 1, V]
    return TargetOutput(logits=logits, hidden=out.hidden, cache=out.cache, final=out.final)


def row_output(out: TargetOutput, b: int, n: int, layers) -> TargetOutput:
    """Row b's first n columns of a batched forward as a batch of one (views): logits [1, n, V],
    hidden states at `layers` [1, n, H] each."""
    return TargetOutput(logits=out.logits[b: b + 1, :n],
                        hidden={i: out.hidden[i][b: b + 1, :n] for i in layers},
                        cache=out.cache,
                        final=None if out.final is None else out.final[b: b + 1, :n])


def _full_layers(cache) -> list:
    """The cache's layers, refusing sliding-window ones (their slots cannot be moved per row)."""
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            raise DecodeError("batched or tree verification does not support sliding-window "
                              "cache layers yet: decode this target one sequence at a time")
    return list(cache.layers)


def keep_paths(cache, pasts: list[int], cache_len: int, paths: list[list[int]]) -> list[int]:
    """Keep row b's slots 0 .. past_b - 1 and its accepted nodes (new slots cache_len + path_b)
    right after them, in place; crop to the longest row -> the new valid lengths [B]."""
    rows, dest, src = [], [], []
    for b, (past, path) in enumerate(zip(pasts, paths)):
        for j, node in enumerate(path):
            if past + j != cache_len + node:
                rows.append(b)
                dest.append(past + j)
                src.append(cache_len + node)
    lengths = [past + len(path) for past, path in zip(pasts, paths)]
    if rows:
        index = [torch.tensor(x, dtype=torch.long) for x in (rows, dest, src)]
        for layer in _full_layers(cache):
            r, d, s = (x.to(layer.keys.device) for x in index)
            for name in ("keys", "values"):
                full = getattr(layer, name)  # [B, heads, L + N, head_dim]
                full[r, :, d] = full[r, :, s]  # the right side is gathered first: overlaps are safe
    trim_cache(cache, max(lengths))
    return lengths


def select_rows(cache, rows: list[int], lengths: list[int]) -> None:
    """Keep only batch rows `rows` (in that order) whose valid lengths are `lengths`, in place;
    crop to the longest kept row."""
    for layer in _full_layers(cache):
        index = torch.tensor(rows, dtype=torch.long, device=layer.keys.device)
        layer.keys, layer.values = layer.keys[index], layer.values[index]
    trim_cache(cache, max(lengths))


def _pad_slots(x: torch.Tensor, length: int) -> torch.Tensor:
    """x [B, heads, L, head_dim] -> [B, heads, length, head_dim], zero slots appended."""
    return F.pad(x, (0, 0, 0, length - x.shape[-2]))


def _stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[B_i, heads, L_i, head_dim] each -> their rows stacked, right-padded to the longest."""
    length = max(x.shape[-2] for x in tensors)
    return torch.cat([_pad_slots(x, length) for x in tensors], dim=0)


def merge_rows(cache, other):
    """The rows of `other` stacked after those of `cache` (both right-padded to the longer one);
    `cache` is changed in place and returned (None: `other` itself)."""
    if cache is None:
        return other
    for mine, theirs in zip(_full_layers(cache), _full_layers(other)):
        for name in ("keys", "values"):
            setattr(mine, name, _stacked([getattr(mine, name), getattr(theirs, name)]))
    return cache


def stack_rows(caches: list) -> DynamicCache:
    """Caches of one row each (a draft group's members) -> a new cache of all their rows in that
    order, right-padded to the longest (row b's valid length is its own cache's); theirs unchanged."""
    layers = zip(*(_full_layers(c) for c in caches))
    return DynamicCache([(_stacked([layer.keys for layer in group]),
                          _stacked([layer.values for layer in group])) for group in layers])


def take_row(cache, b: int, length: int, into) -> None:
    """Row b of `cache`, its first `length` slots, becomes the one-row cache `into` (views, in place)."""
    for mine, theirs in zip(_full_layers(into), _full_layers(cache)):
        mine.keys, mine.values = theirs.keys[b: b + 1, :, :length], theirs.values[b: b + 1, :, :length]
