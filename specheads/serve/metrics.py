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

    def record(self, stats: DecodeStats, prompt_tokens: int, completion_tokens: int,
               finish_reason: str) -> None:
        """Add one finished request."""
        with self.lock:
            c = self.counters
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
