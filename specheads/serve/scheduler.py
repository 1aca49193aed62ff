"""The decode thread of `specheads serve`: concurrent requests decode together (continuous batching).

One thread drives a `verify.loop.Batch`. Admitted requests wait in a FIFO and join the batch at
step boundaries, up to `max_batch` rows; at most `max_queue` wait beyond those, and past that a
request gets 503 with Retry-After. A row leaves the batch when it finishes; when its client went
away (`cancel` set: dropped at the next boundary, its cache rows released); or when its own
proposer or text stream failed (engine.Guarded): that request gets the error and the other rows
decode on. A failure of the shared target forward fails the rows decoding then, and the thread goes
on with the queue. Each row equals its request decoded alone (greedy: token for token), so batching
changes no answer; `max_batch` 1 decodes one request at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specheads.serve.engine import Cancelled, Completion, Engine, Live, Params, RequestError
from specheads.serve.metrics import Metrics
from specheads.verify.loop import Batch
from specheads.verify.steps import DecodeResult


class Overloaded(RequestError):
    """The queue is full: 503 with a Retry-After estimate (seconds)."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message, None, 503)
        self.retry_after = retry_after


@dataclass(eq=False)
class Job:
    """An admitted request and where its answer goes (a future on the server's event loop)."""

    index: int  # its row's index in the batch
    ids: list[int]
    params: Params
    emit: Callable[[str], None] | None  # text deltas (streaming), called on the decode thread
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    cancel: threading.Event = field(default_factory=threading.Event)
    live: Live | None = None  # set when it joins the batch
    joined: float = 0.0


