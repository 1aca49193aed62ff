"""The embedded tiny target ("test" preset): HF loadability, determinism, template, atomicity; the
prebuilt default copy (hash-verified) and what killed builds leave behind."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from specheads.builtin import tiny_target
from specheads.builtin.tiny_target import CHAT_TEMPLATE, build_tiny_target

MSGS = [{"role": "user", "content": "def f(a):\n    \"\"\"Doc.\"\"\""},
        {"role": "assistant", "content": "    return a + 1"}]


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """Two independent builds of the test preset."""
    root = tmp_path_factory.mktemp("targets")
    return root, [build_tiny_target(root / name, "test", progress=False) for name in ("a", "b")]


def test_builds_are_atomic_and_complete(builds):
    root, (a, b) = builds
    assert sorted(p.name for p in root.iterdir()) == ["a", "b"]  # no temp folders left
    names = {p.name for p in a.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "specheads_build.json"} <= names
    info = json.loads((a / "specheads_build.json").read_text())
    assert info["builder_version"] == tiny_target.BUILDER_VERSION and info["preset"] == "test"
    for key in ("seed", "parameters", "train_tokens_seen", "wall_seconds",
                "heldout_text_loss", "heldout_assistant_loss"):
        assert key in info


def test_two_builds_have_identical_weights(builds):
    _, (a, b) = builds
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()


def test_loads_like_a_hub_model(builds):
    _, (a, _) = builds
    model = AutoModelForCausalLM.from_pretrained(a)
    tok = AutoTokenizer.from_pretrained(a)
    cfg = model.config
    assert cfg.model_type == "llama" and cfg.num_hidden_layers >= 8
    assert not cfg.tie_word_embeddings
    assert next(model.parameters()).dtype == torch.float32
    end_id = tok.convert_tokens_to_ids("<|end|>")
    assert tok.eos_token == "<|end|>" and tok.pad_token == "<|pad|>"
    assert model.generation_config.eos_token_id == end_id
    ids = tok("def f(x):\n    return x", return_tensors="pt").input_ids  # [1, T]
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[0] == 1 and 1 <= out.shape[1] - ids.shape[1] <= 4


def test_chat_template_renders_as_specified(builds):
    _, (a, _) = builds
    tok = AutoTokenizer.from_pretrained(a)
    assert tok.chat_template == CHAT_TEMPLATE
    text = tok.apply_chat_template(MSGS, tokenize=False)
    assert text == ("<|user|>def f(a):\n    \"\"\"Doc.\"\"\"<|end|>\n"
                    "<|assistant|>    return a + 1<|end|>\n")
    prompt = tok.apply_chat_template(MSGS[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|end|>\n<|assistant|>")


def test_assistant_content_tokenizes_right_after_the_marker(builds):
    _, (a, _) = builds
    tok = AutoTokenizer.from_pretrained(a)
    ids = tok(tok.apply_chat_template(MSGS, tokenize=False), add_special_tokens=False).input_ids
    start = ids.index(tok.convert_tokens_to_ids("<|assistant|>")) + 1
    content = tok(MSGS[1]["content"], add_special_tokens=False).input_ids
    end_id = tok.convert_tokens_to_ids("<|end|>")
    assert ids[start:start + len(content) + 1] == content + [end_id]


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    def killed(folder, preset, progress):
        (folder / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny_target, "build_into", killed)
    with pytest.raises(KeyboardInterrupt):
        build_tiny_target(tmp_path / "dest", "test", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_cache_builds_once_under_a_versioned_name(tmp_path, monkeypatch):
    calls = []

    def fake(folder, preset, progress):
        calls.append(preset)
        (folder / tiny_target.BUILD_INFO).write_text("{}")

    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    monkeypatch.setattr(tiny_target, "build_into", fake)
    first = tiny_target.cached_tiny_target("test", progress=False)
    assert first == tiny_target.cached_tiny_target("test", progress=False)
    assert calls == ["test"]
    assert first.parent == tmp_path and tiny_target.BUILDER_VERSION in first.name


def test_cache_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECHEADS_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tiny_target.cache_dir() == tmp_path / "xdg" / "specheads"
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "own"))
    assert tiny_target.cache_dir() == tmp_path / "own"
    with pytest.raises(ValueError):
        build_tiny_target(tmp_path / "x", "no-such-preset")


# --- the prebuilt default target and the leftovers of killed builds ------------------------------------
def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def test_prebuilt_default_matches_its_hashes_and_todays_builder():
    """The shipped build is what this builder version and preset describe (change either: rebuild it)."""
    from dataclasses import asdict

    prebuilt = tiny_target.prebuilt_path("default")
    assert prebuilt is not None
    tiny_target.check_prebuilt(prebuilt, "default")
    info = json.loads((prebuilt / tiny_target.BUILD_INFO).read_text())
    assert info["builder_version"] == tiny_target.BUILDER_VERSION and info["preset"] == "default"
    assert info["hyperparameters"] == asdict(tiny_target.PRESETS["default"])
    assert set(tiny_target.manifest(prebuilt)) == {p.name for p in prebuilt.iterdir()} - {tiny_target.MANIFEST}


def test_cache_installs_the_prebuilt_copy_and_replaces_a_damaged_one(tmp_path, monkeypatch):
    def no_build(*args):
        raise AssertionError("the prebuilt copy should have been used")

    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    monkeypatch.setattr(tiny_target, "build_into", no_build)
    first = tiny_target.cached_tiny_target("default", progress=False)
    prebuilt = tiny_target.prebuilt_path("default")
    assert first == tiny_target.cache_path("default") and tiny_target.verified(first, prebuilt)
    weights = first / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one flipped byte in the cached weights
    weights.write_bytes(bytes(data))
    assert not tiny_target.verified(first, prebuilt)
    assert tiny_target.cached_tiny_target("default", progress=False) == first
    assert tiny_target.verified(first, prebuilt) and _leftovers(tmp_path) == []


def test_a_damaged_prebuilt_copy_is_refused_by_name(tmp_path, monkeypatch):
    fake = tmp_path / "prebuilt" / f"tiny-target-default-{tiny_target.BUILDER_VERSION}"
    shutil.copytree(tiny_target.prebuilt_path("default"), fake)
    (fake / "config.json").write_text("{}")
    monkeypatch.setattr(tiny_target, "PREBUILT_DIR", tmp_path / "prebuilt")
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    with pytest.raises(tiny_target.PrebuiltCorrupt, match="does not match its recorded sha256"):
        tiny_target.cached_tiny_target("default", progress=False)


def test_a_killed_build_leaves_nothing_after_the_next_build(tmp_path, monkeypatch):
    """SIGKILL a real build mid-way; the next use of the cache removes its temporary folder."""
    env = {**os.environ, "SPECHEADS_CACHE": str(tmp_path), "OMP_NUM_THREADS": "1"}
    code = "from specheads.builtin.tiny_target import cached_tiny_target; cached_tiny_target('test', progress=False)"
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    deadline = time.monotonic() + 300
    try:
        while not _leftovers(tmp_path) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL and _leftovers(tmp_path), "the build ended before it was killed"
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    built = tiny_target.cached_tiny_target("test", progress=False)
    assert (built / tiny_target.BUILD_INFO).is_file() and _leftovers(tmp_path) == []


def test_leftover_of_a_reused_pid_is_removed_and_a_live_writers_is_kept(tmp_path, monkeypatch):
    """A temporary named after a pid that now belongs to a later process (a new container) is stale."""
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    name = tiny_target.cache_path("test").name
    later = subprocess.Popen(["sleep", "60"])
    try:
        stale = tmp_path / f".{name}.tmp-{later.pid}-abcdefgh"
        stale.mkdir()
        os.utime(stale, (time.time() - 3600,) * 2)  # made an hour before that process started
        live = tmp_path / f".{name}.tmp-{os.getppid()}-ijklmnop"  # our parent started before it was made
        live.mkdir()
        monkeypatch.setattr(tiny_target, "build_into", lambda folder, preset, progress:
                            (folder / tiny_target.BUILD_INFO).write_text("{}"))
        tiny_target.cached_tiny_target("test", progress=False)
        assert _leftovers(tmp_path) == [live.name]
    finally:
        later.kill()
