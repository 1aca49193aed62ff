"""llama.cpp, the third engine: our exports converted to GGUF and decoded by `llama-server` on a CPU.

`ensure()` finds (or downloads and builds) the llama.cpp pinned in engine_facts.LLAMA_CPP_BUILD under
the user cache: `<cache>/engines/llama.cpp-<version>/` holds the PyPI sdist of llama-cpp-python (which
vendors llama.cpp), its tree under `sdist/`, the binaries in `sdist/vendor/llama.cpp/build/bin` and the
converter's one extra Python package under `pydeps/`. `convert()` / `convert_draft()` run llama.cpp's
own convert_hf_to_gguf.py (through llamacpp_convert.py, which only names the pre-tokenizer when the
converter does not know the tokenizer's hash; the choice is recorded next to the GGUF). `Server` runs
`llama-server` with given speculative settings and answers greedy /completion requests.

    python -m specheads.engines.llamacpp ensure
    python -m specheads.engines.llamacpp check EXPORT --target TARGET [--prompts FILE --limit N]
    python -m specheads.engines.llamacpp convert TARGET_OR_EXPORT OUT.gguf [--target TARGET]

`check` converts target and draft, decodes each prompt plain and with the draft (`--spec-type
draft-eagle3 -md DRAFT.gguf`), and passes when every speculative output equals the plain one token for
token and drafts were accepted.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specheads.atomic import write_json, write_text
from specheads.builtin.tiny_target import cache_dir
from specheads.data.prompts import encode_chat, read_prompts, user_turn
from specheads.engine_facts import LLAMA_CPP, LLAMA_CPP_BUILD, LLAMA_CPP_EAGLE3_LAYERS, LLAMA_CPP_PRE_TOKENIZERS, LLAMA_CPP_SPEC
from specheads.session import Session, eos_ids
from specheads.verify.loop import decode
from specheads.verify.registry import make_proposer
from specheads.verify.settings import TreeSpec

CONVERT_SHIM = Path(__file__).with_name("llamacpp_convert.py")
MARKER = "SPECHEADS_PRE_FALLBACK="  # printed by llamacpp_convert.py
STAMP = ".specheads-built"


class LlamaCppError(RuntimeError):
    """llama.cpp is missing and cannot be built, or a conversion / server run failed (says why)."""


class RefusedExport(LlamaCppError):
    """The folder is not an export llama.cpp can run (the message names what to pass instead)."""


# --- where llama.cpp lives ----------------------------------------------------------------------------
def home() -> Path:
    return cache_dir() / "engines" / f"llama.cpp-{LLAMA_CPP_BUILD.version}"


@dataclass(frozen=True)
class LlamaCpp:
    """A built llama.cpp: its source tree (the converter) and binaries."""

    source: Path

    @property
    def bin_dir(self) -> Path:
        return self.source / "build" / "bin"

    @property
    def server(self) -> Path:
        return self.bin_dir / "llama-server"

    @property
    def cli(self) -> Path:
        return self.bin_dir / "llama-cli"

    @property
    def converter(self) -> Path:
        return self.source / "convert_hf_to_gguf.py"

    @property
    def pydeps(self) -> Path:
        return self.source.parents[2] / "pydeps"

    def env(self, **extra: str) -> dict:
        """The binaries' environment: their shared libraries sit beside them (the tree may have moved
        since the build, so the RPATH cannot be trusted)."""
        env = dict(os.environ, **extra)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(self.bin_dir), env.get("LD_LIBRARY_PATH")) if p)
        return env

    def converter_env(self, **extra: str) -> dict:
        env = dict(os.environ, **extra)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(self.pydeps), env.get("PYTHONPATH")) if p)
        return env

    def version(self) -> str:
        done = subprocess.run([str(self.server), "--version"], capture_output=True, text=True, env=self.env(),
                              timeout=60)
        text = (done.stdout + done.stderr).strip()
        if done.returncode != 0:
            raise LlamaCppError(f"{self.server} --version failed (exit {done.returncode}): {text[-500:]}")
        return " ".join(line for line in text.splitlines() if "version" in line or "commit" in line) or text


def built(source: Path) -> bool:
    b = LlamaCpp(source)
    return all(p.is_file() for p in (b.server, b.cli, b.converter))


def configure_command(source: Path, ninja: bool) -> list[str]:
    return ["cmake", "-S", str(source), "-B", str(source / "build"), *(["-G", "Ninja"] if ninja else []),
            *LLAMA_CPP_BUILD.configure]


def build_command(source: Path, jobs: int) -> list[str]:
    return ["cmake", "--build", str(source / "build"), f"-j{jobs}", "--target", *LLAMA_CPP_BUILD.targets]


def download_command(dest: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            f"{LLAMA_CPP_BUILD.package}=={LLAMA_CPP_BUILD.version}", "-d", str(dest)]


def _run(cmd: list[str], what: str, log: Path, **kw) -> None:
    with open(log, "a") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, **kw)
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise LlamaCppError(f"{what} failed (exit {done.returncode}); log {log}:\n{tail}")


def _extract(tarball: Path, dest: Path) -> None:
    """The sdist's top folder (llama_cpp_python-X/) becomes `dest`."""
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(tarball) as tar:
        tar.extractall(tmp, filter="data")
    (top,) = [p for p in tmp.iterdir() if p.is_dir()]
    top.rename(dest)
    tmp.rmdir()


