"""`specheads <verb>`: each verb parses its arguments and calls one library function."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specheads.errors import DEBUG_ENV, run_verb
from specheads.hf_compat import quiet_deepspeed


def _train(argv: list[str]) -> int:
    from specheads.train import main

    return main(argv)


def _export(argv: list[str]) -> int:
    from specheads.cli_parsers import HelpFormatter
    from specheads.engine_facts import EXPORT_FORMATS

    p = argparse.ArgumentParser(prog="specheads export", formatter_class=HelpFormatter, description=(
        "Export a trained head for an engine: vLLM, SGLang, or llama.cpp (gguf)."))
    p.add_argument("checkpoint", help="training output_dir, one of its checkpoint-NNNNNN folders, or a run folder "
                   "holding one training output_dir (runs/demo)")
    p.add_argument("--format", required=True, choices=EXPORT_FORMATS,
                   help="the export formats of engine_facts.FORMATS (each kind accepts some of them), and gguf: "
                        "llama.cpp's sidecar, made by its own converter from one of them")
    p.add_argument("--out", required=True, help="export folder (written atomically); an existing folder is "
                   "replaced only when it is an earlier export")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier export even if that drops its eval attachments or added files")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="the draft length k the engine config and serve commands name (default: the head's "
                        "trained draft steps)")
    p.add_argument("--verifier", default=None, help="hub id of the target, for the speculators config (gguf: "
                   "the target's local HF folder, when the recipe's is elsewhere)")
    p.add_argument("--no-target-gguf", action="store_true",
                   help="gguf: do not convert the target's HF folder to target.gguf (you have one)")
    p.add_argument("--adapter", default=None, choices=["merge", "ship"],
                   help="medusa2 only: merge the LoRA into a full target folder (default) or ship a peft adapter")
    p.add_argument("--llama-cpp", metavar="PATH", default=None,
                   help="gguf: convert with this llama.cpp source tree, built with cmake (build/bin/llama-server); "
                        "default: $SPECHEADS_LLAMA_CPP, else the pinned build in the user cache")
    p.add_argument("--build-llama-cpp", action="store_true",
                   help="gguf: download and build the pinned llama.cpp in the user cache when it is not built "
                        "there yet (about 12 min on 2 cores, once); without it a missing build is refused")
    a = p.parse_args(argv)
    if a.num_speculative_tokens is not None and a.num_speculative_tokens < 1:
        raise ValueError(f"--num-speculative-tokens {a.num_speculative_tokens}: must be >= 1")
    from specheads.export import export, read_export_meta
    from specheads.export.llamacpp_tool import LlamaCppChoice

    out = export(a.checkpoint, a.format, a.out, num_speculative_tokens=a.num_speculative_tokens,
                 verifier=a.verifier, adapter=a.adapter, overwrite=a.overwrite,
                 target_gguf=not a.no_target_gguf, llama_cpp=LlamaCppChoice(a.llama_cpp, a.build_llama_cpp))
    print(f"exported {a.format} -> {out}")
    for cmd in read_export_meta(out).serve_commands:
        print(cmd)
    return 0


def _eval_parser() -> argparse.ArgumentParser:
    from specheads.cli_parsers import (
        SUFFIX_HISTORY_HELP,
        HelpFormatter,
        add_fingerprint_argument,
        add_quiet_argument,
        add_sampling_arguments,
        add_tree_arguments,
    )

    p = argparse.ArgumentParser(prog="specheads eval", formatter_class=HelpFormatter, description=(
        "Decode prompts with the target alone and with an exported draft; check the outputs are "
        "identical and report tau, per-position acceptance, cost ratio and speed-up."))
    p.add_argument("--target", required=True, help="local HF model folder, hub id (org/name, from the hub cache) or builtin:tiny")
    p.add_argument("--draft", required=True, help="export folder written by `specheads export`, or a hub id (org/name)")
    p.add_argument("--prompts", help="prompts file (online mode): JSON lines or a JSON array of rows with "
                   "prompt, turns, messages (first user turn), question, instruction (+input) or text")
    p.add_argument("--offline", action="store_true", help="teacher-forced acceptance on --data, no generation")
    p.add_argument("--data", help="held-out conversations (any training data format) for --offline")
    p.add_argument("--no-predict", action="store_true", help="skip the step-cost measurement, the prediction and the hybrid rows")
    p.add_argument("--verifier-json", help="bench/verifier.py's verifier.json: plot measured speed-ups")
    p.add_argument("--bench-json", help="server load test JSON: plot throughput over concurrency")
    p.add_argument("--llamacpp-cost", help="bench/llamacpp.py --cost's JSON: predict the drafter in llama.cpp from "
                   "llama.cpp's own measured costs and advise its k (or no speculation)")
    p.add_argument("--suffix-history", metavar="FILE", help=SUFFIX_HISTORY_HELP)
    p.add_argument("--mix-rows", default=None,
                   help="which hybrid rows of the table to decode, comma-separated (hybrid, union, adaptive; "
                        "default: all)")
    p.add_argument("--attach", action="store_true",
                   help="also copy metrics, report and plots into the export and its README (for push)")
    p.add_argument("--out", required=True, help="folder for metrics.json and outputs.jsonl")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens decoded per prompt turn")
    p.add_argument("--batch-size", type=int, default=1,
                   help="sequences per target forward (default 1); tau and outputs do not change, measured "
                        "speed-ups compare speculative and plain decoding at this batch size")
    add_tree_arguments(p)
    add_sampling_arguments(p)
    add_fingerprint_argument(p)
    p.add_argument("--limit", "--num-prompts", dest="limit", type=int, default=None,
                   help="first N prompts only (default: all)")
    add_quiet_argument(p)
    p.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="the target's dtype (default: bfloat16 on a GPU, float32 elsewhere)")
    return p


def _eval(argv: list[str]) -> int:
    p = _eval_parser()
    a = p.parse_args(argv)
    if a.offline:
        return _eval_offline(a)
    if not a.prompts:
        p.error("--prompts is required (or --offline --data FILE)")
    return _eval_online(a)


def _eval_offline(a: argparse.Namespace) -> int:
    """`eval --offline`: teacher-forced acceptance on held-out conversations."""
    from specheads.eval.offline import evaluate_offline

    if not a.data:
        raise ValueError("--offline needs --data FILE (held-out conversations)")
    m = evaluate_offline(a.target, a.draft, a.data, a.out, a.limit, dtype=a.dtype, device=a.device,
                         allow_missing_fingerprint=a.allow_missing_fingerprint)
    acc = " / ".join(f"{x:.2f}" for x in m["offline"]["acc_cond"])
    walk = m["offline"].get("decode_order")
    order = f" ({walk['tau']:.3f} in decode order, k = {len(walk['acceptance_per_position'])})" if walk else ""
    print(f"offline tau {m['tau_est']:.3f}{order} over {m['offline']['samples']} samples, conditional acceptance "
          f"{acc}; simulated tau {json.dumps({k: round(v, 2) for k, v in m['simulated_tau']['chain'].items()})} "
          f"-> {Path(a.out) / 'metrics.json'}")
    return 0


def _eval_online(a: argparse.Namespace) -> int:
    """`eval`: decode the prompts plainly and speculatively; exit 1 when the outputs differ."""
    from specheads.cli_options import sampling_from_args, spec_from_args
    from specheads.eval.mixes import MIXES
    from specheads.eval.online import evaluate
    from specheads.eval.predict import advice_summary

    tree = spec_from_args(a)
    m = evaluate(a.target, a.draft, a.prompts, a.out, a.max_new_tokens, a.k, a.limit,
                 tree=None if tree.kind == "chain" else tree,
                 sampling=sampling_from_args(a), predict=not a.no_predict,
                 verifier_json=a.verifier_json, bench_json=a.bench_json, attach=a.attach, quiet=a.quiet,
                 dtype=a.dtype, device=a.device, allow_missing_fingerprint=a.allow_missing_fingerprint,
                 batch_size=a.batch_size, llamacpp_cost=a.llamacpp_cost, suffix_history=a.suffix_history,
                 mix_rows=MIXES if a.mix_rows is None else tuple(r.strip() for r in a.mix_rows.split(",") if r.strip()))
    d = m["speculative"]
    label = f"k={m['k']}" if m["tree"]["kind"] == "chain" else f"tree={m['tree']['kind']} k={m['k']}"
    free = ", ".join(f"{key} {m[key]['tau']:.3f}" for key in ("ngram", "suffix") if key in m)
    print(f"{label} tau={d['tau']:.3f} ({free}) c={d['cost_ratio_c']:.3f} "
          f"predicted speed-up {d['predicted_speedup']:.2f}x measured {d['measured_speedup']:.2f}x"
          f"{f' (both at batch {a.batch_size})' if a.batch_size > 1 else ''} "
          f"greedy_equal={m['greedy_equal']}{'' if m['lossless'] else ' LOSSY (typical acceptance)'}"
          f" -> {Path(a.out) / 'metrics.json'}")
    from specheads.eval.table import print_results  # the table the demo prints, for every eval

    print_results(m, f"specheads eval: {m.get('num_prompts', '?')} prompts, {label}", f"drafter ({a.draft})")
    if m.get("draft_warning"):
        print(m["draft_warning"], file=sys.stderr)
    if m.get("advice"):
        print(f"recommended: {advice_summary(m['advice'])} -> {Path(a.out) / 'report.md'}")
    return 1 if m["greedy_equal"] is False else 0


def _generate(argv: list[str]) -> int:
    from specheads.generate import main

    return main(argv)


def _tiny_target(argv: list[str]) -> int:
    from specheads.cli_parsers import HelpFormatter

    p = argparse.ArgumentParser(prog="specheads tiny-target", formatter_class=HelpFormatter,
                                description="Build the embedded tiny target (a HF folder) from the Python standard library.")
    p.add_argument("--out", default=None, help="folder to write; default: the user cache (printed)")
    p.add_argument("--preset", default="default", choices=["default", "test"],
                   help="'default' is the demo's target; 'test' a smaller one the tests build in seconds")
    a = p.parse_args(argv)
    from specheads.builtin.tiny_target import build_tiny_target, cached_tiny_target

    path = build_tiny_target(a.out, preset=a.preset) if a.out else cached_tiny_target(a.preset)
    print(path)
    return 0


def _target(argv: list[str]) -> int:
    if not argv or argv[0] != "from-gguf":
        print("usage: specheads target from-gguf FILE.gguf --out DIR [--name HUB_ID]")
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    from specheads.cli_parsers import from_gguf_parser

    from_gguf_parser().parse_args(argv[1:])  # --help and usage errors before the module (and torch) loads
    from specheads.from_gguf import main

    return main(argv[1:])


def _demo(argv: list[str]) -> int:
    from specheads.demo import main

    return main(argv)


def _push(argv: list[str]) -> int:
    from specheads.hub import main

    return main(argv)


def _serve(argv: list[str]) -> int:
    from specheads.serve.server import main

    return main(argv)


def _bench(argv: list[str]) -> int:
    from specheads.eval.bench import main

    return main(argv)


def _regenerate(argv: list[str]) -> int:
    from specheads.regenerate_command import main

    return main(argv)


def _magpie(argv: list[str]) -> int:
    from specheads.data.magpie import main

    return main(argv)


def _capture(argv: list[str]) -> int:
    from specheads.data.features import main

    return main(argv)


def _vocab_stats(argv: list[str]) -> int:
    from specheads.data.vocab_stats import main

    return main(argv)


def _check_engine(argv: list[str]) -> int:
    from specheads.engines.check import main

    return main(argv)


VERBS = {
    "train": (_train, "train a drafter from a YAML recipe"),
    "capture": (_capture, "store the frozen target's features for offline training"),
    "vocab-stats": (_vocab_stats, "count supervised tokens once for the draft vocabulary"),
    "export": (_export, "export a checkpoint for vLLM, SGLang or llama.cpp (GGUF)"),
    "eval": (_eval, "measure acceptance on prompts with the built-in verifier"),
    "generate": (_generate, "stream one prompt's answer with a draft; compare with plain decoding"),
    "tiny-target": (_tiny_target, "build the embedded tiny target"),
    "target": (_target, "from-gguf: convert a GGUF chat model into a HF target folder"),
    "demo": (_demo, "the whole pipeline on the embedded target"),
    "check-engine": (_check_engine, "load and run an export with vLLM's or SGLang's own code (CPU), compare"),
    "push": (_push, "publish an export folder to the Hugging Face hub with a model card"),
    "serve": (_serve, "OpenAI-compatible server (target + optional draft) with /metrics"),
    "bench": (_bench, "load-test OpenAI-compatible servers: latency, tokens/s, acceptance, greedy match"),
    "regenerate": (_regenerate, "rewrite a dataset's assistant turns with the target (resumable)"),
    "magpie": (_magpie, "let the target write user prompts (Magpie) for regenerate, deduplicated"),
}


def main(argv: list[str] | None = None) -> int:
    """Run one verb; anything it raises becomes one line on stderr (`--debug`: the traceback)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = False
    while argv and argv[0] == "--debug":
        debug, argv = True, argv[1:]
    if argv[:1] in (["--version"], ["-V"]):
        from specheads import __version__

        print(f"specheads {__version__}")
        return 0
    if argv and argv[0] not in VERBS and argv[0] not in ("-h", "--help"):
        print(f"specheads: unknown verb '{argv[0]}'", file=sys.stderr)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in VERBS:
        lines = "\n".join(f"  {name:<12} {help_}" for name, (_, help_) in VERBS.items())
        print(f"usage: specheads [--debug] [--version] <verb> [args]\n\nverbs:\n{lines}\n\n"
              f"--debug (or {DEBUG_ENV}=1) shows the Python traceback of a failure; --version prints the version; "
              "`specheads <verb> --help` shows a verb's options and their defaults")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    fn, _ = VERBS[argv[0]]
    quiet_deepspeed()  # its CPU notice, logged whenever transformers first imports it
    return run_verb(argv[0], checked_first(argv[0], fn), argv[1:], debug)


LIGHT_PARSERS = {"train": "train_parser", "capture": "capture_parser", "vocab-stats": "vocab_stats_parser",
                 "generate": "generate_parser", "demo": "demo_parser", "push": "push_parser",
                 "regenerate": "regenerate_parser", "magpie": "magpie_parser", "serve": "serve_parser",
                 "check-engine": "check_engine_parser"}


def checked_first(verb: str, fn):
    """`fn`, with the verb's arguments parsed first by its parser in cli_parsers (no torch import): --help
    and a usage error answer at once, before the verb's module (and torch) loads."""
    name = LIGHT_PARSERS.get(verb)
    if name is None:
        return fn

    def run(argv: list[str]) -> int:
        from specheads import cli_parsers

        getattr(cli_parsers, name)().parse_args(argv)
        return fn(argv)

    return run


if __name__ == "__main__":
    sys.exit(main())
