"""`specheads bench`: load-test OpenAI-compatible servers (vLLM, SGLang, `specheads serve`), with and
without speculation, at fixed concurrency levels, and check the speculative server is lossless.

Each level streams every prompt (chat or completions API, temperature 0 by default) through
`concurrency` worker threads and measures TTFT (first non-empty text delta), TPOT ((latency - TTFT)
/ (output tokens - 1)), request latency and output tokens/s. Acceptance comes from the difference of
two Prometheus scrapes of `/metrics` around the level: vLLM's `vllm:spec_decode_num_*` counters
(also what `specheads serve` exposes) or SGLang's `sglang:spec_verify_calls` /
`sglang:generation_tokens` counters and `sglang:spec_accept_*` gauges. The greedy-match check sends
a sample of prompts, non-streamed at temperature 0, to both servers and compares the texts: a
lossless speculative server answers exactly what the baseline does.

JSON written to OUT/bench.json (OUT/bench.md renders it):

    {"servers": {"speculative": URL, "baseline": URL | null}, "model": str, "api": "chat"|"completions",
     "prompts": {"file": str, "count": int}, "max_tokens": int, "temperature": float,
     "concurrency": [int, ...],
     "results": [                                   # one row per (label, concurrency)
       {"label": "speculative"|"baseline", "concurrency": int, "requests": int, "failed": int,
        "errors": [str, ...],                       # first few failure messages
        "duration_s": float, "output_tokens": int, "output_tokens_per_s": float,
        "requests_per_s": float,
        "ttft_ms": STATS, "tpot_ms": STATS, "latency_ms": STATS,   # STATS = {mean, p50, p90, p99}
        "acceptance": null | {"source": "vllm"|"sglang", "drafts": int|null, "draft_tokens": int|null,
                              "accepted_tokens": int|null, "acceptance_rate": float|null,
                              "acceptance_length": float|null,  # tokens per target step, bonus included
                              "per_position": [float, ...]}}],
     "speedup": {"<concurrency>": speculative / baseline output tokens/s},  # only levels where no
                                                    # request of either server failed
     "failed_requests": int,                        # over all rows; > 0 makes the command exit 1
     "greedy_match": null | {"sample": int, "matched": int, "rate": float,
                             "mismatches": [{"prompt": id, "first_difference": int,
                                             "speculative": str, "baseline": str}]}}
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from specheads.atomic import check_output, write_json, write_text
from specheads.cli_parsers import HelpFormatter
from specheads.engine_facts import VLLM_SPEC_METRICS
from specheads.progress import Progress

DEFAULT_CONCURRENCY = (1, 8, 32)
MAX_ERRORS = 10  # failure messages kept per row


class BenchError(ValueError):
    """A benchmark that cannot run (bad arguments, a server that does not answer)."""


@dataclass
class Outcome:
    """One streamed request: timings in seconds, output token count, the text or the error."""

    ok: bool
    latency: float = 0.0
    ttft: float | None = None
    tokens: int = 0
    text: str = ""
    error: str = ""


# --- HTTP ----------------------------------------------------------------------------------------


def _request(url: str, body: dict | None = None) -> urllib.request.Request:
    data = None if body is None else json.dumps(body).encode()
    return urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                  headers={"Content-Type": "application/json"})


def get_text(url: str, timeout: float = 30.0) -> str:
    with urllib.request.urlopen(_request(url), timeout=timeout) as resp:
        return resp.read().decode()


def post_json(url: str, body: dict, timeout: float) -> dict:
    with urllib.request.urlopen(_request(url, body), timeout=timeout) as resp:
        return json.loads(resp.read().decode())


def served_model(base: str) -> str:
    """The first model id GET /v1/models names."""
    try:
        return json.loads(get_text(f"{base}/v1/models"))["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError) as err:
        raise BenchError(f"{base}/v1/models did not name a model ({err}); is the server up? "
                         "(or pass --model)") from None


def request_body(prompt: str, api: str, model: str, max_tokens: int, temperature: float,
                 stream: bool) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if api == "chat":
        return {**body, "messages": [{"role": "user", "content": prompt}]}
    return {**body, "prompt": prompt}


def _delta_text(chunk: dict) -> str:
    choice = (chunk.get("choices") or [{}])[0]
    return (choice.get("delta") or {}).get("content") or choice.get("text") or ""


def describe_error(err: Exception) -> str:
    """A failed request in one line: the HTTP status and the server's own message when there is one."""
    if isinstance(err, urllib.error.HTTPError):
        try:
            detail = json.loads(err.read().decode("utf-8", "replace"))["error"]["message"]
        except (OSError, ValueError, KeyError, TypeError):
            detail = err.reason
        return f"HTTP {err.code}: {detail}"[:300]
    return f"{type(err).__name__}: {err}"[:300]


