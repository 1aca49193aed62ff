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


DEEPSPEED_CPU_NOTICE = "Setting accelerator to CPU"  # DeepSpeed's import-time warning on a machine without CUDA


def _not_deepspeed_cpu_notice(record) -> bool:
    return DEEPSPEED_CPU_NOTICE not in record.getMessage()


def quiet_deepspeed() -> None:
    """Drop DeepSpeed's 'Setting accelerator to CPU' warning (logged at its import, which transformers and
    accelerate trigger; on a CPU-only machine it is expected, and it lands inside progress bars). Only
    that message: standard logging, no DeepSpeed import; safe to call again."""
    import logging

    ds_logger = logging.getLogger("DeepSpeed")  # the logger deepspeed.utils.logging configures
    if _not_deepspeed_cpu_notice not in ds_logger.filters:
        ds_logger.addFilter(_not_deepspeed_cpu_notice)


def quiet_loading() -> None:
    """Where specheads loads or saves a model: transformers' per-call progress bars ('Loading weights',
    'Writing model shards') off, as our own progress says what loads and in a log file they are lines
    joined by carriage returns; and DeepSpeed's CPU notice dropped (`quiet_deepspeed`)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    quiet_deepspeed()
