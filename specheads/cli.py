"""`specheads <verb>`: each verb parses its arguments and calls one library function."""

from __future__ import annotations

import argparse
import sys


def _train(argv: list[str]) -> int:
    from specheads.train import main

    return main(argv)


def _export(argv: list[str]) -> int:
    from specheads.export import export

    p = argparse.ArgumentParser(prog="specheads export", description="Export a trained head for an engine.")
    p.add_argument("checkpoint", help="training output_dir or a checkpoint-NNNNNN folder")
    p.add_argument("--format", required=True, choices=["vllm", "vllm-native", "sglang", "vllm-0.32", "medusa"])
    p.add_argument("--out", required=True, help="export folder (written atomically); an existing folder is "
                   "replaced only when it is an earlier export")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier export even if that drops its eval attachments or added files")
    p.add_argument("--num-speculative-tokens", type=int, default=None)
    p.add_argument("--verifier", default=None, help="hub id of the target, for the speculators config")
    p.add_argument("--adapter", default=None, choices=["merge", "ship"],
                   help="medusa2 only: merge the LoRA into a full target folder (default) or ship a peft adapter")
    a = p.parse_args(argv)
    from specheads.export import read_export_meta

    out = export(a.checkpoint, a.format, a.out, num_speculative_tokens=a.num_speculative_tokens,
                 verifier=a.verifier, adapter=a.adapter, overwrite=a.overwrite)
    print(f"exported {a.format} -> {out}")
    for cmd in read_export_meta(out).serve_commands:
        print(cmd)
    return 0


def _eval(argv: list[str]) -> int:
    from specheads.eval.online import main

    return main(argv)


def _generate(argv: list[str]) -> int:
    from specheads.generate import main

    return main(argv)


def _tiny_target(argv: list[str]) -> int:
    from specheads.builtin.tiny_target import build_tiny_target, cached_tiny_target

    p = argparse.ArgumentParser(prog="specheads tiny-target",
                                description="Build the embedded tiny target (a HF folder) from the Python standard library.")
    p.add_argument("--out", default=None, help="folder to write; default: the user cache (printed)")
    p.add_argument("--preset", default="default", choices=["default", "test"])
    a = p.parse_args(argv)
    path = build_tiny_target(a.out, preset=a.preset) if a.out else cached_tiny_target(a.preset)
    print(path)
    return 0


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
    from specheads.data.regenerate_run import main

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
    "export": (_export, "export a checkpoint for vLLM or SGLang"),
    "eval": (_eval, "measure acceptance on prompts with the built-in verifier"),
    "generate": (_generate, "stream one prompt's answer with a draft; compare with plain decoding"),
    "tiny-target": (_tiny_target, "build the embedded tiny target"),
    "demo": (_demo, "the whole pipeline on the embedded target"),
    "check-engine": (_check_engine, "load and run an export with vLLM's or SGLang's own code (CPU), compare"),
    "push": (_push, "publish an export folder to the Hugging Face hub with a model card"),
    "serve": (_serve, "OpenAI-compatible server (target + optional draft) with /metrics"),
    "bench": (_bench, "load-test OpenAI-compatible servers: latency, tokens/s, acceptance, greedy match"),
    "regenerate": (_regenerate, "rewrite a dataset's assistant turns with the target (resumable)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in VERBS:
        lines = "\n".join(f"  {name:<12} {help_}" for name, (_, help_) in VERBS.items())
        print(f"usage: specheads <verb> [args]\n\nverbs:\n{lines}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    fn, _ = VERBS[argv[0]]
    try:
        return fn(argv[1:])
    except (ValueError, FileNotFoundError) as err:
        # our error classes derive from ValueError and carry a message meant for the user
        print(f"specheads {argv[0]}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
