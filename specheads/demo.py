"""`specheads demo`: the whole pipeline offline on the embedded target, under one run folder.

tiny target -> demo data -> EAGLE-3 training -> vLLM + SGLang exports -> eval on held-out
prompts -> a table. Re-running reuses the cached target, the data and a finished checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from specheads.atomic import write_json

DEFAULT_RECIPE = Path("recipes/demo/eagle3.yaml")


def link_target(run: Path, target: Path) -> Path:
    """runs/<x>/target -> the cached target folder (a symlink; nothing is copied)."""
    link = run / "target"
    if link.is_symlink() and link.resolve() == target.resolve():
        return link
    if link.is_symlink() or link.is_file():
        link.unlink()
    if not link.exists():
        link.symlink_to(target.resolve(), target_is_directory=True)
    return link


def demo_recipe(recipe_path: Path, run: Path, extra: list[str]):
    from specheads.config import load_recipe

    overrides = [f"target.path={run / 'target'}", f"data.train=[{run / 'data' / 'train.jsonl'}]",
                 f"train.output_dir={run / 'checkpoint'}", *extra]
    return load_recipe(recipe_path if recipe_path.is_file() else None, overrides)


def run_demo(run: Path, recipe_path: Path = DEFAULT_RECIPE, max_new_tokens: int = 96,
             limit: int | None = None, overrides: list[str] = (), preset: str = "default",
             module_limit: int | None = None) -> dict:
    """Run every stage; returns the summary written to RUN/demo_summary.json."""
    from specheads.builtin.stdlib import write_demo_data
    from specheads.builtin.tiny_target import cached_tiny_target
    from specheads.eval.online import evaluate
    from specheads.export import export
    from specheads.train import train

    run.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    t0 = time.time()
    target = link_target(run, cached_tiny_target(preset))
    timings["target_s"] = time.time() - t0
    data = run / "data"
    if not (data / "heldout_prompts.jsonl").is_file():
        write_demo_data(data, limit=module_limit)
    timings["data_s"] = time.time() - t0 - timings["target_s"]
    t1 = time.time()
    ckpt = train(demo_recipe(recipe_path, run, list(overrides)))
    timings["train_s"] = time.time() - t1
    t1 = time.time()
    exports = {fmt: export(ckpt, fmt, run / "export" / fmt) for fmt in ("vllm", "sglang")}
    timings["export_s"] = time.time() - t1
    t1 = time.time()
    metrics = evaluate(str(target), str(exports["vllm"]), str(data / "heldout_prompts.jsonl"),
                       str(run / "eval"), max_new_tokens=max_new_tokens, limit=limit)
    timings["eval_s"] = time.time() - t1
    timings["total_s"] = time.time() - t0
    summary = {"run": str(run), "checkpoint": str(ckpt), "exports": {k: str(v) for k, v in exports.items()},
               "timings": {k: round(v, 1) for k, v in timings.items()}, "metrics": metrics}
    write_json(run / "demo_summary.json", summary)
    return summary


def serve_commands(export_dir: Path) -> list[str]:
    """The serve command lines the exporter wrote into the folder's README."""
    readme = Path(export_dir) / "README.md"
    if not readme.is_file():
        return []
    lines = readme.read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip().startswith(("vllm serve", "python -m sglang"))]


def print_summary(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    m = summary["metrics"]
    spec, ngram = m["speculative"], m["ngram"]
    table = Table(title=f"specheads demo — {m.get('num_prompts', '?')} held-out prompts, greedy, k={m.get('k')}")
    for col in ("proposer", "tau", "acceptance per position", "predicted speedup", "greedy equal"):
        table.add_column(col)
    for name, r in (("EAGLE-3 (exported for vLLM)", spec), ("n-gram (prompt lookup)", ngram)):
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
        table.add_row(name, f"{r['tau']:.3f}", acc, f"{r.get('predicted_speedup', float('nan')):.2f}x",
                      str(r.get("greedy_equal", m.get("greedy_equal"))))
    console = Console()
    console.print(table)
    ratio = spec["tau"] / ngram["tau"] if ngram["tau"] else float("nan")
    console.print(f"EAGLE-3 tau / n-gram tau = {ratio:.2f}   draft/target cost ratio c = {m.get('cost_ratio', float('nan')):.3f}")
    console.print("timings (s): " + json.dumps(summary["timings"]))
    for fmt, folder in summary["exports"].items():
        for cmd in serve_commands(Path(folder)):
            console.print(f"[{fmt}] {cmd}", soft_wrap=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specheads demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default=os.environ.get("RUN", "runs/demo"), help="run folder (default runs/demo)")
    p.add_argument("--recipe", default=str(DEFAULT_RECIPE))
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N prompts")
    p.add_argument("--preset", default="default", choices=["default", "test"],
                   help="embedded target preset ('test' is a seconds-sized smoke run)")
    p.add_argument("--module-limit", type=int, default=None, help="use only the first N stdlib modules for data")
    p.add_argument("overrides", nargs="*", help="recipe overrides, e.g. train.max_steps=50")
    a = p.parse_args(argv)
    summary = run_demo(Path(a.run), Path(a.recipe), a.max_new_tokens, a.limit, a.overrides,
                       a.preset, a.module_limit)
    print_summary(summary)
    if not summary["metrics"].get("greedy_equal", False):
        print("ERROR: speculative output differs from plain greedy decoding (see eval/metrics.json)")
        return 1
    return 0
