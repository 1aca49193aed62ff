"""Evaluation reports: metrics.json, report.md and PNG plots, and their copy inside an export.

Plots (matplotlib, Agg backend, written atomically):

* `acceptance.png`: acceptance per draft position, unconditional and conditional;
* `tau_by_category.png`: tau per prompt category (tokens / target forwards summed per category);
* `speedup.png`: predicted speed-up per chain length k (and per tree budget), with the measured
  points of a verifier benchmark (bench/verifier.py's verifier.json) when given;
* `concurrency.png`: a server load test's throughput over concurrency, when given;
* `reliability.png`: the drafter's top draft probability vs its acceptance (raw and calibrated).

Server benchmark input (`bench`): a JSON object with `results`, a list of rows each holding
`concurrency` (int), a throughput (`output_tokens_per_s`, `output_throughput` or `tokens_per_s`)
and a series name (`label`, `name` or `method`; rows without one form the series "run").
"""

from __future__ import annotations

import io
import json
from collections import defaultdict
from pathlib import Path

from specheads.atomic import check_output, write_bytes, write_json, write_text
from specheads.errors import read_user_text
from specheads.eval.predict import sglang_flags
from specheads.eval.recommend import recommended_k, with_recommended_k
from specheads.eval_identity import history_warning
from specheads.export.readme import RECOMMENDED

# training-free proposers every eval compares with, as reports name them
FREE_NAMES = {"ngram": "n-gram (prompt lookup)", "suffix": "suffix decoding (vLLM method: suffix)"}
# the drafter combined with the free proposer (eval/mixes.py), as reports name them ({free}: its row)
MIX_NAMES = {"hybrid": "hybrid choose (drafter or {free} per step)", "union": "union (drafter + {free} in one tree)",
             "adaptive": "adaptive draft length (drafter + {free})"}

THROUGHPUT_KEYS = ("output_tokens_per_s", "output_throughput", "tokens_per_s")
SERIES_KEYS = ("label", "name", "method")


class ReportError(ValueError):
    """A report input that cannot be plotted (the message names the file and field)."""


def _figure(width: float = 6.4, height: float = 4.0):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(width, height), dpi=110)
    ax.grid(True, alpha=0.3)
    return plt, fig, ax


def _save(plt, fig, path: Path) -> Path:
    """PNG bytes written atomically (a half-written plot never replaces a good one)."""
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    write_bytes(path, buf.getvalue())
    return path


# --- plots -----------------------------------------------------------------------------------------


def plot_acceptance(path: Path, uncond: list[float], cond: list[float], title: str) -> Path:
    """Grouped bars: acceptance per draft position, unconditional and conditional."""
    plt, fig, ax = _figure()
    xs = list(range(1, len(uncond) + 1))
    ax.bar([x - 0.2 for x in xs], uncond, width=0.4, label="unconditional (all drafts up to p accepted)")
    ax.bar([x + 0.2 for x in xs], cond, width=0.4, label="conditional (given p-1 accepted)")
    for x, u, c in zip(xs, uncond, cond):
        ax.annotate(f"{u:.2f}", (x - 0.2, u), ha="center", va="bottom", fontsize=8)
        ax.annotate(f"{c:.2f}", (x + 0.2, c), ha="center", va="bottom", fontsize=8)
    ax.set(xlabel="draft position p", ylabel="acceptance", ylim=(0, 1.08), xticks=xs, title=title)
    ax.legend(loc="upper right", fontsize=8)
    return _save(plt, fig, path)


def tau_by_category(outputs: list[dict]) -> dict[str, dict]:
    """tau per category: decode tokens / target forwards summed per category (mean of turns if
    rows carry no counts)."""
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0])
    for row in outputs:
        s = sums[str(row.get("category") or "all")]
        s[0] += row.get("decode_tokens", 0)
        s[1] += row.get("decode_forwards", 0)
        s[2] += row.get("tau", 0.0)
        s[3] += 1
    return {c: {"tau": tok / fw if fw else taus / n, "turns": n}
            for c, (tok, fw, taus, n) in sorted(sums.items())}