def missing_tools(ninja_ok: bool = True) -> list[str]:
    need = {"cmake": "cmake", "a C compiler (cc / gcc)": ("cc", "gcc", "clang"),
            "a C++ compiler (c++ / g++)": ("c++", "g++", "clang++")}
    out = []
    for what, names in need.items():
        if not any(shutil.which(n) for n in ((names,) if isinstance(names, str) else names)):
            out.append(what)
    return out


def ensure(progress=print, build: bool = True) -> LlamaCpp:
    """The pinned llama.cpp, downloaded and built first when absent (build=False: raise instead)."""
    root, b = home(), LlamaCpp(home() / "sdist" / "vendor" / "llama.cpp")
    if not built(b.source):
        if not build:
            raise LlamaCppError(f"llama.cpp {LLAMA_CPP_BUILD.version} is not built under {root}: run "
                                "`python -m specheads.engines.llamacpp ensure`")
        tools = missing_tools()
        if tools:
            raise LlamaCppError(f"building llama.cpp needs {', '.join(tools)} on PATH (Debian/Ubuntu: "
                                "`apt-get install cmake build-essential ninja-build`); or build it yourself "
                                f"under {b.source} with {shlex.join(configure_command(b.source, True))}")
        root.mkdir(parents=True, exist_ok=True)
        log = root / "build.log"
        tarball = root / f"{LLAMA_CPP_BUILD.package.replace('-', '_')}-{LLAMA_CPP_BUILD.version}.tar.gz"
        if not tarball.is_file():
            progress(f"[specheads] downloading the {LLAMA_CPP_BUILD.package} {LLAMA_CPP_BUILD.version} sdist "
                     f"(vendors llama.cpp {LLAMA_CPP_BUILD.commit})")
            _run(download_command(root), "pip download", log)
        if not b.source.is_dir():
            _extract(tarball, root / "sdist")
        progress(f"[specheads] building llama.cpp (about {LLAMA_CPP_BUILD.minutes} min on 2 cores); log {log}")
        _run(configure_command(b.source, bool(shutil.which("ninja"))), "cmake configure", log)
        _run(build_command(b.source, os.cpu_count() or 2), "cmake build", log)
        if not built(b.source):
            raise LlamaCppError(f"the build finished but {b.server} or {b.cli} is missing; log {log}")
    ensure_converter_deps(b, progress)
    stamp = root / STAMP
    if not stamp.is_file():
        write_text(stamp, b.version() + "\n")
    return b


