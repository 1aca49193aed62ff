"""More data for a finished `make real` run: how held-out tau moves with conversations, Magpie
prompts or raw text, and what each costs in CPU-hours.

    python bench/real_model_scaling.py --run runs/real --out runs/real-magpie --magpie 640 \
        [--configs baseline,init_lm_head] [--reuse runs/quality_ab_real] [--epochs 4]
    python bench/real_model_scaling.py --run runs/real --prompts alpaca_en_1k.json --train-prompts 900 \
        --out runs/real-900 [--raw-text wiki.txt] [--results bench/results/real_model_scaling_900.json]

Reuses the run's regenerated conversations, feature capture and held-out set (same prompt split as
bench/real_model.py). New data comes from the prompts the run did not have (`--train-prompts`
above the run's), from prompts the target writes itself (`--magpie N`: `specheads magpie`, then
the ones equal to a held-out, MT-bench or training prompt of the run dropped, whitespace and case
ignored) or from raw text (wiki / web text as `text` rows of about 2,000 characters, supervised on
every token against the target's own distribution; the draft vocabulary is then counted from the
conversations only). The new conversations are answered as the run's were (batched, greedy,
resumable), only they are captured (int8), and training reads the run's capture and the new one as
one (`data.features` a list). Each `--configs` entry (bench/quality_ab.py's options; `baseline`:
the run's recipe) trains the run's epochs over the grown data with one checkpoint per epoch, and
every checkpoint is scored teacher-forced on the run's held-out conversations, beside the same
configuration trained on the run's data alone (the run's own checkpoints for `baseline`; a
bench/quality_ab_real.py result from `--reuse DIR` when there, else trained here): the same numbers
as the run's data/epochs table. Wall seconds of every stage, the run's own included, give each
row's CPU-hours (wall x cores). Writes OUT/scaling.json and OUT/scaling.md (and --results).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality_ab_real as qab  # noqa: E402  (the configurations and the run's setup)
import real_model as rm  # noqa: E402  (the stages and helpers of the full run)


def new_prompts(run: Path, source: Path, data: Path, n_train: int) -> dict:
    """The first n_train train-side prompts of the run's split that the run did not regenerate."""
    rm.split_prompts(source, data, n_train, 0)
    had = {json.loads(line)["id"] for line in (run / "data" / "train_prompts.jsonl").open()}
    rows = [line for line in (data / "train_prompts.jsonl").open() if json.loads(line)["id"] not in had]
    (data / "new_prompts.jsonl").write_text("".join(rows))
    return {"run_had": len(had), "new": len(rows)}


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def run_prompts(run: Path) -> set[str]:
    """Every user prompt the run trained on, held out or evaluated (normalised)."""
    from specheads.data.regenerate_run import read_rows

    seen = set()
    for name in ("train.jsonl", "heldout.jsonl", "heldout_prompts.jsonl", "mt_bench_first.jsonl"):
        path = run / "data" / name
        if path.is_file():
            seen |= {_norm(m["content"]) for r in read_rows(path) for m in r.messages if m["role"] == "user"}
    return seen


