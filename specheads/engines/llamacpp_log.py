"""What `llama-server` says in its log about each request it answered: prompt and generation time,
how many compute graphs it reused, and (at `-lv 4`) each speculative implementation's own counters.

The bench prices a row's steps from these (bench/llamacpp.py): a verification batch of a new size makes
llama.cpp build a new graph (`graphs reused` does not grow), and a mixed `--spec-type` runs its draftless
lookup first and its draft model only when the lookup found nothing, which only the per-implementation
`statistics` lines tell apart. The counters are cumulative over the server's life; `per_request` turns
them into each request's own.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

# llama-server prints its speculative implementations' statistics at the trace level
STATS_ARGS = ("-lv", "4")

_PROMPT = re.compile(r"\| task (-?\d+) \| prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
_EVAL = re.compile(r"\|\s+eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
_REUSED = re.compile(r"\|\s+graphs reused =\s*(\d+)")
_STATS = re.compile(r"statistics\s+(\S+): #calls\(b,g,a\) =\s*(\d+)\s+(\d+)\s+(\d+), #gen drafts =\s*(\d+), "
                    r"#acc drafts =\s*(\d+), #gen tokens =\s*(\d+), #acc tokens =\s*(\d+)"
                    r"(?:.*dur\(b,g,a\) =\s*([\d.]+),\s*([\d.]+),\s*([\d.]+) ms)?")
STAT_FIELDS = ("calls_begin", "calls_draft", "calls_accept", "gen_drafts", "acc_drafts", "gen_tokens", "acc_tokens",
               "draft_ms")


@dataclass
class RequestLog:
    """One answered request: its timings, the server's graph reuse count and per-implementation
    statistics as printed after it (both cumulative over the server's life)."""

    task: int
    prompt_ms: float
    prompt_n: int
    eval_ms: float | None = None
    eval_n: int | None = None
    graphs_reused: int | None = None
    stats: dict[str, dict] = field(default_factory=dict)


def parse(text: str) -> list[RequestLog]:
    """Every request of a llama-server log, in the order answered."""
    out: list[RequestLog] = []
    for line in text.splitlines():
        if m := _PROMPT.search(line):
            out.append(RequestLog(int(m.group(1)), float(m.group(2)), int(m.group(3))))
        elif not out:
            continue
        elif m := _EVAL.search(line):
            out[-1].eval_ms, out[-1].eval_n = float(m.group(1)), int(m.group(2))
        elif m := _REUSED.search(line):
            out[-1].graphs_reused = int(m.group(1))
        elif m := _STATS.search(line):
            counts = [int(x) for x in m.groups()[1:8]]
            draft_ms = float(m.group(10)) if m.group(10) is not None else None
            out[-1].stats[m.group(1)] = dict(zip(STAT_FIELDS, [*counts, draft_ms]))
    return out


def per_request(records: list[RequestLog]) -> list[dict]:
    """Each request's own counters: graphs reused and every statistic as the difference from the
    request before (the first request's counters are its own)."""
    out, prev = [], None
    for r in records:
        d = asdict(r)
        if prev is not None and r.graphs_reused is not None and prev.graphs_reused is not None:
            d["graphs_reused"] = r.graphs_reused - prev.graphs_reused
        for impl, s in r.stats.items():
            before = prev.stats.get(impl) if prev is not None else None
            d["stats"][impl] = {k: (round(v - before[k], 3) if before and v is not None and before.get(k) is not None
                                    else v) for k, v in s.items()}
        out.append(d)
        prev = r
    return out


def read(path: Path, last: int | None = None) -> list[dict]:
    """The per-request counters of a log file (`last`: only its last requests, e.g. the timed ones
    after the warm-ups); [] when the file is missing."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return []
    rows = per_request(parse(text))
    return rows[-last:] if last else rows
