"""The verbs' options, defined with the standard library alone so `specheads VERB --help` answers at
once: the flags several verbs share, the help formatter every verb uses (defaults shown), and the
parsers of the verbs whose modules load torch when imported (each verb's main() parses with its
function here, then imports what it runs). A verb's description that is its module's docstring is
read from the source file, not imported. cli_options turns the shared flags into settings.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
NEW_PHASE_FLAG = "--new-phase"  # train: resume with a changed recipe (resume_plan.NEW_PHASE_FLAG; a test keeps them equal)
STORAGE_DTYPES = ("bfloat16", "float32", "int8")  # capture --dtype (data/feature_cache.py STORAGE)
DEFAULT_RECIPE = Path("recipes/demo/eagle3.yaml")  # the demo's recipe

TRAIN_HELP = """Train a drafter on a frozen target from a YAML recipe (recipes/), with dotted key=value overrides.

  specheads train recipes/demo/eagle3.yaml data.train=data/train.jsonl train.output_dir=runs/x
  specheads train RECIPE 'data.train=[a.jsonl,b.jsonl]' train.max_steps=500 train.lr=1e-3
  torchrun --nproc_per_node 2 -m specheads.train RECIPE ...          (several processes: DDP)
  accelerate launch --config_file recipes/accelerate/ddp.yaml -m specheads.train RECIPE ...

Rerunning the same command resumes from the latest checkpoint in train.output_dir. A resume that
changes what the weights depend on (lr, data, head.*, batch size, ...) is refused unless
--new-phase. An unknown key is refused with the valid ones; recipes/ and the README list them.
"""


# --- flags shared by several verbs, and the help formatter -----------------------------------------------
class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every verb's --help: each option's default appended unless its help already says it or there is
    none to show (None, False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        said = re.search(r"\(default|default:|%\(default", text, re.IGNORECASE)  # the help names it already
        if said or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


class RawHelpFormatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """HelpFormatter for a description laid out in lines of its own."""


def add_quiet_argument(p) -> None:
    """--quiet (alias --no-progress, bench's old spelling): no progress on stderr."""
    p.add_argument("--quiet", "--no-progress", dest="quiet", action="store_true", help="no progress on stderr")


def add_tree_arguments(p: argparse.ArgumentParser) -> None:
    """--tree / --k / --depth / --top-k / --total-tokens, shared by generate and eval."""
    p.add_argument("--tree", default="chain",
                   help="chain (default), eagle2 (dynamic tree) or FILE.json (static tree: a list "
                        "of rank paths such as [[0], [1], [0, 0]])")
    p.add_argument("--k", type=int, default=None, help="chain draft length (default: the export's)")
    p.add_argument("--depth", type=int, default=5, help="EAGLE-2: expansion levels after the first")
    p.add_argument("--top-k", type=int, default=8, help="EAGLE-2: branching factor")
    p.add_argument("--total-tokens", type=int, default=48,
                   help="EAGLE-2: tokens verified per step, root included")


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    """--temperature / --top-p / --seed / --acceptance / --typical-*, shared by generate and eval."""
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 (default): greedy, checked identical to plain greedy; > 0: speculative "
                        "sampling")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--acceptance", choices=["exact", "typical"], default="exact",
                   help="exact (default): lossless verification; typical: Medusa typical "
                        "acceptance, LOSSY (needs --temperature > 0)")
    p.add_argument("--typical-epsilon", type=float, default=None,
                   help="typical acceptance: hard threshold epsilon (default 0.09)")
    p.add_argument("--typical-delta", type=float, default=None,
                   help="typical acceptance: entropy threshold factor delta (default 0.3)")


def add_fingerprint_argument(p: argparse.ArgumentParser) -> None:
    """--allow-missing-fingerprint, the one override of the fingerprint policy (session.py)."""
    p.add_argument("--allow-missing-fingerprint", action="store_true",
                   help="use a specheads export that records no target fingerprint (refused by "
                        "default); a draft whose fingerprint names another target is always refused")


HYBRID_HELP = ("combine the drafter with a free proposer (suffix decoding; prompt lookup when arctic-inference is "
               "absent, said at start): choose = per step the draft expected to accept more, union = both in one "
               "verified tree, off = the drafter alone. auto (default): the setting EXPORT/eval/metrics.json "
               "(`specheads eval --attach`) predicts fastest of the drafter alone, hybrid choose, union and "
               "adaptive, so a hybrid whenever it predicts one faster than the drafter alone; without that file "
               "the drafter alone")