def plot_tau_by_category(path: Path, by_cat: dict[str, dict], title: str) -> Path:
    """Horizontal bars of tau per category, plain decoding (1.0) marked."""
    plt, fig, ax = _figure(6.4, max(2.4, 0.45 * len(by_cat) + 1.4))
    names = list(by_cat)
    taus = [by_cat[n]["tau"] for n in names]
    ax.barh(names, taus, color="tab:green")
    for i, (name, t) in enumerate(zip(names, taus)):
        ax.annotate(f"{t:.2f} ({by_cat[name]['turns']} turns)", (t, i), va="center", fontsize=8,
                    xytext=(3, 0), textcoords="offset points")
    ax.axvline(1.0, color="grey", ls="--", lw=1, label="plain decoding")
    ax.set(xlabel="tau (tokens per target forward, bonus included)", title=title,
           xlim=(0, max(taus + [1.0]) * 1.3))
    ax.legend(loc="lower right", fontsize=8)
    return _save(plt, fig, path)


def measured_chain_speedups(verifier_json: dict) -> dict[int, float]:
    """k -> measured speed-up of the chain rows of bench/verifier.py's verifier.json."""
    out = {}
    for row in verifier_json.get("methods", []):
        st = row.get("settings", {})
        if st.get("kind") == "chain" and st.get("k"):
            out[int(st["k"])] = float(row["speedup"])
    return out


def plot_speedup(path: Path, prediction: dict, measured: dict[int, float] | None, title: str) -> Path:
    """Predicted speed-up per chain length (and tree budget), measured chain points overlaid."""
    plt, fig, ax = _figure()
    ks = [r["k"] for r in prediction["chains"]]
    ax.plot(ks, [r["speedup"] for r in prediction["chains"]], "o-", label="predicted, chain of k")
    if measured:
        mk = sorted(measured)
        ax.plot(mk, [measured[k] for k in mk], "s--", color="tab:red", label="measured, chain of k")
    best = prediction["best_chain_k"]
    label = f"recommended k = {best}" if prediction.get("speculate", True) else f"best k = {best} (no speed-up: not recommended)"
    ax.axvline(best, color="tab:blue", ls=":", lw=1, label=label)
    ax.axhline(1.0, color="grey", ls="--", lw=1)
    ax.set(xlabel="draft length k (tokens verified per step = k + 1)", ylabel="speed-up over plain decoding",
           xticks=ks, title=title)
    if prediction.get("trees"):
        top = ax.twiny()
        budgets = [t["budget"] for t in prediction["trees"]]
        top.plot(range(len(budgets)), [t["speedup"] for t in prediction["trees"]], "^-", color="tab:purple",
                 alpha=0.7, label="predicted, best tree (top axis: tokens per step)")
        top.set_xticks(range(len(budgets)), [str(b) for b in budgets])
        top.legend(loc="lower left", fontsize=8)
    ax.legend(loc="lower right", fontsize=8)
    return _save(plt, fig, path)


def plot_reliability(path: Path, calibration: dict, title: str) -> Path:
    """Reliability diagram: observed acceptance over mean predicted probability per bin, raw and
    cross-fitted calibrated, the diagonal marked (perfect calibration)."""
    plt, fig, ax = _figure(5.2, 4.4)
    ax.plot([0, 1], [0, 1], "--", color="grey", lw=1, label="perfectly calibrated")
    for key, label, style in (("reliability_raw", "raw top draft probability", "o-"),
                              ("reliability_calibrated", "calibrated (cross-fitted)", "s-")):
        rows = calibration.get(key) or []
        ax.plot([r["mean_predicted"] for r in rows], [r["observed"] for r in rows], style, label=label)
    ax.set(xlabel="predicted P(accept | earlier drafts accepted)", ylabel="observed acceptance",
           xlim=(0, 1), ylim=(0, 1.02), title=title)
    ax.legend(loc="upper left", fontsize=8)
    return _save(plt, fig, path)