def stream_request(url: str, body: dict, timeout: float) -> Outcome:
    """POST with stream=true; read server-sent events, timing the first text delta."""
    start = time.perf_counter()
    ttft, parts, usage, chunks, done = None, [], None, 0, False
    try:
        with urllib.request.urlopen(_request(url, body), timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    done = True
                if not line.startswith("data:") or done:
                    continue
                chunk = json.loads(line[len("data:"):])
                if "error" in chunk:
                    return Outcome(False, latency=time.perf_counter() - start,
                                   error=f"error event in the stream: {chunk['error']}"[:300])
                text = _delta_text(chunk)
                if text:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    parts.append(text)
                    chunks += 1
                usage = chunk.get("usage") or usage
    except (OSError, ValueError) as err:  # HTTPError, resets, timeouts, broken JSON
        return Outcome(False, latency=time.perf_counter() - start, error=describe_error(err))
    if not done:
        return Outcome(False, latency=time.perf_counter() - start,
                       error="the stream ended without its [DONE] event (cut off)")
    tokens = int(usage["completion_tokens"]) if usage else chunks
    return Outcome(True, time.perf_counter() - start, ttft, tokens, "".join(parts))


# --- Prometheus ----------------------------------------------------------------------------------

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict, float]]:
    """Exposition text -> [(name without `_total`, labels, value)]."""
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if not m or line.startswith("#"):
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        name = m.group(1)[:-len("_total")] if m.group(1).endswith("_total") else m.group(1)
        out.append((name, dict(_LABEL.findall(m.group(2) or "")), value))
    return out


def metric_sum(samples, name: str, **labels) -> float | None:
    """Sum of a metric over all label sets matching `labels`; None when the server has none."""
    hits = [v for n, lab, v in samples if n == name and all(lab.get(k) == s for k, s in labels.items())]
    return sum(hits) if hits else None


def scrape(base: str) -> list | None:
    try:
        return parse_prometheus(get_text(f"{base}/metrics"))
    except (OSError, ValueError):
        return None


def _delta(before, after, name: str, **labels) -> float | None:
    a, b = metric_sum(after, name, **labels), metric_sum(before, name, **labels)
    return None if a is None else a - (b or 0.0)


def _ratio(num, den) -> float | None:
    return None if num is None or not den else num / den


def vllm_acceptance(before, after) -> dict | None:
    """docs/engines.md §2.8: rate = accepted / draft tokens, length = 1 + accepted / drafts."""
    m = VLLM_SPEC_METRICS
    drafts, tokens, accepted = (_delta(before, after, m[s]) for s in ("drafts", "draft_tokens", "accepted"))
    if drafts is None:
        return None
    positions = sorted({int(lab["position"]) for n, lab, _ in after
                        if n == m["per_pos"] and lab.get("position", "").isdigit()})
    per_pos = [_ratio(_delta(before, after, m["per_pos"], position=str(i)), drafts)
               for i in positions]
    length = None if not drafts or accepted is None else 1 + accepted / drafts
    return {"source": "vllm", "drafts": int(drafts), "draft_tokens": None if tokens is None else int(tokens),
            "accepted_tokens": None if accepted is None else int(accepted),
            "acceptance_rate": _ratio(accepted, tokens), "acceptance_length": length, "per_position": per_pos}


def sglang_acceptance(before, after) -> dict | None:
    """docs/engines.md §3.5: length = generated tokens / verify calls; the gauges as reported."""
    verify = _delta(before, after, "sglang:spec_verify_calls")
    gauge = metric_sum(after, "sglang:spec_accept_length")
    if verify is None and gauge is None:
        return None
    generated = _delta(before, after, "sglang:generation_tokens")
    return {"source": "sglang", "drafts": None if verify is None else int(verify), "draft_tokens": None,
            "accepted_tokens": None, "acceptance_rate": metric_sum(after, "sglang:spec_accept_rate"),
            "acceptance_length": _ratio(generated, verify) or gauge, "per_position": []}


def acceptance(before, after) -> dict | None:
    if before is None or after is None:
        return None
    return vllm_acceptance(before, after) or sglang_acceptance(before, after)


# --- one concurrency level -----------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated q-th percentile (q in [0, 100]) of a non-empty list."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stats_ms(values: list[float]) -> dict | None:
    """mean / p50 / p90 / p99 in milliseconds; None when nothing was measured."""
    if not values:
        return None
    ms = [v * 1000 for v in values]
    return {"mean": sum(ms) / len(ms), **{f"p{q}": percentile(ms, q) for q in (50, 90, 99)}}


