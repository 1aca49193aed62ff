"""The embedded default: demo data and a tiny target built from the Python standard library."""
from specheads.builtin.stdlib import write_demo_data
from specheads.builtin.tiny_target import CHAT_TEMPLATE, build_tiny_target, cached_tiny_target

__all__ = ["CHAT_TEMPLATE", "build_tiny_target", "cached_tiny_target", "write_demo_data"]
