"""The engines' own virtualenvs: vLLM 0.33.0 and SGLang 0.5.23, created once under the user cache.

The engines pin their own torch and transformers, so they never go into specheads' environment: each
gets `<cache>/engines/<engine>-<version>/` (created with `python -m venv` and `pip install
<engine>==<version>`), reused afterwards. A stamp file written after a successful install makes the
check cheap; a folder without the stamp whose Python imports the pinned version is accepted (and
stamped). Every failure is loud: a clear error, never a silent skip.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from specheads import engine_facts as facts
from specheads.atomic import write_text
from specheads.builtin.tiny_target import cache_dir


@dataclass(frozen=True)
class EngineSpec:
    package: str  # the PyPI name and the import name
    version: str
    disk_gb: float  # measured install size, plus headroom
    minutes: int  # measured install time on 2 cores


ENGINES = {
    "vllm": EngineSpec("vllm", facts.ENGINES["vllm"].release, 10.0, 10),
    "sglang": EngineSpec("sglang", facts.ENGINES["sglang"].release, 11.5, 10),
}
STAMP = ".specheads-installed"


class EngineSetupError(ValueError):
    """An engine's virtualenv is missing and cannot be created; says why and what to do."""


def spec(engine: str) -> EngineSpec:
    if engine not in ENGINES:
        raise ValueError(f"engine '{engine}': expected one of {', '.join(ENGINES)}")
    return ENGINES[engine]


def venv_dir(engine: str) -> Path:
    s = spec(engine)
    return cache_dir() / "engines" / f"{engine}-{s.version}"


def python_of(engine: str) -> Path:
    return venv_dir(engine) / "bin" / "python"


def installed_version(engine: str) -> str | None:
    """The version the venv's Python imports, or None (no venv, or the import fails)."""
    py = python_of(engine)
    if not py.exists():
        return None
    try:
        done = subprocess.run([str(py), "-c", f"import {spec(engine).package} as m; print(m.__version__)"],
                              capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[-1].strip() if done.returncode == 0 and lines else None


def is_ready(engine: str) -> bool:
    """True when the stamp says the pinned version was installed here (no subprocess)."""
    stamp = venv_dir(engine) / STAMP
    return python_of(engine).exists() and stamp.is_file() and stamp.read_text().strip() == spec(engine).version


def ensure(engine: str, progress=print) -> Path:
    """The engine venv's Python, creating the venv first when needed."""
    s, folder = spec(engine), venv_dir(engine)
    if is_ready(engine):
        return python_of(engine)
    if installed_version(engine) == s.version:  # installed before stamps existed, or by hand
        _stamp(folder, s.version)
        return python_of(engine)
    _check_disk(engine, folder)
    progress(f"creating the {engine} {s.version} environment at {folder} (once): pip install "
             f"{s.package}=={s.version}, about {s.disk_gb:.0f} GB of disk and {s.minutes} minutes")
    log = folder.parent / f"{engine}-{s.version}.install.log"
    _run([sys.executable, "-m", "venv", "--clear", str(folder)], log, engine)
    _run([str(python_of(engine)), "-m", "pip", "install", "--upgrade", "pip"], log, engine)
    _run([str(python_of(engine)), "-m", "pip", "install", f"{s.package}=={s.version}"], log, engine)
    found = installed_version(engine)
    if found != s.version:
        raise EngineSetupError(f"{folder}: after installing {s.package}=={s.version}, `import {s.package}` "
                               f"gives version {found!r}; see {log}, remove the folder and try again")
    _stamp(folder, s.version)
    progress(f"{engine} {s.version} installed at {folder}")
    return python_of(engine)


def _check_disk(engine: str, folder: Path) -> None:
    s = spec(engine)
    parent = folder.parent
    parent.mkdir(parents=True, exist_ok=True)
    free_gb = shutil.disk_usage(parent).free / 1e9
    if free_gb < s.disk_gb:
        raise EngineSetupError(
            f"the {engine} {s.version} environment needs about {s.disk_gb:.0f} GB at {parent}, but only "
            f"{free_gb:.1f} GB are free: free some space, or point SPECHEADS_CACHE at a larger disk")


def _run(cmd: list[str], log: Path, engine: str) -> None:
    run_logged(cmd, log, f"creating the {engine} environment failed", EngineSetupError)


def run_logged(cmd: list[str], log: Path, failure: str, error: type[Exception]) -> None:
    """Run `cmd` with its output appended to `log`; on a non-zero exit raise `error` saying `failure`,
    the command, the log and the log's end."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as fh:
        fh.write(f"$ {' '.join(cmd)}\n")
        fh.flush()
        done = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-2000:]
        raise error(f"{failure} (exit {done.returncode}) at `{' '.join(cmd)}`; full log {log}; its end:\n{tail}")


def _stamp(folder: Path, version: str) -> None:
    write_text(folder / STAMP, version + "\n")


def main(argv: list[str] | None = None) -> int:
    """`python -m specheads.engines.venvs [ENGINE ...]`: create the engines' venvs now (CI starts this
    beside the test suite, so `make engine-check` later finds them ready)."""
    engines = (sys.argv[1:] if argv is None else argv) or list(ENGINES)
    for engine in engines:
        try:
            print(ensure(engine), flush=True)
        except (EngineSetupError, ValueError) as err:
            print(f"specheads: {err}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
