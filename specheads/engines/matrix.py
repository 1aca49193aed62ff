"""`make engine-check`: every head kind x export format x engine, checked with the engines' own code.

Builds a small export of every kind and format into `OUT/exports/` (random-weight heads on the tiny
test-preset target; MTP on tiny DeepSeek-V3 / Qwen3-Next / Qwen3.5 targets faithful to the released
configs), adds the demo's exports when a demo run is given, runs `specheads.engines.check` on each
with each engine that can serve its format (one probe at a time), and writes `OUT/engine-check.json`
and `OUT/engine-check.md` (kind x format x engine -> config / weights / layers / forward).
Exits non-zero when any check fails.

    python -m specheads.engines.matrix --out runs/engine-check [--run runs/demo[:TARGET]] [--runs-only] [--engines vllm,sglang]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specheads.atomic import write_json, write_text
from specheads.builtin.family_targets import save_family_target
from specheads.builtin.tiny_target import cached_tiny_target
from specheads.engines.check import EngineCheck, FAIL, PROBES, format_report, prepare, run_jobs
from specheads.export import export
from specheads.export.checkpoint import Checkpoint, save_checkpoint
from specheads.heads.dflash import DFlashHead, DFlashOptions
from specheads.heads.draft import DraftHead, DraftOptions
from specheads.heads.eagle import EagleHead, EagleOptions
from specheads.heads.eagle3 import Eagle3Head, Eagle3Options
from specheads.heads.medusa import MedusaHead, MedusaOptions
from specheads.heads.mtp import MtpHead, MtpOptions
from specheads.provenance import provenance
from specheads.target import Target



# export format -> the engines that load it (Medusa: both engines are asked, and must refuse it)
FORMAT_ENGINES = {"vllm": ("vllm",), "vllm-native": ("vllm",), "sglang": ("sglang",),
                  "vllm-0.32": ("vllm",), "medusa": ("sglang",)}
MTP_FAMILIES = ("deepseek_v3", "qwen3_next", "qwen3_5")
STAGES = ("config", "weights", "layers", "forward")


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


# --- building the small exports ----------------------------------------------------------------------
def _fingerprint_provenance(target) -> dict:

    return provenance(target=target.fingerprint())


def _checkpoint(root: Path, head, target_path: Path, prov: dict):

    return save_checkpoint(root / "run", 1, head.float(), recipe={"target": {"path": str(target_path)}},
                           provenance=prov, trainer_state={})


def _perturb(head, scale: float, seed: int) -> None:
    """Random weights that make every tensor matter (norms away from 1, no pass-through init)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            if p.is_floating_point():
                p.add_(torch.randn(p.shape, generator=g) * scale)


def _random_head(head_cls, options, target, seed: int, scale: float = 0.0, init_from_target: bool = False):
    """A `head_cls` head for `target` built under `seed`; initialised from the target and/or
    perturbed by `scale` (0: not perturbed) when asked."""
    torch.manual_seed(seed)
    head = head_cls.for_target(options, target.config)
    if init_from_target:
        head.init_from_target(target)
    if scale:
        _perturb(head, scale, seed)
    return head


def eagle3_head(target, draft_vocab: int, seed: int):

    head = _random_head(Eagle3Head, Eagle3Options(ttt_steps=3, draft_vocab_size=draft_vocab), target, seed, 0.05)
    V = target.vocab_size
    if draft_vocab < V:  # a scattered draft vocabulary, so a wrong d2t shows
        used = torch.sort(torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:draft_vocab]).values
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[used] = True
        head.set_vocab_map(used - torch.arange(draft_vocab), t2d)
    return head