SUFFIX_HISTORY_HELP = ("conversations whose answers go into suffix decoding's global cache before the first "
                       "request, as a server that answered them would have it (e.g. the regenerated training data)")


def add_mixing_arguments(p: argparse.ArgumentParser) -> None:
    """--hybrid / --adaptive, shared by generate, serve and regenerate --draft (specheads/mixing.py)."""
    p.add_argument("--hybrid", choices=["auto", "choose", "union", "off"], default="auto", help=HYBRID_HELP)
    p.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=None,
                   help="adaptive draft length: per step the draft (drafter, or the free one with --hybrid choose) "
                        "and its length 0..k_max with the most expected tokens per measured cost, from the "
                        "calibration and step costs in EXPORT/eval/metrics.json (default: as --hybrid auto decides)")
    p.add_argument("--suffix-history", metavar="FILE", help=SUFFIX_HISTORY_HELP)


def module_doc(relative: str) -> str:
    """The docstring of specheads/<relative> read from its source (importing it would load torch)."""
    return ast.get_docstring(ast.parse((PACKAGE / relative).read_text(encoding="utf-8"))) or ""


@dataclass(frozen=True)
class DemoPreset:
    """A demo --preset's settings: the embedded target's preset and the demo's sizes; a flag given on the
    command line wins, and recipe overrides given there come after `overrides` (so they win too)."""

    regenerate: int = 2000
    regenerate_tokens: int = 128  # longest regenerated answer
    module_limit: int | None = None
    limit: int | None = None
    max_new_tokens: int = 96
    overrides: tuple[str, ...] = ()


DEMO_PRESETS = {
    "default": DemoPreset(),
    # the 'test' target's context is 256 tokens: every length here fits it, and each stage takes seconds
    "test": DemoPreset(regenerate=12, regenerate_tokens=64, module_limit=60, limit=3, max_new_tokens=16,
                       overrides=("data.max_length=128", "head.draft_vocab_size=256", "train.batch_size=4",
                                  "train.max_steps=8", "train.save_every=8", "train.log_every=4")),
}


def generate_parser() -> argparse.ArgumentParser:
    """`specheads generate`'s options."""
    p = argparse.ArgumentParser(prog="specheads generate", formatter_class=HelpFormatter, description=(
        "Generate from one prompt with an exported draft (greedy unless --temperature > 0), "
        "streaming the text; then decode it plainly and report tau, per-position acceptance "
        "and tokens/s of both."))
    p.add_argument("--target", required=True, help="local HF model folder, hub id (org/name, from the hub cache) or builtin:tiny")
    p.add_argument("--draft", required=True, help="export folder written by `specheads export`, or a hub id (org/name)")
    p.add_argument("--prompt", required=True, help="the user message (or raw text with --no-chat)")
    add_tree_arguments(p)
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="render the prompt with the chat template (default) or feed it raw")
    add_sampling_arguments(p)
    add_mixing_arguments(p)
    add_fingerprint_argument(p)
    p.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda, cuda:1 ...")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on a GPU, float32 on a CPU")
    return p


