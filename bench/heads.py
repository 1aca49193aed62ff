"""Side-by-side table of every drafter kind on the same target, data and budget.

    python bench/heads.py --run runs/demo --out runs/bench-heads [--kinds eagle3,eagle,...] \
        [--steps 300] [--limit 16] [--max-new-tokens 64] [--k 4] [--predict]

`--run` is a folder written by `make demo` (its `target` link and `data/`): each kind trains from
its demo recipe on the same regenerated answers with the same step budget, is exported to the
first format that can serve it, loaded back from that folder (as users serve it; a kind no
engine serves for this target family, MTP on a Llama, runs from its checkpoint), and decoded on
the same held-out prompts: plain greedy (the reference), a chain of k drafts and a tree (EAGLE-2
dynamic tree where the kind has one, otherwise the static tree below). Every speculative output
must equal plain greedy decoding. Writes OUT/heads.json and OUT/heads.md.

Columns: trainable parameters; training seconds per optimizer step (the frozen target's forward
included, CPU fp32 here); tau (tokens per target forward, bonus included); per-position
acceptance of the chain (unconditional: share of draft steps whose first p drafts were all
accepted). `peagle` is EAGLE-3 with parallel drafting (recipes/peagle/demo.yaml).

`--predict` adds, per kind: the chain length k that specheads' own prediction (eval/predict.py,
from the measured acceptance and micro-timed target / drafter costs) expects to be fastest (up to
8, or a DFlash block minus the anchor), tau at that k, the predicted speed-up and the measured one
(wall-clock tokens/s of that chain over plain greedy on the same prompts, drafting included).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

from specheads.atomic import write_json, write_text
from specheads.data.prompts import read_prompts
from specheads.session import eos_ids, load_draft
from specheads.verify.loop import decode, greedy_decode
from specheads.verify.registry import make_proposer
from specheads.verify.settings import TreeSpec, make_tree_spec
from specheads.verify.steps import DecodeStats

DEMO_RECIPES = {"eagle3": "recipes/demo/eagle3.yaml"}  # other kinds: recipes/<kind>/demo.yaml
VARIANTS = ("peagle",)  # benched like kinds: recipes/<variant>/demo.yaml trains a registered kind
MAX_PREDICT_K = 8
TREE_EAGLE2 = (4, 4, 16)  # depth, top_k, total_tokens
# a static tree of 15 drafts (Medusa-style rank paths), wide at the root, depth 4 (= k, and what
# 4 Medusa heads can fill)
STATIC_TREE = ((0,), (1,), (2,), (3,), (0, 0), (0, 1), (1, 0), (2, 0), (0, 0, 0), (0, 0, 1),
               (0, 1, 0), (1, 0, 0), (1, 1), (0, 0, 0, 0), (0, 0, 0, 1))


def _verifier_module():
    """bench/verifier.py (a script, not a package) for its prompt encoding."""
    path = Path(__file__).resolve().parent / "verifier.py"
    spec = importlib.util.spec_from_file_location("bench_verifier", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


def recipe_path(kind: str, root: Path) -> Path:
    path = root / DEMO_RECIPES.get(kind, f"recipes/{kind}/demo.yaml")
    if not path.is_file():
        raise FileNotFoundError(f"no demo recipe for head kind '{kind}' (expected {path})")
    return path


def train_kind(kind: str, run: Path, out: Path, steps: int, root: Path, extra: list[str]):
    """Train one kind on the run's data; returns (checkpoint, seconds per step, trainable params)."""
    from specheads.config import load_recipe
    from specheads.export.checkpoint import Checkpoint
    from specheads.train import train

    data = run / "data" / "train_regen.jsonl"
    if not data.is_file():
        data = run / "data" / "train.jsonl"
    overrides = [f"target.path={run / 'target'}", f"data.train=[{data}]",
                 f"train.output_dir={out / kind / 'checkpoint'}", f"train.max_steps={steps}",
                 f"train.save_every={steps}", "train.resume=false", *extra]
    recipe = load_recipe(recipe_path(kind, root), overrides)
    t0 = time.perf_counter()
    ckpt = train(recipe)
    seconds = time.perf_counter() - t0
    head = Checkpoint(ckpt).build_head()
    params = sum(p.numel() for p in head.parameters() if p.requires_grad)
    return ckpt, seconds / steps, params, recipe


def exported_head(ckpt: Path, out: Path, kind: str, target):
    """(head, format): exported to the first format the kind's writer supports and loaded back
    from that folder; when no engine serves the kind for this target family (MTP on a Llama),
    the checkpoint itself, labelled as such."""
    from specheads.export import WRITERS, ExportRefused, export
    from specheads.export.checkpoint import Checkpoint

    head_kind = Checkpoint(ckpt).kind  # a variant (peagle) trains a registered kind (eagle3)
    if head_kind not in WRITERS:
        raise ValueError(f"head kind '{head_kind}' has no exporter")
    fmt = WRITERS[head_kind].FORMATS_WRITTEN[0]
    try:
        folder = export(ckpt, fmt, out / kind / "export" / fmt)
    except ExportRefused:
        head = Checkpoint(ckpt).build_head()
        return head.to(device=target.device, dtype=target.dtype).eval(), "checkpoint (no engine export)"
    return load_draft(folder, target).head, fmt


