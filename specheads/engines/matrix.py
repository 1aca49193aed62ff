"""`make engine-check`: every head kind x export format x engine, checked with the engines' own code.

Builds a small export of every kind and format into `OUT/exports/` (random-weight heads on the tiny
test-preset target; MTP on tiny DeepSeek-V3 / Qwen3-Next / Qwen3.5 targets faithful to the released
configs), adds the demo's exports when a demo run is given, runs `specheads.engines.check` on each
with each engine that can serve its format (one probe at a time), and writes `OUT/engine-check.json`
and `OUT/engine-check.md` (kind x format x engine -> config / weights / layers / forward).
Exits non-zero when any check fails.

    python -m specheads.engines.matrix --out runs/engine-check [--run runs/demo[:TARGET]] [--runs-only] \
        [--engines vllm,sglang,llama.cpp]

llama.cpp (in the default; built once on first use) decodes every export it runs
(engine_facts.LLAMA_CPP_SPEC) plain and speculatively in `llama-server` on the CPU
(specheads.engines.llamacpp_check): config = converted to GGUF and loaded, weights = the sidecar records
the export's aux layer ids and d2t and three injected faults are caught (EAGLE-3), forward = every
speculative output equal to plain, and for a trained run's export drafts accepted at our verifier's
rate (random-weight heads are rarely accepted).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoModelForCausalLM

from specheads.atomic import write_json, write_text
from specheads.builtin.family_targets import save_family_target
from specheads.builtin.tiny_target import cached_tiny_target
from specheads.engine_facts import FORMAT_ENGINES, LLAMA_CPP, LLAMA_CPP_SPEC, VLLM_CPU_DECODE_ROWS
from specheads.engines import llamacpp as lc
from specheads.engines import llamacpp_check, vllm_rows
from specheads.engines.check import FAIL, PASS, PROBES, REFUSED, EngineCheck, Stage, format_report, prepare, run_jobs
from specheads.export import export
from specheads.export.checkpoint import Checkpoint, save_checkpoint
from specheads.export.contract_rules import META_FILE
from specheads.kinds import KINDS, Example
from specheads.provenance import provenance
from specheads.target import Target

STAGES = ("config", "weights", "layers", "forward")
LLAMA_CPP_KEY = "llama.cpp"  # --engines name of the decoding check (not a probe)
VLLM_CPU_KEY = "vllm-cpu"  # --engines name of vLLM's decode rows (vllm_rows; not a probe)
DECODERS = (LLAMA_CPP_KEY, VLLM_CPU_KEY)


@dataclass
class Row:
    """One export to check: what it is, where it is, the target it was trained on."""

    name: str
    kind: str
    format: str
    export: Path
    target: Path | None
    engines: tuple[str, ...] = ()
    note: str = ""
    trained: bool = False  # a trained run's export (llama.cpp: its drafts must be accepted)


# --- building the small exports ----------------------------------------------------------------------
def fingerprint_provenance(target) -> dict:
    return provenance(target=target.fingerprint())


def save_example(root: Path, head, target_path: Path, prov: dict):
    """A one-step training checkpoint of `head` under `root/run`, recorded as trained on `target_path`."""
    return save_checkpoint(root / "run", 1, head.float(), recipe={"target": {"path": str(target_path)}},
                           provenance=prov, trainer_state={})


def family_target(root: Path, family: str, tiny: Path, vocab: int):
    """(folder, Target) of a tiny `family` target with the test target's tokenizer (built once)."""
    folder = root / "targets" / family
    if not (folder / "config.json").is_file():
        save_family_target(folder, family, vocab=vocab, tokenizer_dir=tiny)
    return folder, Target(AutoModelForCausalLM.from_pretrained(folder), None, folder)


def example_checkpoint(root: Path, example: Example, tiny: Path, target) -> tuple[Checkpoint, Path]:
    """(checkpoint, target folder) of `example`, reused from `root/checkpoints` when there."""
    folder = root / "checkpoints" / example.name
    found = sorted(folder.glob("run/checkpoint-*"))
    target_path = tiny
    if example.family:
        target_path, target = family_target(root, example.family, tiny, target.vocab_size)
    if found:
        return Checkpoint(found[-1]), target_path
    prov = fingerprint_provenance(target) if not example.family else provenance(target={
        "vocab_size": target.vocab_size, "hidden_size": target.hidden_size, "name": example.family})
    return save_example(folder, example.build(target, example.seed), target_path, prov), target_path