def regenerate_parser() -> argparse.ArgumentParser:
    """`specheads regenerate`'s options."""
    p = argparse.ArgumentParser(prog="specheads regenerate", formatter_class=HelpFormatter, description=(
        "Rewrite the assistant turns of a dataset with the target (turn by turn), locally or "
        "through an OpenAI-compatible server; resumable after a kill."))
    p.add_argument("source", help="dataset file (ShareGPT, OpenAI messages, Alpaca; .json/.jsonl/...)")
    p.add_argument("--out", required=True, help="output JSON-lines file (resumed if it exists)")
    p.add_argument("--format", default="auto", choices=["auto", "sharegpt", "openai", "messages", "alpaca", "text"],
                   help="the dataset's row format (default auto: from the first row's keys; a prompts file with "
                        "prompt / turns / question rows is read as prompts to answer)")
    p.add_argument("--limit", type=int, default=None, help="first N rows only")
    g = p.add_argument_group("backend")
    g.add_argument("--target", default=None, help="local HF model folder or hub id (org/name): generate in this process")
    g.add_argument("--endpoint", default=None, help="OpenAI-compatible base URL, e.g. http://host:8000/v1")
    g.add_argument("--model", default=None, help="served model name (default: the first listed)")
    g.add_argument("--api-key", default=None, help="the server's API key (default: none sent)")
    g.add_argument("--concurrency", type=int, default=8, help="conversations in flight (endpoint)")
    g.add_argument("--timeout", type=float, default=300.0, help="seconds per request (endpoint)")
    g.add_argument("--retries", type=int, default=4, help="retries per request (endpoint)")
    g.add_argument("--backoff", type=float, default=1.0, help="first retry delay in seconds, doubling")
    g.add_argument("--batch-size", type=int, default=16,
                   help="prompts per target forward (local; plain generate, or speculative with --draft)")
    g.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda, cuda:1, ... (local)")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="the target's dtype (default: bfloat16 on a GPU, float32 elsewhere)")
    g.add_argument("--draft", default=None,
                   help="an export folder of the target's drafter: decode speculatively, --batch-size "
                        "prompts at a time (greedy: the same answers as plain decoding; sampled: the same "
                        "distribution, each answer seeded from --seed and its prompt)")
    add_fingerprint_argument(g)
    add_mixing_arguments(g)
    s = p.add_argument_group("sampling and content")
    s.add_argument("--max-new-tokens", type=int, default=512, help="longest new answer, in tokens")
    s.add_argument("--temperature", type=float, default=0.0, help="0: greedy answers")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    s.add_argument("--seed", type=int, default=0, help="sampling seed (each answer's seed also depends on its prompt)")
    s.add_argument("--thinking", default="keep", choices=["keep", "drop"],
                   help="keep or drop <think> blocks / the server's reasoning in new answers")
    add_quiet_argument(p)
    s.add_argument("--tools", default="keep", choices=["keep", "skip"],
                   help="keep: tool results and tool-calling turns stay, text answers are "
                        "regenerated; skip: leave rows with tool messages out")
    return p


def train_parser() -> argparse.ArgumentParser:
    """`specheads train`'s options."""
    p = argparse.ArgumentParser(prog="specheads train", description=TRAIN_HELP, formatter_class=RawHelpFormatter)
    p.add_argument("recipe", help="YAML recipe (see recipes/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-4")
    p.add_argument(NEW_PHASE_FLAG, action="store_true", dest="new_phase",
                        help="resume with a changed recipe (lr, data, head.*, batch size, schedule, a longer "
                             "cosine/wsd run, ...): a new phase from the latest checkpoint's weights, with a fresh "
                             "optimizer and learning-rate schedule up to train.max_steps, recorded in the "
                             "checkpoints. Without it a resume refuses any change that affects the weights")
    return p