def concurrency_series(bench: dict, where: str = "bench") -> dict[str, list[tuple[int, float]]]:
    """Series name -> [(concurrency, throughput)] sorted by concurrency."""
    rows = bench.get("results") if isinstance(bench, dict) else None
    if not isinstance(rows, list) or not rows:
        raise ReportError(f"{where}: expected an object with a non-empty 'results' list")
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for i, row in enumerate(rows):
        key = next((k for k in THROUGHPUT_KEYS if k in row), None)
        if "concurrency" not in row or key is None:
            raise ReportError(f"{where}: results[{i}] needs 'concurrency' and one of {', '.join(THROUGHPUT_KEYS)}")
        name = next((str(row[k]) for k in SERIES_KEYS if row.get(k)), "run")
        series[name].append((int(row["concurrency"]), float(row[key])))
    return {n: sorted(pts) for n, pts in series.items()}


def plot_concurrency(path: Path, series: dict[str, list[tuple[int, float]]], title: str) -> Path:
    """Output tokens/s over concurrency, one line per series, log2 concurrency axis."""
    plt, fig, ax = _figure()
    for name, pts in series.items():
        ax.plot([c for c, _ in pts], [t for _, t in pts], "o-", label=name)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="concurrent requests", ylabel="output tokens/s", title=title)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


# --- report.md -----------------------------------------------------------------------------------


def prediction_table(prediction: dict, measured: dict[int, float] | None = None) -> list[str]:
    """Markdown rows: k, expected tokens, predicted (and measured) speed-up."""
    head = "| k | tokens/step (predicted) | step cost / plain step | predicted speed-up |"
    lines = [head + (" measured speed-up |" if measured else ""),
             "|---:|---:|---:|---:|" + ("---:|" if measured else "")]
    plain = prediction["costs"]["plain_step_s"] or prediction["costs"]["target_s"]["1"]
    best = prediction["best_chain_k"] if prediction.get("speculate", True) else None
    for r in prediction["chains"]:
        m = f" {measured[r['k']]:.2f}x |" if measured and r["k"] in measured else (" |" if measured else "")
        mark = " (recommended)" if r["k"] == best else ""
        lines.append(f"| {r['k']}{mark} | {r['expected_tokens']:.2f} | {r['step_s'] / plain:.2f} | {r['speedup']:.2f}x |{m}")
    return lines


def calibration_lines(cal: dict) -> list[str]:
    """report.md's calibration section: ECE raw / calibrated and the raw reliability table."""
    lines = ["", "## Draft calibration", "",
             f"{cal['records']} draft positions whose earlier drafts were accepted ({cal['accepted']} accepted). "
             f"Expected calibration error of the drafter's top draft probability: {cal['ece_raw']:.3f} raw, "
             f"{cal['ece_calibrated']:.3f} after the calibration map ({cal['fit']}).", "",
             "| draft probability | mean predicted | observed acceptance | count |", "|---|---:|---:|---:|"]
    for r in cal["reliability_raw"]:
        lines.append(f"| {r['bin'][0]:.1f}-{r['bin'][1]:.1f} | {r['mean_predicted']:.3f} | {r['observed']:.3f} | {r['count']} |")
    return lines


def predicted_text(row: dict) -> str:
    """A row's predicted speed-up, only where measured step costs priced it: the seed formula alone
    takes verifying k + 1 tokens to cost one plain step, which no CPU run bears out."""
    if not row.get("predicted_speedup_model"):
        return "not predicted (no measured step costs, e.g. --no-predict)"
    return f"predicted {row.get('predicted_speedup', float('nan')):.2f}x"


def caveat_lines(metrics: dict) -> list[str]:
    """What qualifies every number below: a suffix history that held the evaluated prompts."""
    flag = history_warning(metrics)
    return [f"> **Warning:** {flag}.", ""] if flag else []


