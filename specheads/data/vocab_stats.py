"""Token frequencies over the supervised tokens of a dataset, counted once and reused by any head.

    specheads vocab-stats RECIPE --out FILE [--workers N] [key=value ...]

The counts are exactly what training would count from the same recipe (same tokenisation, loss
masks and max_length, held-out samples left out), streamed sample by sample and split over worker
processes. Training uses
them with `data.vocab_stats: FILE` to build the reduced draft vocabulary without re-counting.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
from pathlib import Path

import torch

from specheads.atomic import save_safetensors
from specheads.cli_parsers import vocab_stats_parser
from specheads.config import check_recipe_inputs, load_recipe
from specheads.data.samples import read_recipe_conversations, split_samples
from specheads.data.tokenize import tokenize_conversation
from specheads.provenance import provenance
from specheads.target import resolve_target_path, tokenizer_hash

FORMAT = "specheads-vocab-stats"
_WORKER: dict = {}  # per worker process: the tokenizer and settings, set once by the pool initializer


class VocabStatsError(ValueError):
    """A vocabulary-statistics file that is missing, malformed or made for another tokenizer."""


def count_supervised(tokenizer, convs, vocab_size: int, max_length: int,
                     end_of_turn: str | None = None) -> tuple[torch.Tensor, list[bool]]:
    """Counts [V] int64 of supervised token ids (streamed), and per conversation whether it is kept
    as a sample (has a supervised token within max_length, as `tokenize_all` decides)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    kept = []
    for conv in convs:
        s = tokenize_conversation(tokenizer, conv, max_length, end_of_turn=end_of_turn)
        ids = torch.tensor(s.input_ids, dtype=torch.int64)[torch.tensor(s.loss_mask, dtype=torch.bool)]
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
        kept.append(ids.numel() > 0)
    return counts, kept


def _init_worker(tokenizer, vocab_size, max_length, end_of_turn) -> None:
    torch.set_num_threads(1)
    _WORKER.update(tokenizer=tokenizer, vocab_size=vocab_size, max_length=max_length, end_of_turn=end_of_turn)


def _count_chunk(convs) -> tuple[torch.Tensor, list[bool]]:
    w = _WORKER
    return count_supervised(w["tokenizer"], convs, w["vocab_size"], w["max_length"], w["end_of_turn"])


def count_parallel(tokenizer, convs: list, vocab_size: int, max_length: int, end_of_turn: str | None = None,
                   workers: int = 1, chunk: int = 256) -> tuple[torch.Tensor, list[bool]]:
    """`count_supervised` over `workers` processes (chunks of conversations, kept flags in order);
    the result is the same."""
    if workers <= 1:
        return count_supervised(tokenizer, convs, vocab_size, max_length, end_of_turn)
    chunks = [convs[i:i + chunk] for i in range(0, len(convs), chunk)]
    counts, kept = torch.zeros(vocab_size, dtype=torch.int64), []
    with multiprocessing.get_context("spawn").Pool(
            workers, initializer=_init_worker, initargs=(tokenizer, vocab_size, max_length, end_of_turn)) as pool:
        for c, k in pool.imap(_count_chunk, chunks):
            counts += c
            kept.extend(k)
    return counts, kept


def count_training(recipe, tokenizer, vocab_size: int, workers: int = 1, report=print) -> tuple[torch.Tensor, int]:
    """Counts [V] over the samples training trains on, and their number: every kept sample is
    counted (in parallel), then the held-out ones (`split_samples`, a few) are taken off again."""
    d = recipe.data
    convs = read_recipe_conversations(recipe, report)
    counts, kept = count_parallel(tokenizer, convs, vocab_size, d.max_length, d.end_of_turn, workers=workers)
    trained, held = split_samples(recipe, [c for c, k in zip(convs, kept) if k])
    if held:
        counts -= count_supervised(tokenizer, held, vocab_size, d.max_length, d.end_of_turn)[0]
    return counts, len(trained)


def save_vocab_stats(path: str | Path, counts: torch.Tensor, meta: dict) -> Path:
    """Write counts [V] and their provenance as one safetensors file (atomically)."""
    save_safetensors({"counts": counts.to(torch.int64).contiguous()}, path,
                     metadata={"format": FORMAT, "meta": json.dumps(meta)})
    return Path(path)


