"""The SmolLM2 drafter-quality A/B on one GPU inside a short lease: bench/real_model.py (the `make real`
pipeline) and bench/quality_ab_real.py (every option trained on that run's data, cache and steps), with
the target on CUDA, several configurations at once, the best single options then combined.

    python bench/gpu_quality.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --prompts alpaca_en_1k.json \
        --mt-bench mt_bench_questions.jsonl --out DIR [--configs adamw,lr2e3,...] [--deadline 480]

Stages: real_model.py --until export (regenerate 900 + 40 conversations, capture, train the recipe's
drafter for 4 epochs, the held-out table, export); then, at the same time, that run's MT-bench eval
(real_model.py again, k = 3, batch --eval-batch-size: tau and outputs do not depend on the batch) and
the configurations, --parallel processes at a time (each `quality_ab_real.py --configs NAME`); then the
best --combine single options that beat the baseline and set different keys, together (`A+B`);
last, quality_ab_real.py over every finished configuration writes the table. Nothing new starts after
--deadline seconds; what runs then is stopped at --deadline + --grace. Held-out tau is teacher-forced and fp32, as on the CPU; the
regenerated data are the target's own greedy answers, batched on the GPU. Writes DIR/gpu_quality.json
beside the two scripts' own reports, and copies all of them into --results when given.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))  # bench/ siblings
DEFAULT_CONFIGS = ("lr2e3,norm_output,eagle31,qk_norm,lk,tv,dropout,"  # the likelier winners in the first wave
                   "noise,wd,lr5e4,lr3e3,clip1,adamw,freeze_lm_head")


class Jobs:
    """Child processes of this bench, each with its log under OUT/logs; stopped together at the end."""

    def __init__(self, logs: Path, env: dict):
        self.logs, self.env, self.running = logs, env, {}
        logs.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, argv: list[str]) -> None:
        log = (self.logs / f"{name}.log").open("w")
        self.running[name] = subprocess.Popen([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT,
                                              env=self.env, start_new_session=True)
        print(f"[gpu-quality] {name} started", flush=True)

    def reap(self) -> list[tuple[str, int]]:
        """The jobs that ended since the last call, with their exit codes."""
        ended = [(n, p.returncode) for n, p in self.running.items() if p.poll() is not None]
        for name, rc in ended:
            del self.running[name]
            print(f"[gpu-quality] {name} ended (exit {rc})", flush=True)
        return ended

    def stop_all(self) -> list[str]:
        stopped = list(self.running)
        for p in self.running.values():
            p.kill()
        for p in self.running.values():
            p.wait()
        self.running = {}
        return stopped


def final_tau(result_file: Path) -> float | None:
    """The last epoch's held-out tau of one finished configuration (None: not finished)."""
    if not result_file.is_file():
        return None
    return json.loads(result_file.read_text())["epochs"][-1]["tau"]


def combination(base: float | None, taus: dict[str, float | None], count: int,
                known: dict[str, list[str]]) -> str | None:
    """`A+B`: up to `count` configurations whose final tau beats the baseline's, best first, skipping
    one that sets a key a better one already sets (lr2e3+lr3e3 would be lr3e3 again); None when fewer
    than two remain (or the baseline was not scored)."""
    if base is None:
        return None
    pick: list[str] = []
    keys: set[str] = set()
    for name in sorted((n for n, t in taus.items() if t is not None and t > base), key=lambda n: -taus[n]):
        own = {o.split("=", 1)[0] for o in known[name]}
        if len(pick) < count and not own & keys:
            pick.append(name)
            keys |= own
    return "+".join(pick) if len(pick) >= 2 else None


def real_args(a) -> list[str]:
    """bench/real_model.py's arguments for this run (the same for both invocations, so stages resume)."""
    source = ["--gguf", a.gguf] if a.gguf else ["--target", a.target]
    return [str(BENCH / "real_model.py"), *source, "--prompts", a.prompts, "--mt-bench", a.mt_bench,
            "--out", str(a.out / "run"), "--device", a.device, "--regen-batch-size", str(a.regen_batch_size),
            "--train-prompts", str(a.train_prompts), "--heldout-prompts", str(a.heldout_prompts),
            "--max-new-tokens", str(a.max_new_tokens), "--eval-new-tokens", str(a.eval_new_tokens),
            "--mt-bench-per-category", str(a.mt_bench_per_category), "--eval-batch-sizes", str(a.eval_batch_size),
            "--skip-recommended", "--skip-heldout-eval", "--title", "EAGLE-3 on SmolLM2, the target on a GPU",
            *a.real_arg]


def quality_args(a, configs: str) -> list[str]:
    return [str(BENCH / "quality_ab_real.py"), "--run", str(a.out / "run"), "--out", str(a.out / "ab"),
            "--configs", configs, "--device", a.device]


