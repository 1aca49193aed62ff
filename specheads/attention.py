"""The target's attention kernel: torch's sdpa with grouped-query heads passed as they are.

transformers' "sdpa" path copies every key / value head `num_key_value_groups` times
(`repeat_kv`) before the kernel whenever a mask is given on a CPU, since some GPU kernels fall
back to math with GQA and a mask. Our verifier always gives a 4-D mask (trees, ragged rows), so
at batch 8 with a 300-token cache that copy was ~15% of a SmolLM2 forward. torch's CPU kernel
takes `enable_gqa=True` with a mask and gives the same numbers (the same flash kernel, the same
summation order), so the target is loaded under this name instead of "sdpa": same masks
(`sdpa_mask`), same results, no copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

GQA_SDPA = "specheads_gqa_sdpa"  # the name the target's config carries once loaded with it


def gqa_sdpa_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0,
                     scaling: float | None = None, is_causal: bool | None = None,
                     **_ignored) -> tuple[torch.Tensor, None]:
    """query [B, H, q, D], key / value [B, KV, k, D] (H a multiple of KV) -> output [B, q, H, D].

    Causality as transformers' sdpa decides it: the kernel's own causal flag only for a
    multi-token query without a mask (a prefill); otherwise the given mask, cut to the keys.
    """
    if attention_mask is not None and attention_mask.ndim == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
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
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Make GQA_SDPA a name transformers' models accept (idempotent) -> that name."""
    AttentionInterface.register(GQA_SDPA, gqa_sdpa_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(GQA_SDPA, sdpa_mask)
    return GQA_SDPA