def magpie_prompts(target: Path, run: Path, data: Path, a) -> dict:
    """`--magpie` prompts written by the target, less any prompt the run already has."""
    raw = data / "magpie_all.jsonl"
    rm._check(rm.cli(["magpie", "--target", target, "--out", raw, "--n", a.magpie, "--batch-size",
                      a.magpie_batch_size, "--max-new-tokens", 96, "--seed", a.seed, "--device", "cpu",
                      "--dtype", "float32", "--quiet", *a.magpie_arg]), "magpie")
    seen = run_prompts(run)
    rows = [json.loads(line) for line in raw.open()]
    fresh = [r for r in rows if _norm(r["prompt"]) not in seen]
    kept = fresh[:a.magpie_use] if a.magpie_use else fresh
    (data / "magpie_prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    meta = json.loads(Path(str(raw) + ".meta.json").read_text())
    return {"generated": meta.get("counts", {}).get("generated"), "cleaned": len(rows),
            "equal_to_a_run_prompt": len(rows) - len(fresh), "kept": len(kept)}


def raw_text_rows(src: Path, out: Path, chars: int = 2000) -> dict:
    """Plain text (or `text` jsonl) cut at sentence ends into rows of about `chars` characters."""
    raw = src.read_text()
    if src.suffix == ".jsonl":
        raw = " ".join(json.loads(line)["text"] for line in raw.splitlines() if line.strip())
    rows, cur = [], ""
    for sentence in re.split(r"(?<=[.!?])\s+", raw):
        cur = f"{cur} {sentence}".strip()
        if len(cur) >= chars:
            rows.append(cur)
            cur = ""
    out.write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    return {"source": src.name, "rows": len(rows), "chars": sum(map(len, rows))}


def vocab_stats(target: Path, chat: str, out: Path, common: list[str]) -> dict:
    """Draft-vocabulary counts from the regenerated answers only (raw text must not move it)."""
    rm._check(rm.cli(["vocab-stats", rm.RECIPE, f"target.path={target}", f"data.train=[{chat}]", *common,
                      "--out", out]), "vocab-stats")
    return {"file": out.name}


def new_data(a, st, setup: dict, run_dir: Path, data: Path) -> tuple[list[Path], dict]:
    """The files of new conversations (and raw text) and what making them gave."""
    files, info = [], {}
    if a.train_prompts:
        if not a.prompts:
            raise SystemExit("[scaling] --train-prompts needs --prompts (the file the run was made from)")
        info["prompts"] = st.run("prompts", new_prompts, run_dir, Path(a.prompts), data, a.train_prompts)
        if info["prompts"]["new"]:
            info["regenerate"] = st.run("regenerate_new", rm.regenerate, data / "new_prompts.jsonl",
                                        data / "new.jsonl", setup["target"], a)
            files.append(data / "new.jsonl")
    if a.magpie:
        info["magpie"] = st.run("magpie", magpie_prompts, setup["target"], run_dir, data, a)
        info["regenerate_magpie"] = st.run("regenerate_magpie", rm.regenerate, data / "magpie_prompts.jsonl",
                                           data / "magpie.jsonl", setup["target"], a)
        files.append(data / "magpie.jsonl")
    if a.raw_text:
        info["raw_text"] = st.run("raw_text", raw_text_rows, Path(a.raw_text), data / "raw_text.jsonl")
    return files, info


def without(name: str, overrides: list[str], setup: dict, out: Path, reuse: Path | None) -> dict:
    """The configuration on the run's data alone: held-out tau per epoch and its train seconds."""
    if name == "baseline":
        return {"epochs": qab.scored(setup, setup["baseline"]), "train_s": setup["run_stages"]["train_1"],
                "from": "the run's own checkpoints"}
    if reuse is not None and (reuse / name / "result.json").is_file():
        (out / name).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(reuse / name / "result.json", out / name / "result.json")
        where = f"bench/quality_ab_real.py's result in {reuse}"
    else:
        where = "trained here from the run's capture"
    r = qab.run_config(name, overrides, setup, out)
    return {"epochs": r["epochs"], "train_s": r["train_s"], "from": where}


def cpu_hours(seconds: float) -> float:
    return seconds * (os.cpu_count() or 1) / 3600


def run(a) -> dict:
    out, run_dir = Path(a.out).resolve(), Path(a.run).resolve()
    setup = qab.real_setup(run_dir)
    setup["run_stages"] = {k: v["wall_s"] for k, v in json.loads((run_dir / "stages.json").read_text()).items()}
    if a.target:
        setup["target"] = Path(a.target).resolve()
    settings = json.loads((run_dir / "real_model.json").read_text())["settings"]
    for key in ("epochs", "batch_size", "max_new_tokens", "regen_batch_size"):
        if getattr(a, key) is None:
            setattr(a, key, settings[key])
    known = {"baseline": [], **qab.configs()}
    names = a.configs.split(",")
    if unknown := [n for n in names if n not in known]:
        raise SystemExit(f"[scaling] --configs: unknown '{unknown[0]}'; expected some of {', '.join(known)}")
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    st = rm.Stages(out)
    files, info = new_data(a, st, setup, run_dir, data)
    chat = [setup["train"], *files]
    common = list(setup["overrides"])
    if a.raw_text:
        st.run("vocab_stats", vocab_stats, setup["target"], ",".join(map(str, chat)), data / "vocab_stats.json",
               common)
        common.append(f"data.vocab_stats={data / 'vocab_stats.json'}")
        files.append(data / "raw_text.jsonl")
    if not files:
        raise SystemExit("[scaling] no new data: pass --train-prompts above the run's, --magpie N or --raw-text")
    info["capture"] = st.run("capture", rm.capture, setup["target"], ",".join(map(str, files)),
                             out / "features_new", common, settings["storage"])
    train = ",".join(str(f) for f in [setup["train"], *files])
    samples = sum(1 for f in [setup["train"], *files] for _ in f.open())
    configs = {}
    for name in names:
        tag = "" if name == names[0] else f"_{name}"
        t_info = st.run(f"train{tag}", rm.train_run, setup["target"], train,
                        [setup["features"], out / "features_new"], out / f"ckpt{tag}", samples, a,
                        [*common, *known[name]])
        table = st.run(f"table{tag}", rm.epochs_table, setup["target"], setup["heldout"],
                       {"1": {"dir": str(out / f"ckpt{tag}"), "info": t_info}}, setup["max_length"])
        configs[name] = {"overrides": known[name], "train": t_info, "table": table, "train_s": st.done[f"train{tag}"]["wall_s"],
                         "without": without(name, known[name], setup, out / "without", a.reuse)}
    first = configs[names[0]]
    return {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()
                         if k not in ("out", "run", "target", "results")},
            "conversations": sum(1 for f in chat for _ in f.open()), "run_conversations": setup["budget"]["samples"],
            "run_steps": setup["budget"]["steps"],
            "samples": samples, "data": info, "train": first["train"], "table": first["table"], "configs": configs,
            "stages": {k: v["wall_s"] for k, v in st.done.items()}, "run_stages": setup["run_stages"],
            "cpus": os.cpu_count()}


