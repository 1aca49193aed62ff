"""Evaluation: online acceptance with the built-in verifier (`specheads eval`)."""

from specheads.eval.online import evaluate, read_prompts

__all__ = ["evaluate", "read_prompts"]