def ensure_converter_deps(b: LlamaCpp, progress=print) -> None:
    """The converter runs under this Python; what it needs beyond specheads' own packages goes into
    `pydeps/` (pip --target), never into this environment."""
    probe = [sys.executable, "-c", "import sentencepiece, torch, transformers, safetensors"]
    if subprocess.run(probe, capture_output=True, env=b.converter_env()).returncode == 0:
        return
    progress(f"[specheads] installing {', '.join(LLAMA_CPP_BUILD.converter_extras)} for llama.cpp's converter "
             f"into {b.pydeps}")
    b.pydeps.parent.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(b.pydeps),
          *LLAMA_CPP_BUILD.converter_extras], "pip install (converter deps)", b.pydeps.parent / "build.log")


# --- conversion ---------------------------------------------------------------------------------------
def pre_tokenizer(target_dir: Path) -> tuple[str, str] | None:
    """(llama.cpp pre-tokenizer name, why) for the target's tokenizer.json, or None (no rule: the
    converter's own hash table decides, and refuses an unknown tokenizer)."""
    path = Path(target_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    pre = json.loads(path.read_text()).get("pre_tokenizer") or {}
    key = (pre.get("type"), bool(pre.get("use_regex", True)), bool(pre.get("add_prefix_space", False)))
    name = LLAMA_CPP_PRE_TOKENIZERS.get(key)
    if not name:
        return None
    return name, (f"tokenizer.json pre_tokenizer is {key[0]}(use_regex={key[1]}, add_prefix_space={key[2]}): "
                  f"GPT-2's split regex, llama.cpp's '{name}'")


def convert_command(b: LlamaCpp, model_dir: Path, out: Path, outtype: str = "f32",
                    target_dir: Path | None = None) -> list[str]:
    cmd = [sys.executable, str(CONVERT_SHIM), str(b.source), str(model_dir), "--outfile", str(out), "--outtype", outtype]
    if target_dir is not None:
        cmd += ["--target-model-dir", str(target_dir)]
    return cmd


def _convert(b: LlamaCpp, model_dir: Path, out: Path, tokenizer_dir: Path, outtype: str,
             target_dir: Path | None) -> dict:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pre = pre_tokenizer(tokenizer_dir)
    cmd = convert_command(b, model_dir, out, outtype, target_dir)
    tmp_log = out.with_name(out.name + ".convert.log")
    env = b.converter_env(SPECHEADS_GGUF_PRE=pre[0] if pre else "")
    with open(tmp_log, "w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=3600)
    text = tmp_log.read_text(errors="replace")
    if done.returncode != 0 or not out.is_file():
        hint = ""
        if "pre-tokenizer was not recognized" in text:
            hint = ("\nthe converter does not know this tokenizer's pre-tokenizer and no rule in "
                    "engine_facts.LLAMA_CPP_PRE_TOKENIZERS matches its tokenizer.json")
        raise LlamaCppError(f"llama.cpp's converter failed on {model_dir} (exit {done.returncode}); "
                            f"log {tmp_log}:\n{text[-2500:]}{hint}")
    applied = next((line.split(MARKER, 1)[1].strip() for line in text.splitlines() if MARKER in line), None)
    record = {"source": str(model_dir), "gguf": str(out), "outtype": outtype,
              "target_model_dir": str(target_dir) if target_dir else None,
              "converter": f"llama.cpp {LLAMA_CPP.series} convert_hf_to_gguf.py (from {LLAMA_CPP_BUILD.package} "
                           f"{LLAMA_CPP_BUILD.version}), unmodified", "command": shlex.join(cmd),
              "pre_tokenizer": {"fallback_applied": applied,
                                "rule": pre[1] if pre and applied else None,
                                "note": ("the converter's hash table does not know this tokenizer; tokenizer.ggml.pre "
                                         f"was set to '{applied}' at run time (no file edited)") if applied
                                else "the converter's own choice"}}
    write_json(out.with_name(out.name + ".json"), record)
    return record


def convert(target_dir: Path, out_gguf: Path, outtype: str = "f32") -> dict:
    """The HF target folder as a GGUF (returns the conversion record written beside it)."""
    target_dir = Path(target_dir)
    if not (target_dir / "config.json").is_file():
        raise RefusedExport(f"{target_dir}: no config.json; pass an HF target folder")
    return _convert(ensure(), target_dir, out_gguf, target_dir, outtype, None)


def draft_spec(export_dir: Path) -> tuple[str, dict]:
    """(llama.cpp --spec-type, config.json) of a specheads export, or RefusedExport saying why not."""
    export_dir = Path(export_dir)
    meta_path, cfg_path = export_dir / "specheads.json", export_dir / "config.json"
    if not cfg_path.is_file() or not meta_path.is_file():
        raise RefusedExport(f"{export_dir}: no config.json / specheads.json; pass a folder written by "
                            "`specheads export --format vllm`")
    meta, cfg = json.loads(meta_path.read_text()), json.loads(cfg_path.read_text())
    kind = meta.get("kind")
    fmt = meta.get("format")
    spec = LLAMA_CPP_SPEC.get((kind, fmt))
    if spec is None:
        served = ", ".join(f"{k} (--format {f})" for k, f in LLAMA_CPP_SPEC)
        raise RefusedExport(f"{export_dir}: a {kind} export in format {fmt}; llama.cpp {LLAMA_CPP.series} runs "
                            f"{served} from specheads")
    if spec != "draft-eagle3":
        return spec, cfg
    if cfg.get("speculators_model_type") == "peagle" or cfg.get("parallel_drafting"):
        raise RefusedExport(f"{export_dir}: a P-EAGLE head (parallel drafting); llama.cpp {LLAMA_CPP.series} has no "
                            "P-EAGLE: --spec-type draft-eagle3 drafts one token per step")
    layers = cfg.get("eagle_aux_hidden_state_layer_ids") or []
    if spec == "draft-eagle3" and len(layers) != LLAMA_CPP_EAGLE3_LAYERS:
        raise RefusedExport(f"{export_dir}: EAGLE-3 taps {len(layers)} target layers {layers}; llama.cpp's EAGLE-3 "
                            f"takes exactly {LLAMA_CPP_EAGLE3_LAYERS} (src/models/eagle3.cpp)")
    return spec, cfg


def convert_draft(export_dir: Path, target_dir: Path, out_gguf: Path, outtype: str = "f32") -> dict:
    """A specheads export (engine_facts.LLAMA_CPP_SPEC) as a llama.cpp draft GGUF."""
    spec, _ = draft_spec(export_dir)
    record = _convert(ensure(), Path(export_dir), out_gguf, Path(target_dir), outtype, Path(target_dir))
    record["spec_type"] = spec
    write_json(Path(out_gguf).with_name(Path(out_gguf).name + ".json"), record)
    return record


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


def server_command(b: LlamaCpp, model: Path, spec: SpecSettings, port: int, threads: int, ctx: int) -> list[str]:
    cmd = [str(b.server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-tb", str(threads), "-c", str(ctx), "-np", "1", "--no-webui"]
    if spec.draft is not None:
        cmd += ["-md", str(spec.draft), "-td", str(threads)]
    if spec.types:
        cmd += ["--spec-type", ",".join(spec.types)]
    if spec.n_max is not None:
        cmd += ["--spec-draft-n-max", str(spec.n_max)]
    return cmd + list(spec.extra)


def completion_body(prompt: Sequence[int] | str, n_predict: int) -> dict:
    """Greedy, no prompt cache (each request decodes from scratch), the generated token ids returned."""
    return {"prompt": list(prompt) if not isinstance(prompt, str) else prompt, "n_predict": n_predict,
            "temperature": 0, "cache_prompt": False, "return_tokens": True, "stream": False}


@dataclass
class Completion:
    text: str
    tokens: list[int]
    timings: dict = field(default_factory=dict)

    @property
    def drafted(self) -> int:
        return int(self.timings.get("draft_n") or 0)

    @property
    def accepted(self) -> int:
        return int(self.timings.get("draft_n_accepted") or 0)


class Server:
    """`llama-server` on a free port: `with Server(b, model, spec) as s: s.complete(ids, 64)`."""

    def __init__(self, b: LlamaCpp, model: Path, spec: SpecSettings | None = None, threads: int = 2,
                 ctx: int = 2048, log: Path | None = None, env: dict | None = None, startup_s: float = 300):
        self.b, self.spec, self.threads = b, spec or SpecSettings(), threads
        self.port = free_port()
        self.cmd = server_command(b, Path(model), self.spec, self.port, threads, ctx)
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
                                    f"{shlex.join(self.cmd)}\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.3)
        raise LlamaCppError(f"llama-server not healthy after {self.startup_s:.0f} s\n{self.log_tail()}")

    def log_tail(self, chars: int = 2500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def complete(self, prompt: Sequence[int] | str, n_predict: int, timeout: float = 1800) -> Completion:
        data = json.dumps(completion_body(prompt, n_predict)).encode()
        req = urllib.request.Request(self.url("/completion"), data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                out = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise LlamaCppError(f"/completion: HTTP {e.code}: {e.read()[:500]!r}\n{self.log_tail()}") from None
        return Completion(out.get("content", ""), list(out.get("tokens") or []), out.get("timings") or {})

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
def prompt_ids(target_dir: Path, prompts_file: Path | None, limit: int) -> list[tuple[str, list[int]]]:
    """(id, token ids) of the prompts, chat-templated exactly as our eval does (data/prompts.py); the
    ids go to llama.cpp as they are, so both engines see the same tokens."""
    from transformers import AutoTokenizer


    tok = AutoTokenizer.from_pretrained(str(target_dir))
    if prompts_file is None:
        texts = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"",
                 "Write a function that reverses a list in place.", "import os\n\n\ndef walk(root):"]
        return [(f"builtin-{i}", encode_chat(tok, user_turn(t))) for i, t in enumerate(texts[:limit])]
    return [(row.id, encode_chat(tok, user_turn(row.turns[0]))) for row in read_prompts(prompts_file, limit)]


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


def ours(target_dir: Path, export_dir: Path, prompts, n_predict: int, k: int | None) -> dict:
    """Our verifier on the same prompt ids (greedy chain of k, CPU float32): accepted / drafted, and
    where its tokens first differ from llama.cpp's (filled in by the caller)."""

    session = Session.open(str(target_dir), export_dir, k=k, device="cpu", dtype="float32")
    target, head, eos = session.target, session.head, eos_ids(session.target)
    drafted = accepted = 0
    tokens = []
    for _, ids in prompts:
        spec = TreeSpec("chain", k=session.k)
        r = decode(target, make_proposer(spec, head, target), ids, n_predict, session.k, eos)
        drafted += r.stats.proposed_tokens
        accepted += sum(r.stats.accepted_per_pos)
        tokens.append([int(t) for t in r.tokens])
    return {"k": session.k, "drafted": drafted, "accepted": accepted,
            "accepted_per_drafted": accepted / drafted if drafted else None, "tokens": tokens}


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check(export_dir: Path, target_dir: Path, work: Path, prompts_file: Path | None = None, limit: int = 8,
          n_predict: int = 64, threads: int = 2, n_max: int | None = None, require_accepted: bool = True,
          compare_ours: bool = False, omp: str | None = None, progress=print) -> dict:
    """Plain vs speculative llama.cpp on the same prompts: PASS when every speculative output equals
    the plain one token for token and (require_accepted) some draft tokens were accepted."""
    spec_type, cfg = draft_spec(export_dir)
    b = ensure(progress=progress)
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    target_gguf, draft_gguf = work / "target-f32.gguf", work / "draft-f32.gguf"
    progress(f"[llama.cpp] converting the target {target_dir} -> {target_gguf}")
    target_rec = _convert(b, Path(target_dir), target_gguf, Path(target_dir), "f32", None)
    progress(f"[llama.cpp] converting the draft {export_dir} -> {draft_gguf}")
    draft_rec = convert_draft(export_dir, target_dir, draft_gguf)
    prompts = prompt_ids(Path(target_dir), prompts_file, limit)
    # EAGLE-3 drafts a chain of k; DFlash / DSpark a block, sized by llama.cpp from the GGUF (block_size)
    k = n_max or (json.loads((Path(export_dir) / "specheads.json").read_text()).get("num_speculative_tokens")
                  if spec_type == "draft-eagle3" else None)
    load0 = load_average()
    plain, plain_s = decode_all(b, target_gguf, SpecSettings(), prompts, n_predict, threads, work / "server-plain.log",
                                omp=omp)
    spec_settings = SpecSettings((spec_type,), draft_gguf, n_max=k)
    spec, spec_s = decode_all(b, target_gguf, spec_settings, prompts, n_predict, threads, work / "server-spec.log",
                              omp=omp)
    rows = []
    for (pid, ids), p, s in zip(prompts, plain, spec):
        rows.append({"id": pid, "prompt_tokens": len(ids), "plain_tokens": len(p.tokens), "spec_tokens": len(s.tokens),
                     "equal": p.tokens == s.tokens, "first_difference": first_difference(p.tokens, s.tokens),
                     "drafted": s.drafted, "accepted": s.accepted,
                     "plain_tok_s": p.timings.get("predicted_per_second"),
                     "spec_tok_s": s.timings.get("predicted_per_second")})
    drafted, accepted = sum(r["drafted"] for r in rows), sum(r["accepted"] for r in rows)
    equal = all(r["equal"] for r in rows)
    mine = None
    if compare_ours and spec_type == "draft-eagle3":
        progress("[llama.cpp] our verifier on the same prompt ids")
        mine = ours(Path(target_dir), Path(export_dir), prompts, n_predict, k)
        # llama.cpp returns the tokens it generated, an end-of-generation token included when it stops on one
        same = [m == p.tokens[:len(m)] or p.tokens == m[:len(p.tokens)] for m, p in zip(mine.pop("tokens"), plain)]
        mine["same_tokens_as_llama_cpp_plain"] = f"{sum(same)}/{len(same)}"
    problems = [f"{r['id']}: speculative output differs from plain at token {r['first_difference']}"
                for r in rows if not r["equal"]]
    if drafted == 0:
        problems.append("llama.cpp drafted no tokens: the draft was not used")
    elif require_accepted and accepted == 0:
        problems.append(f"none of {drafted} drafted tokens was accepted")
    return {"verdict": "PASS" if not problems else "FAIL", "problems": problems, "engine": LLAMA_CPP.label,
            "version": b.version(), "export": str(export_dir), "target": str(target_dir),
            "spec_type": spec_type, "spec_draft_n_max": k, "threads": threads,
            "omp_wait_policy": omp_label(omp), "n_predict": n_predict,
            "prompts": len(rows), "greedy_equal": equal, "drafted": drafted, "accepted": accepted,
            "accepted_per_drafted": accepted / drafted if drafted else None,
            "ours": mine, "decode_seconds": {"plain": plain_s, "spec": spec_s}, "load_average": {"before": load0,
                                                                                  "after": load_average()},
            "conversions": {"target": target_rec, "draft": draft_rec},
            "server_commands": {"plain": shlex.join(server_command(b, target_gguf, SpecSettings(), 0, threads, 2048)),
                                "spec": shlex.join(server_command(b, target_gguf, spec_settings, 0, threads, 2048))},
            "rows": rows}


def format_check(r: dict) -> str:
    rate = f"{r['accepted_per_drafted']:.3f}" if r["accepted_per_drafted"] is not None else "-"
    lines = [f"llama.cpp check: {r['verdict']}  ({r['version']})",
             f"  {r['prompts']} prompts x {r['n_predict']} tokens, {r['spec_type']} k={r['spec_draft_n_max'] or 'default'}, "
             f"threads {r['threads']}, OMP_WAIT_POLICY {r['omp_wait_policy']}, load {r['load_average']}",
             f"  greedy-equal: {sum(x['equal'] for x in r['rows'])}/{len(r['rows'])}; accepted/drafted "
             f"{r['accepted']}/{r['drafted']} = {rate}"]
    if r.get("ours"):
        o = r["ours"]
        lines.append(f"  our verifier, same prompt ids, k={o['k']}: accepted/drafted {o['accepted']}/{o['drafted']} = "
                     f"{o['accepted_per_drafted'] or 0:.3f}; same greedy tokens as llama.cpp plain: "
                     f"{o['same_tokens_as_llama_cpp_plain']}")
    if r["conversions"]["target"]["pre_tokenizer"]["fallback_applied"]:
        lines.append(f"  pre-tokenizer: {r['conversions']['target']['pre_tokenizer']['note']}")
    lines += [f"  {p}" for p in r["problems"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specheads.engines.llamacpp", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("ensure", help="locate or download + build the pinned llama.cpp")
    c = sub.add_parser("check", help="plain vs speculative llama.cpp decoding of an export")
    c.add_argument("export")
    c.add_argument("--target", required=True, help="the HF target folder the export was trained on")
    c.add_argument("--prompts", help="a prompts jsonl (default: 3 built-in prompts)")
    c.add_argument("--limit", type=int, default=8)
    c.add_argument("--n-predict", type=int, default=64)
    c.add_argument("--threads", type=int, default=2)
    c.add_argument("--k", type=int, default=None, help="--spec-draft-n-max (default: the export's speculative_tokens)")
    c.add_argument("--work", default=None, help="folder for the GGUFs, logs and llamacpp-check.json")
    c.add_argument("--omp-wait-policy", choices=["PASSIVE", "ACTIVE"], default=None,
                   help="the servers' OMP_WAIT_POLICY (default: inherited); PASSIVE measured faster on shared cores")
    c.add_argument("--ours", action="store_true", help="also run our verifier on the same prompt ids (acceptance)")
    c.add_argument("--no-require-accepted", action="store_true",
                   help="pass on greedy equality alone (random-weight test heads draft but are never accepted)")
    v = sub.add_parser("convert", help="an HF target or (with --target) a specheads export as GGUF")
    v.add_argument("model")
    v.add_argument("out")
    v.add_argument("--target", default=None)
    v.add_argument("--outtype", default="f32", choices=["f32", "f16", "bf16", "q8_0"])
    a = p.parse_args(argv)
    try:
        if a.cmd == "ensure":
            b = ensure()
            print(f"llama.cpp ready: {b.server}\n  {b.version()}\n  converter {b.converter}")
            return 0
        if a.cmd == "convert":
            rec = convert_draft(a.model, a.target, a.out, a.outtype) if a.target else convert(a.model, a.out, a.outtype)
            print(json.dumps(rec, indent=2))
            return 0
        work = Path(a.work or Path(a.export).resolve().parent / "llamacpp-check")
        r = check(Path(a.export), Path(a.target), work, Path(a.prompts) if a.prompts else None, a.limit,
                  a.n_predict, a.threads, a.k, not a.no_require_accepted, a.ours, a.omp_wait_policy)
        write_json(work / "llamacpp-check.json", r)
        print(format_check(r))
        print(f"  report: {work / 'llamacpp-check.json'}")
        return 0 if r["verdict"] == "PASS" else 1
    except (LlamaCppError, FileNotFoundError) as e:
        print(f"llama.cpp: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
