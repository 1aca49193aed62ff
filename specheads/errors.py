"""What a user sees when a command fails: one line naming the culprit, never a traceback.

`explain` turns an exception into that line at the CLI boundary (`specheads.cli.main`); the
causes raise our ValueError subclasses with precise messages, and `read_user_text` reads a file a
user handed us (recipe, data, prompts, README) so a binary or non-UTF-8 file is named.
`--debug` (before the verb) or SPECHEADS_DEBUG=1 lets the traceback through instead.
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

DEBUG_ENV = "SPECHEADS_DEBUG"


class UserInputError(ValueError):
    """An input the user can fix (the message names the file, key or option and what to do)."""


class DiskFull(ValueError):
    """No space left where we write; the message says where, what survived and how to go on."""


# how a full disk (or quota) reads where no errno survives, e.g. safetensors' Rust io error
DISK_FULL_TEXT = ("no space left on device", "os error 28", "disk quota exceeded", "os error 122")


def debug_enabled(flag: bool = False) -> bool:
    return flag or os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes")


def read_user_text(path: str | Path, what: str, error: type[ValueError] = UserInputError) -> str:
    """A user's text file as UTF-8; missing, unreadable or binary files raise `error` naming the
    file as `what` (the caller's own error class, so its callers can catch it)."""
    path = Path(path)
    if not path.exists():
        raise error(f"{what} '{path}' does not exist")
    if path.is_dir():
        raise error(f"{what} '{path}' is a folder, expected a text file")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise error(f"{what} '{path}': cannot read it ({err.strerror})") from None
    if b"\x00" in data[:8192]:
        raise error(f"{what} '{path}' is a binary file, expected UTF-8 text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{what} '{path}' is not UTF-8 text (invalid byte at offset {err.start}); "
                    "convert it to UTF-8") from None


def is_network_error(err: BaseException) -> bool:
    """A connection that could not be made (no network, DNS, refused, timed out)."""
    names = {type(e).__name__ for e in _chain(err)}
    return bool(names & {"ConnectionError", "ConnectError", "ConnectTimeout", "ReadTimeout",
                         "Timeout", "NameResolutionError", "MaxRetryError", "OfflineModeIsEnabled",
                         "ConnectionRefusedError", "gaierror", "LocalEntryNotFoundError"})


PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
             "communicator was aborted")


def peer_failure(err: BaseException) -> tuple[str, BaseException] | None:
    """('lost' | 'timeout', the exception) when `err` says another process of a distributed run
    went away or went silent: torch.distributed's DistError, gloo's socket and timeout errors."""
    dist = getattr(sys.modules.get("torch.distributed"), "DistError", ())
    for e in _chain(err):
        text = str(e).lower()
        lost = any(p in text for p in PEER_LOST)
        if not (isinstance(e, dist) or (isinstance(e, RuntimeError) and (lost or "gloo" in text))):
            continue
        if lost:
            return "lost", e
        if "timed out" in text or "timeout" in text:
            return "timeout", e
    return None


def disk_full(err: BaseException) -> BaseException | None:
    """The exception in `err`'s chain that says a disk (or quota) is full: ENOSPC / EDQUOT, or the
    text of one (safetensors); None if none does."""
    for e in _chain(err):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return e
        if any(text in str(e).lower() for text in DISK_FULL_TEXT):
            return e
    return None


def free_space(path: str | Path) -> str:
    """'N.N GiB free there now' for the disk holding `path` (its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return f"{shutil.disk_usage(path).free / 2**30:.1f} GiB free there now"
    except OSError:
        return "free space unknown"


@contextmanager
def disk_guard(where: str | Path, after: str):
    """Turn a full disk inside the block into DiskFull: 'disk full at PATH (free now): `after`'
    (what survived and how to go on); PATH is the file the error names, else `where`."""
    try:
        yield
    except DiskFull:
        raise
    except Exception as err:
        found = disk_full(err)
        if found is None:
            raise
        at = getattr(found, "filename", None) or where
        raise DiskFull(f"disk full at {at} ({_reason(found)}; {free_space(at)}): {after}") from err


def _reason(err: BaseException) -> str:
    """An OSError's strerror (no '[Errno 28]'), else the message's first line."""
    return (err.strerror if isinstance(err, OSError) else None) or first_line(err)


def first_line(err: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message, shortened (library messages can run long)."""
    text = str(err).strip()
    return text.splitlines()[0][:limit] if text else type(err).__name__


def _chain(err: BaseException):
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def explain(err: BaseException) -> tuple[str, int]:
    """(one-line message, exit code) for an exception that reached the CLI boundary."""
    if isinstance(err, KeyboardInterrupt):  # a command may add what a rerun does (train: the checkpoint)
        notes = "; ".join(getattr(err, "__notes__", None) or [])
        return f"interrupted{f': {notes}' if notes else ''}", 130
    torch = sys.modules.get("torch")  # not imported: not a torch error (and no seconds spent importing it)
    oom = torch is not None and isinstance(err, torch.OutOfMemoryError)
    if oom or (isinstance(err, RuntimeError) and "out of memory" in str(err).lower()):
        return ("out of memory: lower the batch size (train.batch_size, --batch-size) or "
                f"max_length, or use a device with more memory ({first_line(err)})"), 1
    if isinstance(err, (ValueError, FileNotFoundError, NotImplementedError)) and str(err):
        return str(err), 1  # our error classes carry a message meant for the user
    full = disk_full(err)
    if full is not None:  # a write no disk_guard covers: what survived is the command's to say
        at = getattr(full, "filename", None)
        return (f"disk full{f' at {at}' if at else ''} ({_reason(full)}): free some space (or choose an output "
                "on another disk) and rerun the same command"), 1
    if is_network_error(err):
        return (f"cannot reach the server ({type(err).__name__}: {first_line(err)}); "
                "check the network, the endpoint and any proxy settings"), 1
    if isinstance(err, OSError):
        where = f"'{err.filename}': " if err.filename else ""
        return f"{where}{err.strerror or err}", 1
    return (f"unexpected {type(err).__name__}: {err}. This is a bug or an input we do not check "
            f"yet: rerun with --debug (or {DEBUG_ENV}=1) for the traceback and report it"), 1


def run_verb(verb: str, fn, argv: list[str], debug: bool = False) -> int:
    """`fn(argv)` with the CLI's error boundary: one line naming the culprit instead of a traceback
    (unless `debug` or SPECHEADS_DEBUG=1), a quiet exit when stdout's reader went away."""
    try:
        rc = fn(argv)
        sys.stdout.flush()  # a closed pipe shows up here at the latest
        return rc
    except BrokenPipeError:
        # the reader (`| head`) went away: stop quietly, and keep the interpreter's exit flush quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (Exception, KeyboardInterrupt) as err:
        if debug_enabled(debug):
            raise
        message, rc = explain(err)
        own_line = "\n" if isinstance(err, KeyboardInterrupt) else ""  # not glued onto a progress bar's line
        print(f"{own_line}specheads {verb}: error: {message}", file=sys.stderr)
        return rc