def demo_parser() -> argparse.ArgumentParser:
    """`specheads demo`'s options."""
    p = argparse.ArgumentParser(prog="specheads demo", description=module_doc("demo.py"), formatter_class=RawHelpFormatter)
    p.add_argument("--run", default=os.environ.get("RUN", "runs/demo"), help="run folder (default runs/demo)")
    p.add_argument("--recipe", default=str(DEFAULT_RECIPE), help="the EAGLE-3 recipe the demo trains with")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens decoded per held-out prompt (default: the preset's, 96 / test 16)")
    p.add_argument("--limit", "--num-prompts", dest="limit", type=int, default=None,
                   help="evaluate only the first N prompts (default: the preset's, all / test 3)")
    p.add_argument("--preset", default="default", choices=list(DEMO_PRESETS),
                   help="default: the embedded target and the full demo (minutes); test: a smaller target, 12 "
                        "regenerated prompts and 8 training steps, a smoke run in seconds")
    p.add_argument("--module-limit", type=int, default=None,
                   help="use only the first N stdlib modules for data (default: the preset's, all / test 60)")
    p.add_argument("--regenerate", type=int, default=None,
                   help="answer N train prompts with the target itself and train on those (0 = original "
                        "answers; default: the preset's, 2000 / test 12)")
    p.add_argument("overrides", nargs="*", help="recipe overrides, e.g. train.max_steps=50 (after the preset's)")
    return p


def push_parser() -> argparse.ArgumentParser:
    """`specheads push`'s options."""
    p = argparse.ArgumentParser(prog="specheads push", formatter_class=HelpFormatter,
                                description=module_doc("hub.py").split("\n\n")[0])
    p.add_argument("export_dir", help="a folder written by `specheads export` and measured by `specheads eval --attach`")
    p.add_argument("--repo", required=True, help="hub repository id, e.g. org/name-eagle3")
    p.add_argument("--private", action="store_true", help="create the repository private")
    p.add_argument("--dry-run", action="store_true", help="print the files and the model card; upload nothing")
    p.add_argument("--endpoint", default=None, help="hub endpoint (default: HF_ENDPOINT or huggingface.co)")
    p.add_argument("--license", default=None, metavar="ID",
                   help="the card's licence (default: the target's, from its model card's `license:`; refused "
                        "when unknown)")
    p.add_argument("--base-model", default=None, metavar="ORG/NAME",
                   help="the target's hub id, for the card's base_model and serve commands (default: the one the "
                        "export records; else the target's local path, made absolute)")
    return p


def capture_parser() -> argparse.ArgumentParser:
    """`specheads capture`'s options."""
    p = argparse.ArgumentParser(prog="specheads capture", formatter_class=RawHelpFormatter,
                                description=module_doc("data/features.py"))
    p.add_argument("recipe", help="the training recipe (its target, data and head decide what is stored)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.max_length=2048")
    p.add_argument("--out", default=None, help="capture folder (default: the recipe's data.features)")
    p.add_argument("--dtype", default="bfloat16", choices=list(STORAGE_DTYPES),
                   help="storage dtype; int8 = per-row absmax with a float32 scale (lossy)")
    p.add_argument("--shard-mb", type=float, default=1024.0, help="approximate shard size in MiB")
    p.add_argument("--batch-size", type=int, default=8, help="samples per target forward")
    add_quiet_argument(p)
    return p


def vocab_stats_parser() -> argparse.ArgumentParser:
    """`specheads vocab-stats`'s options."""
    p = argparse.ArgumentParser(prog="specheads vocab-stats", formatter_class=RawHelpFormatter,
                                description=module_doc("data/vocab_stats.py"))
    p.add_argument("recipe", help="the training recipe (its target tokenizer and data are used)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.train=a.jsonl")
    p.add_argument("--out", default=None, help="file to write (default: the recipe's data.vocab_stats)")
    p.add_argument("--workers", type=int, default=1, help="tokenising processes")
    return p


def magpie_parser() -> argparse.ArgumentParser:
    """`specheads magpie`'s options."""
    p = argparse.ArgumentParser(prog="specheads magpie", formatter_class=HelpFormatter, description=(
        "Magpie: let the target write user prompts (its chat template up to a user turn's opening, sampled), "
        "clean and deduplicate them, and write a prompts file for `specheads regenerate`."))
    p.add_argument("--target", required=True, help="local HF chat model folder or hub id (its tokenizer needs a chat template)")
    p.add_argument("--out", required=True, help="prompts JSON-lines file ({id, prompt} rows); resumed if it exists")
    p.add_argument("--n", type=int, default=1000, help="samples to generate (kept <= n after cleaning)")
    p.add_argument("--batch-size", type=int, default=16, help="samples per generate call")
    p.add_argument("--max-new-tokens", type=int, default=64, help="longest prompt, in tokens")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the prompts")
    p.add_argument("--top-p", type=float, default=0.99, help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--system", default=None, help="system prompt before the user turn (default: the template's own)")
    p.add_argument("--min-chars", type=int, default=12, help="drop shorter prompts")
    p.add_argument("--max-chars", type=int, default=2000, help="drop longer prompts")
    p.add_argument("--keep-truncated", action="store_true", help="keep prompts cut at --max-new-tokens")
    p.add_argument("--near-prefix-words", type=int, default=4,
                   help="near-duplicates are looked for among prompts opening with these many equal words")
    p.add_argument("--near-jaccard", type=float, default=0.7,
                   help="word-trigram Jaccard similarity at which a prompt is a near-duplicate of a kept one")
    p.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda, ...")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="the target's dtype (default: bfloat16 on a GPU, float32 elsewhere)")
    add_quiet_argument(p)
    return p


def from_gguf_parser() -> argparse.ArgumentParser:
    """`specheads target from-gguf`'s options."""
    p = argparse.ArgumentParser(prog="specheads target from-gguf", formatter_class=HelpFormatter,
                                description="Convert a GGUF chat model into a HF folder (fp32, chat template kept).")
    p.add_argument("file", help="the .gguf file")
    p.add_argument("--out", required=True, help="folder to write (atomically)")
    p.add_argument("--name", default=None,
                   help="the model's hub id (e.g. HuggingFaceTB/SmolLM2-135M-Instruct), recorded for exports")
    return p


# serve's admission defaults (serve/server.py ServeOptions, whose module loads torch; a test keeps them equal)
SERVE_DEFAULTS = {"max_batch": 8, "max_queue": 256, "read_timeout": 30.0, "max_body_mb": 8.0, "log_interval": 10.0}


def serve_parser() -> argparse.ArgumentParser:
    """`specheads serve`'s options."""
    p = argparse.ArgumentParser(prog="specheads serve", formatter_class=HelpFormatter, description=(
        "Serve the target (with an exported draft, or plainly) behind an OpenAI-compatible API "
        "with Prometheus /metrics using vLLM's speculative-decoding metric names."))
    p.add_argument("--target", required=True, help="local HF model folder, hub id (org/name, from the hub cache) or builtin:tiny")
    p.add_argument("--draft", default=None, help="export folder from `specheads export` or a hub id (org/name) (default: none)")
    add_tree_arguments(p)
    add_mixing_arguments(p)
    add_fingerprint_argument(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed)")
    p.add_argument("--served-model-name", default=None, help="default: the target folder's name")
    p.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="the target's dtype (default: bfloat16 on a GPU, float32 elsewhere)")
    p.add_argument("--max-batch", type=int, default=SERVE_DEFAULTS["max_batch"],
                   help="requests decoding together, joining at step boundaries (rows per target "
                        "forward; 1: one at a time) (default %(default)s)")
    p.add_argument("--max-queue", type=int, default=SERVE_DEFAULTS["max_queue"],
                   help="requests that may wait behind the --max-batch decoding; more get 503 with "
                        "Retry-After (default %(default)s)")
    p.add_argument("--read-timeout", type=float, default=SERVE_DEFAULTS["read_timeout"],
                   help="seconds a request's headers, and then its body, may take to arrive "
                        "(default %(default)s)")
    p.add_argument("--max-body-mb", type=float, default=SERVE_DEFAULTS["max_body_mb"],
                   help="largest request body in megabytes; larger ones get 413. A 128K-token context of text is "
                        "about 0.5-1.5 MB of JSON, so the default leaves room for tool schemas and escaped text while "
                        "bounding what one request makes the server hold (default %(default)s)")
    p.add_argument("--log-interval", type=float, default=SERVE_DEFAULTS["log_interval"],
                   help="seconds between log lines of throughput and draft acceptance (as vLLM's), written only "
                        "when requests ran or finished; 0: none (default %(default)s)")
    p.add_argument("--log-requests", action="store_true", help="one line per request on stderr")
    return p


CHECK_ENGINES = ("sglang", "vllm")  # engines/check.py PROBES' keys (a test keeps them equal)


def check_engine_parser() -> argparse.ArgumentParser:
    """`specheads check-engine`'s options."""
    p = argparse.ArgumentParser(prog="specheads check-engine", formatter_class=HelpFormatter, description=(
        "Load and run an export with vLLM 0.33's or SGLang 0.5.23's own code on the CPU (each in its own venv "
        "under the user cache, created on first use) and compare config, weights, tapped layers and the "
        "draft's forward with ours."))
    p.add_argument("export", help="an export folder written by `specheads export`")
    p.add_argument("--engine", required=True, choices=CHECK_ENGINES, help="the engine whose code loads the export")
    p.add_argument("--target", help="the target folder (not needed for MTP: the export is the target)")
    p.add_argument("--k", type=int, help="draft length (default: the export's)")
    p.add_argument("--positions", type=int, default=256, help="prompt positions compared (capped by the context)")
    p.add_argument("--work", help="keep the probe's files here (default: a temp folder)")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds allowed for the engine probe")
    p.add_argument("--json", help="write the report as JSON here")
    return p
