"""llama.cpp benchmark: plain, each draftless --spec-type, our EAGLE-3 export, and EAGLE-3 mixed with
a draftless type, side by side on the same prompts, in `llama-server` on a CPU.

    python bench/llamacpp.py --target T --draft EXPORT_DIR --prompts FILE --out DIR \
        [--limit N] [--n-predict N] [--threads N] [--k N] [--mix ngram-mod]

The target and the export are converted to f32 GGUFs with llama.cpp's own converter
(specheads.engines.llamacpp). Each row is one `llama-server` process decoding every prompt (chat-
rendered ids, greedy, no prompt cache); tok/s is generated tokens over generation seconds summed over
prompts (llama.cpp's `predicted_n` / `predicted_ms`), accepted/drafted its `draft_n_accepted` /
`draft_n`; each server first answers two untimed warm-up requests; every row's outputs are compared
token for token with the plain row's, and plain runs again last to show how far the machine drifted. Threads, the
OMP_WAIT_POLICY and the load average before and after each row are recorded: on a shared machine the
speeds are only comparable within one run. Writes DIR/llamacpp.json and DIR/llamacpp.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specheads.atomic import write_json, write_text
from specheads.engines import llamacpp as lc

DRAFTLESS_ROWS = ("ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache")


def rows_to_run(spec_type: str, draft: Path, k: int, mix: str) -> list[lc.SpecSettings]:
    """plain first (the reference) and again last (how far the machine drifted during the run)."""
    return [lc.SpecSettings(), *(lc.SpecSettings((t,)) for t in DRAFTLESS_ROWS),
            lc.SpecSettings((spec_type,), draft, n_max=k), lc.SpecSettings((spec_type, mix), draft, n_max=k),
            lc.SpecSettings()]


def summarize(label: str, spec: lc.SpecSettings, outs: list[lc.Completion], plain: list[lc.Completion] | None,
              load: dict, threads: int, omp: str | None = None) -> dict:
    n = sum(int(o.timings.get("predicted_n") or len(o.tokens)) for o in outs)
    ms = sum(float(o.timings.get("predicted_ms") or 0.0) for o in outs)
    drafted, accepted = sum(o.drafted for o in outs), sum(o.accepted for o in outs)
    equal = None if plain is None else [o.tokens == p.tokens for o, p in zip(outs, plain)]
    return {"row": label, "spec_types": list(spec.types), "draft": str(spec.draft) if spec.draft else None,
            "spec_draft_n_max": spec.n_max, "tokens": n, "seconds": ms / 1000, "tok_s": n / (ms / 1000) if ms else None,
            "drafted": drafted, "accepted": accepted, "accepted_per_drafted": accepted / drafted if drafted else None,
            "greedy_equal": None if equal is None else all(equal),
            "greedy_equal_prompts": None if equal is None else f"{sum(equal)}/{len(equal)}",
            "threads": threads, "omp_wait_policy": lc.omp_label(omp), "load_average": load,
            "per_prompt": [{k: o.timings.get(k) for k in ("predicted_n", "predicted_ms", "draft_n", "draft_n_accepted")}
                           for o in outs]}


def markdown(result: dict) -> str:
    plain = result["rows"][0]["tok_s"] or 0
    lines = [f"llama.cpp {result['version']}: {result['prompts']} prompts x {result['n_predict']} tokens, greedy, "
             f"threads {result['threads']}, OMP_WAIT_POLICY {result['omp_wait_policy']}, f32 GGUFs. "
             "Speeds taken on a shared machine (load average per row): compare within this table only.", "",
             "| row | tok/s | vs plain | accepted/drafted | greedy-equal | load (1 min, before/after) |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        rate = f"{r['accepted']}/{r['drafted']} = {r['accepted_per_drafted']:.3f}" if r["drafted"] else "-"
        speed = f"{r['tok_s']:.1f}" if r["tok_s"] else "-"
        ratio = f"{r['tok_s'] / plain:.2f}x" if r["tok_s"] and plain else "-"
        eq = "reference" if r["greedy_equal"] is None else r["greedy_equal_prompts"]
        lines.append(f"| {r['row']} | {speed} | {ratio} | {rate} | {eq} | "
                     f"{r['load_average']['before'][0]} / {r['load_average']['after'][0]} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True, help="a specheads EAGLE-3 export (--format vllm)")
    p.add_argument("--prompts", default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--limit", type=int, default=16)
    p.add_argument("--n-predict", type=int, default=96)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--k", type=int, default=None, help="--spec-draft-n-max for the draft rows (default: the export's)")
    p.add_argument("--omp-wait-policy", choices=["PASSIVE", "ACTIVE"], default=None,
                   help="the servers' OMP_WAIT_POLICY (default: inherited; recorded per row)")
    p.add_argument("--mix", default="ngram-mod", help="the draftless type mixed with the draft in the last row")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        spec_type, _ = lc.draft_spec(Path(a.draft))
        b = lc.ensure()
        target_gguf, draft_gguf = out / "target-f32.gguf", out / "draft-f32.gguf"
        conv = {"target": lc.convert(Path(a.target), target_gguf),
                "draft": lc.convert_draft(Path(a.draft), Path(a.target), draft_gguf)}
        prompts = lc.prompt_ids(Path(a.target), Path(a.prompts) if a.prompts else None, a.limit)
        k = a.k or json.loads((Path(a.draft) / "specheads.json").read_text()).get("num_speculative_tokens")
        rows, plain = [], None
        for spec in rows_to_run(spec_type, draft_gguf, k, a.mix):
            before = lc.load_average()
            print(f"[bench] {spec.label} ... (load {before})", flush=True)
            outs, _ = lc.decode_all(b, target_gguf, spec, prompts, a.n_predict, a.threads,
                                    out / f"server-{spec.label}.log", omp=a.omp_wait_policy, warmup=2)
            label = spec.label if plain is None or spec.types else "plain (again)"
            row = summarize(label, spec, outs, plain, {"before": before, "after": lc.load_average()}, a.threads,
                            a.omp_wait_policy)
            plain = plain or outs
            rows.append(row)
            print(f"        {row['tok_s']:.1f} tok/s, accepted {row['accepted']}/{row['drafted']}, "
                  f"equal {row['greedy_equal_prompts']}", flush=True)
    except lc.LlamaCppError as e:
        print(f"bench/llamacpp: {e}", file=sys.stderr)
        return 2
    result = {"version": b.version(), "target": a.target, "draft": a.draft, "prompts_file": a.prompts,
              "prompts": len(prompts), "n_predict": a.n_predict, "threads": a.threads,
              "omp_wait_policy": lc.omp_label(a.omp_wait_policy), "spec_draft_n_max": k,
              "mix": a.mix, "conversions": conv, "rows": rows}
    write_json(out / "llamacpp.json", result)
    write_text(out / "llamacpp.md", markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
