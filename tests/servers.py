"""Real `specheads serve` processes on loopback for the server tests (no mocks)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading


def launch(args: list[str], stderr=subprocess.PIPE) -> subprocess.Popen:
    """`python -m specheads serve ... --port 0`, started (not yet listening); `stderr` may be an
    open file, for tests that read the server's log while it runs."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "specheads", "serve", *args, "--port", "0"],
                            stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)


def wait_listening(proc: subprocess.Popen, timeout: float = 180.0) -> str:
    """The base URL the server prints once it listens (the process is killed if it never does)."""
    found = {}

    def read():
        for line in proc.stdout:
            if "listening on " in line:
                found["url"] = line.split("listening on ")[1].strip()
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    if "url" not in found:
        proc.kill()
        log = proc.stderr.read()[-2000:] if proc.stderr else "(stderr went to a file)"
        raise RuntimeError(f"server did not start: {log}")
    return found["url"]


def start_server(args: list[str], timeout: float = 180.0) -> tuple[subprocess.Popen, str]:
    """Launch a server and wait until it listens -> (process, base URL)."""
    proc = launch(args)
    return proc, wait_listening(proc, timeout)
