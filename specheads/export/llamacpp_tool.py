"""The pinned llama.cpp as a tool: found (or downloaded and built) under the user cache, and its own
`convert_hf_to_gguf.py` run on our exports, with what llama.cpp cannot load refused in its words.

`ensure()` finds (or downloads and builds) the llama.cpp pinned in engine_facts.LLAMA_CPP_BUILD:
`<cache>/engines/llama.cpp-<version>/` holds the PyPI sdist of llama-cpp-python (which vendors
llama.cpp), its tree under `sdist/`, the binaries in `sdist/vendor/llama.cpp/build/bin` and the
converter's one extra Python package under `pydeps/`. `convert()` / `convert_draft()` run the converter
through engines/llamacpp_convert.py (which only names the pre-tokenizer when the converter does not
know the tokenizer's hash; the choice is recorded next to the GGUF). Here, below the engines, because
`export --format gguf` (export/gguf.py) converts; specheads.engines.llamacpp runs the server.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from specheads.atomic import write_json, write_text
from specheads.builtin.tiny_target import cache_dir
from specheads.engine_facts import (
    LLAMA_CPP,
    LLAMA_CPP_BUILD,
    LLAMA_CPP_DFLASH_BACKBONE,
    LLAMA_CPP_EAGLE3_LAYER,
    LLAMA_CPP_EAGLE3_LAYERS,
    LLAMA_CPP_EAGLE3_UNREAD,
    LLAMA_CPP_GGUF,
    LLAMA_CPP_MROPE_FAMILIES,
    LLAMA_CPP_MTP_FAMILIES,
    LLAMA_CPP_PRE_TOKENIZERS,
    LLAMA_CPP_QWEN35_MROPE_DEFAULT,
    LLAMA_CPP_SPEC,
)

CONVERT_SHIM = Path(__file__).parents[1] / "engines" / "llamacpp_convert.py"  # run as a script, never imported
MARKER = "SPECHEADS_PRE_FALLBACK="  # printed by llamacpp_convert.py
STAMP = ".specheads-built"
LLAMA_CPP_ENV = "SPECHEADS_LLAMA_CPP"  # an existing llama.cpp source tree built under build/bin (--llama-cpp)


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
        return home() / "pydeps"  # the converter's extra packages: in the user cache, whichever tree converts

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


@dataclass(frozen=True)
class LlamaCppChoice:
    """Which llama.cpp `export --format gguf` converts with: `path` (--llama-cpp) an existing source tree
    built under build/bin; `build` (--build-llama-cpp) lets it build the pinned one when absent."""

    path: str | None = None
    build: bool = False


def locate(choice: LlamaCppChoice = LlamaCppChoice(), progress=print) -> LlamaCpp:
    """The llama.cpp a gguf export converts with, chosen before anything slow starts: the choice's path
    (or $SPECHEADS_LLAMA_CPP); else the pinned build in the user cache; else, when the choice allows it,
    that build made now (~12 min); else a refusal naming both ways."""
    path, build = choice.path or os.environ.get(LLAMA_CPP_ENV) or None, choice.build
    if path:
        given = LlamaCpp(Path(path).expanduser())
        if not built(given.source):
            missing = [str(p) for p in (given.server, given.cli, given.converter) if not p.is_file()]
            raise LlamaCppError(f"llama.cpp at {given.source} (--llama-cpp or {LLAMA_CPP_ENV}): {', '.join(missing)} "
                                "missing; pass the source tree of a llama.cpp built with cmake (its build/bin "
                                "holds llama-server and llama-cli)")
        ensure_converter_deps(given, progress)
        return given
    if built(home() / "sdist" / "vendor" / "llama.cpp") or build:
        if build:
            progress(f"[specheads] --build-llama-cpp: llama.cpp {LLAMA_CPP_BUILD.version} is built under {home()} "
                     f"when absent (about {LLAMA_CPP_BUILD.minutes} min on 2 cores, once)")
        return ensure(progress)
    raise LlamaCppError(
        f"--format gguf converts with llama.cpp's own converter, and no llama.cpp is built under {home()}. "
        f"Pass --build-llama-cpp to download and build the pinned one there (llama-cpp-python "
        f"{LLAMA_CPP_BUILD.version}; about {LLAMA_CPP_BUILD.minutes} min on 2 cores, once), or --llama-cpp PATH (or "
        f"{LLAMA_CPP_ENV}=PATH) for a llama.cpp source tree you built (build/bin/llama-server)")


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


def convert(target_dir: Path, out_gguf: Path, outtype: str = "f32", b: LlamaCpp | None = None) -> dict:
    """The HF target folder as a GGUF (returns the conversion record written beside it)."""
    target_dir = Path(target_dir)
    if not (target_dir / "config.json").is_file():
        raise RefusedExport(f"{target_dir}: no config.json; pass an HF target folder")
    return _convert(b or ensure(), target_dir, out_gguf, target_dir, outtype, None)


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
    if spec in ("draft-dflash", "draft-dspark"):
        return spec, check_dflash(export_dir, cfg)
    if spec == "draft-mtp":
        return spec, check_mtp(export_dir, cfg)
    if spec != "draft-eagle3":
        return spec, cfg
    if cfg.get("speculators_model_type") == "peagle" or cfg.get("parallel_drafting"):
        raise RefusedExport(f"{export_dir}: a P-EAGLE head (parallel drafting); llama.cpp {LLAMA_CPP.series} has no "
                            "P-EAGLE: --spec-type draft-eagle3 drafts one token per step")
    check_eagle31(export_dir, cfg)
    layers = cfg.get("eagle_aux_hidden_state_layer_ids") or []
    if len(layers) != LLAMA_CPP_EAGLE3_LAYERS:
        raise RefusedExport(f"{export_dir / 'config.json'}: eagle_aux_hidden_state_layer_ids {layers} taps {len(layers)} "
                            f"target layers; llama.cpp {LLAMA_CPP.series} says \"EAGLE3 requires exactly "
                            f"{LLAMA_CPP_EAGLE3_LAYERS} entries in 'extract_layers'\" (src/models/eagle3.cpp): train "
                            f"with {LLAMA_CPP_EAGLE3_LAYERS} aux layers to serve it in llama.cpp")
    return spec, cfg


def check_eagle31(export_dir: Path, cfg: dict) -> None:
    """EAGLE 3.1 options llama.cpp's EAGLE-3 graph does not run (it would serve a different draft)."""
    unread = [key for key in LLAMA_CPP_EAGLE3_UNREAD if cfg.get(key)]
    if unread:
        raise RefusedExport(f"{export_dir / 'config.json'}: {', '.join(unread)} true; llama.cpp {LLAMA_CPP.series}'s "
                            "EAGLE-3 graph (src/models/eagle3.cpp) reads only norm_before_residual and norm_before_fc: "
                            "train with norm_before_fc instead to serve it in llama.cpp")
    layer = (cfg.get("transformer_layer_config") or {}).get("model_type", LLAMA_CPP_EAGLE3_LAYER)
    if layer != LLAMA_CPP_EAGLE3_LAYER:
        raise RefusedExport(f"{export_dir / 'config.json'}: transformer_layer_config.model_type {layer!r}; llama.cpp "
                            f"{LLAMA_CPP.series}'s converter reads an EAGLE-3 draft layer as {LLAMA_CPP_EAGLE3_LAYER} "
                            "(conversion/llama.py): train without head.qk_norm to serve it in llama.cpp")


