"""More data for a finished `make real` run: how held-out tau moves with conversations or raw text.

    python bench/real_model_scaling.py --run runs/real --target DIR --prompts alpaca_en_1k.json \
        --out runs/real-900 --train-prompts 900 [--raw-text wiki.txt] [--epochs 5] \
        [--results bench/results/real_model_scaling_900.json]

Reuses the run's regenerated conversations and held-out set (same prompt split as
bench/real_model.py), regenerates only the prompts the run did not have (batched, greedy,
resumable), optionally mixes raw text in (wiki / web text as `text` rows of about 2,000
characters, supervised on every token against the target's own distribution; the draft
vocabulary is still counted from the regenerated answers only), captures int8 features once,
trains E epochs with one checkpoint per epoch, and scores each checkpoint teacher-forced on the
run's held-out conversations: the same numbers as the run's data/epochs table, so the rows can
be read side by side. Writes OUT/scaling.json (and --results) with the wall time of each stage.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_model as rm  # noqa: E402  (the stages and helpers of the full run)


def new_prompts(run: Path, source: Path, data: Path, n_train: int) -> dict:
    """The first n_train train-side prompts of the run's split that the run did not regenerate."""
    rm.split_prompts(source, data, n_train, 0)
    had = {json.loads(line)["id"] for line in (run / "data" / "train_prompts.jsonl").open()}
    rows = [line for line in (data / "train_prompts.jsonl").open() if json.loads(line)["id"] not in had]
    (data / "new_prompts.jsonl").write_text("".join(rows))
    return {"run_had": len(had), "new": len(rows)}


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


def vocab_stats(target: Path, chat: Path, out: Path, common: list[str]) -> dict:
    """Draft-vocabulary counts from the regenerated answers only (raw text must not move it)."""
    rm._check(rm.cli(["vocab-stats", rm.RECIPE, f"target.path={target}", f"data.train=[{chat}]", *common,
                      "--out", out]), "vocab-stats")
    return {"file": out.name}


def run(a) -> dict:
    out, run_dir, target = Path(a.out).resolve(), Path(a.run).resolve(), Path(a.target).resolve()
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    st = rm.Stages(out)
    info = {"prompts": st.run("prompts", new_prompts, run_dir, Path(a.prompts), data, a.train_prompts)}
    if info["prompts"]["new"]:
        info["regenerate"] = st.run("regenerate_new", rm.regenerate, data / "new_prompts.jsonl", data / "new.jsonl",
                                    target, a)
    chat = data / "train.jsonl"
    new = (data / "new.jsonl").read_text() if info["prompts"]["new"] else ""
    chat.write_text((run_dir / "data" / "train.jsonl").read_text() + new)
    files = [chat]
    common = [f"head.draft_vocab_size={a.draft_vocab}", f"data.max_length={a.max_length}"]
    if a.raw_text:
        info["raw_text"] = st.run("raw_text", raw_text_rows, Path(a.raw_text), data / "raw_text.jsonl")
        files.append(data / "raw_text.jsonl")
        st.run("vocab_stats", vocab_stats, target, chat, data / "vocab_stats.json", common)
        common.append(f"data.vocab_stats={data / 'vocab_stats.json'}")
    train = ",".join(str(f) for f in files)
    info["capture"] = st.run("capture", rm.capture, target, train, out / "features", common, a.storage)
    samples = sum(1 for f in files for _ in f.open())
    train_info = st.run("train", rm.train_run, target, train, out / "features", out / "ckpt", samples, a, common)
    table = st.run("table", rm.epochs_table, target, run_dir / "data" / "heldout.jsonl",
                   {"1": {"dir": str(out / "ckpt"), "info": train_info}}, a.max_length)
    return {"settings": {k: v for k, v in vars(a).items() if k not in ("out", "run", "target", "results")},
            "conversations": sum(1 for _ in chat.open()), "samples": samples, "data": info, "train": train_info,
            "table": table, "stages": {k: v["wall_s"] for k, v in st.done.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", required=True, help="a finished bench/real_model.py output folder")
    p.add_argument("--target", required=True)
    p.add_argument("--prompts", required=True, help="the --prompts the run was made from")
    p.add_argument("--out", required=True)
    p.add_argument("--results", default=None, help="also write the JSON here")
    p.add_argument("--train-prompts", type=int, default=0, help="total train prompts (the run's plus new ones)")
    p.add_argument("--raw-text", default=None, help="plain text or `text` jsonl mixed into the training data")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--regen-batch-size", type=int, default=16)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--storage", default="int8", choices=["int8", "bfloat16", "float32"])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=8)
    a = p.parse_args(argv)
    report = run(a)
    from specheads.atomic import write_json

    for path in [Path(a.out) / "scaling.json"] + ([Path(a.results)] if a.results else []):
        write_json(path, report)
    last = report["table"][-1]
    print(f"[scaling] {report['samples']} samples, epoch {last['epoch']}: held-out tau {last['tau']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