def sweep(a, jobs: Jobs, t0: float, names: list[str], known: dict[str, list[str]]) -> dict:
    """Each configuration in its own process, --parallel at a time, until --deadline; then the best
    --combine single options together. Returns name -> final tau (None: not finished)."""
    queue, combined = list(names), False
    while queue or jobs.running or not combined:
        for _ in jobs.reap():
            pass
        late = time.time() - t0 > a.deadline
        if not queue and not combined and not any(n.startswith("cfg-") for n in jobs.running):
            combined = True
            both = combination(final_tau(a.out / "ab" / "baseline" / "result.json"),
                               {n: final_tau(a.out / "ab" / n / "result.json") for n in names}, a.combine, known)
            if both and not late:
                queue.append(both)
                names = [*names, both]
        while queue and not late and sum(n.startswith("cfg-") for n in jobs.running) < a.parallel:
            name = queue.pop(0)
            jobs.start(f"cfg-{name}", quality_args(a, name))
        if late and time.time() - t0 > a.deadline + a.grace:
            break
        if late and not jobs.running:
            break
        time.sleep(2)
    return {n: final_tau(a.out / "ab" / n / "result.json") for n in names}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--gguf")
    g.add_argument("--target")
    p.add_argument("--prompts", required=True)
    p.add_argument("--mt-bench", required=True)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--results", type=Path, default=None, help="copy the reports into this folder")
    p.add_argument("--configs", default=DEFAULT_CONFIGS)
    p.add_argument("--device", default="cuda")
    p.add_argument("--parallel", type=int, default=7)
    p.add_argument("--combine", type=int, default=2, help="how many of the best single options to combine")
    p.add_argument("--deadline", type=float, default=480, help="seconds after which nothing new starts")
    p.add_argument("--grace", type=float, default=45, help="seconds the running jobs get after the deadline")
    p.add_argument("--threads", type=int, default=2, help="torch threads per child process")
    p.add_argument("--train-prompts", type=int, default=900)
    p.add_argument("--heldout-prompts", type=int, default=40)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--regen-batch-size", type=int, default=128)
    p.add_argument("--eval-new-tokens", type=int, default=128)
    p.add_argument("--eval-batch-size", type=int, default=16)
    p.add_argument("--mt-bench-per-category", type=int, default=10)
    p.add_argument("--real-arg", action="append", default=[],
                   help="one more argument for real_model.py (repeat; e.g. --real-arg=--draft-vocab=64)")
    a = p.parse_args(argv)
    a.out = a.out.resolve()
    import quality_ab_real

    known = quality_ab_real.configs()
    names = [n for n in a.configs.split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown:
        p.error(f"--configs: unknown '{unknown[0]}'; expected some of {', '.join(known)}")
    t0 = time.time()
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "PYTHONUNBUFFERED": "1"}
    jobs = Jobs(a.out / "logs", env)
    report: dict = {"command": " ".join(["python", "bench/gpu_quality.py", *(argv if argv is not None else sys.argv[1:])]),
                    "stages": {}}
    # the pipeline up to the export (real_model.py exits 1 there on purpose: "stopped after the export")
    jobs.start("real-until-export", [*real_args(a), "--until", "export"])
    while jobs.running:
        jobs.reap()
        time.sleep(2)
    stages = json.loads((a.out / "run" / "stages.json").read_text()) if (a.out / "run" / "stages.json").is_file() else {}
    report["stages"]["until_export_s"] = round(time.time() - t0, 1)
    report["real_stages"] = {k: round(v["wall_s"], 1) for k, v in stages.items()}
    if "export" not in stages:
        print(f"[gpu-quality] the pipeline did not reach the export: see {a.out / 'logs' / 'real-until-export.log'}")
        return finish(a, report, 1)
    jobs.start("real-mt-bench", real_args(a))  # the same run again: it goes on with the MT-bench eval
    report["taus"] = sweep(a, jobs, t0, names, known)
    report["stopped"] = jobs.stop_all()
    report["stages"]["sweep_s"] = round(time.time() - t0, 1)
    done = [n for n, t in report["taus"].items() if t is not None]
    if done:  # every finished configuration read back into one table (nothing trains again)
        rc = subprocess.run([sys.executable, *quality_args(a, ",".join(done))], env=env,
                            stdout=(a.out / "logs" / "report.log").open("w"), stderr=subprocess.STDOUT).returncode
        report["report_exit"] = rc
    real = a.out / "run" / "real_model.json"
    if real.is_file():
        e = next(iter(json.loads(real.read_text())["evals"].values()))
        report["mt_bench"] = {k: e.get(k) for k in ("tau", "ngram_tau", "ratio_to_ngram", "greedy_equal",
                                                   "acceptance_per_position", "measured_speedup")}
    return finish(a, report, 0)


def finish(a, report: dict, rc: int) -> int:
    import torch

    from specheads.atomic import write_json

    report["device"] = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    report["torch"] = torch.__version__
    write_json(a.out / "gpu_quality.json", report)
    if a.results:
        a.results.mkdir(parents=True, exist_ok=True)
        for src in (a.out / "gpu_quality.json", a.out / "ab" / "quality_ab_real.json", a.out / "ab" / "quality_ab_real.md",
                    a.out / "run" / "real_model.json", a.out / "run" / "real_model.md"):
            if src.is_file():
                shutil.copy(src, a.results / src.name)
    print(json.dumps(report, indent=1))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