def report_markdown(metrics: dict, plots: dict[str, str], measured: dict[int, float] | None = None) -> str:
    """report.md: the headline numbers, the prediction table, the advice, the plots."""
    spec = metrics.get("speculative") or metrics.get("offline") or {}
    lines = ["# specheads evaluation", "", *caveat_lines(metrics)]
    if "tau" in metrics:
        lines.append(f"- tau {metrics['tau']:.3f} (bonus included; plain decoding = 1.00), draft shape "
                     f"{json.dumps(metrics.get('tree'))}, greedy equal: {metrics.get('greedy_equal')}")
    if "batch_size" in metrics:
        lines.append(f"- batch size {metrics['batch_size']} (sequences per target forward); measured speed-ups "
                     f"against {metrics.get('measured_speedup_baseline', 'plain decoding')}")
    acc = spec.get("acceptance_per_position") or spec.get("acc_uncond")
    if acc:
        lines.append("- acceptance per position: " + " / ".join(f"{a:.2f}" for a in acc))
    cal = metrics.get("calibration")
    if cal:
        lines.append(f"- draft calibration: ECE {cal['ece_raw']:.3f} (raw top draft probability), "
                     f"{cal['ece_calibrated']:.3f} (calibrated) over {cal['records']} draft positions")
    for name, label in [*FREE_NAMES.items(), *MIX_NAMES.items()]:
        row = metrics.get(name)
        if row and row.get("skipped"):
            lines.append(f"- {label.format(free='the free proposer')}: skipped ({row['skipped']})")
        elif row:
            note = f" ({row['free_note']})" if row.get("free_note") else ""
            lines.append(f"- {label.format(free=row.get('free'))} tau {row['tau']:.3f}, measured speed-up "
                         f"{row.get('measured_speedup', float('nan')):.2f}x, {predicted_text(row)}{note}")
    if metrics.get("simulated_tau"):
        sim = metrics["simulated_tau"]
        lines.append("- simulated tau, chain of k: " + ", ".join(f"k={k}: {t:.2f}" for k, t in sim["chain"].items()))
        if sim["tree"]:
            lines.append("- simulated tau, best tree: " + ", ".join(f"{n} tokens: {t:.2f}" for n, t in sim["tree"].items()))
    if metrics.get("calibration"):
        lines += calibration_lines(metrics["calibration"])
    pred, adv = metrics.get("prediction"), metrics.get("advice")
    if pred:
        lines += ["", "## Predicted speed-up", "",
                  "From the measured conditional acceptance per position and the measured seconds of a "
                  "target forward per verified-token count, the drafter per level and the loop per step.", "",
                  *prediction_table(pred, measured)]
    if adv:
        lines += ["", *advice_lines(adv)]
    if metrics.get("llamacpp"):
        lines += ["", *llamacpp_lines(metrics["llamacpp"])]
    if plots:
        lines += ["", "## Plots", "", *[f"![{name}]({file})" for name, file in plots.items()]]
    return "\n".join(lines) + "\n"


def advice_lines(adv: dict) -> list[str]:
    """The recommended-settings section (also written into an export's README)."""
    sampled = adv.get("sampling")
    at = f" at temperature {sampled['temperature']:g}, top-p {sampled['top_p']:g}" if sampled else ""
    lines = [RECOMMENDED, "",
             f"Predicted from acceptance{at} and step costs measured with specheads' own verifier (batch 1); "
             "re-check on your hardware and batch sizes.", ""]
    engines = adv.get("engines")
    if engines:
        lines.append(f"- Best setting per engine (the drafter, a draftless method or both): {advice_line(engines)}")
    if not adv.get("speculate", True):
        return lines + [f"- No speculation with the drafter alone: {adv['reason']}."] + concurrency_lines(
            adv.get("by_concurrency")) + [""]
    v, s = adv["vllm"], adv["sglang"]
    lines += [f"- vLLM: `\"num_speculative_tokens\": {v['num_speculative_tokens']}` in `--speculative-config` "
             f"(predicted {v['predicted_speedup']:.2f}x, {v['expected_tokens']:.2f} tokens per step)",
             f"- SGLang: `{sglang_flags(s)}` (predicted {s['predicted_speedup']:.2f}x)"]
    lines += [f"- {adv[key][0].upper()}{adv[key][1:]}." for key in ("kept_on", "uncertain") if adv.get(key)]
    if adv.get("recommended"):
        lines.append(f"- The serve commands above draft k = {v['num_speculative_tokens']}, this recommendation "
                     "(`vllm serve DIR` alone drafts the k in the export's own config).")
    tree = adv.get("sglang_tree_to_try")
    if tree:
        lines.append(f"- SGLang tree to try (a rougher prediction, {tree['predicted_speedup']:.2f}x: measure it "
                     f"before adopting): `{sglang_flags(tree)}`")
    return lines + concurrency_lines(adv.get("by_concurrency")) + [""]


