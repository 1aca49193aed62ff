"""Suffix decoding with adaptive length, replayed over known greedy answers: what each of the
adaptive rule's suffix settings is worth, without running the model.

    python bench/suffix_replay.py --target T --outputs EVAL/outputs.jsonl --costs EVAL/metrics.json \
        --out DIR [--history data/train.jsonl]

Greedy decoding is deterministic, so every step of a speculative decode of a turn can be replayed
from the turn's plain greedy answer (outputs.jsonl's `plain_ids`): suffix decoding drafts from its
cache, the adaptive rule picks the length, the target's verdict is the known continuation, and the
step is priced at the eval's measured verify curve v(n) (metrics.json `adaptive.length_costs`, in
plain steps). Tokens per unit of that cost is the speed-up the target's steps allow; the proposer's
own seconds and the loop's overhead are left out (eval's `suffix` and `adaptive` rows measure them).
Turns go in the eval's order, one global cache per setting across them, as in eval. Settings:
the longest free draft (3: the drafter's k; 8: eval's COST_K), the path probabilities raw or
calibrated online (`PathReliability`), and the cache empty or warmed with `--history`'s answers.
Each setting also reports how the library's path probabilities held (settled draft tokens and
survivors per bin of the reported probability: `PathReliability`'s counters). Writes
DIR/suffix_replay.json and .md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from specheads.atomic import write_json, write_text
from specheads.data.prompts import user_turn
from specheads.data.suffix_history import history_pairs
from specheads.eval.waves import eval_prompt_ids
from specheads.target import Target
from specheads.verify.adaptive_proposers import LengthCosts, best_length
from specheads.verify.suffix_proposers import SuffixProposer

SETTINGS = [  # (name, longest free draft, calibrated, warm)
    ("k <= 3, raw probabilities", 3, False, False),
    ("k <= 8, raw probabilities", 8, False, False),
    ("k <= 8, calibrated online", 8, True, False),
    ("k <= 3, calibrated online, warm cache", 3, True, True),
    ("k <= 8, calibrated online, warm cache", 8, True, True),
]


def turns(outputs: Path, tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, plain greedy answer) per first turn of outputs.jsonl, in its order."""
    rows = [json.loads(line) for line in outputs.read_text().splitlines()]
    return [(eval_prompt_ids(tokenizer, user_turn(r["prompt"])), r["plain_ids"]) for r in rows if r.get("turn", 0) == 0]


def replay_turn(proposer: SuffixProposer, prompt: list[int], answer: list[int], costs: LengthCosts, k: int,
                calibrated: bool) -> tuple[int, float, dict]:
    """One turn decoded by suffix decoding + adaptive length -> (tokens, cost in plain steps, lengths)."""
    proposer.start(torch.tensor(prompt), answer[0])
    i, cost, lengths = 1, 1.0, {}  # the prefill's token: one plain step, as in plain decoding
    while i < len(answer):
        room = len(answer) - i - 1
        draft = proposer.propose(min(k, room)).tolist() if room > 0 else []
        raw = [min(max(float(p), 0.0), 1.0) for p in proposer.probs[:len(draft)]]
        survival = proposer.survival(len(draft)) if calibrated else raw
        n = best_length(survival, costs, drafted=False)[0]
        m = 0
        while m < n and draft[m] == answer[i + m]:
            m += 1
        step = answer[i:i + m + 1]
        proposer.accept(None, torch.tensor(step))
        cost += costs.v(n + 1)
        lengths[n] = lengths.get(n, 0) + 1
        i += len(step)
    proposer.close()
    return len(answer), cost, lengths


def replay(data: list, costs: LengthCosts, k: int, calibrated: bool, history: list) -> dict:
    shared = SuffixProposer()
    shared.warm(history)
    tokens, cost, lengths = 0, 0.0, {}
    for prompt, answer in data:
        t, c, ls = replay_turn(shared.fork(), prompt, answer, costs, k, calibrated)
        tokens, cost = tokens + t, cost + c
        for n, count in ls.items():
            lengths[n] = lengths.get(n, 0) + count
    steps, r = sum(lengths.values()), shared.reliability
    reliability = [{"reported": f"{b / r.bins:.2f}-{(b + 1) / r.bins:.2f}", "settled": r.shown[b], "kept": r.kept[b]}
                   for b in range(r.bins) if r.shown[b]]
    return {"tokens": tokens, "cost_plain_steps": cost, "speedup": tokens / cost, "steps": steps,
            "tokens_per_step": tokens / steps, "verified_lengths": {str(n): lengths[n] for n in sorted(lengths)},
            "reliability": reliability}


def markdown(r: dict) -> str:
    lines = ["# Suffix decoding with adaptive length, replayed over plain greedy answers", "",
             f"`{r['command']}`", "",
             f"{r['turns']} turns of `{r['outputs']}`; verify curve v(1..{len(r['verify'])}) = "
             f"{', '.join(f'{v:.2f}' for v in r['verify'])} plain steps (`{r['costs']}`, as the eval measured it); "
             f"warm cache: {r['history_answers']} answers of `{r['history']}`. Speed-up = tokens / priced target "
             "steps (the proposer's own seconds and the loop's overhead left out).", "",
             "| setting | speed-up (target steps) | tokens per step | verified draft lengths |", "|---|---:|---:|---|"]
    lines += [f"| {s['name']} | {s['speedup']:.3f}x | {s['tokens_per_step']:.2f} | "
              f"{', '.join(f'{n}: {c}' for n, c in s['verified_lengths'].items())} |" for s in r["settings"]]
    first = r["settings"][0]
    lines += ["", f"How the library's path probabilities held ({first['name']}): settled draft tokens per bin of "
              "the reported cumulative probability, and the share that survived.", "",
              "| reported | settled | survived |", "|---|---:|---:|"]
    lines += [f"| {b['reported']} | {b['settled']} | {b['kept'] / b['settled']:.2f} |" for b in first["reliability"]]
    return "\n".join(lines + [""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="the target folder (its tokenizer renders the prompts)")
    p.add_argument("--outputs", required=True, help="an eval's outputs.jsonl (greedy)")
    p.add_argument("--costs", required=True, help="that eval's metrics.json (adaptive.length_costs)")
    p.add_argument("--history", default=None, help="conversations for the warm settings (e.g. data/train.jsonl)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    tokenizer = Target.load(a.target, device="cpu").tokenizer
    metrics = json.loads(Path(a.costs).read_text())
    costs = LengthCosts.from_dict(metrics["adaptive"]["length_costs"], f"{a.costs} adaptive.length_costs")
    data = turns(Path(a.outputs), tokenizer)
    history = history_pairs(a.history, tokenizer) if a.history else []
    report = {"command": " ".join(["python", "bench/suffix_replay.py", *(argv or sys.argv[1:])]),
              "outputs": Path(a.outputs).name, "costs": Path(a.costs).name, "turns": len(data),
              "history": Path(a.history).name if a.history else None, "history_answers": len(history),
              "verify": list(costs.verify), "settings": []}
    for name, k, calibrated, warm in SETTINGS:
        if warm and not history:
            continue
        report["settings"].append({"name": name, "free_k_max": k, "calibrated": calibrated, "warm": warm,
                                   **replay(data, costs, k, calibrated, history if warm else [])})
        print(f"{name}: {report['settings'][-1]['speedup']:.3f}x", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "suffix_replay.json", report)
    write_text(out / "suffix_replay.md", markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
