"""Timing that a shared machine cannot turn into advice: configurations interleaved, repeated, their
spread kept, a noisy measurement timed again and marked when it stays noisy.

One configuration timed as a block (every repetition of plain, then every repetition of the
drafter) hands a burst of load to whichever block it falls in: on a 2-core machine shared with
other jobs, plain at batch 8 once measured 444 tok/s against 965 in the next run, and that burst
became the advice. Here every key is timed once per repetition, in an order that turns by one
each repetition, so a burst slows several keys a little rather than one key's whole block; each
key keeps its median and quartiles (`Timing`), and while a key's interquartile range is above
`NOISY` of its median another round of repetitions is added (up to `MAX_ROUNDS`). What stays
noisy after that is reported (`Timing.noisy`), so a prediction priced from it can say it is
uncertain instead of flipping a recommendation.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

from specheads.verify.steps import Clock

# a timing whose interquartile range is above this share of its median is noisy
NOISY = 0.15
# rounds of repetitions at most (the first included) before a noisy timing is kept and marked
MAX_ROUNDS = 3


@dataclass(frozen=True)
class Timing:
    """Seconds of one timed configuration over its repetitions: median and quartiles."""

    median: float
    q1: float
    q3: float
    samples: int

    @classmethod
    def of(cls, seconds: list[float]) -> Timing:
        if not seconds:
            raise ValueError("Timing.of needs at least one measurement")
        if len(seconds) == 1:
            return cls(seconds[0], seconds[0], seconds[0], 1)
        q1, median, q3 = statistics.quantiles(seconds, n=4, method="inclusive")
        return cls(median, q1, q3, len(seconds))

    @property
    def spread(self) -> float:
        """Interquartile range over the median (0: every repetition alike)."""
        return (self.q3 - self.q1) / self.median if self.median > 0 else 0.0

    @property
    def noisy(self) -> bool:
        return self.spread > NOISY

    def to_dict(self) -> dict:
        return {"median_s": self.median, "q1_s": self.q1, "q3_s": self.q3, "samples": self.samples,
                "spread": self.spread}


def device_timer(device) -> Callable[[Callable[[], object]], float]:
    """timer(call) -> the seconds of one call, the device synchronised around it (`Clock`)."""

    def time_call(call) -> float:
        clock = Clock(device)
        with clock:
            call()
        return clock.seconds

    return time_call


def turned(keys: list, by: int) -> list:
    """keys rotated left by `by` (the order of one repetition)."""
    by %= max(len(keys), 1)
    return keys[by:] + keys[:by]


def round_robin(calls: dict, reps: int, device=None, timer=None, noisy: float = NOISY,
                max_rounds: int = MAX_ROUNDS) -> dict:
    """Timing per key of `calls` (key -> a repeatable call): one untimed call each first (warm-up),
    then rounds of `reps` repetitions, every key timed once per repetition in an order turning by one
    each repetition; another round while any key's spread is above `noisy`, `max_rounds` rounds at
    most. `timer(call) -> seconds` (default: `device_timer(device)`; tests pass a fake clock)."""
    if reps < 1 or max_rounds < 1:
        raise ValueError(f"round_robin needs reps >= 1 and max_rounds >= 1, got {reps} and {max_rounds}")
    timer = timer or device_timer(device)
    keys = list(calls)
    for key in keys:
        calls[key]()
    seconds: dict = {key: [] for key in keys}
    timings: dict = {}
    for done in range(max_rounds):
        for rep in range(reps):
            for key in turned(keys, done * reps + rep):
                seconds[key].append(timer(calls[key]))
        timings = {key: Timing.of(s) for key, s in seconds.items()}
        if all(t.spread <= noisy for t in timings.values()):
            break
    return timings


def medians(timings: dict) -> dict:
    return {key: t.median for key, t in timings.items()}


def median_round_robin(calls: dict, reps: int, device=None, timer=None) -> dict:
    """Median seconds per key of `round_robin`."""
    return medians(round_robin(calls, reps, device, timer))


def largest_spread(*groups: dict) -> float:
    """The largest `Timing.spread` among dicts of timings (0.0 when there are none)."""
    return max((t.spread for g in groups for t in g.values()), default=0.0)
