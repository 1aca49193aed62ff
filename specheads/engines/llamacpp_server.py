"""`llama-server` run with given speculative settings, answering greedy /completion requests on
127.0.0.1: one process per setting (`Server`), the prompts rendered as our eval renders them
(`prompt_ids`), and every prompt decoded through one server (`decode_all`).
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specheads.data.prompts import encode_chat, read_prompts, user_turn
from specheads.export.llamacpp_tool import LlamaCpp, LlamaCppError


# --- the server ---------------------------------------------------------------------------------------
@dataclass
class SpecSettings:
    """llama-server's speculative settings: `types` the --spec-type list, `draft` the -md GGUF."""

    types: tuple[str, ...] = ()
    draft: Path | None = None
    n_max: int | None = None  # --spec-draft-n-max (llama.cpp's default: 3)
    extra: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return "+".join(self.types) or "plain"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(b: LlamaCpp, model: Path, spec: SpecSettings, port: int, threads: int, ctx: int,
                   slots: int = 1) -> list[str]:
    """`slots` requests decode together (-np, continuous batching), each with `ctx` tokens of context."""
    cmd = [str(b.server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-tb", str(threads), "-c", str(ctx * slots), "-np", str(slots), "--no-webui"]
    if spec.draft is not None:
        cmd += ["-md", str(spec.draft), "-td", str(threads)]
    if spec.types:
        cmd += ["--spec-type", ",".join(spec.types)]
    if spec.n_max is not None:
        cmd += ["--spec-draft-n-max", str(spec.n_max)]
    return cmd + list(spec.extra)


def completion_body(prompt: Sequence[int] | str, n_predict: int, cache_prompt: bool = False) -> dict:
    """Greedy, by default no prompt cache (each request decodes from scratch; `cache_prompt`: the
    longest cached prefix is reused, so only the new tokens are evaluated), the token ids returned."""
    return {"prompt": list(prompt) if not isinstance(prompt, str) else prompt, "n_predict": n_predict,
            "temperature": 0, "cache_prompt": cache_prompt, "return_tokens": True, "stream": False}


@dataclass
class Completion:
    text: str
    tokens: list[int]
    timings: dict = field(default_factory=dict)
    server_log: dict | None = None  # what the server logged about this request (llamacpp_log.per_request)

    @property
    def drafted(self) -> int:
        return int(self.timings.get("draft_n") or 0)

    @property
    def accepted(self) -> int:
        return int(self.timings.get("draft_n_accepted") or 0)


class Server:
    """`llama-server` on a free port: `with Server(b, model, spec) as s: s.complete(ids, 64)`."""

    def __init__(self, b: LlamaCpp, model: Path, spec: SpecSettings | None = None, threads: int = 2,
                 ctx: int = 2048, log: Path | None = None, env: dict | None = None, startup_s: float = 300,
                 slots: int = 1):
        self.b, self.spec, self.threads = b, spec or SpecSettings(), threads
        self.port = free_port()
        self.cmd = server_command(b, Path(model), self.spec, self.port, threads, ctx, slots)
        self.log_path = Path(log) if log else Path(model).with_name(f"llama-server-{self.spec.label}.log")
        self.env, self.startup_s, self.proc = env or {}, startup_s, None

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self._log.write(f"$ {shlex.join(self.cmd)}\n")
        self._log.flush()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self.b.env(**self.env), start_new_session=True)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        deadline = time.time() + self.startup_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise LlamaCppError(f"llama-server exited ({self.proc.returncode}) before it was ready: "
                                    f"{self.first_error() or 'see its log'}\n{shlex.join(self.cmd)}\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.3)
        raise LlamaCppError(f"llama-server not healthy after {self.startup_s:.0f} s\n{self.log_tail()}")

    def first_error(self) -> str | None:
        """llama.cpp's first error line in the log (e.g. "error loading model: ... tensor 'x' not found")."""
        lines = self.log_tail(200_000).splitlines()
        return next((line.split(" E ", 1)[1].strip() for line in lines if " E " in line and "error" in line), None)

    def log_tail(self, chars: int = 2500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def complete(self, prompt: Sequence[int] | str, n_predict: int, timeout: float = 1800,
                 cache_prompt: bool = False) -> Completion:
        data = json.dumps(completion_body(prompt, n_predict, cache_prompt)).encode()
        req = urllib.request.Request(self.url("/completion"), data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                out = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise LlamaCppError(f"/completion: HTTP {e.code}: {e.read()[:500]!r}\n{self.log_tail()}") from None
        return Completion(out.get("content", ""), list(out.get("tokens") or []), out.get("timings") or {})

    def tokenize(self, text: str) -> list[int]:
        """llama.cpp's token ids of `text` (no special tokens added)."""
        data = json.dumps({"content": text, "add_special": False}).encode()
        req = urllib.request.Request(self.url("/tokenize"), data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return [int(t) for t in json.loads(r.read()).get("tokens") or []]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)
        if getattr(self, "_log", None):
            self._log.close()
            self._log = None


# --- prompts ------------------------------------------------------------------------------------------
BUILTIN_PROMPTS = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"",
                   "Write a function that reverses a list in place.", "import os\n\n\ndef walk(root):")
# text that exercises a BPE pre-tokenizer's split (spaces, newlines, digits, contractions, punctuation)
SPLIT_PROBE = "  two spaces\n\n\ttab 3 33 3333 3.14 I've 'RE they'll ... !!! ```code``` naïve 😀 über"


def prompt_texts(prompts_file: Path | None, limit: int) -> list[tuple[str, str]]:
    """(id, first user turn) of the prompts (default: 3 built-in ones)."""
    if prompts_file is None:
        return [(f"builtin-{i}", t) for i, t in enumerate(BUILTIN_PROMPTS[:limit])]
    return [(row.id, row.turns[0]) for row in read_prompts(prompts_file, limit)]


def prompt_ids(target_dir: Path, prompts_file: Path | None, limit: int) -> list[tuple[str, list[int]]]:
    """(id, token ids) of the prompts, chat-templated exactly as our eval does (data/prompts.py); the
    ids go to llama.cpp as they are, so both engines see the same tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    return [(pid, encode_chat(tok, user_turn(t))) for pid, t in prompt_texts(prompts_file, limit)]


def tokenizer_agreement(server: Server, target_dir: Path, texts: list[str]) -> dict:
    """llama.cpp's tokenization of `texts` (the GGUF's vocabulary and pre-tokenizer) against the HF
    tokenizer's, no special tokens: where the pre-tokenizer choice would show."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    differ = [t[:60] for t in texts if server.tokenize(t) != tok.encode(t, add_special_tokens=False)]
    return {"texts": len(texts), "equal": len(texts) - len(differ), "differ": differ}


# --- the engine check ---------------------------------------------------------------------------------
def omp_env(policy: str | None) -> dict:
    """The server's OMP_WAIT_POLICY: None inherits ours. Measured (2 shared cores, load ~6, demo
    target, 2 threads): unset 48-386 tok/s, PASSIVE 692-915 tok/s: spinning OpenMP workers fight the
    other processes for the cores."""
    return {} if policy is None else {"OMP_WAIT_POLICY": policy}


def omp_label(policy: str | None) -> str:
    return policy if policy is not None else os.environ.get("OMP_WAIT_POLICY", "(unset)")


def decode_all(b: LlamaCpp, model: Path, spec: SpecSettings, prompts, n_predict: int, threads: int,
               log: Path, ctx: int = 2048, omp: str | None = None, warmup: int = 0) -> tuple[list[Completion], float]:
    """Every prompt through one server, after `warmup` untimed requests (the first prompt, 16 tokens);
    (completions, wall seconds of the decoding requests)."""
    with Server(b, model, spec, threads=threads, ctx=ctx, log=log, env=omp_env(omp)) as server:
        for _ in range(warmup):
            server.complete(prompts[0][1], 16)
        started = time.time()
        outs = [server.complete(ids, n_predict) for _, ids in prompts]
        return outs, time.time() - started


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]