def read_vocab_stats(path: str | Path) -> tuple[torch.Tensor, dict]:
    """counts [V] and the metadata dict of a vocab-stats file."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise VocabStatsError(f"data.vocab_stats {path}: no such file; write it with `specheads vocab-stats`")
    try:
        with safe_open(str(path), framework="pt") as f:
            info = f.metadata() or {}
            if info.get("format") != FORMAT or "counts" not in f.keys():
                raise VocabStatsError(f"data.vocab_stats {path}: not a file written by `specheads vocab-stats`")
            return f.get_tensor("counts"), json.loads(info["meta"])
    except (SafetensorError, OSError, json.JSONDecodeError) as err:
        raise VocabStatsError(f"data.vocab_stats {path}: cannot be read ({str(err)[:160]}); the file is truncated "
                              "or corrupt: run `specheads vocab-stats` again") from None


def load_vocab_stats(path: str | Path, target) -> torch.Tensor:
    """Counts [V] for `target`, refused when they were counted with another tokenizer or vocab size."""
    counts, meta = read_vocab_stats(path)
    if meta.get("tokenizer_sha256") != tokenizer_hash(target.tokenizer) or counts.numel() != target.vocab_size:
        raise VocabStatsError(
            f"data.vocab_stats {path}: counted for another tokenizer ({meta.get('target', '?')}, vocab "
            f"{counts.numel()}) than this target's (vocab {target.vocab_size}); run `specheads vocab-stats` again")
    return counts


def check_stats_output(out: str | Path) -> None:
    """Refuse an `--out` that holds something other than an earlier vocab-stats file (it would be
    replaced), before anything is counted."""
    out = Path(out)
    if not out.exists() and not out.is_symlink():
        return
    if out.is_dir() or out.is_symlink():
        raise VocabStatsError(f"--out {out} is a {'folder' if out.is_dir() else 'link'}: pass a file path "
                              f"(e.g. {out.name}.safetensors elsewhere); nothing was changed")
    try:
        read_vocab_stats(out)
    except VocabStatsError:
        raise VocabStatsError(f"--out {out} exists and is not a vocab-stats file ({out.stat().st_size} bytes); "
                              "writing there would replace it. Nothing was changed: choose another --out, or move "
                              "or remove it yourself") from None


def vocab_stats(recipe, out: str | Path, workers: int = 1, report=print) -> Path:
    """Count the recipe's supervised tokens and save them to `out` (replacing only an earlier count)."""
    from transformers import AutoConfig, AutoTokenizer

    check_stats_output(out)
    folder = resolve_target_path(recipe.target.path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab_size = AutoConfig.from_pretrained(folder).vocab_size
    counts, n = count_training(recipe, tokenizer, vocab_size, workers=workers, report=report)
    meta = {"target": str(folder.name), "tokenizer_sha256": tokenizer_hash(tokenizer), "vocab_size": vocab_size,
            "num_samples": n, "num_tokens": int(counts.sum()), "max_length": recipe.data.max_length,
            "sources": list(recipe.data.train), "provenance": provenance()}
    path = save_vocab_stats(out, counts, meta)
    report(f"[specheads] vocab stats: {meta['num_tokens']} supervised tokens from {n} samples, "
           f"{int((counts > 0).sum())} distinct ids -> {path}")
    return path


def main(argv: list[str] | None = None) -> int:
    """`specheads vocab-stats`: parse arguments, load the recipe, check it, count."""
    p = vocab_stats_parser()
    a = p.parse_args(argv)
    if a.workers < 1:
        raise VocabStatsError(f"--workers {a.workers}: must be >= 1 (tokenising processes)")
    recipe = load_recipe(a.recipe, a.overrides)
    out = a.out or recipe.data.vocab_stats
    if not out:
        raise VocabStatsError("no output file: pass --out FILE or set data.vocab_stats in the recipe")
    check_recipe_inputs(recipe, outputs=("vocab_stats",), memory=False)
    vocab_stats(recipe, out, workers=a.workers)
    return 0


if __name__ == "__main__":  # torchrun / accelerate launch: the same error boundary as the CLI
    from specheads.errors import run_verb

    sys.exit(run_verb("vocab-stats", main, sys.argv[1:]))
