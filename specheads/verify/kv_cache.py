"""The target's KV cache for decoding: transformers' `DynamicCache` whose full-attention layers
write new slots in place into a buffer with headroom instead of concatenating.

`DynamicLayer.update` concatenates, copying the whole cache of every layer on every forward: at
batch 8 with a 300-token SmolLM2 cache that was a quarter of a one-token step. A `GrowingLayer`
keeps `keys` / `values` as views [B, heads, L, head_dim] of a buffer [B, heads, capacity,
head_dim]; an update writes slots L .. L + n - 1 and widens the view. Everything else the
decoder does to a cache stays what it was: a crop narrows the view (in place, so its slots are
reused by the next update), `verify.ragged.keep_paths` writes inside the view, and any new
tensor assigned to `keys` / `values` (rows selected, merged or taken) is copied into a fresh
buffer at the next update. Slots past the view are never read. In a packed forward
(`attention.packed`) the new states [1, heads, T, head_dim] are first unpacked to the padded rows.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from specheads.attention import current_packing

HEADROOM = 128  # slots allocated beyond the need, at least; and a quarter more for long caches


def _is_prefix_view(view: torch.Tensor, buf: torch.Tensor | None) -> bool:
    """Whether `view` is buf[:, :, :L] (same storage start, strides and other sizes)."""
    return (buf is not None and view.ndim == 4 and view.data_ptr() == buf.data_ptr()
            and view.stride() == buf.stride() and view.shape[:2] == buf.shape[:2]
            and view.shape[-1] == buf.shape[-1])


def _appended(have: torch.Tensor, new: torch.Tensor, buf: torch.Tensor | None):
    """have [B, h, L, d] (or an empty tensor) + new [B, h, n, d] -> (view [B, h, L + n, d], buffer)."""
    length = have.shape[-2] if have.ndim == 4 else 0
    need = length + new.shape[-2]
    if not (_is_prefix_view(have, buf) and buf.shape[-2] >= need):
        capacity = need + max(HEADROOM, need // 4)
        fresh = new.new_empty(*new.shape[:2], capacity, new.shape[-1])  # [B, h, capacity, d]
        if length:
            fresh[:, :, :length] = have
        buf = fresh
    buf[:, :, length:need] = new
    return buf[:, :, :need], buf


class GrowingLayer(DynamicLayer):
    """A full-attention cache layer that appends in place (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self._key_buf = self._value_buf = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append key / value states [B, heads, n, head_dim] -> the whole cached keys and values."""
        packing = current_packing()
        if packing is not None:  # [1, heads, T, head_dim] -> [B, heads, N, head_dim]
            key_states, value_states = packing.unpack_heads(key_states), packing.unpack_heads(value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self._key_buf = _appended(self.keys, key_states, self._key_buf)
        self.values, self._value_buf = _appended(self.values, value_states, self._value_buf)
        return self.keys, self.values

    def reset(self) -> None:
        self._key_buf = self._value_buf = None
        super().reset()


def decode_cache(config) -> DynamicCache:
    """A new cache for `config`'s target: its full-attention layers growing in place, any
    sliding-window layer left as transformers builds it."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
