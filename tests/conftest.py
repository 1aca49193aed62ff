"""Shared fixtures: a small real target folder (tokenizer + chat template + Llama weights)."""

from __future__ import annotations

import os

import pytest

# Every process a test starts (CLI runs, servers, trainers) runs one torch thread: torch with two
# threads on two shared cores slows down 10-20x as soon as another process competes (the other
# xdist worker, CI's background engine builds); the demo smoke test took 530 s that way, 21 s on one.
os.environ["OMP_NUM_THREADS"] = "1"


def pytest_collection_modifyitems(config, items):
    """Engine tests need the engines' venvs (~20 GB): only with SPECHEADS_ENGINE_TESTS=1 (make engine-check)."""
    if os.environ.get("SPECHEADS_ENGINE_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="needs the vLLM / SGLang venvs: set SPECHEADS_ENGINE_TESTS=1 (make engine-check)")
    for item in items:
        if "engine" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    """The embedded target's 'test' preset: 8 layers, tiny widths, built in seconds."""
    from specheads.builtin.tiny_target import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("target") / "tiny", preset="test", progress=False)


@pytest.fixture
def demo_run_dir(tmp_path, tiny_target_dir, demo_data_dir):
    """A run folder as `make demo` leaves one for the bench scripts: target (a link), data/train.jsonl
    and data/heldout_prompts.jsonl."""
    run = tmp_path / "run"
    (run / "data").mkdir(parents=True)
    (run / "target").symlink_to(tiny_target_dir, target_is_directory=True)
    for name in ("train.jsonl", "heldout_prompts.jsonl"):
        (run / "data" / name).write_bytes((demo_data_dir / name).read_bytes())
    return run


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


def random_export(target_dir, root):
    """A random EAGLE-3 head for the target at `target_dir`, checkpointed and exported under `root`
    the way users do it."""
    import torch

    from specheads.export import export
    from specheads.export.checkpoint import save_checkpoint
    from specheads.heads.eagle3 import Eagle3Head, Eagle3Options
    from specheads.provenance import provenance
    from specheads.target import Target

    target = Target.load(str(target_dir), device="cpu")
    torch.manual_seed(0)
    head = Eagle3Head.for_target(Eagle3Options(ttt_steps=3, draft_vocab_size=256), target.config)
    ckpt = save_checkpoint(root / "run", 1, head, recipe={},
                           provenance=provenance(target=target.fingerprint()), trainer_state={})
    return export(ckpt, "vllm", root / "export")


@pytest.fixture(scope="session")
def random_export_dir(tiny_target_dir, tmp_path_factory):
    """A random EAGLE-3 head for the tiny target, checkpointed and exported the way users do it."""
    return random_export(tiny_target_dir, tmp_path_factory.mktemp("draft"))


@pytest.fixture(scope="session")
def varied_target_dir(tiny_target_dir, tmp_path_factory):
    """The tiny target's folder (tokenizer, chat template, architecture) with random weights (std
    0.1, seeded). The trained tiny target's greedy text collapses to one repeated token; this one's
    continuations differ from prompt to prompt, so a row decoded with another row's cache shows."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("varied") / "tiny"
    shutil.copytree(tiny_target_dir, folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    torch.manual_seed(0)
    for param in model.parameters():
        if param.dim() > 1:
            torch.nn.init.normal_(param.data, std=0.1)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def varied_export_dir(varied_target_dir, tmp_path_factory):
    """A random EAGLE-3 head for `varied_target_dir`, exported."""
    return random_export(varied_target_dir, tmp_path_factory.mktemp("varied-draft"))
