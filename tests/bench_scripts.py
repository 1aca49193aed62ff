"""bench/ holds scripts, not a package: load one as a module, registered in sys.modules while the
tests use it (dataclasses look their module up while the script runs)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(script: str, name: str | None = None):
    """bench/<script> as a module named `name` (default bench_<stem>)."""
    path = BENCH / script
    spec = importlib.util.spec_from_file_location(name or f"bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def unload_bench(module) -> None:
    sys.modules.pop(module.__name__, None)
