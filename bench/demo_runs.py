"""make demo's table, R times: is it stable, and is each prediction within 10% of its measurement?

    python bench/demo_runs.py --out DIR [--runs 2] [-- DEMO ARGS ...]

Runs `specheads demo` (a real process) in R fresh run folders, DIR/run1 .. DIR/runR, one after the
other: each regenerates its data, trains its drafter and measures its table anew, as a fresh clone's
`make demo` does. Then every row of the table side by side per run (tau, predicted and measured
speed-up, the prediction's error), the spread of each row between runs, and each hybrid row's measured
speed-up over the better of EAGLE-3 and prompt lookup alone. A finished run folder (its
demo_summary.json) is read again rather than rerun, so a bench cut short resumes. Arguments after `--`
go to every demo (e.g. `-- --limit 16`). Writes DIR/demo_runs.json and DIR/demo_runs.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from specheads.atomic import write_json, write_text
from specheads.demo import table_rows
from specheads.eval.report import MIX_NAMES
from specheads.provenance import machine

TOLERANCE = 0.10  # the bar: every row's prediction within 10% of its measurement
SINGLES = ("speculative", "ngram")  # the hybrid rows are compared with the better of these alone


class DemoFailed(RuntimeError):
    """A demo process that did not finish (the message names its run folder and log)."""


def run_demo(run: Path, log: Path, demo_args: list[str]) -> float:
    """`specheads demo --run RUN DEMO_ARGS` as its own process, its output in LOG -> wall seconds."""
    cmd = [sys.executable, "-m", "specheads", "demo", "--run", str(run), *demo_args]
    t0 = time.perf_counter()
    with log.open("w") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
    if rc != 0 or not (run / "demo_summary.json").is_file():
        raise DemoFailed(f"the demo in {run} exited with status {rc}: its output is in {log}")
    return time.perf_counter() - t0


def row_errors(summary: dict) -> dict[str, dict]:
    """Each row of the demo's table (`demo.table_rows`) with its prediction's error and verdict."""
    rows = {}
    for key, (label, r) in table_rows(summary["metrics"]).items():
        if r.get("measured_speedup") is None:
            continue
        pred, meas = r["predicted_speedup"], r["measured_speedup"]
        err = pred / meas - 1
        rows[key] = {"label": label, "tau": r["tau"], "predicted": pred, "measured": meas, "error": err,
                     "within": abs(err) <= TOLERANCE, "greedy_equal": bool(r.get("greedy_equal"))}
    return rows


def compare(runs: list[dict]) -> dict:
    """Across runs: each row's spread, the hybrid rows over the better single row, the verdicts."""
    keys = [k for k in runs[0]["rows"] if all(k in r["rows"] for r in runs)]
    spread = {}
    for k in keys:
        meas = [r["rows"][k]["measured"] for r in runs]
        pred = [r["rows"][k]["predicted"] for r in runs]
        spread[k] = {"measured_min": min(meas), "measured_max": max(meas), "measured_spread": max(meas) / min(meas) - 1,
                     "predicted_min": min(pred), "predicted_max": max(pred),
                     "predicted_spread": max(pred) / min(pred) - 1}
    over = {k: [r["rows"][k]["measured"] / max(r["rows"][s]["measured"] for s in SINGLES) for r in runs]
            for k in MIX_NAMES if k in keys}
    return {"rows": keys, "spread": spread, "mix_over_best_single": over,
            "all_within": all(r["rows"][k]["within"] for r in runs for k in keys),
            "all_greedy_equal": all(r["rows"][k]["greedy_equal"] for r in runs for k in keys)}


def markdown(report: dict) -> str:
    runs, c = report["runs"], report["compare"]
    m = report["machine"]
    lines = [f"# make demo's table, {len(runs)} fresh runs", "",
             f"`{report['command']}`", "",
             f"{runs[0]['prompts']} held-out prompts, greedy, k = {runs[0]['k']}, {runs[0]['max_new_tokens']} new tokens, "
             f"our verifier, {runs[0]['dtype']}, {m['cpu']}, {m['cpus']} CPUs, {m['torch_threads']} torch threads, "
             f"load average {m['load_1min']:.2f} as this bench began (before any run it made). "
             "Each run regenerated its data and trained its drafter anew. "
             f"Prediction error = predicted / measured - 1 (bar: within {TOLERANCE:.0%}).", ""]
    head = "| row | " + " | ".join(f"run {i + 1}: tau, predicted / measured (error)" for i in range(len(runs)))
    lines += [head + " | measured spread |", "|---" + "|---:" * len(runs) + "|---:|"]
    for k in c["rows"]:
        cells = []
        for r in runs:
            x = r["rows"][k]
            mark = "" if x["within"] else " **over 10%**"
            cells.append(f"{x['tau']:.2f}, {x['predicted']:.2f}x / {x['measured']:.2f}x ({x['error']:+.1%}){mark}")
        lines.append(f"| {runs[0]['rows'][k]['label']} | " + " | ".join(cells)
                     + f" | {c['spread'][k]['measured_spread']:.1%} |")
    lines += ["", "Hybrid rows, measured speed-up over the better of EAGLE-3 and prompt lookup alone:", ""]
    for k, ratios in c["mix_over_best_single"].items():
        lines.append(f"- {runs[0]['rows'][k]['label']}: " + ", ".join(f"run {i + 1} {x:.2f}x" for i, x in enumerate(ratios)))
    lines += ["", f"Every prediction within {TOLERANCE:.0%}: {'yes' if c['all_within'] else 'no'}; "
              f"every row greedy-equal in every run: {'yes' if c['all_greedy_equal'] else 'no'}.",
              "", "Wall time per run (regeneration, training, eval, concurrency): "
              + ", ".join(f"{r['wall_s']:.0f} s" for r in runs) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    demo_args = argv[argv.index("--") + 1:] if "--" in argv else []
    ours = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="a folder for the run folders and the report")
    p.add_argument("--runs", type=int, default=2, help="fresh demo runs, one after another (at least 2)")
    a = p.parse_args(ours)
    if a.runs < 2:
        p.error("--runs: at least 2 (stability is measured between runs)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    before = machine()  # the load before the first demo
    runs = []
    for i in range(1, a.runs + 1):
        run = out / f"run{i}"
        summary_file = run / "demo_summary.json"
        wall = None
        if not summary_file.is_file():
            print(f"[demo_runs] run {i}/{a.runs}: specheads demo --run {run}", file=sys.stderr, flush=True)
            try:
                wall = run_demo(run, out / f"run{i}.log", demo_args)
            except DemoFailed as e:
                print(f"ERROR: {e}", file=sys.stderr)
                return 1
        summary = json.loads(summary_file.read_text())
        m = summary["metrics"]
        runs.append({"run": run.name, "wall_s": wall if wall is not None else summary["timings"]["total_s"],
                     "prompts": m["num_prompts"], "k": m["k"], "max_new_tokens": m["max_new_tokens"],
                     "dtype": m["provenance"]["dtype"], "git_sha": m["provenance"]["git_sha"],
                     "rows": row_errors(summary)})
    report = {"command": " ".join(["python", "bench/demo_runs.py", *argv]), "demo_args": demo_args,
              "tolerance": TOLERANCE, "machine": before, "runs": runs, "compare": compare(runs)}
    write_json(out / "demo_runs.json", report)
    write_text(out / "demo_runs.md", markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