def check_dflash(export_dir: Path, cfg: dict) -> dict:
    """DFlash / DSpark: llama.cpp's converter reads a Qwen3 stack (`class DFlashModel(Qwen3Model)`) and
    only DSpark's vanilla Markov head."""
    layer_cfg = cfg.get("transformer_layer_config") or cfg
    backbone = layer_cfg.get("model_type")
    if backbone != LLAMA_CPP_DFLASH_BACKBONE:
        raise RefusedExport(f"{export_dir / 'config.json'}: model_type {backbone!r}; llama.cpp {LLAMA_CPP.series}'s "
                            "converter reads DFlash and DSpark drafts as a Qwen3 stack only (conversion/qwen.py: "
                            f"class DFlashModel(Qwen3Model)); export a head with {LLAMA_CPP_DFLASH_BACKBONE} layers")
    markov = cfg.get("markov_head_type", "vanilla")
    if markov != "vanilla":
        raise RefusedExport(f"{export_dir / 'config.json'}: markov_head_type {markov!r}; llama.cpp's converter says "
                            f"\"unsupported markov_head_type {markov!r} (only 'vanilla' is supported)\"")
    if cfg.get("enable_confidence_head") and (cfg.get("markov_rank") or 0) > 0 \
            and not cfg.get("confidence_head_with_markov"):
        raise RefusedExport(f"{export_dir / 'config.json'}: a confidence head without the Markov embedding "
                            "(confidence_head_with_markov false); llama.cpp's DSpark loader (src/models/dflash.cpp) "
                            "builds conf_proj as [n_embd + markov_rank, 1] and its graph always feeds it "
                            "cat[h, markov_w1[prev]], so this [n_embd] projection would not load: train with "
                            "head.confidence_head_with_markov: true to serve it in llama.cpp")
    return cfg


