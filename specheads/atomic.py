"""Atomic writes: build in a temporary sibling, then rename, so nothing is ever half-written.

Every writer here also
- honours the umask: files 0666 & ~umask, folders 0777 & ~umask (tempfile and safetensors create
  0600 / 0700, which a rename would otherwise carry over: an engine running as another user could
  not read an export);
- names its temporaries `.NAME.tmp-PID-XXXXXXXX`, so the next write of NAME recognises what a killed
  writer left (its process is gone) and removes it, and never anything else;
- replaces an existing folder only when `owned(folder)` says it is one we wrote for the same
  purpose; anything else is refused, naming what would be lost.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

TMP_INFIX = ".tmp-"


class OutputRefused(ValueError):
    """An output path that holds something we did not write for this purpose; nothing was changed."""


# --- modes ------------------------------------------------------------------------------------
def current_umask() -> int:
    """The process umask (read from /proc where possible: setting it to read it is not thread-safe)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(path: str | Path) -> None:
    """Give `path` (and everything under it) the modes a plain open()/mkdir() would have given.

    Symlinks and hard-linked files (st_nlink > 1, e.g. a target's shards linked into an MTP
    export) keep their mode: changing it would change the user's original file."""
    mask = current_umask()
    path = Path(path)
    entries = [path] if not path.is_dir() else [path, *path.rglob("*")]
    for p in entries:
        st = p.lstat()
        if p.is_symlink() or (not p.is_dir() and st.st_nlink > 1):
            continue
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


# --- temporaries of our own writers -----------------------------------------------------------
def tmp_prefix(name: str) -> str:
    """Prefix of a temporary for NAME: `.NAME.tmp-PID-` (mkstemp/mkdtemp add 8 random characters)."""
    return f".{name}{TMP_INFIX}{os.getpid()}-"


def _stale_pattern(name_regex: str) -> re.Pattern:
    # ours: .NAME.tmp-PID-XXXXXXXX (this version), .NAME.tmp-XXXXXXXX (older atomic_dir),
    # .NAME.old-PID (a replaced folder whose removal was cut short)
    return re.compile(rf"^\.(?P<name>{name_regex})(?:\.tmp-(?:(?P<pid>\d+)-)?[A-Za-z0-9_]{{8}}|\.old-(?P<old>\d+))$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def process_start(pid: int) -> float | None:
    """When process `pid` started (seconds since the epoch, ~10 ms), from /proc; None where unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime in clock ticks
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def writer_alive(pid: int, temporary: Path) -> bool:
    """The process that made `temporary` still runs: `pid` is alive and started before the temporary's
    last change (a pid reused by a later process, e.g. in a new container, does not count)."""
    if pid == os.getpid():
        return True
    if not _alive(pid):
        return False
    started = process_start(pid)
    try:
        changed = temporary.lstat().st_mtime
    except OSError:
        return False
    return started is None or started <= changed + 2.0  # 2 s: btime is whole seconds


def remove_stale(folder: str | Path, name_regex: str, any_pid: bool = False) -> list[Path]:
    """Remove temporaries our writers left in `folder` for names matching `name_regex`, when the
    process that made them is gone (`any_pid`: the caller is the only possible writer of these
    names, so every one is stale). Returns what was removed."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    pattern, removed = _stale_pattern(name_regex), []
    for p in folder.iterdir():
        m = pattern.match(p.name)
        if not m:
            continue
        pid = m.group("pid") or m.group("old")
        if pid is not None and not any_pid and writer_alive(int(pid), p):
            continue  # a writer still at work
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)
        removed.append(p)
    return removed


# --- what an output path holds ----------------------------------------------------------------
def describe_contents(folder: Path, limit: int = 5) -> str:
    """'N files, X MiB, e.g. a, b/c' for a refusal message."""
    files = [p for p in folder.rglob("*") if p.is_file() or p.is_symlink()]
    size = sum(p.lstat().st_size for p in files)
    names = ", ".join(str(p.relative_to(folder)) for p in sorted(files)[:limit])
    more = f" and {len(files) - limit} more" if len(files) > limit else ""
    return f"{len(files)} file(s), {size / 2**20:.1f} MiB: {names}{more}"


def is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and not any(path.iterdir())


def check_output(dest: str | Path, owned: Callable[[Path], bool] | None, what: str,
                 hint: str = "choose another output path, or move or remove it yourself") -> None:
    """Refuse `dest` unless it is absent, an empty folder, or `owned(dest)` (ours, same purpose)."""
    dest = Path(dest)
    if not dest.exists() and not dest.is_symlink():
        return
    if is_empty_dir(dest) or (owned is not None and dest.is_dir() and owned(dest)):
        return
    if not dest.is_dir() or dest.is_symlink():
        raise OutputRefused(f"{dest} exists and is not a folder; it would be replaced by {what}: {hint}")
    raise OutputRefused(f"{dest} is not {what} written by specheads; writing there would replace its "
                        f"{describe_contents(dest)}. Nothing was changed: {hint}")


# --- writers ----------------------------------------------------------------------------------
@contextmanager
def atomic_dir(dest: str | Path, owned: Callable[[Path], bool] | None = None, what: str = "an output folder",
               hint: str = "choose another output path, or move or remove it yourself"):
    """Yield a temp folder next to `dest`; on success it replaces `dest`, on error it is removed.

    An existing `dest` is replaced only when empty or `owned(dest)` (checked before and after the
    build); otherwise OutputRefused. Temporaries a killed write of `dest` left are removed first."""
    dest = Path(dest)
    check_output(dest, owned, what, hint)
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(dest.parent, re.escape(dest.name))
    tmp = Path(tempfile.mkdtemp(prefix=tmp_prefix(dest.name), dir=dest.parent))
    try:
        yield tmp
        apply_umask(tmp)
        if dest.exists() or dest.is_symlink():
            check_output(dest, owned, what, hint)  # it may have changed while we built
            old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
            os.replace(dest, old)
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def atomic_file(path: str | Path):
    """Yield a temp path beside `path` (inside a private temp folder, so that a library writing via
    its own temporaries leaves nothing beside `path` if killed); on success it becomes `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(path.parent, re.escape(path.name))
    tmp_dir = Path(tempfile.mkdtemp(prefix=tmp_prefix(path.name), dir=path.parent))
    try:
        yield tmp_dir / path.name
        apply_umask(tmp_dir / path.name)
        os.replace(tmp_dir / path.name, path)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def write_bytes(path: str | Path, data: bytes) -> None:
    """Write a file atomically (temp file in the same folder + os.replace), mode per the umask."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(path.parent, re.escape(path.name))
    fd, tmp = tempfile.mkstemp(prefix=tmp_prefix(path.name), dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        apply_umask(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text(path: str | Path, text: str) -> None:
    """write_bytes of UTF-8 text."""
    write_bytes(path, text.encode("utf-8"))


def write_json(path: str | Path, obj) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def save_safetensors(tensors: dict, path: str | Path, metadata: dict | None = None) -> str:
    """safetensors.torch.save_file, atomically and per the umask; returns the file's sha256.

    save_file writes through its own `.tmpXXXXXX` temporary (0600) beside the file: it is made
    inside our temp folder, so a kill leaves only a temporary we recognise."""
    from safetensors.torch import save_file

    # lazy, measured: `import specheads.atomic` 0.07 s, specheads.integrity (torch) 1.9 s, and
    # `specheads bench` imports this module while it checks its options before any torch import
    from specheads.integrity import sha256_file

    with atomic_file(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
        digest = sha256_file(tmp)
    return digest
