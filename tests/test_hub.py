"""`specheads push`: the card, the refusals, a dry run, and an upload to a local hub double.

The upload goes to a small standard-library HTTP server that answers the four calls
huggingface_hub makes (create repo, validate the card's YAML, preupload, commit): no hub
emulator exists to run offline, and the real hub needs network and an account.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from specheads.hub import PushError, model_card, push

SECRET = "hf_testTOKENthatMustNeverBePrinted123"


def _export(tmp_path, metrics=True, equal=True):
    d = tmp_path / "export"
    (d / "eval").mkdir(parents=True)
    (d / "specheads.json").write_text(json.dumps({
        "format": "vllm", "kind": "eagle3", "engine": {"name": "vllm", "version": "0.33"},
        "specheads_version": "0.1.0", "checkpoint": "checkpoint-000300", "checkpoint_step": 300,
        "dtype": "float32", "verifier": {"name": "org/target", "hub_id": "org/target"},
        "target": {"name": "org/target", "vocab_size": 2048, "hidden_size": 128, "num_layers": 8,
                   "tokenizer_sha256": "ab" * 32, "embedding_sha256": "cd" * 32},
        "checkpoint_provenance": {"git_sha": "0123456789abcdef"}}))
    (d / "README.md").write_text("# EAGLE-3 draft\n\n## Serve\n\n```bash\nvllm serve org/target\n```\n")
    (d / "model.safetensors").write_bytes(b"\x00" * 64)
    if metrics:
        (d / "eval" / "metrics.json").write_text(json.dumps({
            "tau": 2.25, "num_prompts": 64, "greedy_equal": equal, "mismatched_ids": [] if equal else ["7"],
            "tree": {"kind": "chain", "k": 3}, "ngram": {"tau": 1.46},
            "speculative": {"acceptance_per_position": [0.61, 0.41, 0.27], "measured_speedup": 1.21},
            "provenance": {"prompts_file": "data/heldout_prompts.jsonl", "device": "cpu", "dtype": "float32"}}))
    return d


def test_card_carries_provenance_metrics_and_serve_commands(tmp_path):
    card = model_card(_export(tmp_path), license_id="apache-2.0")
    assert card.startswith("---\nlibrary_name: specheads\nlicense: apache-2.0\n")
    assert "base_model: org/target" in card and "vllm serve org/target" in card
    assert "| 2.250 | 0.61 / 0.41 / 0.27 | 1.21x | 1.460 |" in card
    assert "checkpoint `checkpoint-000300` (step 300), git 0123456789ab" in card


def test_refuses_without_metrics_or_with_a_lossy_eval(tmp_path):
    with pytest.raises(PushError, match="has no eval/metrics.json"):
        push(_export(tmp_path / "a", metrics=False), "org/x", dry_run=True, out=lambda s: None)
    with pytest.raises(PushError, match="differed from plain greedy"):
        push(_export(tmp_path / "b", equal=False), "org/x", dry_run=True, out=lambda s: None)
    with pytest.raises(PushError, match="not an export folder"):
        push(tmp_path, "org/x", dry_run=True, out=lambda s: None)


def _cli(args, env_extra):
    env = {**os.environ, "HF_TOKEN": SECRET, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1",
           "OMP_NUM_THREADS": "1", **env_extra}
    return subprocess.run([sys.executable, "-m", "specheads", "push", *args], capture_output=True,
                          text=True, env=env, timeout=120)


def test_dry_run_prints_the_plan_and_never_the_token(tmp_path):
    d = _export(tmp_path)
    r = _cli([str(d), "--repo", "org/draft", "--dry-run", "--license", "apache-2.0"], {})
    assert r.returncode == 0, r.stderr
    assert "would push" in r.stdout and "model.safetensors (64 bytes)" in r.stdout
    assert "eval/metrics.json" in r.stdout and "--- model card ---" in r.stdout
    assert SECRET not in r.stdout + r.stderr


class _HubDouble(BaseHTTPRequestHandler):
    """Answers create_repo / validate-yaml / preupload / commit; records what it received."""

    calls: list = []
    files: dict = {}
    auth: set = set()

    def log_message(self, *args):  # keep the test output quiet
        pass

    def _base(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}"

    def _reply(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        data = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        _HubDouble.calls.append(self.path.split("?")[0])
        _HubDouble.auth.add(self.headers.get("Authorization"))
        if self.path.startswith("/api/repos/create"):
            return self._reply({"url": f"{self._base()}/org/draft", "name": "org/draft"})
        if self.path.startswith("/api/validate-yaml"):
            return self._reply({})
        if "/preupload/" in self.path:
            files = json.loads(data)["files"]
            return self._reply({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                          for f in files]})
        if "/commit/" in self.path:
            for line in data.decode().splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    _HubDouble.files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            return self._reply({"commitUrl": f"{self._base()}/org/draft/commit/" + "a" * 40, "commitOid": "a" * 40})
        self.send_error(404)


def test_upload_to_a_local_hub_double(tmp_path):
    server = HTTPServer(("127.0.0.1", 0), _HubDouble)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        d = _export(tmp_path)
        endpoint = f"http://127.0.0.1:{server.server_port}"
        r = _cli([str(d), "--repo", "org/draft", "--private", "--endpoint", endpoint, "--license", "apache-2.0"],
                 {"HF_DEBUG": "1"})
    finally:
        server.shutdown()
    assert r.returncode == 0, r.stderr[-2000:]
    assert SECRET not in r.stdout + r.stderr  # even with HF_DEBUG on
    assert _HubDouble.auth == {f"Bearer {SECRET}"}  # the token did go to the hub, in the header only
    assert _HubDouble.calls[0] == "/api/repos/create" and _HubDouble.calls[-1].endswith("/commit/main")
    assert set(_HubDouble.files) == {"README.md", "specheads.json", "model.safetensors", "eval/metrics.json"}
    assert _HubDouble.files["model.safetensors"] == b"\x00" * 64
    assert _HubDouble.files["README.md"].decode() == model_card(d, "org/draft", "apache-2.0")
    assert f"pushed: {endpoint}/org/draft/commit/" in r.stdout


def _local_target_export(tmp_path, license_line: str):
    """An export (as `specheads export runs/demo ... --out runs/demo/export/vllm` leaves it, run from
    tmp_path) of a drafter for a local target folder whose model card says `license_line`."""
    target = tmp_path / "runs" / "demo" / "target"
    target.mkdir(parents=True)
    (target / "README.md").write_text(f"---\n{license_line}\nlanguage: en\n---\n# tiny\n")
    d = _export(tmp_path)
    export = tmp_path / "runs" / "demo" / "export" / "vllm"
    export.parent.mkdir(parents=True)
    d.rename(export)
    cmd = ("vllm serve runs/demo/target --speculative-config "
           "'{\"method\":\"eagle3\",\"model\":\"runs/demo/export/vllm\",\"num_speculative_tokens\":3}'")
    meta = json.loads((export / "specheads.json").read_text())
    meta.update(serve_commands=[cmd], verifier={"name": "target", "hub_id": None})
    (export / "specheads.json").write_text(json.dumps(meta))
    (export / "README.md").write_text(f"# EAGLE-3 draft for `target` (vLLM 0.33)\n\n## Serve\n\n```bash\n{cmd}\n```\n")
    return export, target


def test_the_card_takes_the_targets_licence_and_serves_from_the_repository(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    export, target = _local_target_export(tmp_path, "license: llama3.1")
    card = model_card("runs/demo/export/vllm", "org/tiny-eagle3")
    assert "\nlicense: llama3.1\n" in card and "apache-2.0" not in card
    assert "\n# org/tiny-eagle3\n" in card and "\n# EAGLE-3 draft" not in card
    assert f"vllm serve {target} --speculative-config" in card and '"model":"org/tiny-eagle3"' in card
    assert "runs/demo/export/vllm" not in card and "serve runs/demo/target" not in card
    hub = model_card("runs/demo/export/vllm", "org/tiny-eagle3", base_model="acme/tiny")
    assert "vllm serve acme/tiny --speculative-config" in hub and "base_model: acme/tiny" in hub


def test_an_unknown_licence_is_asked_for(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _local_target_export(tmp_path, "language: en")
    with pytest.raises(PushError, match=r"licence of target is unknown.*pass --license ID"):
        model_card("runs/demo/export/vllm", "org/tiny-eagle3")
    assert "\nlicense: other\n" in model_card("runs/demo/export/vllm", "org/tiny-eagle3", license_id="other")
