"""The target's attention kernel: torch's sdpa with grouped-query heads passed as they are.

transformers' "sdpa" path copies every key / value head `num_key_value_groups` times
(`repeat_kv`) before the kernel whenever a mask is given on a CPU, since some GPU kernels fall
back to math with GQA and a mask. Our verifier always gives a 4-D mask (trees, ragged rows), so
at batch 8 with a 300-token cache that copy was ~15% of a SmolLM2 forward. torch's CPU kernel
takes `enable_gqa=True` with a mask and gives the same numbers (the same flash kernel, the same
summation order), so the target is loaded under this name instead of "sdpa": same masks
(`sdpa_mask`), same results, no copy.

Packed rows: the batched verifier's rows draft different numbers of tokens, and padding them to
the longest costs the full arithmetic of every padded slot in every linear layer (on a CPU the
forward is compute-bound from ~8 tokens on). Inside `packed(packing)` the target runs over one
row [1, T] of every row's real tokens; this kernel (and `verify.kv_cache.GrowingLayer` for the new
keys and values) sees them as the padded rows [B, N] the per-row 4-D mask is written for, so only
the attention itself is computed on padded rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

GQA_SDPA = "specheads_gqa_sdpa"  # the name the target's config carries once loaded with it


@dataclass(frozen=True)
class Packing:
    """B ragged rows of n_b tokens fed as one packed row [1, T] (T = sum n_b, row by row): packed
    token t is slot `index[t]` = b * width + j of the padded layout [B, width]."""

    rows: int
    width: int
    index: torch.Tensor  # [T] long, on the target's device

    @classmethod
    def of(cls, counts: list[int], device) -> Packing:
        """Rows of counts[b] tokens each -> their packing (width: the longest row)."""
        width = max(counts)
        index = torch.cat([b * width + torch.arange(n) for b, n in enumerate(counts)])
        return cls(len(counts), width, index.to(device))

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, width, ...] -> [1, T, ...]: the real slots, row by row."""
        return x.reshape(self.rows * self.width, *x.shape[2:]).index_select(0, self.index)[None]

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """x [1, T, ...] -> [B, width, ...], padding slots zero."""
        out = x.new_zeros(self.rows * self.width, *x.shape[2:])
        out.index_copy_(0, self.index, x[0])
        return out.view(self.rows, self.width, *x.shape[2:])

    def unpack_heads(self, x: torch.Tensor) -> torch.Tensor:
        """x [1, heads, T, head_dim] -> [B, heads, width, head_dim], padding slots zero."""
        return self.unpack(x.transpose(1, 2)).transpose(1, 2)


_PACKING: ContextVar[Packing | None] = ContextVar("specheads_packing", default=None)


@contextmanager
def packed(packing: Packing) -> Iterator[Packing]:
    """Within: the target's forward is over `packing`'s packed row (see the module docstring)."""
    token = _PACKING.set(packing)
    try:
        yield packing
    finally:
        _PACKING.reset(token)


def current_packing() -> Packing | None:
    """The packing of the forward running now, or None (rows as they are)."""
    return _PACKING.get()


def aligned(mask: torch.Tensor) -> torch.Tensor:
    """mask, copied when it is a CUDA view that is not contiguous from a 16-byte aligned pointer:
    the memory-efficient sdpa kernel reads it with 16-byte loads and does not check the pointer
    (a cut view then fails with "CUDA error: misaligned address"). CPU tensors pass as they are."""
    if mask.device.type != "cuda" or (mask.is_contiguous() and mask.data_ptr() % 16 == 0):
        return mask
    return mask.clone(memory_format=torch.contiguous_format)


def gqa_sdpa_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0,
                     scaling: float | None = None, is_causal: bool | None = None,
                     **_ignored) -> tuple[torch.Tensor, None]:
    """query [B, H, q, D], key / value [B, KV, k, D] (H a multiple of KV) -> output [B, q, H, D].

    Causality as transformers' sdpa decides it: the kernel's own causal flag only for a
    multi-token query without a mask (a prefill); otherwise the given mask, cut to the keys.
    Packed (`packed`): query [1, H, T, D] is unpacked to the rows of the mask and the output
    packed back to [1, T, H, D].
    """
    packing = current_packing()
    if packing is not None:
        query = packing.unpack_heads(query)  # [B, H, N, D]
    if attention_mask is not None and attention_mask.ndim == 4:
        attention_mask = aligned(attention_mask[:, :, :, : key.shape[-2]])
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(query.shape[2] > 1 and attention_mask is None and causal)
    if causal and key.shape[-2] > query.shape[2]:  # queries after cached keys: bottom-right causal
        q_len, k_len = query.shape[2], key.shape[-2]
        attention_mask = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)
        causal = False
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout if module.training else 0.0,
        scale=scaling, is_causal=causal, enable_gqa=key.shape[1] != query.shape[1],
    )  # [B, H, q, D]
    out = out.transpose(1, 2)  # [B, q, H, D]
    return (out.contiguous() if packing is None else packing.pack(out)), None


def register() -> str:
    """Make GQA_SDPA a name transformers' models accept (idempotent) -> that name."""
    AttentionInterface.register(GQA_SDPA, gqa_sdpa_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(GQA_SDPA, sdpa_mask)
    return GQA_SDPA