def concurrency_lines(by: dict | None) -> list[str]:
    """The best k per batch size (k 0: plain decoding) in each engine's own setting."""
    if not by:
        return []
    each = ", ".join(f"batch {r['batch_size']}: " + (f"k = {r['best_k']} ({r['best_speedup']:.2f}x{band_mark(r)})"
                                                     if r["best_k"] else "no speculation") for r in by["rows"])
    source = by.get("from", "target forwards and drafter steps over B rows timed by eval")
    return [f"- By concurrency (predicted from {source}): {each}",
            f"  - vLLM: `\"num_speculative_tokens_per_batch_size\": {by['vllm_num_speculative_tokens_per_batch_size']}` "
            "in `--speculative-config` (k 0: no speculation at that size)",
            *[f"  {note}" for note in band_notes(by["rows"])],
            "  - SGLang and llama.cpp take one draft length per server (`--speculative-num-steps`, "
            "`--spec-draft-n-max`): the k of the concurrency you expect most"]


def band_mark(band: dict) -> str:
    """" measured" for a band kept on by this run's measurement, " ?" for an uncertain one, else ""."""
    return " measured" if band.get("kept_on") else " ?" if band.get("verdict") == "uncertain" else ""


def band_notes(rows: list[dict]) -> list[str]:
    """One line per band of the schedule that is not a plain prediction: kept on by a measurement of
    this run, or uncertain (the timings' spread reaches across the gain that decides)."""
    out = []
    for b in rows:
        if b.get("kept_on"):
            out.append(f"- batch {b['batch_size']}: {b['kept_on']}")
        elif b.get("verdict") == "uncertain" and "top_speedup" in b:
            out.append(f"- batch {b['batch_size']}: uncertain, predicted {b['top_speedup']:.2f}x at k={b['top_k']} "
                       f"({b['speedup_low']:.2f}x to {b['speedup_high']:.2f}x within the spread of the timed costs); "
                       "speculation kept on: measure it at this concurrency before turning it off")
    return out


def llamacpp_lines(lc: dict) -> list[str]:
    """The drafter priced at llama.cpp's own measured costs (eval/engine_costs.py)."""
    if lc.get("skipped"):
        return [f"- llama.cpp prediction: skipped ({lc['skipped']})"]
    m = lc["measured_in"]
    v = ", ".join(f"v({n}) = {x:.2f}" for n, x in sorted(lc["v"].items()))
    by_k = ", ".join(f"k={k}: {x:.2f}x" for k, x in lc["speedup_by_k"].items())
    return ["## In llama.cpp (its own measured costs)", "",
            f"Costs measured in llama-server {m.get('version')} ({m.get('quantization')} target, {m.get('threads')} "
            f"threads, OMP_WAIT_POLICY {m.get('omp_wait_policy')}; `{lc['curve_from']}`): {v}; a draft token "
            f"c = {lc['c']:.2f} of a plain step.", "",
            f"- predicted speed-up over plain llama.cpp per `--spec-draft-n-max`: {by_k}",
            f"- use: **{lc['use']}** (speculation only when predicted >= {1 + lc['min_gain']:.2f}x)"]


def advice_line(engines: dict) -> str:
    """One line per engine of `engine_advice`, for report.md and the terminal."""
    parts = []
    for name, e in engines.items():
        if name == "specheads":
            parts.append(f"specheads serve: {e['use']} (predicted {e['predicted_speedup']:.2f}x)")
        elif name == "llama.cpp":
            predicted = f", predicted {e['predicted_speedup']:.2f}x from its own costs" if "curve_from" in e else ""
            parts.append(f"llama.cpp: {e['use']} (`{e['flags']}`{predicted})")
        else:
            what = f"`{e['flags']}`" if e["flags"] else "the drafter"
            parts.append(f"{e['engine']}: {what} (predicted {e['predicted_speedup']:.2f}x)")
    return "; ".join(parts)


# --- writing -----------------------------------------------------------------------------------