def build_exports(root: Path, preset: str = "test", only: tuple[str, ...] | None = None) -> list[Row]:
    """Every kind's matrix examples x their formats as small exports under `root` (reused when there),
    on the tiny target's `preset`; `only`: just these row names."""
    root.mkdir(parents=True, exist_ok=True)
    tiny = cached_tiny_target(preset, progress=False)
    target = Target.load(str(tiny), device="cpu")
    V, rows = target.vocab_size, []
    for kind, spec in KINDS.items():
        for example in (e for e in spec.examples if e.matrix):
            formats = [f for f in example.formats if only is None or f"{example.name}-{f}" in only]
            if not formats:
                continue
            ckpt, target_path = example_checkpoint(root, example, tiny, target)
            checked_against = None if example.family else tiny  # MTP: the export is the target
            for fmt in formats:
                out = root / f"{example.name}-{fmt}"
                if not (out / "specheads.json").is_file():
                    export(ckpt, fmt, out)
                rows.append(Row(f"{example.name}-{fmt}", kind, fmt, out, checked_against, FORMAT_ENGINES[fmt],
                                example.note.format(V=V, half=V // 2)))
    return rows


def run_rows(run: Path, target: Path | None = None) -> list[Row]:
    """A trained run's exports (`make demo`, `make real`: RUN/export/FORMAT), checked against its target
    (RUN/target unless given: `make real` keeps the converted target in the user cache)."""
    rows, target = [], target or run / "target"
    label = run.name
    for fmt in FORMAT_ENGINES:
        folder = run / "export" / fmt
        if (folder / "config.json").is_file():
            kind = json.loads((folder / META_FILE).read_text())["kind"]  # the head trained in that run
            rows.append(Row(f"{label}-{fmt}", kind, fmt, folder, target, FORMAT_ENGINES[fmt],
                            f"the trained head of {label}", trained=True))
    if not rows:
        raise FileNotFoundError(f"{run / 'export'}: no export; run `make demo RUN={run}` (or `make real`) first")
    if not (target / "config.json").is_file():
        raise FileNotFoundError(f"{target}: not a target folder; pass RUN:TARGET (make engine-check TARGET=...)")
    return rows


def parse_run(text: str) -> tuple[Path, Path | None]:
    """`RUN` or `RUN:TARGET` -> absolute paths."""
    run, _, target = text.partition(":")
    return Path(run).resolve(), Path(target).resolve() if target else None


# --- running and reporting -----------------------------------------------------------------------------
def run_checks(rows: list[Row], engines: list[str], work: Path, log=print) -> list[tuple[Row, EngineCheck]]:
    """Every row with every engine that serves its format (one engine process per engine where the
    probe takes a batch)."""
    pairs = [(row, engine) for row in rows for engine in row.engines if engine in engines]
    jobs = []
    for row, engine in pairs:
        log(f"== preparing {row.name} ({row.kind}, {row.format}) for {engine}")
        jobs.append(prepare(row.export, engine, row.target, work=work / row.name))
    log(f"== running {len(jobs)} engine checks")
    reports = run_jobs(jobs)
    for report in reports:
        log(format_report(report))
    return [(row, report) for (row, _), report in zip(pairs, reports)]


def llamacpp_checks(rows: list[Row], work: Path, log=print) -> list[tuple[Row, EngineCheck]]:
    """Every row llama.cpp runs, decoded plain and speculatively (specheads.engines.llamacpp_check):
    config = converted and loaded, weights = the sidecar records what the export says and each injected
    fault (EAGLE-3) is caught, forward = greedy-equal (and, trained EAGLE-3, acceptance within
    llamacpp_check.ACCEPTANCE_TOLERANCE of our verifier's)."""
    out = []
    for row in (r for r in rows if (r.kind, r.format) in LLAMA_CPP_SPEC):
        log(f"== llama.cpp: {row.name} ({row.kind}, {row.format})")
        report = EngineCheck(str(row.export), LLAMA_CPP_KEY, row.kind, row.format, engine_version=LLAMA_CPP.series)
        started = time.time()
        llamacpp_row(row, report, work / row.name / LLAMA_CPP_KEY, log)
        report.seconds = time.time() - started
        log(f"   {report.stages.get('forward', report.stages['config']).status}")
        out.append((row, report))
    return out


def llamacpp_row(row: Row, report: EngineCheck, work: Path, log=print) -> None:
    """Fill `report` with one row's llama.cpp stages (a head llama.cpp cannot run: REFUSED, in its words)."""
    target = row.target or row.export  # MTP: the export is the target
    try:
        llamacpp_check.refuse_early(row.export)
        g = llamacpp_check.prepare(row.export, target, work, lc.ensure(progress=log), log)
        r = llamacpp_check.check(row.export, target, work, limit=3, n_predict=48, require_accepted=row.trained,
                                 compare_ours=row.trained, omp="PASSIVE", progress=log, prepared=g)
    except lc.RefusedExport as e:
        report.stages["config"] = Stage(REFUSED, str(e))
        return
    except lc.LlamaCppError as e:
        report.stages["config"] = Stage(FAIL, str(e)[-1500:])
        return
    pre = ((r["conversions"].get("target") or {}).get("pre_tokenizer") or {}).get("fallback_applied")
    report.stages["config"] = Stage(PASS, "converted to GGUF and loaded" + (f" (pre-tokenizer {pre})" if pre else ""))
    static = r["sidecar_problems"]
    faults = [llamacpp_check.fault_check(row.export, target, work / "faults" / f, f, g, limit=2, n_predict=32,
                                         compare_ours=row.trained, omp="PASSIVE", progress=lambda m: None)
              for f in (llamacpp_check.FAULTS if r["spec_type"] == "draft-eagle3" else ())]
    missed = [f["fault"] for f in faults if f["caught"] is False]
    caught = [f["fault"] for f in faults if f["caught"]]
    report.stages["weights"] = Stage(FAIL if static or missed else PASS, "; ".join(
        static + [f"injected fault not caught: {m}" for m in missed]) or f"injected faults caught: {', '.join(caught)}")
    dynamic = [p for p in r["problems"] if p not in static]
    report.stages["forward"] = Stage(PASS if not dynamic else FAIL, "; ".join(dynamic))
    report.numbers = {k: r[k] for k in ("prompts", "drafted", "accepted", "accepted_per_drafted", "greedy_equal",
                                        "threads", "omp_wait_policy", "quantization", "tok_s", "load_average")}
    report.numbers["ours_accepted_per_drafted"] = (r["ours"] or {}).get("accepted_per_drafted")
    report.numbers["faults"] = faults


def vllm_cpu_checks(rows: list[Row], out: Path, runs: list[str], runs_only: bool = False, only: str | None = None,
                    log=print) -> list[tuple[Row, EngineCheck]]:
    """vLLM's decode rows (vllm_rows): the kinds' small exports on the demo's target and vLLM's free
    proposers (unless `runs_only`), and every trained run's export in a vLLM format, on the first run's
    held-out prompts (else three built-in prompts)."""
    exports = [] if runs_only else build_exports(out / "exports-vllm-cpu", "default", VLLM_CPU_DECODE_ROWS)
    exports += [r for r in rows if r.trained and r.format == "vllm"]
    prompts = next((parse_run(t)[0] / "data" / "heldout_prompts.jsonl" for t in runs
                    if (parse_run(t)[0] / "data" / "heldout_prompts.jsonl").is_file()), None)
    decode = vllm_rows.decode_rows(exports, cached_tiny_target("default", progress=False), free=not runs_only)
    decode = [d for d in decode if not only or only in d.name]
    results = vllm_rows.run(decode, out / "work-vllm-cpu", prompts, limit=6, n_predict=64, log=log)
    return [(Row(d.name, d.kind, d.format, d.export or d.target, d.target, trained=d.trained,
                 note=d.spec.json or ""), r) for d, r in results]


def markdown(results: list[tuple[Row, EngineCheck]], seconds: float) -> str:
    lines = ["| kind | format | engine | export | config | weights | layers | forward | notes |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row, r in results:
        cells = [r.stages.get(s) for s in STAGES]
        status = [c.status if c else "-" for c in cells]
        notes = []
        if "logits_max_abs_diff" in r.numbers:
            n = r.numbers
            notes.append(f"logits max diff {n['logits_max_abs_diff']:.1e}, argmax {n['argmax_equal']}/{n['positions']}")
        for c in cells:
            if c and c.status in (FAIL, "NOT RUN", "REFUSED") and c.detail:
                notes.append(" ".join(c.detail.split())[:160].replace("|", "/"))
                break
        if "accepted_per_drafted" in r.numbers:
            n = r.numbers
            ours = n.get("ours_accepted_per_drafted")
            speed = n.get("tok_s") or {}
            notes.append(f"decoded: greedy-equal {n['greedy_equal']}, accepted/drafted {n['accepted']}/{n['drafted']}"
                         + (f" (ours {ours:.3f})" if ours is not None else "")
                         + (f", tok/s {speed['plain']:.0f} plain / {speed['spec']:.0f} drafted" if speed.get("spec") else "")
                         + (f", {sum(bool(f['caught']) for f in n['faults'])} faults caught" if n.get("faults") else ""))
        if row.note:
            notes.append(row.note)
        lines.append(f"| {row.kind} | {row.format} | {r.engine} {r.engine_version or ''} | {row.name} | "
                     + " | ".join(status) + f" | {'; '.join(notes)} |")
    lines.append("")
    lines.append(f"{len(results)} checks, {sum(not r.passed for _, r in results)} failed, {seconds:.0f} s.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for the exports, the probes' files and the report")
    p.add_argument("--run", "--demo", dest="runs", action="append", default=[], metavar="RUN[:TARGET]",
                   help="a trained run folder (make demo / make real) whose export/ folders are checked too, "
                        "against TARGET (default RUN/target); repeatable")
    p.add_argument("--runs-only", action="store_true", help="check only the --run exports, not the kind x format matrix")
    p.add_argument("--engines", default=",".join([*PROBES, *DECODERS]), help="comma-separated engines (default: all)")
    p.add_argument("--only", help="check only rows whose name contains this")
    a = p.parse_args(argv)
    engines = [e for e in a.engines.split(",") if e]
    probed = [e for e in engines if e not in DECODERS]
    missing = [e for e in probed if not (Path(__file__).with_name(PROBES.get(e, "?"))).is_file()]
    if missing or any(e not in PROBES for e in probed):
        print(f"engine-check: no probe for {missing or probed}; engines with one: {', '.join(PROBES)} "
              f"(and {', '.join(DECODERS)}, decoding)", file=sys.stderr)
        return 2
    out, started = Path(a.out).resolve(), time.time()  # absolute: each probe runs in its own folder
    try:
        rows = [row for text in a.runs for row in run_rows(*parse_run(text))]
    except FileNotFoundError as e:
        print(f"engine-check: {e}", file=sys.stderr)
        return 2
    if not a.runs_only:
        rows += build_exports(out / "exports")
    if a.only:
        rows = [r for r in rows if a.only in r.name]
    results = run_checks(rows, probed, out / "work") if probed else []
    if LLAMA_CPP_KEY in engines:
        results += llamacpp_checks(rows, out / "work")
    if VLLM_CPU_KEY in engines:
        results += vllm_cpu_checks(rows, out, a.runs, a.runs_only, a.only)
    seconds = time.time() - started

    write_json(out / "engine-check.json", {"seconds": seconds, "engines": engines, "checks": [
        {"name": row.name, "kind": row.kind, "format": row.format, "note": row.note, **r.to_dict()}
        for row, r in results]})
    write_text(out / "engine-check.md", markdown(results, seconds))
    print(markdown(results, seconds))
    failed = [f"{row.name} ({r.engine})" for row, r in results if not r.passed]
    if failed:
        print(f"engine-check: FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