def level_row(label: str, concurrency: int, outcomes: list[Outcome], duration: float, accept) -> dict:
    """Aggregate one level's outcomes into a `results` row (see the module docstring)."""
    ok = [o for o in outcomes if o.ok]
    tokens = sum(o.tokens for o in ok)
    tpot = [(o.latency - o.ttft) / (o.tokens - 1) for o in ok if o.ttft is not None and o.tokens > 1]
    return {
        "label": label, "concurrency": concurrency, "requests": len(outcomes),
        "failed": len(outcomes) - len(ok), "errors": [o.error for o in outcomes if not o.ok][:MAX_ERRORS],
        "duration_s": duration, "output_tokens": tokens,
        "output_tokens_per_s": tokens / duration if duration > 0 else 0.0,
        "requests_per_s": len(ok) / duration if duration > 0 else 0.0,
        "ttft_ms": stats_ms([o.ttft for o in ok if o.ttft is not None]),
        "tpot_ms": stats_ms(tpot), "latency_ms": stats_ms([o.latency for o in ok]),
        "acceptance": accept,
    }


def run_level(label: str, base: str, bodies: list[dict], concurrency: int, api: str,
              timeout: float, progress) -> dict:
    """Stream every body through `concurrency` threads; scrape /metrics before and after."""
    url = f"{base}/v1/{'chat/completions' if api == 'chat' else 'completions'}"
    before = scrape(base)
    lock = threading.Lock()

    def one(body: dict) -> Outcome:
        out = stream_request(url, body, timeout)
        with lock:
            progress.update(1)
        return out

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        outcomes = list(pool.map(one, bodies))
    duration = time.perf_counter() - start
    return level_row(label, concurrency, outcomes, duration, acceptance(before, scrape(base)))


# --- greedy match --------------------------------------------------------------------------------


def _answer(base: str, body: dict, api: str, timeout: float) -> str:
    url = f"{base}/v1/{'chat/completions' if api == 'chat' else 'completions'}"
    choice = post_json(url, body, timeout)["choices"][0]
    return (choice.get("message") or {}).get("content") or choice.get("text") or ""


def first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def greedy_match(spec: str, base: str, rows: list[tuple[str, dict]], api: str, timeout: float,
                 progress) -> dict:
    """Non-streamed temperature-0 answers of both servers on a sample, compared exactly."""
    mismatches = []
    for pid, body in rows:
        body = {**body, "temperature": 0.0, "stream": False}
        body.pop("stream_options", None)
        try:
            a, b = _answer(spec, body, api, timeout), _answer(base, body, api, timeout)
        except (OSError, ValueError, KeyError, IndexError) as err:  # a failed pair cannot count as a match
            a, b = f"<request failed: {type(err).__name__}: {err}>", ""
        progress.update(1)
        if a != b:
            i = first_difference(a, b)
            mismatches.append({"prompt": pid, "first_difference": i,
                               "speculative": a[max(0, i - 20): i + 40], "baseline": b[max(0, i - 20): i + 40]})
    n = len(rows)
    return {"sample": n, "matched": n - len(mismatches), "rate": (n - len(mismatches)) / n if n else None,
            "mismatches": mismatches}


# --- report --------------------------------------------------------------------------------------


