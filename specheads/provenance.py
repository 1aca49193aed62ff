"""Provenance stamped on every artifact: versions, git SHA, command line, time."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import specheads


def git_sha() -> str | None:
    """The SHA of the checkout specheads runs from, when it is one (None for an installed wheel)."""
    root = Path(specheads.__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def cpu_model() -> str:
    """The CPU's model name (speed figures differ between the CPUs a machine can be drawn with)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """What a speed figure was measured on: CPU model and count, torch threads, 1-minute load average."""
    import torch

    return {"cpu": cpu_model(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "load_1min": round(os.getloadavg()[0], 2)}


def provenance(**extra) -> dict:
    """Package and library versions, git SHA, argv and a UTC timestamp, plus `extra` fields."""
    import torch
    import transformers

    return {
        "specheads_version": specheads.__version__,
        "git_sha": git_sha(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "argv": list(sys.argv),
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **extra,
    }