def tree_spec_for(head, target) -> TreeSpec | None:
    """EAGLE-2 where the kind builds dynamic trees, else the static tree, else None."""
    depth, top_k, total = TREE_EAGLE2
    for spec in (make_tree_spec("eagle2", depth=depth, top_k=top_k, total_tokens=total),
                 TreeSpec("static", choices=STATIC_TREE, source="bench/heads.py")):
        try:
            make_proposer(spec, head, target)
        except (ValueError, NotImplementedError, KeyError):
            continue
        return spec
    return None


def decode_all(target, head, spec: TreeSpec | None, prompts, references, max_new_tokens: int):
    """Summed DecodeStats over prompts (None spec = plain) and the ids that differ from plain."""
    eos = eos_ids(target)
    total, mismatched = DecodeStats(), []
    for (pid, ids), ref in zip(prompts, references):
        if spec is None:
            result = greedy_decode(target, ids, max_new_tokens, eos)
        else:
            result = decode(target, make_proposer(spec, head, target), ids, max_new_tokens,
                            spec.k or 0, eos)
        total = total.add(result.stats)
        if ref is not None and result.tokens != ref:
            mismatched.append(pid)
    return total, mismatched


def measure(target, head, prompts, references, k: int, max_new_tokens: int) -> dict:
    """tau of a chain of k and of a tree, per-position acceptance, greedy equality."""
    chain = make_tree_spec("chain", k=k)
    stats, bad = decode_all(target, head, chain, prompts, references, max_new_tokens)
    s = stats.summary()
    row = {"chain_k": k, "tau_chain": s["tau"], "acceptance_per_position": s["acceptance_per_position"],
           "acceptance_per_position_conditional": s["acceptance_per_position_conditional"],
           "tree": None, "tau_tree": None, "mismatched_ids": list(bad)}
    tree = tree_spec_for(head, target)
    if tree is not None:
        tstats, tbad = decode_all(target, head, tree, prompts, references, max_new_tokens)
        row.update(tree=tree.describe(), tau_tree=tstats.summary()["tau"])
        row["mismatched_ids"] += [f"tree:{p}" for p in tbad]
    row["greedy_equal"] = not row["mismatched_ids"]
    return row


def rate(stats) -> float:
    """Generated tokens per wall-clock second."""
    return stats.tokens / stats.wall_s


def max_chain(head) -> int:
    """Longest chain worth predicting: a DFlash block minus its anchor, else MAX_PREDICT_K."""
    block = getattr(head.config, "block_size", None)
    return min(MAX_PREDICT_K, block - 1) if block else MAX_PREDICT_K


def predicted_row(target, head, prompts, references, max_new_tokens: int) -> dict:
    """k chosen by eval/predict.py from acceptance measured at the longest chain, then tau and the
    wall-clock speed-up of that chain over plain decoding (drafting included)."""
    from specheads.eval.predict import prediction_metrics

    k_max = max_chain(head)
    stats, _ = decode_all(target, head, make_tree_spec("chain", k=k_max), prompts, references, max_new_tokens)
    cond = stats.summary()["acceptance_per_position_conditional"]
    metrics = prediction_metrics(target, head, [[int(t) for t in ids] for _, ids in prompts], cond, k_max=k_max)
    if not metrics:
        return {"predicted_k": None}
    best = max(metrics["prediction"]["chains"], key=lambda r: r["speedup"])
    plain, _ = decode_all(target, head, None, prompts, references, max_new_tokens)
    spec, bad = decode_all(target, head, make_tree_spec("chain", k=best["k"]), prompts, references, max_new_tokens)
    return {"k_max": k_max, "cond_acceptance_k_max": cond, "predicted_k": best["k"],
            "predicted_speedup": best["speedup"], "tau_predicted_k": spec.summary()["tau"],
            "tokens_per_s_plain": rate(plain), "tokens_per_s_spec": rate(spec),
            "measured_speedup": rate(spec) / rate(plain), "predicted_k_mismatched_ids": list(bad)}


def predicted_table(report: dict) -> list[str]:
    rows = [r for r in report["kinds"] if r.get("predicted_k")]
    if not rows:
        return []
    lines = ["", "Chain length chosen by specheads' prediction (eval/predict.py), then measured "
             "(wall clock, drafting included, one thread):", "",
             "| kind | k (predicted best) | tau at k | predicted speed-up | measured speed-up | tokens/s plain | tokens/s spec |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['predicted_k']} (of <= {r['k_max']}) | {r['tau_predicted_k']:.2f} | "
                     f"{r['predicted_speedup']:.2f}x | {r['measured_speedup']:.2f}x | {r['tokens_per_s_plain']:.1f} | "
                     f"{r['tokens_per_s_spec']:.1f} |")
    return lines


