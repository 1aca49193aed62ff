"""Prometheus text exposition of the server's counters, with vLLM's metric names.

Speculation counters follow vLLM's `SpecDecodingProm` (counters exposed with a `_total` suffix,
labels `model_name` and `engine`): drafts (steps that proposed >= 1 token), draft tokens,
accepted draft tokens (bonus excluded) and accepted tokens per position (cumulative: drafts whose
accepted prefix reached position p). So `vllm bench serve`-style scrapers compute
acceptance length = 1 + d(accepted) / d(drafts) from two scrapes.
"""

from __future__ import annotations

import threading

from specheads.verify.decode import DecodeStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_COUNTERS = (
    ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
    ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
    ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
    ("vllm:prompt_tokens", "Number of prefill tokens processed."),
    ("vllm:generation_tokens", "Number of generation tokens processed."),
)


class Metrics:
    """Counters summed over finished requests (thread-safe)."""

    def __init__(self, model_name: str):
        self.labels = f'model_name="{_escape(model_name)}",engine="0"'
        self.lock = threading.Lock()
        self.values = {name: 0 for name, _ in _COUNTERS}
        self.per_pos: list[int] = []
        self.finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        self.running = 0

    def record(self, stats: DecodeStats, prompt_tokens: int, completion_tokens: int,
               finish_reason: str) -> None:
        """Add one finished request."""
        with self.lock:
            v = self.values
            v["vllm:spec_decode_num_drafts"] += stats.drafts
            v["vllm:spec_decode_num_draft_tokens"] += stats.proposed_tokens
            v["vllm:spec_decode_num_accepted_tokens"] += sum(stats.accepted_per_pos)
            v["vllm:prompt_tokens"] += prompt_tokens
            v["vllm:generation_tokens"] += completion_tokens
            n = max(len(self.per_pos), len(stats.accepted_per_pos))
            self.per_pos = [a + b for a, b in zip(self.per_pos + [0] * (n - len(self.per_pos)),
                                                  stats.accepted_per_pos + [0] * (n - len(stats.accepted_per_pos)))]
            self.finished[finish_reason] = self.finished.get(finish_reason, 0) + 1

    def record_abort(self) -> None:
        with self.lock:
            self.finished["abort"] += 1

    def change_running(self, delta: int) -> None:
        with self.lock:
            self.running += delta

    def render(self) -> str:
        """The exposition text (one HELP/TYPE block per metric family)."""
        with self.lock:
            lines = []
            for name, help_ in _COUNTERS:
                lines += [f"# HELP {name}_total {help_}", f"# TYPE {name}_total counter",
                          f"{name}_total{{{self.labels}}} {self.values[name]}"]
            name = "vllm:spec_decode_num_accepted_tokens_per_pos"
            lines += [f"# HELP {name}_total Accepted tokens per draft position.",
                      f"# TYPE {name}_total counter"]
            lines += [f'{name}_total{{{self.labels},position="{p}"}} {c}'
                      for p, c in enumerate(self.per_pos)]
            name = "vllm:request_success"
            lines += [f"# HELP {name}_total Count of successfully processed requests.",
                      f"# TYPE {name}_total counter"]
            lines += [f'{name}_total{{{self.labels},finished_reason="{r}"}} {c}'
                      for r, c in sorted(self.finished.items())]
            lines += ["# HELP vllm:num_requests_running Requests being served.",
                      "# TYPE vllm:num_requests_running gauge",
                      f"vllm:num_requests_running{{{self.labels}}} {self.running}"]
        return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def parse_metrics(text: str) -> dict[str, float]:
    """Exposition text -> {'name{labels}': value} (for tests and load generators)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
