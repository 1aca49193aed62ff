"""The server's Prometheus metrics (prometheus_client), with vLLM's metric names.

Speculation counters follow vLLM's `SpecDecodingProm` (counters exposed with a `_total` suffix,
labels `model_name` and `engine`): drafts (steps that proposed >= 1 token), draft tokens,
accepted draft tokens (bonus excluded) and accepted tokens per position (cumulative: drafts whose
accepted prefix reached position p). So `vllm bench serve`-style scrapers compute
acceptance length = 1 + d(accepted) / d(drafts) from two scrapes. Request counts and the
running / waiting gauges use vLLM's names too.
"""

from __future__ import annotations

import threading
import time

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from specheads.engine_facts import VLLM_SPEC_METRICS
from specheads.verify.steps import DecodeStats

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST

# no `*_created` series: vLLM's scrapers and ours read only the counters
prometheus_client.disable_created_metrics()

_COUNTERS = {
    "drafts": (VLLM_SPEC_METRICS["drafts"], "Number of spec decoding drafts."),
    "draft_tokens": (VLLM_SPEC_METRICS["draft_tokens"], "Number of draft tokens."),
    "accepted": (VLLM_SPEC_METRICS["accepted"], "Number of accepted tokens."),
    "prompt": ("vllm:prompt_tokens", "Number of prefill tokens processed."),
    "generation": ("vllm:generation_tokens", "Number of generation tokens processed."),
}
_REASONS = ("stop", "length", "abort")


class Metrics:
    """Counters summed over finished requests, in a registry of their own (one per server)."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model_name": model_name, "engine": "0"}
        names = list(labels)
        self.counters = {key: Counter(name, help_, names, registry=self.registry).labels(**labels)
                         for key, (name, help_) in _COUNTERS.items()}
        self.per_pos = Counter(VLLM_SPEC_METRICS["per_pos"],
                               "Accepted tokens per draft position.", names + ["position"],
                               registry=self.registry)
        self.finished = Counter("vllm:request_success", "Count of successfully processed requests.",
                                names + ["finished_reason"], registry=self.registry)
        for reason in _REASONS:
            self.finished.labels(**labels, finished_reason=reason)
        self.running = Gauge("vllm:num_requests_running", "Requests being decoded.", names,
                             registry=self.registry).labels(**labels)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for the decoder.",
                             names, registry=self.registry).labels(**labels)
        self.labels = labels
        self.lock = threading.Lock()  # one request's counts appear together in a scrape
        self.totals = dict.fromkeys(_COUNTERS, 0)  # the counters' values, for the periodic log line

    def record(self, stats: DecodeStats, prompt_tokens: int, completion_tokens: int,
               finish_reason: str) -> None:
        """Add one finished request."""
        with self.lock:
            c = self.counters
            for key, n in (("drafts", stats.drafts), ("draft_tokens", stats.proposed_tokens),
                           ("accepted", sum(stats.accepted_per_pos)), ("prompt", prompt_tokens),
                           ("generation", completion_tokens)):
                self.totals[key] += n
            c["drafts"].inc(stats.drafts)
            c["draft_tokens"].inc(stats.proposed_tokens)
            c["accepted"].inc(sum(stats.accepted_per_pos))
            c["prompt"].inc(prompt_tokens)
            c["generation"].inc(completion_tokens)
            for pos, n in enumerate(stats.accepted_per_pos):
                self.per_pos.labels(**self.labels, position=str(pos)).inc(n)
            self.finished.labels(**self.labels, finished_reason=finish_reason).inc()

    def record_abort(self) -> None:
        self.finished.labels(**self.labels, finished_reason="abort").inc()

    def snapshot(self) -> tuple[dict[str, int], int, int]:
        """(the counters' totals, requests running, requests waiting) at one moment."""
        with self.lock:
            return dict(self.totals), int(self.running._value.get()), int(self.waiting._value.get())

    def render(self) -> bytes:
        """The exposition text."""
        with self.lock:
            return generate_latest(self.registry)


def parse_metrics(text: str) -> dict[str, float]:
    """Exposition text -> {'name{labels}': value} (for tests and load generators)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def throughput_line(before: dict[str, int], now: dict[str, int], seconds: float, running: int, waiting: int) -> str:
    """vLLM's periodic log line, over the requests that finished in the last `seconds`."""
    d = {key: now[key] - before.get(key, 0) for key in now}
    line = (f"avg prompt throughput: {d['prompt'] / seconds:.1f} tokens/s, avg generation throughput: "
            f"{d['generation'] / seconds:.1f} tokens/s (requests finished in the last {seconds:.0f} s), "
            f"running: {running} reqs, waiting: {waiting} reqs")
    if d["drafts"]:
        line += (f"; speculation: mean acceptance length {1 + d['accepted'] / d['drafts']:.2f}, draft acceptance "
                 f"rate {100 * d['accepted'] / max(d['draft_tokens'], 1):.1f}% ({d['accepted']} of "
                 f"{d['draft_tokens']} draft tokens)")
    return line


class ThroughputLog:
    """A thread writing `throughput_line` every `interval` seconds to `out`, only after a span in which
    requests finished or were running / waiting (an idle server writes nothing)."""

    def __init__(self, metrics: Metrics, interval: float, out):
        self.metrics, self.interval, self.out = metrics, interval, out
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="specheads-throughput-log", daemon=True)
        if interval > 0:
            self.thread.start()

    def _run(self) -> None:
        before, *_ = self.metrics.snapshot()
        last = time.monotonic()
        while not self.stop.wait(self.interval):
            now, running, waiting = self.metrics.snapshot()
            t = time.monotonic()
            if now != before or running or waiting:
                self.out(throughput_line(before, now, t - last, running, waiting))
            before, last = now, t

    def close(self) -> None:
        self.stop.set()
