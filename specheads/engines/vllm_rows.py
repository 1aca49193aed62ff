"""`make engine-check`'s vLLM decode rows: every drafter kind vLLM's CPU runner serves, its free proposers
and each trained run's export, decoded by vLLM's own server (vllm_check) and reported as EngineCheck rows.

config = vLLM served the setting (REFUSED: vLLM said why, in its words); weights = on a trained run's
EAGLE-3 export, each injected fault (vllm_check.FAULTS) made vLLM's own acceptance fall; forward =
greedy-equal to the same vLLM without speculation, drafts made, and on a trained export vLLM's accepted
tokens per position within vllm_check.ACCEPTANCE_TOLERANCE of our verifier's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from specheads.engine_facts import VLLM_CPU, VLLM_CPU_FREE_PROPOSERS
from specheads.engines import vllm_check
from specheads.engines import vllm_server as vs
from specheads.engines.check import FAIL, PASS, REFUSED, EngineCheck, Stage

K = 3  # draft tokens per step for every row (the demo recipe's k)


@dataclass
class DecodeRow:
    """One setting vLLM decodes: a drafter export (`export`) or a free proposer (`export` None)."""

    name: str
    kind: str
    format: str
    spec: vs.SpecConfig
    target: Path
    export: Path | None = None
    trained: bool = False


def decode_rows(export_rows, free_target: Path, free: bool = True) -> list[DecodeRow]:
    """`export_rows` (matrix.Row: the kinds' small exports and trained runs' exports in a vLLM format)
    as decode rows, then (`free`) vLLM's free proposers on `free_target`."""
    rows = [DecodeRow(r.name, r.kind, r.format, vs.drafter(r.export, r.kind, r.format, K, r.name),
                      r.target or r.export, r.export, r.trained) for r in export_rows]
    return rows + [DecodeRow(m, m, "-", vs.free_proposer(m, K), free_target) for m in VLLM_CPU_FREE_PROPOSERS if free]


def run(rows: list[DecodeRow], work: Path, prompts_file: Path | None, limit: int, n_predict: int,
        log=print) -> list[tuple[DecodeRow, EngineCheck]]:
    """Every row decoded; vLLM's plain output of each target decoded once and shared by its rows."""
    plain: dict[Path, list] = {}
    out = []
    for row in rows:
        log(f"== vLLM decode: {row.name} ({row.kind}, {row.format})")
        report = EngineCheck(str(row.export or row.target), vs.ENGINE, row.kind, row.format,
                             engine_version=VLLM_CPU.release)
        started = time.time()
        one(row, report, work / row.name, prompts_file, limit, n_predict, plain, log)
        report.seconds = time.time() - started
        log(f"   {report.stages.get('forward', report.stages['config']).status}")
        out.append((row, report))
    return out


def one(row: DecodeRow, report: EngineCheck, work: Path, prompts_file, limit: int, n_predict: int,
        plain: dict, log) -> None:
    """Fill `report` with one row's stages."""
    kw = dict(prompts_file=prompts_file, limit=limit, n_predict=n_predict, threads=2, progress=log)
    try:
        r = vllm_check.check(row.spec, row.target, work, export_dir=row.export, compare_ours=row.trained,
                             require_accepted=row.trained, plain=plain.get(row.target), **kw)
    except vs.VllmRefused as e:
        report.stages["config"] = Stage(REFUSED, str(e))
        return
    except vs.VllmError as e:
        report.stages["config"] = Stage(FAIL, str(e)[-1500:])
        return
    plain[row.target] = r["plain"]
    report.stages["config"] = Stage(PASS, f"served with --speculative-config {row.spec.json}")
    report.engine_config = row.spec.config or {}
    if row.trained:
        faults = [vllm_check.fault_check(f, row.export, r, row.target, work / "faults", **kw)
                  for f in vllm_check.FAULTS]
        missed = [f["fault"] for f in faults if f["caught"] is False]
        caught = [f["fault"] for f in faults if f["caught"]]
        report.stages["weights"] = Stage(FAIL if missed else PASS, "; ".join(
            f"injected fault not caught: {f['fault']} ({f['how']})" for f in faults if f["caught"] is False)
            or f"injected faults caught by vLLM's acceptance: {', '.join(caught) or 'none applicable'}")
        report.numbers["faults"] = faults
    report.stages["forward"] = Stage(PASS if r["verdict"] == "PASS" else FAIL, "; ".join(r["problems"]))
    counters = r["vllm"] or {}
    report.numbers.update({"prompts": r["prompts"], "greedy_equal": r["greedy_equal"],
                           "drafted": counters.get("draft_tokens"), "accepted": counters.get("accepted_tokens"),
                           "accepted_per_drafted": counters.get("acceptance_rate"),
                           "accepted_per_pos": counters.get("accepted_per_pos"), "drafts": counters.get("drafts"),
                           "ours_accepted_per_drafted": (r["ours"] or {}).get("accepted_per_drafted"),
                           "ours_accepted_per_pos": (r["ours"] or {}).get("accepted_per_pos"),
                           "threads": r["threads"], "dtype": r["dtype"], "startup_s": r["startup_s"],
                           "load_average": r["load_average"]})
