"""Where `specheads serve` tokenises requests: off the event loop and off the decode thread, on lanes
of threads that each hold tokenizer copies of their own (a fast tokenizer must not serve two threads
at once). Small requests go to one lane, large ones (more than SMALL_PROMPT_CHARS bytes of body) to
another, so a large request, tokenised until it proves too long for the context, never holds up a
small one; after each large request the heap it freed goes back to the system. At most
MAX_LARGE_PENDING large requests hold a place (their bodies in memory); more get 503 with Retry-After.
"""

from __future__ import annotations

import ctypes
import queue
from concurrent.futures import ThreadPoolExecutor

from specheads.serve.engine import Engine
from specheads.serve.scheduler import Overloaded

SMALL_PROMPT_CHARS = 1 << 16  # requests with a larger body tokenise on the large lane
MAX_LARGE_PENDING = 4  # large requests tokenising or waiting to; more get 503


def release_memory() -> None:
    """Give the heap a large request freed back to the system (glibc keeps it otherwise)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator decides
        pass


class Lane:
    """Threads tokenising requests, each job with one of the lane's own tokenizer copies; a lane for
    large requests gives the memory they freed back after each."""

    def __init__(self, engine: Engine, workers: int, name: str, max_pending: int | None = None):
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"specheads-prepare-{name}")
        self.tokenizers: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(workers):
            self.tokenizers.put(engine.tokenizer.copy())
        self.large = name == "large"
        self.pending, self.max_pending = 0, max_pending  # requests in this lane (event loop only)

    def enter(self) -> None:
        """Take a place in the lane, or 503 when `max_pending` requests already hold one (their bodies
        are in memory: a flood of large bodies cannot pile up)."""
        if self.max_pending is not None and self.pending >= self.max_pending:
            raise Overloaded(f"{self.pending} large requests (bodies over {SMALL_PROMPT_CHARS} bytes) are already "
                             "being tokenised: retry later", retry_after=5)
        self.pending += 1

    def done(self, loop) -> None:
        """After a request of this lane was prepared and its body dropped."""
        self.pending -= 1
        if self.large:
            loop.run_in_executor(self.pool, release_memory)

    def run(self, prepare, body: dict, chat: bool):
        tokenizer = self.tokenizers.get()
        try:
            return prepare(body, chat, tokenizer)
        finally:
            self.tokenizers.put(tokenizer)


def make_lanes(engine: Engine) -> dict[str, Lane]:
    """Two threads for small requests, one for large ones."""
    return {"small": Lane(engine, 2, "small"), "large": Lane(engine, 1, "large", MAX_LARGE_PENDING)}


def lane_for(lanes: dict[str, Lane], body_bytes: int) -> Lane:
    return lanes["large" if body_bytes > SMALL_PROMPT_CHARS else "small"]