class Scheduler:
    """Admission on the event loop's thread (`admit`, `submit`); the batch on the decode thread.

    `admitted` (decoding + waiting) is only touched on the event loop's thread; `waiting`, `rows`
    and `batch` only on the decode thread.
    """

    def __init__(self, engine: Engine, metrics: Metrics, max_queue: int, max_batch: int):
        self.engine, self.metrics = engine, metrics
        self.max_queue, self.max_batch = max_queue, max_batch
        self.admitted = 0
        self.mean_s = 1.0  # running mean of a request's decode time, for Retry-After
        self.inbox: queue.SimpleQueue[Job | None] = queue.SimpleQueue()  # None: stop
        self.waiting: deque[Job] = deque()
        self.rows: dict[int, Job] = {}  # the batch's rows by index
        self.batch = Batch(engine.target)
        self.indices = itertools.count()
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="specheads-decode", daemon=True)
        self.thread.start()

    # --- the event loop's side ---------------------------------------------------------------

    def admit(self) -> None:
        """Take a place (a row or the queue) or raise Overloaded."""
        if self.admitted >= self.max_batch + self.max_queue:
            wait = max(1, math.ceil(self.mean_s * self.admitted / self.max_batch))
            raise Overloaded(f"the server is busy: {self.admitted - self.max_batch} requests are waiting "
                             f"behind the {self.max_batch} decoding (--max-queue {self.max_queue}, "
                             f"--max-batch {self.max_batch}); retry in about {wait} s", wait)
        self.admitted += 1
        self.metrics.waiting.inc()

    def submit(self, ids: list[int], params: Params, emit=None) -> tuple[asyncio.Future, threading.Event]:
        """Queue an admitted request -> (future of its Completion, its cancel event)."""
        loop = asyncio.get_running_loop()
        job = Job(next(self.indices), ids, params, emit, loop.create_future(), loop)
        job.future.add_done_callback(self._release)
        self.inbox.put(job)
        return job.future, job.cancel

    def _release(self, future: asyncio.Future) -> None:
        self.admitted -= 1
        if not future.cancelled():
            future.exception()  # retrieved here: a failure is reported by the request's handler

    def close(self) -> None:
        """Stop the decode thread after its current step (waiting requests are not answered)."""
        self.closed = True
        self.inbox.put(None)
        self.thread.join(30)

    # --- the decode thread -------------------------------------------------------------------

    def _run(self) -> None:
        with torch.no_grad():
            while not self.closed:
                self._take(block=not (self.waiting or self.batch.rows))
                if self.closed:
                    return
                try:
                    self._turn()
                except Exception as err:  # noqa: BLE001 - a bug of ours: those rows fail, serving goes on
                    self._fail_all(err)

    def _take(self, block: bool) -> None:
        """Move arrived requests to the waiting FIFO (first waiting for one when idle)."""
        try:
            job = self.inbox.get() if block else self.inbox.get_nowait()
            while job is not None:
                self.waiting.append(job)
                job = self.inbox.get_nowait()
            self.closed = True
        except queue.Empty:
            pass

    def _turn(self) -> None:
        """One step boundary: drop rows that must leave, then admit waiting requests or step."""
        self._drop_gone()
        room = self.max_batch - len(self.batch.rows)
        if room > 0 and self.waiting:
            self._join(room)
        elif self.batch.rows:
            try:
                done = self.batch.step()
            except Exception as err:  # noqa: BLE001 - the shared forward: every row fails, not the server
                self._fail_all(err)
                return
            self._settle(done)

    def _drop_gone(self) -> None:
        """Requests whose client went away, and rows whose proposer or stream failed, leave now."""
        for job in [j for j in self.waiting if j.cancel.is_set()]:
            self.waiting.remove(job)
            self.metrics.waiting.dec()
            self._fail(job, Cancelled("the client disconnected before its turn"))
        gone = [i for i, job in self.rows.items() if job.cancel.is_set() or job.live.error is not None]
        if gone:
            self.batch.drop(gone)
            self.metrics.running.set(len(self.batch.rows))
            for i in gone:
                job = self.rows.pop(i)
                self._fail(job, job.live.error or Cancelled("the client disconnected"))

    def _join(self, room: int) -> None:
        """Up to `room` waiting requests join the batch (their prompts prefilled together)."""
        items = []
        for _ in range(min(room, len(self.waiting))):
            job = self.waiting.popleft()
            self.metrics.waiting.dec()
            try:
                job.live, job.joined = self.engine.start(job.ids, job.params, job.emit), time.perf_counter()
            except Exception as err:  # noqa: BLE001 - this request only
                self._fail(job, err)
                continue
            self.rows[job.index] = job
            items.append((job.index, job.live.request))
        try:
            done = self.batch.admit(items)
        except Exception as err:  # noqa: BLE001 - their prefill: the rows already decoding are untouched
            for index, _ in items:
                self._fail(self.rows.pop(index), err)
            return
        self._settle(done)

    def _settle(self, done: list[tuple[int, DecodeResult]]) -> None:
        """Answer the requests whose rows finished (counted before the answer goes out)."""
        self.metrics.running.set(len(self.batch.rows))
        for index, result in done:
            job = self.rows.pop(index)
            try:
                completion = self.engine.finish(job.live, result)
            except Exception as err:  # noqa: BLE001 - its text stream failed: this request only
                self._fail(job, err)
                continue
            self.metrics.record(completion.stats, completion.prompt_tokens, len(completion.tokens),
                                completion.finish_reason)
            self._answer(job, completion)

    def _fail_all(self, err: Exception) -> None:
        """Every row fails with `err`; the batch starts empty (its proposers closed)."""
        jobs = list(self.rows.values())
        self.rows.clear()
        with contextlib.suppress(Exception):  # a broken batch: its proposers may stay open
            self.batch.drop([job.index for job in jobs])
        self.batch = Batch(self.engine.target)
        self.metrics.running.set(0)
        for job in jobs:
            self._fail(job, err)

    def _fail(self, job: Job, err: BaseException) -> None:
        self.metrics.record_abort()
        self._answer(job, error=err)

    def _answer(self, job: Job, completion: Completion | None = None, error: BaseException | None = None) -> None:
        """Resolve the job's future on its event loop (nobody waits once the loop is closed)."""
        if job.joined:
            self.mean_s = 0.8 * self.mean_s + 0.2 * (time.perf_counter() - job.joined)

        def resolve():
            if not job.future.done():
                job.future.set_exception(error) if error is not None else job.future.set_result(completion)

        try:
            job.loop.call_soon_threadsafe(resolve)
        except RuntimeError:
            pass