def read_json(path: str | Path | None, what: str = "JSON input") -> dict | None:
    """An optional JSON input (None stays None); a missing or broken file is a clear error."""
    if path is None:
        return None
    try:
        return json.loads(read_user_text(path, what, ReportError))
    except json.JSONDecodeError as err:
        raise ReportError(f"'{path}' is not valid JSON ({err.msg}, line {err.lineno})") from None


def is_report_folder(folder: Path) -> bool:
    """A folder an earlier `specheads eval` wrote (its metrics.json carries our provenance)."""
    try:
        return "provenance" in json.loads((folder / "metrics.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def check_report_folder(out_dir: str | Path) -> None:
    """Refuse (before any work) an --out holding files an eval did not write: they could be replaced."""
    check_output(Path(out_dir), is_report_folder, "an eval output folder",
                 "choose another --out (a new or empty folder, or an earlier eval's)")


def write_report(out_dir: str | Path, metrics: dict, outputs: list[dict] | None = None,
                 verifier_json: dict | None = None, bench: dict | None = None) -> dict:
    """Plots + report.md + metrics.json (with the plot names) under out_dir; returns metrics."""
    out = Path(out_dir)
    spec = metrics.get("speculative") or metrics.get("offline") or {}
    uncond = spec.get("acceptance_per_position") or spec.get("acc_uncond") or []
    cond = spec.get("acceptance_per_position_conditional") or spec.get("acc_cond") or []
    measured = measured_chain_speedups(verifier_json) if verifier_json else None
    plots = {}
    if uncond:
        plots["acceptance"] = plot_acceptance(out / "acceptance.png", uncond, cond, "Acceptance per draft position").name
    if outputs:
        metrics["tau_by_category"] = tau_by_category(outputs)
        plots["tau_by_category"] = plot_tau_by_category(out / "tau_by_category.png", metrics["tau_by_category"],
                                                        "tau by prompt category").name
    if metrics.get("prediction"):
        plots["speedup"] = plot_speedup(out / "speedup.png", metrics["prediction"], measured,
                                        "Speed-up vs draft length").name
        if measured:
            metrics["measured_chain_speedup"] = {str(k): v for k, v in sorted(measured.items())}
    if metrics.get("calibration"):
        plots["reliability"] = plot_reliability(out / "reliability.png", metrics["calibration"], "Draft calibration").name
    if bench:
        plots["concurrency"] = plot_concurrency(out / "concurrency.png", concurrency_series(bench),
                                                "Server throughput over concurrency").name
    metrics["plots"] = plots
    write_json(out / "metrics.json", metrics)
    write_text(out / "report.md", report_markdown(metrics, plots, measured))
    return metrics


def with_recommendations(readme: str, adv: dict) -> str:
    """README text with its recommended-settings section added or replaced, and its serve commands
    drafting the settled k (`recommend.with_recommended_k`) when the advice speculates."""
    k = recommended_k(adv)
    readme = with_recommended_k(readme, k) if k else readme
    lines = readme.rstrip("\n").split("\n")
    if RECOMMENDED in lines:
        start = lines.index(RECOMMENDED)
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        lines = lines[:start] + lines[end:]
    text = "\n".join(lines).rstrip("\n")
    return text + "\n\n" + "\n".join(advice_lines(adv))


def attach_to_export(export_dir: str | Path, eval_dir: str | Path) -> Path:
    """Copy eval_dir's metrics.json, report.md and plots into EXPORT/eval/ and put the
    recommended settings into EXPORT/README.md (what `specheads push` publishes)."""
    export_dir, eval_dir = Path(export_dir), Path(eval_dir)
    metrics_path = eval_dir / "metrics.json"
    if not metrics_path.is_file():
        raise ReportError(f"{metrics_path} does not exist: run `specheads eval` first")
    metrics = json.loads(metrics_path.read_text())
    dest = export_dir / "eval"
    dest.mkdir(exist_ok=True)
    for name in ["metrics.json", "report.md", *metrics.get("plots", {}).values()]:
        if (eval_dir / name).is_file():  # each file whole or not at all, even if killed
            write_bytes(dest / name, (eval_dir / name).read_bytes())
    readme = export_dir / "README.md"
    if metrics.get("advice") and readme.is_file():
        write_text(readme, with_recommendations(readme.read_text(), metrics["advice"]))
    return dest
