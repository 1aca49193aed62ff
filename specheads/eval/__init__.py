"""Evaluation: online acceptance with the built-in verifier (`specheads eval`).

`evaluate` and `read_prompts` (data/prompts.py's, the prompts file reader) are imported on first
use, so `specheads bench` (an HTTP client) does not pay for torch when it only checks its options.
"""

__all__ = ["evaluate", "read_prompts"]


def __getattr__(name: str):
    if name in __all__:
        from specheads.eval import online

        return getattr(online, name)
    raise AttributeError(f"module 'specheads.eval' has no attribute '{name}'")
