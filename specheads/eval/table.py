"""The results table `specheads eval` and `specheads demo` print: one row per proposer measured on the
same prompts (the drafter, the free proposers, the hybrid rows), with tau, acceptance per position,
predicted and measured speed-up and whether the output equals plain greedy decoding."""

from __future__ import annotations

from specheads.eval.report import FREE_NAMES, MIX_NAMES

COLUMNS = ("proposer", "tau", "acceptance per position", "predicted speedup", "measured speedup", "greedy equal")


def table_rows(m: dict, drafter: str) -> dict[str, tuple[str, dict]]:
    """An eval's rows: key -> (label, the row's metrics), in table order; `drafter` labels the export's row."""
    rows = {"speculative": (drafter, m["speculative"])}
    rows.update({key: (label, m[key]) for key, label in FREE_NAMES.items() if _measured(m.get(key))})
    rows.update({key: (label.format(free=m[key].get("free", "the free proposer")), m[key])
                 for key, label in MIX_NAMES.items() if _measured(m.get(key))})
    return rows


def _measured(row) -> bool:
    """A row that was decoded (a row skipped, e.g. a chain hybrid under a tree draft, records why instead)."""
    return isinstance(row, dict) and "tau" in row and "acceptance_per_position" in row


def results_table(m: dict, title: str, drafter: str):
    """The rich Table of `table_rows`."""
    from rich.table import Table

    table = Table(title=title)
    for col in COLUMNS:
        table.add_column(col)
    for name, r in table_rows(m, drafter).values():
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
        table.add_row(name, f"{r['tau']:.3f}", acc, f"{r.get('predicted_speedup', float('nan')):.2f}x",
                      f"{r.get('measured_speedup', float('nan')):.2f}x", str(r.get("greedy_equal")))
    return table


def print_results(m: dict, title: str, drafter: str, file=None) -> None:
    """The table and the drafter-vs-n-gram line, on `file` (default stdout), 140 columns wide."""
    from rich.console import Console

    console = Console(width=140, file=file)
    console.print(results_table(m, title, drafter))
    spec, ngram = m["speculative"], m.get("ngram") or {}
    if ngram.get("tau"):
        c_spec, c_ngram = spec.get("cost_ratio_c", float("nan")), ngram.get("cost_ratio_c", float("nan"))
        console.print(f"drafter tau / n-gram tau = {spec['tau'] / ngram['tau']:.2f}; draft/target cost ratio c = "
                      f"{c_spec:.3f} (drafter), {c_ngram:.3f} (n-gram)")