def check_mtp(export_dir: Path, cfg: dict) -> dict:
    """MTP: llama.cpp runs the MTP block of the target GGUF for the families whose converter keeps it."""
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch not in LLAMA_CPP_MTP_FAMILIES:
        raise RefusedExport(f"{export_dir / 'config.json'}: architectures [{arch!r}]; llama.cpp {LLAMA_CPP.series}'s "
                            "converter exports MTP blocks (supports_mtp_export) for "
                            f"{', '.join(LLAMA_CPP_MTP_FAMILIES)} of the families specheads trains MTP on; serve this "
                            "export with vLLM or SGLang")
    if arch in LLAMA_CPP_MROPE_FAMILIES:
        check_mrope(export_dir, cfg.get("text_config") or cfg)
    return cfg


def check_mrope(export_dir: Path, cfg: dict) -> None:
    """Qwen3.5: the M-RoPE sections the converter writes must fit the rotary dims, or llama.cpp aborts."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    sections = list(rope.get("mrope_section") or LLAMA_CPP_QWEN35_MROPE_DEFAULT)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rotary = int(head_dim * (rope.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0))
    if sum(sections) > rotary:
        raise RefusedExport(f"{export_dir / 'config.json'}: rope mrope_section {sections} (the converter's default when "
                            f"the config has none) spans {sum(sections)} dims but head_dim {head_dim} x "
                            f"partial_rotary_factor gives {rotary} rotary dims; llama.cpp {LLAMA_CPP.series} aborts "
                            "decoding this target (\"GGML_ASSERT(sect_dims <= ne0) failed\", ggml-cpu/ops.cpp)")


def convert_draft(export_dir: Path, target_dir: Path, out_gguf: Path, outtype: str = "f32",
                  b: LlamaCpp | None = None) -> dict:
    """A specheads export (engine_facts.LLAMA_CPP_SPEC) as a llama.cpp draft GGUF."""
    spec, _ = draft_spec(export_dir)
    kind = json.loads((Path(export_dir) / "specheads.json").read_text())["kind"]
    with_target = LLAMA_CPP_GGUF[kind].needs_target_dir if kind in LLAMA_CPP_GGUF else True
    record = _convert(b or ensure(), Path(export_dir), out_gguf, Path(target_dir), outtype,
                      Path(target_dir) if with_target else None)
    record["spec_type"] = spec
    write_json(Path(out_gguf).with_name(Path(out_gguf).name + ".json"), record)
    return record
