"""The few transformers-version differences specheads depends on, in one place."""

from __future__ import annotations

import functools
import inspect


@functools.cache
def _cache_arg_name() -> str:
    """transformers >= 5.24 names the KV cache `cache`; older 5.x only know `past_key_values`."""
    from transformers.models.llama.modeling_llama import LlamaAttention

    params = inspect.signature(LlamaAttention.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(cache) -> dict:
    """Keyword arguments that hand `cache` to a transformers forward, whatever the version."""
    return {} if cache is None else {_cache_arg_name(): cache}
