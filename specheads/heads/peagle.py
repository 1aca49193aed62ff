"""P-EAGLE training: an EAGLE-3 head (`parallel_drafting: true`) that drafts all k tokens in one
forward (docs/algorithms.md §11; vLLM 0.33 `method: eagle3` + `parallel_drafting`, docs/engines.md §2.9).

Depth 0 is EAGLE-3's first step: row i at position i reads fc(target features at i) and the
embedding of x_{i+1}, and predicts x_{i+2}. Depth d >= 1 of anchor i sits at position i+d, reads
fc(mask_hidden) and the embedding of the mask token, and predicts x_{i+d+2}; it attends to the
depth-0 rows 0..i and to its own chain's depths 1..d, exactly the causal layout vLLM's drafter
sees (the real rows, then k-1 mask rows). Training keeps every depth-0 row and, per depth d, a
nested random share max(cod_ratio^d, cod_min_ratio) of the anchors ("COD" sampling); evaluation
keeps every anchor at every depth.
"""

from __future__ import annotations

import torch

from specheads.heads.losses import LOSSES, ChainCounts, HeadOutput, decayed_output, shift


def depth_anchors(T: int, depths: int, ratio: float, min_ratio: float, random: bool,
                  device) -> list[torch.Tensor]:
    """Sorted anchor rows for depths 1..depths-1 (each a subset of the previous one)."""
    out, pool = [], torch.arange(T, device=device)
    for d in range(1, depths):
        n = max(1, round(T * max(ratio ** d, min_ratio))) if random else T
        keep = torch.randperm(pool.numel(), device=device)[:n] if random else torch.arange(min(n, pool.numel()))
        pool = pool[keep].sort().values
        out.append(pool)
    return out


def parallel_mask(anchor: torch.Tensor, depth: torch.Tensor, valid: torch.Tensor, dtype) -> torch.Tensor:
    """Additive mask [B, 1, Q, Q] over rows (anchor [Q], depth [Q]): depth-0 keys up to the query's
    anchor (real tokens only) plus the query's own chain up to its depth."""
    real = (depth[None] == 0) & (anchor[None] <= anchor[:, None])  # [Q, Q]
    chain = (depth[None] >= 1) & (anchor[None] == anchor[:, None]) & (depth[None] <= depth[:, None])
    key_valid = valid[:, anchor] | (depth[None] >= 1)  # [B, Q]
    allow = (real[None] & key_valid[:, None]) | chain[None]  # [B, Q, Q]
    mask = torch.zeros(allow.shape, dtype=dtype, device=valid.device)
    mask.masked_fill_(~allow, torch.finfo(dtype).min)
    return mask[:, None]


def parallel_rows(head, aux, embeds, mask_embed, valid, sets) -> torch.Tensor:
    """All depth-0 rows, then the rows of each depth's anchors (`sets`), in one forward ->
    outputs [B, T + sum |sets|, H]."""
    B, T = valid.shape
    device = aux.device
    anchor = torch.cat([torch.arange(T, device=device), *sets])  # [Q]
    depth = torch.cat([torch.zeros(T, dtype=torch.long, device=device)] +
                      [torch.full_like(s, d + 1) for d, s in enumerate(sets)])
    real = head.fuse(head.noisy(aux))  # [B, T, H]
    masked = head.fuse(head.mask_hidden[None, None])  # [1, 1, H]
    n_mask = anchor.numel() - T
    hidden = torch.cat([real, masked.expand(B, n_mask, -1)], dim=1)  # [B, Q, H]
    emb = torch.cat([shift(embeds, 1), mask_embed.to(embeds.dtype).expand(B, n_mask, -1)], dim=1)
    return head.step(hidden, emb, (anchor + depth).expand(B, -1),
                     parallel_mask(anchor, depth, valid, hidden.dtype))  # [B, Q, H]


def parallel_train_forward(head, aux, embeds, mask_embed, target_logits, loss_mask, attention_mask) -> HeadOutput:
    """aux [B, T, n*Ht], embeds [B, T, H] (of x_i), mask_embed [H], target_logits [B, T, V],
    loss_mask / attention_mask [B, T] -> the recipe's loss per depth (weighted step_decay^d) and counts."""
    cfg = head.config
    T = loss_mask.shape[1]
    device, valid = aux.device, attention_mask.bool()
    sets = depth_anchors(T, cfg.ttt_steps, cfg.cod_ratio, cfg.cod_min_ratio, head.training, device)
    out = parallel_rows(head, aux, embeds, mask_embed, valid, sets)
    target_argmax = target_logits.argmax(-1)  # [B, T]
    supervised = loss_mask.bool() & valid
    in_vocab = head.t2d[target_argmax]
    losses, counts = [], ChainCounts(loss_mask)
    offset = T
    for d in range(cfg.ttt_steps):
        row_of = torch.arange(T, device=device)  # depth-d query index of each anchor (-1: none)
        if d > 0:
            row_of = torch.full((T,), -1, dtype=torch.long, device=device)
            row_of[sets[d - 1]] = offset + torch.arange(sets[d - 1].numel(), device=device)
            offset += sets[d - 1].numel()
        rows = shift(supervised, d + 2) & shift(in_vocab, d + 1) & (row_of >= 0)[None]  # [B, T]
        b, i = rows.nonzero(as_tuple=True)
        logits = head.logits(out[b, row_of[i]])  # [N, Vd]
        src = target_logits[b, i + d + 1]  # [N, V]: the target predicting x_{i+d+2}
        losses.append(LOSSES[cfg.loss](logits, torch.softmax(src[:, head.t2d].float(), dim=-1)))
        counts.step(rows, b, i, head.to_target_ids(logits.argmax(-1)) == target_argmax[b, i + d + 1])
    return decayed_output(losses, cfg.step_decay, counts)