def markdown(report: dict) -> str:
    st = report["settings"]
    lines = [
        "# Drafter kinds side by side", "",
        f"target `{st['target']}`; {st['steps']} training steps each on `{st['data']}`; "
        f"{st['num_prompts']} held-out prompts, max {st['max_new_tokens']} new tokens, greedy, batch 1, "
        f"CPU float32. tau counts the bonus token (plain decoding = 1.00).", "",
        "| kind | format | trainable params | train s/step | tau chain k | tau tree | tree | acc@1..k | greedy equal |",
        "|---|---|---:|---:|---:|---:|---|---|:---:|",
    ]
    for r in report["kinds"]:
        if "error" in r:
            lines.append(f"| {r['kind']} | | | | | | | failed: {r['error']} | |")
            continue
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
        tree = "" if r["tree"] is None else f"{r['tree']['kind']} n={r['tree']['nodes']}"
        tau_tree = "n/a" if r["tau_tree"] is None else f"{r['tau_tree']:.2f}"
        lines.append(f"| {r['kind']} | {r['format']} | {r['params']:,} | {r['train_s_per_step']:.3f} | "
                     f"{r['tau_chain']:.2f} (k={r['chain_k']}) | {tau_tree} | {tree} | {acc} | "
                     f"{'yes' if r['greedy_equal'] else 'NO'} |")
    return "\n".join(lines + predicted_table(report)) + "\n"


def bench(run: Path, out: Path, kinds: list[str], steps: int, limit: int, max_new_tokens: int,
          k: int, root: Path, extra: list[str] = (), predict: bool = False) -> dict:
    """Train, export, reload and decode every kind; write OUT/heads.json and OUT/heads.md."""
    from specheads.provenance import provenance
    from specheads.target import Target

    torch.manual_seed(0)
    target = Target.load(str(run / "target"), device="cpu")
    rows = read_prompts(run / "data" / "heldout_prompts.jsonl", limit)
    prompts = _verifier_module().encode_rows(target, rows)
    eos = eos_ids(target)
    references = [greedy_decode(target, ids, max_new_tokens, eos).tokens for _, ids in prompts]
    results = []
    for kind in kinds:
        try:
            ckpt, s_per_step, params, _ = train_kind(kind, run, out, steps, root, list(extra))
            head, fmt = exported_head(ckpt, out, kind, target)
            row = measure(target, head, prompts, references, k, max_new_tokens)
            if predict:
                row.update(predicted_row(target, head, prompts, references, max_new_tokens))
                row["greedy_equal"] = row["greedy_equal"] and not row.get("predicted_k_mismatched_ids")
            results.append({"kind": kind, "format": fmt, "params": params,
                            "train_s_per_step": s_per_step, **row})
        except (ValueError, FileNotFoundError, NotImplementedError) as err:
            results.append({"kind": kind, "error": str(err)})
        print(f"[bench/heads] {kind}: {json.dumps(results[-1])[:300]}", flush=True)
    report = {
        "settings": {"target": str(run / "target"), "data": str(run / "data"), "steps": steps,
                     "num_prompts": len(prompts), "max_new_tokens": max_new_tokens, "k": k,
                     "threads": torch.get_num_threads(), "predict": predict},
        "kinds": results,
        "provenance": provenance(target=target.fingerprint()),
    }
    report["greedy_equal"] = all(r.get("greedy_equal", False) for r in results)
    write_json(out / "heads.json", report)
    write_text(out / "heads.md", markdown(report))
    return report


def main(argv: list[str] | None = None) -> int:
    from specheads.heads import HEADS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="a `make demo` run folder (target link + data/)")
    p.add_argument("--out", required=True, help="folder for heads.json and heads.md")
    known = [*HEADS, *VARIANTS]
    p.add_argument("--kinds", default=",".join(known), help="comma-separated head kinds (default: all, and peagle)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per kind (same for all)")
    p.add_argument("--limit", type=int, default=16, help="held-out prompts")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4, help="chain length")
    p.add_argument("--predict", action="store_true",
                   help="also pick k by eval/predict.py and measure tau and wall-clock speed-up at it")
    p.add_argument("--root", default=str(Path(__file__).resolve().parents[1]), help="repo root (recipes/)")
    p.add_argument("overrides", nargs="*", help="recipe overrides applied to every kind")
    a = p.parse_args(argv)
    kinds = [x.strip() for x in a.kinds.split(",") if x.strip()]
    unknown = [x for x in kinds if x not in known]
    if unknown:
        print(f"bench/heads.py: error: unknown head kinds {unknown}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    report = bench(Path(a.run), Path(a.out), kinds, a.steps, a.limit, a.max_new_tokens, a.k,
                   Path(a.root), a.overrides, predict=a.predict)
    print(markdown(report), end="")
    print(f"-> {Path(a.out) / 'heads.json'}")
    return 0 if report["greedy_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