NEW_DATA_STAGES = ("regenerate_new", "magpie", "regenerate_magpie", "raw_text", "vocab_stats", "capture")


def costs(report: dict, name: str) -> dict:
    """CPU-hours of one configuration's two rows (data: answering and capture; train: as measured) and
    the added cost of the new data: making and capturing it, plus the extra steps at the grown run's
    own seconds per step (so the added cost does not mix two runs' machine load)."""
    run, here, cfg = report["run_stages"], report["stages"], report["configs"][name]
    run_data = sum(run.get(k, 0) for k in ("regenerate_train", "capture_1"))
    new = sum(v for k, v in here.items() if k in NEW_DATA_STAGES)
    steps_with, steps_without = cfg["train"]["steps"], report["run_steps"]
    extra_train = cfg["train_s"] * max(0, steps_with - steps_without) / steps_with
    return {"data_without": cpu_hours(run_data), "train_without": cpu_hours(cfg["without"]["train_s"] or 0),
            "data_with": cpu_hours(run_data + new), "train_with": cpu_hours(cfg["train_s"]),
            "added": cpu_hours(new + extra_train)}


def markdown(report: dict, command: str) -> str:
    d = report["data"]
    lines = ["# More data for a `make real` run: held-out tau and CPU-hours", "",
             f"`{command}`", "",
             f"{report['run_conversations']} conversations of the run, {report['samples']} training samples with the "
             f"new data; {report['settings']['epochs']} epochs of batch {report['settings']['batch_size']} each, "
             "one checkpoint per epoch, held-out teacher-forced tau (chain of 3, bonus included) on the run's "
             f"held-out conversations. CPU-hours = wall seconds x {report['cpus']} cores / 3600: data = answering "
             "the prompts (the run's regeneration included) and capturing features, train = the training run as "
             "measured (wall seconds count whatever else ran on the machine then); added = making and capturing "
             "the new data plus the extra steps at the grown run's own seconds per step."]
    if "magpie" in d:
        m = d["magpie"]
        use = report["settings"]["magpie_use"]
        lines += ["", f"Magpie: {m['generated']} prompts sampled, {m['cleaned']} after `specheads magpie`'s "
                      f"cleaning and deduplication, {m['equal_to_a_run_prompt']} equal to a prompt of the run, "
                      f"{m['kept']} answered and trained on" + (f" (the first {use}: `--magpie-use`)." if use else ".")]
    lines += ["", "| config | data | samples | steps | tau per epoch | final tau | data CPU-h | train CPU-h | "
                  "added CPU-h | tau gain per added CPU-h |", "|---|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for name, cfg in report["configs"].items():
        c = costs(report, name)
        base = [e["tau"] for e in cfg["without"]["epochs"]]
        grown = [t["tau"] for t in cfg["table"]]
        lines.append(f"| {name} | the run's ({cfg['without']['from']}) | {report['run_conversations']} | "
                     f"{report['run_steps']} | {' / '.join(f'{t:.3f}' for t in base)} | {base[-1]:.3f} | "
                     f"{c['data_without']:.2f} | {c['train_without']:.2f} | | |")
        gain = (grown[-1] - base[-1]) / c["added"] if c["added"] > 0 else float("nan")
        lines.append(f"| {name} | the run's + new | {report['samples']} | {cfg['train']['steps']} | "
                     f"{' / '.join(f'{t:.3f}' for t in grown)} | {grown[-1]:.3f} | {c['data_with']:.2f} | "
                     f"{c['train_with']:.2f} | {c['added']:.2f} | {gain:+.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", required=True, help="a finished bench/real_model.py output folder")
    p.add_argument("--target", default=None, help="the target's HF folder (default: the run's)")
    p.add_argument("--prompts", default=None, help="the --prompts the run was made from (with --train-prompts)")
    p.add_argument("--out", required=True)
    p.add_argument("--results", default=None, help="also write the JSON here")
    p.add_argument("--train-prompts", type=int, default=0, help="total train prompts (the run's plus new ones)")
    p.add_argument("--magpie", type=int, default=0, help="prompts for the target to write (Magpie), then answer")
    p.add_argument("--magpie-batch-size", type=int, default=32)
    p.add_argument("--magpie-use", type=int, default=0, help="answer only the first N new Magpie prompts (0: all)")
    p.add_argument("--seed", type=int, default=0, help="Magpie's sampling seed")
    p.add_argument("--magpie-arg", action="append", default=[],
                   help="one more `specheads magpie` option, e.g. --magpie-arg=--min-chars=20 (repeatable)")
    p.add_argument("--raw-text", default=None, help="plain text or `text` jsonl mixed into the training data")
    p.add_argument("--configs", default="baseline", help="comma-separated: baseline or bench/quality_ab.py options")
    p.add_argument("--reuse", type=Path, default=None,
                   help="a bench/quality_ab_real.py --out folder: its results are the configs' rows without new data")
    p.add_argument("--max-new-tokens", type=int, default=None, help="answer length (default: the run's)")
    p.add_argument("--regen-batch-size", type=int, default=None, help="(default: the run's)")
    p.add_argument("--epochs", type=int, default=None, help="(default: the run's)")
    p.add_argument("--batch-size", type=int, default=None, help="(default: the run's)")
    a = p.parse_args(argv)
    try:
        report = run(a)
    except qab.NotARealRun as e:
        print(f"ERROR: {e}", file=sys.stderr)
        return 2
    from specheads.atomic import write_json, write_text

    command = " ".join(["python", "bench/real_model_scaling.py", *(argv if argv is not None else sys.argv[1:])])
    for path in [Path(a.out) / "scaling.json"] + ([Path(a.results)] if a.results else []):
        write_json(path, {"command": command, **report})
    write_text(Path(a.out) / "scaling.md", markdown(report, command))
    last = report["table"][-1]
    print(f"[scaling] {report['samples']} samples, epoch {last['epoch']}: held-out tau {last['tau']:.3f}")
    print(markdown(report, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
