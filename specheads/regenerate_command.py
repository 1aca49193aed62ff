"""`specheads regenerate`: the command's options and backend choice (the resumable run:
data/regenerate_run.py; the turn-by-turn engine: data/regenerate_turns.py).

With `--draft` the local target decodes through a speculation session (session.py), `--batch-size`
rows per target forward, so answers come from the one decode loop: greedy answers are exactly plain
greedy decoding's, sampled ones keep the target's distribution (docs/algorithms.md §8), each seeded
from --seed and its prompt (`prompt_seed`), whatever the batch.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from specheads.cli_options import (
    mixing_from_args,
)
from specheads.cli_parsers import regenerate_parser
from specheads.data.openai_client import Endpoint
from specheads.data.regenerate_run import read_rows, run_regenerate
from specheads.data.regenerate_turns import LocalBackend, OpenAIBackend, RegenerateError, RegenOptions, prompt_seed
from specheads.data.resume import check_resumable
from specheads.model_ref import resolve_draft
from specheads.session import Session, load_draft
from specheads.target import Target
from specheads.verify.settings import Sampling, TreeSpec
from specheads.verify.steps import DecodeStats


class SessionDecoder:
    """Speculative decoding (`--draft`): a batch's prompts through a speculation session's
    `decode_many`, up to `batch_size` rows per target forward, each row equal to its decode alone
    (greedy: plain greedy's tokens; sampled: seeded by `prompt_seed`). `stats` sums every decode's
    counts (tau: `stats.summary()`)."""

    def __init__(self, session, opts: RegenOptions, batch_size: int):
        self.session, self.opts, self.batch_size = session, opts, batch_size
        self.stats = DecodeStats()

    def __call__(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        o = self.opts
        each = [Sampling(temperature=o.temperature, top_p=o.top_p, seed=prompt_seed(o.seed, ids)) for ids in prompts]
        results = self.session.decode_many(prompts, max_new_tokens, each, self.batch_size)
        self.stats = self.stats.add(DecodeStats.total(results))
        return [list(r.tokens) for r in results]


def check_options(a: argparse.Namespace) -> None:
    """Refuse bad options and a missing source before a target is loaded or a server asked."""
    bad = [(f"--{name.replace('_', '-')} {getattr(a, name)}", rule) for name, ok, rule in (
        ("concurrency", a.concurrency >= 1, "must be >= 1"),
        ("batch_size", a.batch_size >= 1, "must be >= 1"),
        ("retries", a.retries >= 0, "must be >= 0"),
        ("timeout", a.timeout > 0, "must be > 0 seconds"),
        ("backoff", a.backoff >= 0, "must be >= 0 seconds"),
        ("limit", a.limit is None or a.limit >= 1, "must be >= 1 (rows to regenerate)"),
    ) if not ok]
    if bad:
        raise RegenerateError(f"{bad[0][0]}: {bad[0][1]}")
    if not Path(a.source).exists():
        raise RegenerateError(f"dataset '{a.source}' does not exist")
    if a.draft and a.endpoint:
        raise RegenerateError("--draft speculates with a target loaded in this process; a server "
                              "(--endpoint) uses its own drafter, if it was started with one")
    if a.draft:
        resolve_draft(a.draft)  # a missing folder or an uncached hub id fails before the target loads
    if Path(a.out).is_dir():
        raise RegenerateError(f"--out '{a.out}' is a folder: pass a file path for the JSON lines")
    mixing_from_args(a, a.draft)  # --hybrid / --adaptive checked before a target loads


def make_backend(a: argparse.Namespace, opts: RegenOptions):
    """--target (local; speculative with --draft) or --endpoint (OpenAI-compatible), exactly one."""
    if bool(a.target) == bool(a.endpoint):
        raise RegenerateError("pass exactly one of --target (local generate) or --endpoint "
                              "(an OpenAI-compatible server)")
    if a.endpoint:
        ep = Endpoint(a.endpoint, a.api_key, a.timeout, a.retries, a.backoff)
        return OpenAIBackend(ep, a.model, opts)
    if a.draft:
        return speculative_backend(a, opts)
    target = Target.load(a.target, dtype=a.dtype, device=a.device)
    return LocalBackend(target, opts, a.batch_size)


def speculative_backend(a: argparse.Namespace, opts: RegenOptions) -> LocalBackend:
    """The target and the draft in one session; each batch of answers decoded speculatively."""
    target = Target.load(a.target, dtype=a.dtype, device=a.device)
    draft = load_draft(a.draft, target, a.allow_missing_fingerprint)
    # a turn ends at the tokenizer's eos only, as in the batched path (generate's eos_token_id)
    session = Session(target, draft, TreeSpec("chain"), eos=[target.tokenizer.eos_token_id],
                      mixing=mixing_from_args(a, a.draft))
    print(f"[specheads] regenerate: speculation: {session.mixing.describe()}"
          + (f"; {session.free_note}" if session.free_note else ""), file=sys.stderr, flush=True)
    decoder = SessionDecoder(session, opts, a.batch_size)
    return LocalBackend(session.target, opts, a.batch_size, decoder, draft=str(draft.meta.folder.resolve()))


def main(argv: list[str] | None = None) -> int:
    p = regenerate_parser()
    a = p.parse_args(argv)
    check_options(a)
    opts = RegenOptions(a.max_new_tokens, a.temperature, a.top_p, a.seed, a.thinking, a.tools)
    read_rows(a.source, a.format, a.limit)  # a bad dataset fails before a target is loaded
    check_resumable(a.out)  # before the target loads
    backend = make_backend(a, opts)
    report = run_regenerate(a.source, a.out, backend, opts, a.format, a.limit,
                            a.concurrency, chunk=a.batch_size * 4, quiet=a.quiet)
    print(json.dumps(asdict(report), indent=2))
    if isinstance(getattr(backend, "decoder", None), SessionDecoder) and backend.decoder.stats.decode_forwards:
        print(f"regenerate: speculation tau {backend.decoder.stats.summary()['tau']:.2f} "
              f"(tokens per target forward, this run)", file=sys.stderr)
    print(f"regenerate: {report.finished} finished now, {report.resumed} from earlier runs, "
          f"{report.failed} failed, {report.truncated} truncated -> {a.out}", file=sys.stderr)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