def peagle_head(target, seed: int):
    """P-EAGLE: an EAGLE-3 head drafting in parallel (its mask_hidden perturbed like the rest)."""

    options = Eagle3Options(ttt_steps=3, draft_vocab_size=target.vocab_size // 2, parallel_drafting=True)
    return _random_head(Eagle3Head, options, target, seed, 0.05)


def dflash_head(target, seed: int):

    return _random_head(DFlashHead, DFlashOptions(num_layers=1, block_size=4), target, seed, 0.05)


def eagle_head(target, seed: int):

    return _random_head(EagleHead, EagleOptions(ttt_steps=3), target, seed, 0.05)


def draft_head(target, seed: int):

    return _random_head(DraftHead, DraftOptions(num_layers=2, ttt_steps=3), target, seed, 0.02, init_from_target=True)


def medusa_head(target, seed: int):

    return _random_head(MedusaHead, MedusaOptions(num_heads=3, num_layers=1), target, seed, init_from_target=True)


def mtp_head(target, seed: int):

    return _random_head(MtpHead, MtpOptions(num_layers=1, ttt_steps=1), target, seed, 0.02, init_from_target=True)


def _export_all(root: Path, name: str, kind: str, ckpt, formats, target_path: Path | None, rows: list[Row],
                note: str = "") -> None:

    for fmt in formats:
        out = root / f"{name}-{fmt}"
        if not (out / "specheads.json").is_file():
            export(ckpt, fmt, out)
        rows.append(Row(f"{name}-{fmt}", kind, fmt, out, target_path, FORMAT_ENGINES[fmt], note))


def build_exports(root: Path) -> list[Row]:
    """Every kind x format as a small export under `root` (reused when already there)."""

    root.mkdir(parents=True, exist_ok=True)
    tiny = cached_tiny_target("test", progress=False)
    target = Target.load(str(tiny), device="cpu")
    prov, V, rows = _fingerprint_provenance(target), target.vocab_size, []

    def ckpt(name, head):
        folder = root / "checkpoints" / name
        found = sorted(folder.glob("run/checkpoint-*"))
        if found:

            return Checkpoint(found[-1])
        return _checkpoint(folder, head, tiny, prov)

    _export_all(root, "eagle3", "eagle3", ckpt("eagle3", eagle3_head(target, V // 2, 1)),
                ("vllm", "vllm-native", "sglang"), tiny, rows, f"draft vocab {V // 2} of {V}")
    _export_all(root, "eagle3-fullvocab", "eagle3", ckpt("eagle3-fullvocab", eagle3_head(target, V, 2)),
                ("vllm", "vllm-native", "sglang"), tiny, rows, f"draft vocab = V = {V}: no d2t / t2d")
    _export_all(root, "peagle", "eagle3", ckpt("peagle", peagle_head(target, 7)), ("vllm", "vllm-native"), tiny,
                rows, "P-EAGLE (parallel drafting)")
    _export_all(root, "dflash", "dflash", ckpt("dflash", dflash_head(target, 8)), ("vllm", "vllm-native", "sglang"),
                tiny, rows, "block size 4, 8 anchors")
    _export_all(root, "eagle", "eagle", ckpt("eagle", eagle_head(target, 3)), ("vllm", "sglang"), tiny, rows)
    _export_all(root, "draft", "draft", ckpt("draft", draft_head(target, 4)), ("vllm", "sglang"), tiny, rows)
    _export_all(root, "medusa", "medusa", ckpt("medusa", medusa_head(target, 5)), ("vllm-0.32", "medusa"), tiny,
                rows, "refused by both engines")
    for family in MTP_FAMILIES:
        folder = root / "targets" / family
        if not (folder / "config.json").is_file():
            save_family_target(folder, family, vocab=V, tokenizer_dir=tiny)
        fam_target = Target(__import__("transformers").AutoModelForCausalLM.from_pretrained(folder), None, folder)
        fp = {"vocab_size": fam_target.vocab_size, "hidden_size": fam_target.hidden_size, "name": family}

        name = f"mtp-{family}"
        found = sorted((root / "checkpoints" / name).glob("run/checkpoint-*"))
        if found:

            c = Checkpoint(found[-1])
        else:
            c = _checkpoint(root / "checkpoints" / name, mtp_head(fam_target, 6), folder, provenance(target=fp))
        _export_all(root, name, "mtp", c, ("vllm", "sglang"), None, rows, f"tiny {family} (released config, sizes scaled)")
    return rows


def run_rows(run: Path, target: Path | None = None) -> list[Row]:
    """A trained run's exports (`make demo`, `make real`: RUN/export/FORMAT), checked against its target
    (RUN/target unless given: `make real` keeps the converted target in the user cache)."""
    rows, target = [], target or run / "target"
    label = run.name
    for fmt in ("vllm", "vllm-native", "sglang"):
        folder = run / "export" / fmt
        if (folder / "config.json").is_file():
            rows.append(Row(f"{label}-{fmt}", "eagle3", fmt, folder, target, FORMAT_ENGINES[fmt],
                            f"the trained head of {label}"))
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
    p.add_argument("--engines", default=",".join(PROBES), help="comma-separated engines (default: all)")
    p.add_argument("--only", help="check only rows whose name contains this")
    a = p.parse_args(argv)
    engines = [e for e in a.engines.split(",") if e]
    missing = [e for e in engines if not (Path(__file__).with_name(PROBES.get(e, "?"))).is_file()]
    if missing or any(e not in PROBES for e in engines):
        print(f"engine-check: no probe for {missing or engines}; engines with one: {', '.join(PROBES)}", file=sys.stderr)
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
    results = run_checks(rows, engines, out / "work")
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