def _fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(report: dict) -> str:
    """bench.md: one table row per (label, concurrency), then speed-up and the greedy-match line."""
    lines = [f"# Server benchmark: {report['model']}", "",
             f"{report['prompts']['count']} prompts ({report['api']} API), max_tokens {report['max_tokens']}, "
             f"temperature {report['temperature']}; speculative server {report['servers']['speculative']}"
             + (f", baseline {report['servers']['baseline']}" if report["servers"]["baseline"] else ""), "",
             "| server | concurrency | ok / sent | output tok/s | req/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
             "| latency p50 / p90 / p99 ms | acceptance length | acceptance rate |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["results"]:
        t, p, lat, acc = r["ttft_ms"] or {}, r["tpot_ms"] or {}, r["latency_ms"] or {}, r["acceptance"] or {}
        failed = f" **{r['failed']} FAILED**" if r["failed"] else ""
        lines.append(
            f"| {r['label']} | {r['concurrency']} | {r['requests'] - r['failed']} / {r['requests']}{failed} "
            f"| {_fmt(r['output_tokens_per_s'])} | {_fmt(r['requests_per_s'], 2)} "
            f"| {_fmt(t.get('p50'))} / {_fmt(t.get('p99'))} | {_fmt(p.get('p50'), 2)} / {_fmt(p.get('p99'), 2)} "
            f"| {_fmt(lat.get('p50'))} / {_fmt(lat.get('p90'))} / {_fmt(lat.get('p99'))} "
            f"| {_fmt(acc.get('acceptance_length'), 2)} | {_fmt(acc.get('acceptance_rate'), 2)} |")
    failed = [r for r in report["results"] if r["failed"]]
    if failed:
        lines += ["", f"**{sum(r['failed'] for r in failed)} requests FAILED**: the figures of the marked "
                  "rows cover only their successful requests, and no speed-up is computed at their "
                  "concurrency. First errors:"]
        lines += [f"- {r['label']} @ {r['concurrency']}: {e}" for r in failed for e in r["errors"][:3]]
    if report["servers"]["baseline"]:
        parts = [f"{c}: {report['speedup'][str(c)]:.2f}x" if str(c) in report["speedup"] else
                 f"{c}: not computed (requests failed)" for c in report["concurrency"]]
        lines += ["", "Speed-up (output tok/s, speculative / baseline): " + ", ".join(parts)]
    gm = report["greedy_match"]
    if gm:
        verdict = "lossless on this sample" if gm["matched"] == gm["sample"] else "NOT LOSSLESS"
        lines += ["", f"Greedy match (temperature 0, speculative vs baseline): {gm['matched']} / {gm['sample']} "
                  f"identical — {verdict}."]
        for m in gm["mismatches"][:5]:
            lines.append(f"- prompt {m['prompt']}: first difference at character {m['first_difference']}")
    return "\n".join(lines) + "\n"


# --- entry points --------------------------------------------------------------------------------


def _check_url(flag: str, url: str) -> None:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BenchError(f"{flag} '{url}' is not an http(s) URL: pass e.g. http://127.0.0.1:8000")
    try:
        _ = parts.port  # parsing it raises on a bad port
    except ValueError:
        raise BenchError(f"{flag} '{url}' has an invalid port: pass 1..65535") from None


def check_options(url: str, baseline_url: str | None, concurrency, max_tokens: int, limit: int | None,
                  match_sample: int, api: str, temperature: float, timeout: float) -> list[int]:
    """Refuse bad options (naming the flag) before any prompt is read or server asked -> levels."""
    _check_url("--url", url)
    if baseline_url is not None:
        _check_url("--baseline-url", baseline_url)
    if api not in ("chat", "completions"):
        raise BenchError(f"--api '{api}': expected chat or completions")
    levels = sorted({int(c) for c in concurrency})
    if not levels or levels[0] < 1:
        raise BenchError(f"--concurrency needs integers >= 1, got {list(concurrency)}")
    for flag, value, low in (("--max-new-tokens", max_tokens, 1), ("--num-prompts", limit, 1),
                             ("--match-sample", match_sample, 0)):
        if value is not None and value < low:
            raise BenchError(f"{flag} must be >= {low}, got {value}")
    if not 0 <= temperature <= 2:
        raise BenchError(f"--temperature must be a number in [0, 2], got {temperature}")
    if not 0 < timeout < math.inf:
        raise BenchError(f"--timeout must be a positive number of seconds, got {timeout}")
    return levels


def run_bench(url: str, prompts_file: str, out_dir: str | None = None, baseline_url: str | None = None,
              concurrency=DEFAULT_CONCURRENCY, max_tokens: int = 128, limit: int | None = None,
              match_sample: int = 16, api: str = "chat", model: str | None = None,
              temperature: float = 0.0, timeout: float = 600.0, progress: bool = True) -> dict:
    """Benchmark `url` (and `baseline_url`) at each concurrency; write bench.json / bench.md."""
    levels = check_options(url, baseline_url, concurrency, max_tokens, limit, match_sample, api,
                           temperature, timeout)
    if out_dir:  # refused before any request: a folder of other files is not ours to write into
        check_output(Path(out_dir), lambda f: (f / "bench.json").is_file(), "a bench output folder")
    # lazy, measured: importing this module takes 0.17 s, data.prompts 1.9 s (the data package
    # imports torch), and a bad option must be refused before that
    from specheads.data.prompts import read_prompts

    url, baseline_url = url.rstrip("/"), baseline_url.rstrip("/") if baseline_url else None
    prompts = read_prompts(prompts_file, limit)  # a bad file fails before any server is asked
    model = model or served_model(url)
    rows = [(row.id, request_body(row.turns[0], api, model, max_tokens, temperature, stream=True))
            for row in prompts]
    servers = [("speculative", url)] + ([("baseline", baseline_url)] if baseline_url else [])
    sample = rows[:match_sample] if baseline_url else []
    total = len(rows) * len(levels) * len(servers) + len(sample)
    with Progress(total, "bench", "requests", quiet=not progress) as bar:  # a log gets lines, not \r redraws
        results = [run_level(label, base, [b for _, b in rows], c, api, timeout, bar)
                   for c in levels for label, base in servers]
        match = greedy_match(url, baseline_url, sample, api, timeout, bar) if sample else None
    report = {"servers": {"speculative": url, "baseline": baseline_url}, "model": model, "api": api,
              "prompts": {"file": str(prompts_file), "count": len(rows)}, "max_tokens": max_tokens,
              "temperature": temperature, "concurrency": levels, "results": results,
              "speedup": speedups(results), "failed_requests": sum(r["failed"] for r in results),
              "greedy_match": match}
    if out_dir:
        write_json(Path(out_dir) / "bench.json", report)
        write_text(Path(out_dir) / "bench.md", markdown(report))
    return report


def speedups(results: list[dict]) -> dict[str, float]:
    """speculative / baseline output tokens/s per concurrency, only where both rows are complete
    (a partial run's throughput is not the server's)."""
    by = {(r["label"], r["concurrency"]): r for r in results}
    out = {}
    for (label, c), base in by.items():
        spec = by.get(("speculative", c))
        if label != "baseline" or spec is None or spec["failed"] or base["failed"]:
            continue
        if base["output_tokens_per_s"] > 0:
            out[str(c)] = spec["output_tokens_per_s"] / base["output_tokens_per_s"]
    return out


def failure_lines(report: dict) -> list[str]:
    """What failed, for the terminal: one line per failed row, then its error messages."""
    lines = []
    for r in report["results"]:
        if r["failed"]:
            lines.append(f"{r['label']} @ concurrency {r['concurrency']}: {r['failed']} of "
                         f"{r['requests']} requests FAILED")
            lines += [f"  {e}" for e in r["errors"]]
    if lines:
        lines.append(f"specheads bench: {report['failed_requests']} requests failed; their rows "
                     "are marked and no speed-up is reported for those concurrency levels")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specheads bench", formatter_class=HelpFormatter, description=(
        "Load-test an OpenAI-compatible server (vLLM, SGLang, specheads serve) with speculation, and "
        "optionally a baseline server without it: TTFT, TPOT, tokens/s, latency percentiles, "
        "acceptance from /metrics, and a greedy-match check (exit 1 if the answers differ or any "
        "request failed)."))
    p.add_argument("--url", required=True, help="base URL of the speculative server, e.g. http://127.0.0.1:8000")
    p.add_argument("--baseline-url", default=None, help="base URL of the same target served without speculation")
    p.add_argument("--prompts", required=True, help="prompts file: JSON lines or a JSON array of rows "
                   "with prompt, turns, messages (first user turn), question, instruction (+input) or text")
    p.add_argument("--out", default=None, help="folder for bench.json and bench.md")
    p.add_argument("--concurrency", default=",".join(map(str, DEFAULT_CONCURRENCY)), help="e.g. 1,8,32")
    p.add_argument("--max-new-tokens", "--max-tokens", dest="max_tokens", type=int, default=128,
                   help="tokens per request (max_tokens in the request body)")
    p.add_argument("--num-prompts", "--limit", dest="num_prompts", type=int, default=None,
                   help="use the first N prompts (default: all)")
    p.add_argument("--match-sample", type=int, default=16, help="prompts compared greedily (needs --baseline-url)")
    p.add_argument("--api", default="chat", choices=["chat", "completions"],
                   help="/v1/chat/completions (prompts through the chat template) or /v1/completions (raw text)")
    p.add_argument("--model", default=None, help="model name to request (default: the server's first)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (needed for the greedy-match check)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--quiet", "--no-progress", dest="no_progress", action="store_true", help="no progress on stderr")
    a = p.parse_args(argv)
    try:
        levels = [int(c) for c in a.concurrency.split(",")]
    except ValueError:
        raise BenchError(f"--concurrency '{a.concurrency}': expected integers separated by commas") from None
    report = run_bench(a.url, a.prompts, a.out, a.baseline_url, levels, a.max_tokens, a.num_prompts,
                       a.match_sample, a.api, a.model, a.temperature, a.timeout, not a.no_progress)
    print(markdown(report))
    for line in failure_lines(report):
        print(line, file=sys.stderr)
    gm = report["greedy_match"]
    return 1 if report["failed_requests"] or (gm and gm["matched"] != gm["sample"]) else 0
