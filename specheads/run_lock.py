"""One writer per training run folder: the run's process holds an exclusive lock on a file in
train.output_dir for as long as it trains; a second `train` into that folder is refused at once,
naming the process that holds it.

The lock is `fcntl.flock` on `.specheads_train.lock`, so the kernel drops it when the holder exits
however it exits (a crash or SIGKILL leaves no stuck lock: the file may stay, with the dead
process's details, and the next run simply takes it). The file records who holds it (pid, host,
process start time, command) for the refusal message. The lock is removed when the run ends; a
folder the lock created and nothing else filled is removed too (a run refused while loading leaves
nothing behind).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from specheads.atomic import OutputRefused, process_start

LOCK_FILE = ".specheads_train.lock"


class RunBusy(OutputRefused):
    """train.output_dir is being written by another live training process."""


@dataclass
class RunLock:
    """A held lock: the open file whose flock is the lock, and whether acquiring it made the folder."""

    path: Path
    fd: int
    made_folder: bool


def _when(seconds: float | None) -> str:
    return "at an unknown time" if seconds is None else time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(seconds))


def holder(path: Path) -> str:
    """'pid 123 on host h, started ..., running `cmd`' from a lock file (what a refusal names)."""
    try:
        info = json.loads(path.read_text())
        return (f"pid {info['pid']} on host {info['host']}, started {_when(info.get('started'))}, "
                f"running `{info.get('command', '?')}`")
    except (OSError, ValueError, KeyError, TypeError):
        return "a process whose details are not written yet (it is just starting)"


def busy_message(folder: Path, path: Path) -> str:
    return (f"train.output_dir {folder} is in use by another training run: {holder(path)}. Two runs in one "
            "folder would overwrite each other's checkpoints and interleave metrics.jsonl. Nothing was "
            "changed: wait for that run to end (or stop it), or set train.output_dir to another folder")


def _same_file(fd: int, path: Path) -> bool:
    """The locked descriptor is still the file at `path` (a releasing holder may have removed it)."""
    try:
        st, now = os.fstat(fd), path.stat()
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)


def acquire(folder: str | Path) -> RunLock | None:
    """Take the run lock of `folder` (created if absent), or raise RunBusy naming its holder.
    None where the file system has no locks (some network mounts): the run goes on unguarded."""
    import fcntl

    folder = Path(folder)
    made = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunBusy(busy_message(folder, path)) from None
        except OSError as err:
            os.close(fd)
            print(f"[specheads] {path}: cannot lock ({err.strerror}); nothing stops a second run "
                  "from writing into this folder at the same time", file=sys.stderr)
            return None
        if _same_file(fd, path):
            break
        os.close(fd)  # locked a file its holder removed while releasing: take the current one
    info = {"pid": os.getpid(), "host": socket.gethostname(), "started": process_start(os.getpid()) or time.time(),
            "command": " ".join(sys.argv)}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    return RunLock(path, fd, made)


def release(lock: RunLock | None) -> None:
    """Remove the lock file and drop the lock; remove the folder when acquire made it and it stayed empty."""
    if lock is None:
        return
    lock.path.unlink(missing_ok=True)  # while still held: no one can take the old file in between
    os.close(lock.fd)
    if lock.made_folder:
        try:
            lock.path.parent.rmdir()  # only when empty
        except OSError:
            pass
