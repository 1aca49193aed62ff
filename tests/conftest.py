"""Shared fixtures: a small real target folder (tokenizer + chat template + Llama weights)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    """The embedded target's 'test' preset: 8 layers, tiny widths, built in seconds."""
    from specheads.builtin.tiny_target import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("target") / "tiny", preset="test", progress=False)


@pytest.fixture(scope="session")
def demo_data_dir(tmp_path_factory):
    """A small slice of the standard-library demo conversations."""
    from specheads.builtin.stdlib import write_demo_data

    out = tmp_path_factory.mktemp("data")
    write_demo_data(out, n_prompts=8, limit=60)
    return out


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """Tiny models run faster on one thread than on two contended ones; keeps timings stable."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
