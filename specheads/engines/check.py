"""`specheads check-engine`: an export loaded and run by the engine's own code, compared with ours.

The engine side is a probe script (`probe_vllm.py`, `probe_sglang.py`) run as a subprocess under the
engine's virtualenv (`venvs.py`); it imports nothing from specheads. Our side loads the same folder
with `specheads.export.load` and the target with `specheads.target.Target`. Four stages per export:

  config   the engine accepts the folder and derives the method, k, draft architecture, vocabulary
           sizes and aux-layer ids we intended
  weights  every draft parameter the engine creates is written by its loader (sentinel pre-fill),
           every tensor we wrote reaches a parameter (none silently dropped), shapes match
  layers   the target hidden states the engine taps for the draft equal ours (per position: 1e-4, or
           1e-5 of the position's norm where larger: see `row_tolerance`)
  forward  the engine's draft logits equal our head's (same tolerance, same argmax everywhere),
           and the same greedy chain of k tokens (DFlash: the block at every anchor, and the block
           after the prompt as the chain; our side is the head as trained, so an export whose
           config.json makes the engine draft differently fails here)

Probe protocol (every engine):
  CLI      --target DIR --draft DIR --kind KIND --inputs FILE.safetensors --out DIR [--k N]
  inputs   `input_ids` [1, T] int64 (the prompt) and `next_token` [1] int64 (the target's greedy
           token after it, computed here, so both sides draft from the same token); DFlash also
           `anchors` [n] int64: block anchor positions a (context = rows 0..a-1, block = [x_a, or
           next_token when a = T, then mask x k] at positions a..a+k)
  result   OUT/result.json: engine, version, config {method, num_speculative_tokens,
           draft_architecture, vocab_size, draft_vocab_size, aux_layer_ids (the engine's own
           numbering), ...}, weights {created, loaded, never_written, dropped, shape_mismatch, warnings
           (the engine's own warnings while loading the draft)},
           layers / forward ("ok" | "not_run: why" | "failed: ..."), replaced_kernels, error
           (null | {stage, type, message: the engine's own exception text}), cpu {profile, machine,
           features}: the CPU-feature path the engine took (probe_cpu.py; SPECHEADS_ENGINE_CPU forces one)
  tensors  OUT/tensors.safetensors: aux_hidden [T, n_aux*H] (the states the engine feeds the draft,
           in its concatenation order), draft_logits [T, V] (the draft module on the first draft
           pass: row t reads token t+1 and the state at t; scattered to the full vocabulary with
           -inf elsewhere, as the engine does; DFlash: slots 1..k of each anchor's block, [n*k, V]),
           chain [k] (greedy draft tokens after next_token)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specheads.atomic import write_json
from specheads.cli_parsers import check_engine_parser
from specheads.engine_facts import DRAFT_CLASSES, ENGINE_IGNORES, ENGINE_REFUSES, ENGINE_UNUSED, SERVING
from specheads.engines import venvs
from specheads.export import load, read_export_meta
from specheads.kinds import kind_of
from specheads.target import Target
from specheads.verify.registry import make_proposer
from specheads.verify.settings import TreeSpec

PROBES = {"vllm": "probe_vllm.py", "sglang": "probe_sglang.py"}
BATCH_PROBES = {"vllm"}  # probes that also take `--jobs FILE.json` (many exports, one engine import)
TOLERANCE = 1e-4  # absolute below magnitude 1; logits: relative to their largest magnitude
ROW_TOLERANCE = 1e-5  # tapped states: relative to each position's norm (`row_tolerance`)
ANCHORS = 8  # blocks compared per export (kinds that draft blocks at anchors), spread over the prompt
PASS, FAIL, NOT_RUN, REFUSED = "PASS", "FAIL", "NOT RUN", "REFUSED"


@dataclass
class Stage:
    status: str  # PASS | FAIL | NOT RUN | REFUSED
    detail: str = ""


@dataclass
class EngineCheck:
    """One export checked by one engine."""

    export: str
    engine: str
    kind: str
    format: str
    stages: dict[str, Stage] = field(default_factory=dict)
    numbers: dict = field(default_factory=dict)
    engine_config: dict = field(default_factory=dict)
    engine_version: str | None = None
    replaced_kernels: list[str] = field(default_factory=list)
    error: dict | None = None
    cpu: dict = field(default_factory=dict)  # the CPU-feature path the engine took (probe_cpu.py)
    stderr_tail: str = ""
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(s.status != FAIL for s in self.stages.values())

    def to_dict(self) -> dict:
        d = asdict(self)
        d["passed"] = self.passed
        return d


class EngineCheckError(ValueError):
    """The check cannot run (bad export path, unknown engine); the message says what to do."""


# --- inputs --------------------------------------------------------------------------------------
def make_inputs(target, positions: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """input_ids [1, T] (seeded random ids) and next_token [1] (our target's greedy token after them)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (1, positions), generator=g)
    with torch.no_grad():
        logits = target.forward(ids).logits  # [1, T, V]
    return {"input_ids": ids, "next_token": logits[0, -1].argmax().reshape(1)}


def num_positions(max_positions: int, k: int, wanted: int = 256) -> int:
    return max(8, min(wanted, max_positions - k - 2))


# --- running the probe ----------------------------------------------------------------------------
def _run_engine(engine: str, args: list[str], log: Path, cwd: Path, timeout: float) -> int | None:
    """The engine's probe under its own Python (no specheads on the path); exit code, None on timeout."""
    python = venvs.ensure(engine, progress=lambda m: print(m, file=sys.stderr, flush=True))
    cmd = [str(python), str(Path(__file__).with_name(PROBES[engine]))] + args
    env = {k_: v for k_, v in os.environ.items() if k_ not in ("PYTHONPATH", "VIRTUAL_ENV")}
    with log.open("w") as fh:
        try:
            return subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=cwd, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return None


def read_probe_output(engine: str, out: Path, rc: int | None, timeout: float) -> tuple[dict, dict]:
    """(result.json, tensors) of one probe job; a job that left no result is a ProbeDied error."""
    result_file = out / "result.json"
    if not result_file.is_file():
        why = f"timed out after {timeout:.0f} s" if rc is None else f"exited {rc} without a result"
        return {"error": {"stage": "probe", "type": "ProbeDied", "message": f"the {engine} probe {why}"}}, {}
    tensors = {}
    if (out / "tensors.safetensors").is_file():

        tensors = load_file(str(out / "tensors.safetensors"))
    return json.loads(result_file.read_text()), tensors


# --- our side ---------------------------------------------------------------------------------------
class Ours:
    """The export as specheads loads it, on the same inputs as the probe."""

    def __init__(self, export: Path, target_path: Path | None):
        self.meta = read_export_meta(export)
        self.kind, self.format = self.meta.kind, self.meta.format
        self.spec = kind_of(self.kind)
        self.serving = SERVING.get((self.kind, self.format))
        self.target_path = target_path
        self._target = self._head = None

    @property
    def target(self):
        if self._target is None:
            self._target = Target.load(str(self.target_path), dtype="float32", device="cpu")
        return self._target

    @property
    def head(self):
        if self._head is None:
            head = load(self.meta.folder, attn_implementation="eager", check=False)
            self._head = self.spec.prepare(head, self)
        return self._head

    @property
    def runs_forward(self) -> bool:
        """The engines run this kind's draft: the layers and forward stages compare with ours."""
        return self.spec.engine_side is not None

    @property
    def serves_export(self) -> bool:
        """The export is the target checkpoint with the draft written in (MTP)."""
        return self.serving is not None and self.serving.serves == "export"

    def probe_kind(self) -> str:
        return self.spec.probe_name(self.meta.head_config)

    def k(self) -> int:
        return int(self.meta.num_speculative_tokens or 3)

    def features(self, ids: torch.Tensor):
        """(target output, the states the draft reads [T, F]) (None, None: it reads none)."""
        return self.spec.engine_side.features(self, ids)

    @torch.no_grad()
    def draft_logits(self, ids: torch.Tensor, next_token: int, out, anchors: list[int] | None = None,
                     k: int | None = None) -> torch.Tensor:
        """Our draft module on the first pass, as full-vocabulary logits [T, V] (-inf off the draft vocab);
        block drafters: the blocks at `anchors`, [len(anchors) * k, V]."""
        return self.spec.engine_side.first_pass(self, ids, next_token, out, anchors, k or self.k())

    def full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [N, Vd] at their target ids [N, V], -inf elsewhere."""
        if logits.shape[-1] == self.target.vocab_size:
            return logits
        full = logits.new_full((logits.shape[0], self.target.vocab_size), float("-inf"))
        full[:, self.head.to_target_ids(torch.arange(logits.shape[-1]))] = logits
        return full

    @torch.no_grad()
    def chain(self, ids: torch.Tensor, next_token: int, out, k: int) -> list[int]:
        """The greedy chain our decoder drafts after `next_token`."""
        proposer = make_proposer(TreeSpec(kind="chain", k=k), self.head, self.target)
        proposer.start(ids[0], next_token, out)
        return [int(t) for t in proposer.propose(k)]


def spread_anchors(T: int, n: int = ANCHORS) -> torch.Tensor:
    """n anchor positions spread over 1..T (T: the block right after the prompt), ascending."""
    return torch.linspace(1, T, min(n, T)).round().long().unique()


# --- verdicts ----------------------------------------------------------------------------------------
def _engine_error(result: dict, stage: str) -> str | None:
    err = result.get("error")
    if err and err.get("stage") == stage:
        return f"{err.get('type')}: {err.get('message')}"
    return None


def expected_config(ours: Ours, engine: str, k: int) -> dict:
    """The config values the engine must derive from the export (None: not checked)."""
    want = {"method": ours.serving.engine_method if ours.serving else None, "num_speculative_tokens": k}
    want["draft_architecture"] = DRAFT_CLASSES.get((engine, ours.probe_kind(), ours.spec.layout(ours)))
    if ours.runs_forward:
        want["vocab_size"] = ours.target.vocab_size
        want.update(ours.spec.engine_side.expect(ours, engine))
    return want


def judge_config(result: dict, ours: Ours, engine: str, k: int) -> Stage:
    msg = _engine_error(result, "config") or _engine_error(result, "probe")
    if msg:
        return Stage(FAIL, f"the engine refused the folder: {msg}")
    cfg, problems, want = result.get("config") or {}, [], expected_config(ours, engine, k)
    for key, value in want.items():
        if value is not None and (cfg.get(key) not in value if isinstance(value, tuple) else cfg.get(key) != value):
            problems.append(f"{key}: engine {cfg.get(key)!r}, intended {value!r}")
    shown = ", ".join(f"{key} {cfg.get(key)!r}" for key in want if key in cfg)
    return Stage(FAIL, "; ".join(problems) + f" (engine: {shown})") if problems else Stage(PASS, shown)


def our_tensor_names(ours: Ours) -> set[str]:
    """Tensor names in the weight files this export wrote (an MTP export: only its module file)."""

    names = set()
    for rel in (ours.meta.record.get("sha256") or {"model.safetensors": None}):
        path = ours.meta.folder / rel
        if path.is_file():
            with safe_open(str(path), "pt") as fh:
                names |= set(fh.keys())
    return names


def judge_weights(result: dict, ours: Ours, engine: str) -> Stage:
    msg = _engine_error(result, "weights")
    if msg:
        return Stage(FAIL, f"the engine's loader failed: {msg}")
    if (result.get("error") or {}).get("stage") in ("config", "probe"):
        return Stage(NOT_RUN, "an earlier stage failed")
    w = result.get("weights") or {}
    ignored = [re.compile(p) for p in ENGINE_IGNORES.get((engine, ours.kind), ())]
    mine = our_tensor_names(ours)
    received, dropped = set(w.get("loaded") or []), set(w.get("dropped") or [])
    problems = []
    unused = [re.compile(p) for p in ENGINE_UNUSED.get((engine, ours.kind), ())]
    unwritten = sorted(n for n in w.get("never_written") or [] if not any(p.search(n) for p in unused))
    if unwritten:
        problems.append(f"parameters the loader never wrote (still the sentinel): {unwritten}")
    if w.get("warnings"):
        problems.append(f"the engine warned while loading the draft: {w['warnings']}")
    if w.get("shape_mismatch"):
        problems.append(f"shape mismatches: {w['shape_mismatch']}")
    lost = sorted(n for n in mine if n not in received)
    if lost:
        problems.append(f"tensors of ours the loader never received: {lost}")
    silent = sorted(n for n in mine & dropped if not any(p.search(n) for p in ignored))
    if silent:
        problems.append(f"tensors of ours the loader received but dropped: {silent}")
    if problems:
        return Stage(FAIL, "; ".join(problems))
    return Stage(PASS, f"{len(w.get('created') or [])} draft parameters all written; {len(mine)} tensors of ours "
                       f"all loaded" + (f" (ignored by design: {sorted(mine & dropped)})" if mine & dropped else ""))


def _not_run(result: dict, stage: str) -> Stage | None:
    status = result.get(stage) or "not_run: no result"
    if status.startswith("not_run"):
        return Stage(NOT_RUN, status.split(":", 1)[1].strip() if ":" in status else "")
    return None


def _before_compare(result: dict, tensors: dict, stage: str, what: str, name: str, mine) -> Stage | None:
    """The verdict when there is nothing to compare: the engine's `what` failed, the stage did not
    run, or one side's tensor `name` is missing; None when both sides have it."""
    msg = _engine_error(result, stage)
    if msg:
        return Stage(FAIL, f"the engine's {what} failed: {msg}")
    skipped = _not_run(result, stage)
    if skipped:
        return skipped
    if tensors.get(name) is None or mine is None:
        return Stage(FAIL, f"no {name} from the engine" if tensors.get(name) is None else "our side could not run")
    return None


def tolerance(ours: torch.Tensor) -> float:
    """Allowed max |logit diff| against `ours`: fp32 rounding grows with the logits' magnitude."""
    finite = ours[torch.isfinite(ours)]
    scale = float(finite.abs().max()) if finite.numel() else 1.0
    return TOLERANCE * max(1.0, scale)


def row_tolerance(states: torch.Tensor) -> torch.Tensor:
    """Allowed max |diff| per position of tapped states [T, F] -> [T]: 1e-4, or 1e-5 of the row's norm.

    fp32 kernels differ by rounding that grows with the residual stream's norm: SmolLM2-135M's
    layer-27 rows (norms in the thousands, one feature at 26,000) differ by 3.4e-4 between vLLM's
    fused norms and transformers' (6.6e-7 of the row norm), while a tap one layer off differs by
    0.7 in the median feature.
    """
    return torch.clamp(ROW_TOLERANCE * states.norm(dim=-1), min=TOLERANCE)


def judge_layers(result: dict, tensors: dict, ours_states: torch.Tensor | None, numbers: dict) -> Stage:
    early = _before_compare(result, tensors, "layers", "target forward", "aux_hidden", ours_states)
    if early:
        return early
    theirs = tensors["aux_hidden"]
    if theirs.shape != ours_states.shape:
        return Stage(FAIL, f"the engine taps {list(theirs.shape)}, ours {list(ours_states.shape)}")
    rows = (theirs.float() - ours_states.float()).abs().amax(dim=-1)  # [T]
    limits = row_tolerance(ours_states.float())  # [T]
    worst = int((rows / limits).argmax())
    numbers["aux_hidden_max_abs_diff"] = float(rows.max())
    numbers["aux_hidden_worst_ratio"] = float(rows[worst] / limits[worst])
    if bool((rows > limits).any()):
        return Stage(FAIL, f"the engine taps other states: max |diff| {float(rows[worst]):.3g} > "
                           f"{float(limits[worst]):.3g} at position {worst} ({int((rows > limits).sum())} of "
                           f"{len(rows)} positions; wrong layers, or an off-by-one in their numbering)")
    diff = float(rows.max())
    return Stage(PASS, f"{theirs.shape[0]} positions x {theirs.shape[1]} features, max |diff| {diff:.2g}")


def judge_forward(result: dict, tensors: dict, mine: torch.Tensor | None, chain: list[int] | None,
                  numbers: dict) -> Stage:
    early = _before_compare(result, tensors, "forward", "draft forward", "draft_logits", mine)
    if early:
        return early
    theirs = tensors["draft_logits"]
    if theirs.shape != mine.shape:
        return Stage(FAIL, f"logits shape: engine {list(theirs.shape)}, ours {list(mine.shape)}")
    theirs, mine = theirs.float(), mine.float()
    same_support = bool((torch.isfinite(theirs) == torch.isfinite(mine)).all())
    finite = torch.isfinite(mine) & torch.isfinite(theirs)
    diff = float((theirs[finite] - mine[finite]).abs().max()) if finite.any() else float("inf")
    argmax_equal = int((theirs.argmax(-1) == mine.argmax(-1)).sum())
    engine_chain = [int(t) for t in tensors.get("chain", torch.empty(0, dtype=torch.long)).tolist()]
    limit = tolerance(mine)
    numbers.update(logits_max_abs_diff=diff, logits_tolerance=limit, positions=int(mine.shape[0]),
                   argmax_equal=argmax_equal, chain_engine=engine_chain, chain_ours=chain)
    problems = []
    if not same_support:
        problems.append("the engine's draft vocabulary (finite logits) differs from ours: the d2t mapping differs")
    if diff > limit:
        problems.append(f"max |logit diff| {diff:.3g} > {limit:.3g}")
    if argmax_equal != mine.shape[0]:
        problems.append(f"argmax equal on {argmax_equal} of {mine.shape[0]} positions")
    if "chain" in tensors and engine_chain != chain:
        problems.append(f"greedy chain: engine {engine_chain}, ours {chain}")
    if problems:
        return Stage(FAIL, "; ".join(problems))
    chained = f"chain {chain} equal" if "chain" in tensors else "no chain compared (the engine drafts in parallel)"
    return Stage(PASS, f"max |logit diff| {diff:.2g} over {mine.shape[0]} positions, argmax equal on all, {chained}")


# --- the check -----------------------------------------------------------------------------------
@dataclass
class Job:
    """One export prepared for one engine: our side, the inputs file, where the probe writes."""

    export: Path
    engine: str
    ours: Ours
    k: int
    inputs: dict
    work: Path
    started: float

    @property
    def out(self) -> Path:
        return self.work / self.engine

    def probe_args(self) -> dict:
        return {"target": str(self.ours.target_path), "draft": str(self.export), "kind": self.ours.probe_kind(),
                "inputs": str(self.work / "inputs.safetensors"), "out": str(self.out), "k": self.k}


def prepare(export: str | Path, engine: str, target: str | Path | None = None, k: int | None = None,
            positions: int = 256, work: str | Path | None = None) -> Job:
    """Our side of one check: the export read, the target loaded, the probe's inputs written.
    Paths are made absolute: the probe runs in its own working folder."""
    export = Path(export).resolve()
    if engine not in PROBES:
        raise EngineCheckError(f"engine '{engine}': expected one of {', '.join(PROBES)}")
    if not (export / "config.json").is_file():
        raise EngineCheckError(f"{export}: no config.json; pass a folder written by `specheads export`")
    ours = Ours(export, Path(target).resolve() if target else None)
    if ours.serves_export:
        ours.target_path = export  # the MTP export is the target checkpoint with its modules written in
    if ours.target_path is None:
        raise EngineCheckError(f"{export}: pass --target, the target folder the head was trained on")
    k = k or ours.k()
    work = Path(work).resolve() if work else Path(tempfile.mkdtemp(prefix="specheads-engine-check-"))
    (work / engine).mkdir(parents=True, exist_ok=True)
    if ours.runs_forward:
        max_pos = ours.target.context or 256
        inputs = make_inputs(ours.target, num_positions(max_pos, k, positions))
        if ours.spec.engine_side.anchors:
            inputs["anchors"] = spread_anchors(inputs["input_ids"].shape[1])
    else:  # the engine runs no forward for these kinds; the file keeps the protocol uniform
        inputs = {"input_ids": torch.arange(8)[None] % 7 + 1, "next_token": torch.tensor([1])}

    save_file({n: t.contiguous() for n, t in inputs.items()}, str(work / "inputs.safetensors"))
    return Job(export, engine, ours, k, inputs, work, time.time())


def finish(job: Job, result: dict, tensors: dict, tail: str) -> EngineCheck:
    """Judge the engine's result against our side."""
    ours, engine, k = job.ours, job.engine, job.k
    report = EngineCheck(str(job.export), engine, ours.kind, ours.format)
    report.engine_version, report.engine_config = result.get("version"), result.get("config") or {}
    report.replaced_kernels, report.error, report.stderr_tail = (result.get("replaced_kernels") or [],
                                                                 result.get("error"), tail)
    report.cpu = result.get("cpu") or {}
    if (engine, ours.kind) in ENGINE_REFUSES:
        report.stages = _judge_refusal(result, ENGINE_REFUSES[(engine, ours.kind)])
        report.seconds = time.time() - job.started
        return report
    report.stages["config"] = judge_config(result, ours, engine, k)
    report.stages["weights"] = judge_weights(result, ours, engine)
    feats = mine = chain = None
    if tensors:
        ids, next_token = job.inputs["input_ids"], int(job.inputs["next_token"][0])
        try:
            out, feats = ours.features(ids)
            anchors = [int(a) for a in job.inputs["anchors"]] if "anchors" in job.inputs else None
            mine = ours.draft_logits(ids, next_token, out, anchors, k)
            chain = ours.chain(ids, next_token, out, k)
        except Exception as err:  # noqa: BLE001 - reported as our side's failure, next to the engine's result
            report.numbers["ours_error"] = f"{type(err).__name__}: {err}"
    report.stages["layers"] = judge_layers(result, tensors, feats, report.numbers)
    report.stages["forward"] = judge_forward(result, tensors, mine, chain, report.numbers)
    if "ours_error" in report.numbers:
        for name in ("layers", "forward"):
            if report.stages[name].status == FAIL:
                report.stages[name].detail += f" (specheads could not load the folder: {report.numbers['ours_error']})"
    report.seconds = time.time() - job.started
    return report


def run_jobs(jobs: list[Job], timeout: float = 1200.0) -> list[EngineCheck]:
    """Every job's probe, then its verdicts. Engines whose probe takes `--jobs` run a whole batch in one
    process (one engine import); the others one process per job. Jobs run one at a time."""
    reports: dict[int, EngineCheck] = {}
    for engine in dict.fromkeys(j.engine for j in jobs):
        mine = [(i, j) for i, j in enumerate(jobs) if j.engine == engine]
        if engine in BATCH_PROBES and len(mine) > 1:
            batch_dir = mine[0][1].work.parent
            spec = batch_dir / f"{engine}-jobs.json"
            spec.write_text(json.dumps([j.probe_args() for _, j in mine], indent=1))
            log = batch_dir / f"{engine}-batch.log"
            rc = _run_engine(engine, ["--jobs", str(spec)], log, batch_dir, timeout * len(mine))
            tail = log.read_text(errors="replace")[-4000:]
            for i, job in mine:
                result, tensors = read_probe_output(engine, job.out, rc, timeout * len(mine))
                reports[i] = finish(job, result, tensors, tail)
            continue
        for i, job in mine:
            args = [f"--{key}={value}" for key, value in job.probe_args().items()]
            rc = _run_engine(engine, args, job.out / "probe.log", job.out, timeout)
            result, tensors = read_probe_output(engine, job.out, rc, timeout)
            reports[i] = finish(job, result, tensors, (job.out / "probe.log").read_text(errors="replace")[-4000:])
    return [reports[i] for i in range(len(jobs))]


def check_export(export: str | Path, engine: str, target: str | Path | None = None, k: int | None = None,
                 positions: int = 256, work: str | Path | None = None, timeout: float = 1200.0) -> EngineCheck:
    """Run `engine`'s own loader and draft module on `export` and compare with specheads' (see module doc)."""
    return run_jobs([prepare(export, engine, target, k, positions, work)], timeout)[0]


def _judge_refusal(result: dict, why: str) -> dict[str, Stage]:
    err = result.get("error") or {}
    if err.get("stage") == "config":
        return {"config": Stage(REFUSED, f"{why}; the engine says: {err.get('type')}: {err.get('message')}"),
                "weights": Stage(NOT_RUN, "refused"), "layers": Stage(NOT_RUN, "refused"),
                "forward": Stage(NOT_RUN, "refused")}
    return {"config": Stage(FAIL, f"expected the engine to refuse this kind ({why}), but it accepted it: "
                                  f"{json.dumps(result.get('config'))[:300]}")}


# --- output --------------------------------------------------------------------------------------------
def format_report(r: EngineCheck) -> str:
    cpu = f", CPU path {r.cpu['profile']} ({r.cpu.get('machine')})" if r.cpu else ""
    lines = [f"{r.export}: {r.kind} ({r.format}) in {r.engine} {r.engine_version or '?'}{cpu}  "
             f"[{'PASS' if r.passed else 'FAIL'}, {r.seconds:.0f} s]"]
    for name, stage in r.stages.items():
        lines.append(f"  {name:<8} {stage.status:<8} {stage.detail}")
    for kernel in r.replaced_kernels:
        lines.append(f"  replaced: {kernel}")
    if r.error:
        lines.append(f"  engine error ({r.error.get('stage')}): {r.error.get('type')}: {r.error.get('message')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = check_engine_parser().parse_args(argv)
    report = check_export(a.export, a.engine, a.target, a.k, a.positions, a.work, a.timeout)
    print(format_report(report))
    if not report.passed and report.stderr_tail:
        print("--- engine log (tail) ---\n" + report.stderr_tail[-1500:], file=sys.stderr)
    if a.json:

        write_json(a.json, report.to_dict())
    return 0 if report.passed else 1
