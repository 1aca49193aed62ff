"""Progress of a long step on stderr: a bar on a terminal, one line every `every_s` seconds when
stderr is a file or a pipe (logs), nothing with --quiet (or SPECHEADS_QUIET=1)."""

from __future__ import annotations

import os
import sys
import time

QUIET_ENV = "SPECHEADS_QUIET"


def _clock(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class Progress:
    """`update(n)` as work finishes; `close()` (or `with`) at the end."""

    def __init__(self, total: int, desc: str, unit: str = "it", quiet: bool = False,
                 every_s: float = 30.0, stream=None):
        self.total, self.desc, self.unit, self.every_s = max(int(total), 0), desc, unit, every_s
        self.stream = stream or sys.stderr
        self.quiet = quiet or os.environ.get(QUIET_ENV, "").strip().lower() in ("1", "true", "yes")
        self.done, self.t0 = 0, time.monotonic()
        self.last, self.shown = self.t0, -1
        self.bar = None
        if self.quiet:
            return
        if getattr(self.stream, "isatty", lambda: False)():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total, desc=desc, unit=unit, file=self.stream, dynamic_ncols=True)
        else:
            self._line()

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.monotonic()
        if not self.quiet and (now - self.last >= self.every_s or self.done >= self.total):
            self._line(now)

    def _line(self, now: float | None = None) -> None:
        now = now or time.monotonic()
        self.last, self.shown = now, self.done
        elapsed = now - self.t0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        pct = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        eta = f", ETA {_clock((self.total - self.done) / rate)}" if rate > 0 and self.done < self.total else ""
        print(f"[specheads] {self.desc}: {self.done}/{self.total} {self.unit}{pct}, {rate:.2f} {self.unit}/s, "
              f"elapsed {_clock(elapsed)}{eta}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif not self.quiet and self.shown != self.done:
            self._line()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
