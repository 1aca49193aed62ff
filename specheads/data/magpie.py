"""Prompts without a dataset (Magpie, arXiv 2406.08464): the target writes its own user turns.

The chat template is rendered up to the opening of a user turn (the *pre-query*: a default or
given system turn included), the target samples a continuation until its end-of-turn token, and
the texts are cleaned (`clean`: strip; drop empty, non-printable, too short, too long, cut at
max_new_tokens; deduplicate) and written as a prompts file (`{"id", "prompt"}` rows, read by
data/prompts.py's `read_prompts` and by `specheads regenerate`), so the answers are then written
by the target as for any dataset: `specheads magpie` -> `specheads regenerate` -> train.

Files: OUT (written atomically once the samples are cleaned), OUT.samples.jsonl (the raw samples,
one row per batch, append-only with an index, data/resume.py: a killed run resumes at the next
batch, and a rerun with other filter options re-cleans without generating) and OUT.meta.json
(the generation options, the target's fingerprint, the pre-query, the stop ids and the counts).
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specheads.atomic import atomic_file, write_json
from specheads.cli_parsers import magpie_parser
from specheads.data.messages import lone_surrogate
from specheads.data.regenerate_turns import RegenOptions, generate_batch
from specheads.data.resume import RowWriter, check_resumable
from specheads.progress import Progress
from specheads.target import Target

SENTINELS = ("MagpieQuerySentinelA7", "MagpieQuerySentinelB3")  # two: the opening must not depend on the text
DROP_REASONS = ("empty", "non_printable", "too_short", "too_long", "truncated", "duplicate", "near_duplicate")


class MagpieError(ValueError):
    """An option, tokenizer or output Magpie cannot use (the message says what to change)."""


@dataclass(frozen=True)
class MagpieOptions:
    """What shapes the samples; recorded in OUT.meta.json and checked on resume."""

    n: int = 1000  # samples to generate (kept <= n after cleaning)
    batch_size: int = 16
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 0.99
    seed: int = 0
    system: str | None = None  # a system prompt rendered before the user turn (else the template's default)

    def __post_init__(self):
        for name, ok, rule in (
            ("n", self.n >= 1, "must be >= 1 (samples to generate)"),
            ("batch-size", self.batch_size >= 1, "must be >= 1"),
            ("max-new-tokens", self.max_new_tokens >= 1, "must be >= 1"),
            ("temperature", self.temperature > 0, "must be > 0: greedy decoding writes one prompt n times"),
            ("top-p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("seed", self.seed >= 0, "must be >= 0"),
        ):
            if not ok:
                raise MagpieError(f"--{name} {getattr(self, name.replace('-', '_'))}: {rule}")


@dataclass(frozen=True)
class FilterOptions:
    """The cleaning of samples (not part of the resume check: a rerun may re-clean with others)."""

    min_chars: int = 12
    max_chars: int = 2000
    keep_truncated: bool = False  # keep samples cut at max_new_tokens (no end-of-turn seen)
    near_prefix_words: int = 4  # near-duplicates are looked for among prompts opening with the same words
    near_jaccard: float = 0.7  # word-trigram Jaccard similarity at which a prompt is a near-duplicate

    def __post_init__(self):
        if self.min_chars < 1 or self.max_chars < self.min_chars:
            raise MagpieError(f"--min-chars {self.min_chars} / --max-chars {self.max_chars}: need "
                              "1 <= min-chars <= max-chars")
        if self.near_prefix_words < 1:
            raise MagpieError(f"--near-prefix-words {self.near_prefix_words}: must be >= 1")
        if not 0 < self.near_jaccard <= 1:
            raise MagpieError(f"--near-jaccard {self.near_jaccard}: must be in (0, 1] (1: only identical word sets)")


# --- the pre-query template --------------------------------------------------------------------


@dataclass(frozen=True)
class PreQuery:
    """The text before a user's message, its ids, and where a user turn ends."""

    text: str
    ids: list[int]
    stop_ids: list[int]  # end-of-turn marker (when a single special token) and the eos ids
    stop_text: str | None  # the template's text after a user message, first line (a plain-text marker)


def render(tokenizer, messages: list[dict]) -> str:
    """The chat template's text of `messages` (no generation prompt); template errors named."""
    if not getattr(tokenizer, "chat_template", None):
        raise MagpieError("the target's tokenizer has no chat template: Magpie renders the template up to "
                          "a user turn's opening; use a chat (instruct) model, or set tokenizer.chat_template")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    except Exception as err:  # noqa: BLE001 - jinja's TemplateError and what a template raises itself
        raise MagpieError(f"the chat template cannot render {[m['role'] for m in messages]}: "
                          f"{type(err).__name__}: {err}") from None


def pre_query_text(tokenizer, system: str | None = None) -> str:
    """The rendered conversation cut where the user's content starts: every text before it, the
    template's default system turn (or `system`) included. Refused when the template does not
    render the message verbatim, or its opening depends on the message, or is empty."""
    head = [{"role": "system", "content": system}] if system else []
    cuts = []
    for s in SENTINELS:
        text = render(tokenizer, [*head, {"role": "user", "content": s}])
        if s not in text:
            raise MagpieError("the chat template does not render a user's message verbatim, so the opening "
                              "of a user turn cannot be found")
        cuts.append(text[: text.index(s)])
    if cuts[0] != cuts[1] or not cuts[0].strip():
        raise MagpieError("the chat template has no fixed opening for a user turn (the text before the "
                          f"user's message is {'empty' if cuts[0] == cuts[1] else 'message-dependent'})")
    return cuts[0]


def end_of_turn(tokenizer, system: str | None = None) -> tuple[str, int | None]:
    """(the template's text between a user message and an assistant message, the id of its first
    special token or None): that token is where a user turn ends (e.g. <|im_end|>, <|eot_id|>)."""
    head = [{"role": "system", "content": system}] if system else []
    a, b = SENTINELS
    text = render(tokenizer, [*head, {"role": "user", "content": a}, {"role": "assistant", "content": b}])
    between = text[text.index(a) + len(a):]
    between = between[: between.index(b)] if b in between else between
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    ids = tokenizer(between, add_special_tokens=False)["input_ids"]
    return between, next((i for i in ids if i in special), None)


def pre_query(tokenizer, system: str | None = None, eos_ids: list[int] = ()) -> PreQuery:
    """The prompt every sample starts from and what ends a sample. Ids as encode_chat's (the
    template's text tokenized without added special tokens: a BOS the template writes is in it)."""
    text = pre_query_text(tokenizer, system)
    between, marker = end_of_turn(tokenizer, system)
    stops = [marker] if marker is not None else []
    stops += [i for i in [tokenizer.eos_token_id, *eos_ids] if i is not None and i not in stops]
    first_line = between.strip().split("\n")[0].strip()
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return PreQuery(text, ids, stops, first_line or None)


def model_eos_ids(model) -> list[int]:
    """The eos ids of the model's generation config (an int or a list; e.g. Llama-3's <|eot_id|>)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


# --- sampling ------------------------------------------------------------------------------------


def batch_seed(seed: int, batch: int) -> int:
    """Batch `batch`'s sampling seed: distinct per batch (every batch starts from the same prompt,
    so one seed for all would repeat the same samples), and the same whether or not a run resumed."""
    return (seed * 1_000_003 + batch) % 2**63


def cut_sample(tokenizer, new: list[int], pre: PreQuery) -> dict:
    """One sample's new ids -> {text, truncated, tokens}: up to the first stop id (a plain-text
    marker cut too), decoded without special tokens; truncated when no end of turn was seen."""
    end = next((j for j, t in enumerate(new) if t in pre.stop_ids), None)
    kept = new if end is None else new[:end]
    text = tokenizer.decode(kept, skip_special_tokens=True)
    marked = pre.stop_text is not None and pre.stop_text in text
    text = text[: text.index(pre.stop_text)] if marked else text
    return {"text": text, "truncated": end is None and not marked, "tokens": len(kept)}


def sample_batch(target, pre: PreQuery, opts: MagpieOptions, batch: int) -> list[dict]:
    """Batch `batch`'s samples: the pre-query continued by transformers `generate` (regeneration's
    plain path, `generate_batch`), seeded with `batch_seed`."""
    size = min(opts.batch_size, opts.n - batch * opts.batch_size)
    regen = RegenOptions(opts.max_new_tokens, opts.temperature, opts.top_p, batch_seed(opts.seed, batch))
    out = generate_batch(target, regen)([pre.ids] * size, opts.max_new_tokens)  # [size, <= max_new_tokens]
    return [cut_sample(target.tokenizer, new, pre) for new in out]


def batch_id(batch: int) -> str:
    return f"batch-{batch:06d}"


def sample_all(target, pre: PreQuery, opts: MagpieOptions, raw: Path, quiet: bool = False) -> list[dict]:
    """Every sample in order, generating the batches `raw` (OUT.samples.jsonl) does not hold yet;
    each batch is durable as soon as it is written."""
    batches = -(-opts.n // opts.batch_size)
    writer = RowWriter(raw)
    try:
        todo = [b for b in range(batches) if batch_id(b) not in writer.done]
        with Progress(sum(min(opts.batch_size, opts.n - b * opts.batch_size) for b in todo), "magpie",
                      "samples", quiet=quiet) as progress:
            for b in todo:
                samples = sample_batch(target, pre, opts, b)
                writer.write(batch_id(b), {"id": batch_id(b), "samples": samples})
                progress.update(len(samples))
    finally:
        writer.close()
    rows = {r["id"]: r["samples"] for r in map(json.loads, raw.read_text(encoding="utf-8").splitlines())}
    return [s for b in range(batches) for s in rows[batch_id(b)]]


# --- cleaning ------------------------------------------------------------------------------------


def normalise(text: str) -> str:
    """The exact-duplicate key: whitespace collapsed, case folded."""
    return " ".join(text.split()).casefold()


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text.casefold())


def shingles(ws: list[str], n: int = 3) -> set[tuple[str, ...]]:
    """Word n-grams (a text shorter than n words: its words as one shingle)."""
    return {tuple(ws[i:i + n]) for i in range(len(ws) - n + 1)} if len(ws) >= n else {tuple(ws)}


def jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def printable(text: str) -> bool:
    """Only printable characters, newlines and tabs; no U+FFFD (bytes that decoded to no character)
    and no lone surrogate."""
    return "\ufffd" not in text and lone_surrogate(text) < 0 and all(c.isprintable() or c in "\n\t" for c in text)


def first_failure(sample: dict, f: FilterOptions) -> str | None:
    """The first per-sample filter `sample` fails (its text already stripped), or None."""
    text = sample["text"]
    for reason, bad in (("empty", not text), ("non_printable", not printable(text)),
                        ("too_short", len(text) < f.min_chars), ("too_long", len(text) > f.max_chars),
                        ("truncated", sample["truncated"] and not f.keep_truncated)):
        if bad:
            return reason
    return None


class Deduper:
    """Exact duplicates (the `normalise`d text seen before) and near-duplicates: a prompt whose word
    trigrams have Jaccard similarity >= `near_jaccard` with a kept prompt that opens with the same
    `near_prefix_words` words. Comparing within such buckets only keeps it cheap (buckets are small)
    at the cost of missing near-duplicates whose first words differ."""

    def __init__(self, f: FilterOptions):
        self.f = f
        self.seen: set[str] = set()
        self.buckets: dict[tuple[str, ...], list[set]] = {}

    def check(self, text: str) -> str | None:
        """'duplicate', 'near_duplicate' or None (then the text is remembered as kept)."""
        key = normalise(text)
        if key in self.seen:
            return "duplicate"
        ws = words(text)
        bucket = self.buckets.setdefault(tuple(ws[: self.f.near_prefix_words]), [])
        grams = shingles(ws)
        if any(jaccard(grams, other) >= self.f.near_jaccard for other in bucket):
            return "near_duplicate"
        self.seen.add(key)
        bucket.append(grams)
        return None


@dataclass
class Counts:
    """What cleaning did: samples generated, prompts kept, and samples dropped per reason."""

    generated: int = 0
    kept: int = 0
    dropped: dict = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))


def clean(samples: list[dict], f: FilterOptions) -> tuple[list[tuple[int, str]], Counts]:
    """(index of the sample, stripped text) of each kept sample, in order, and the counts."""
    counts, dedupe, kept = Counts(generated=len(samples)), Deduper(f), []
    for i, sample in enumerate(samples):
        text = sample["text"].strip()
        reason = first_failure({**sample, "text": text}, f) or dedupe.check(text)
        if reason:
            counts.dropped[reason] += 1
        else:
            kept.append((i, text))
    counts.kept = len(kept)
    return kept, counts


# --- the run -------------------------------------------------------------------------------------


def meta_path(out: Path) -> Path:
    return out.with_name(out.name + ".meta.json")


def samples_path(out: Path) -> Path:
    return out.with_name(out.name + ".samples.jsonl")


def check_output(out: Path, meta: dict) -> None:
    """Refuse an OUT that is not an earlier Magpie output, or one made with other options."""
    if out.is_dir():
        raise MagpieError(f"--out '{out}' is a folder: pass a file path for the prompts (e.g. {out / 'prompts.jsonl'})")
    old = json.loads(meta_path(out).read_text(encoding="utf-8")) if meta_path(out).is_file() else None
    if out.exists() and (old is None or "magpie" not in old):
        raise MagpieError(f"--out '{out}' exists and is not a `specheads magpie` output: nothing was changed; "
                          "pass a new --out or move the file away")
    for key in ("magpie", "target", "pre_query") if old else ():
        if old.get(key) != meta[key]:
            raise MagpieError(f"{out} was made with other {key} ({old.get(key)} vs now {meta[key]}): pass a "
                              "new --out or the same settings")
    check_resumable(samples_path(out))


def write_prompts(out: Path, kept: list[tuple[int, str]], seed: int) -> None:
    """The prompts file, atomically: `{"id": "magpie-s<seed>-<sample index>", "prompt"}` rows."""
    with atomic_file(out) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for i, text in kept:
            f.write(json.dumps({"id": f"magpie-s{seed}-{i:06d}", "prompt": text}, ensure_ascii=False) + "\n")


def check_fits(pre: PreQuery, opts: MagpieOptions, context: int | None) -> None:
    """Refuse, before sampling, a pre-query (the system prompt inside) that leaves no room in the context
    for --max-new-tokens, naming the numbers."""
    if context is None or len(pre.ids) + opts.max_new_tokens <= context:
        return
    system = f"with the --system prompt of {len(opts.system)} characters " if opts.system else ""
    if len(pre.ids) >= context:
        raise MagpieError(f"the prompt every sample starts from {system}is {len(pre.ids)} tokens, but the target's "
                          f"context is {context}: shorten --system")
    raise MagpieError(f"the prompt every sample starts from {system}is {len(pre.ids)} tokens and --max-new-tokens "
                      f"{opts.max_new_tokens} more exceed the target's context of {context}: pass --max-new-tokens "
                      f"{context - len(pre.ids)} or less" + (", or shorten --system" if opts.system else ""))


def run_magpie(target, out: str | Path, opts: MagpieOptions, filters: FilterOptions = FilterOptions(),
               quiet: bool = False) -> Counts:
    """Generate `opts.n` samples (resuming what OUT.samples.jsonl holds), clean them and write OUT
    and OUT.meta.json; raises MagpieError (after writing the meta) when nothing was kept."""
    out = Path(out)
    pre = pre_query(target.tokenizer, opts.system, model_eos_ids(target.model))
    check_fits(pre, opts, target.context)
    meta = {"magpie": asdict(opts), "target": target.fingerprint(), "path": str(target.path),
            "pre_query": pre.text, "stop_ids": pre.stop_ids, "stop_text": pre.stop_text}
    check_output(out, meta)
    write_json(meta_path(out), {**meta, "filters": asdict(filters), "counts": None})
    samples = sample_all(target, pre, opts, samples_path(out), quiet)
    kept, counts = clean(samples, filters)
    write_json(meta_path(out), {**meta, "filters": asdict(filters), "counts": asdict(counts)})
    if not kept:
        raise MagpieError(f"none of the {counts.generated} samples passed the filters ({summary(counts)}): "
                          "raise --max-new-tokens, or loosen --min-chars / --max-chars / --keep-truncated")
    write_prompts(out, kept, opts.seed)
    return counts


def summary(counts: Counts) -> str:
    dropped = ", ".join(f"{k} {v}" for k, v in counts.dropped.items() if v) or "none"
    return f"generated {counts.generated}, kept {counts.kept}, dropped: {dropped}"


def main(argv: list[str] | None = None) -> int:
    """`specheads magpie`: options -> a loaded target -> run_magpie -> the counts."""
    p = magpie_parser()
    a = p.parse_args(argv)
    opts = MagpieOptions(a.n, a.batch_size, a.max_new_tokens, a.temperature, a.top_p, a.seed, a.system)
    filters = FilterOptions(a.min_chars, a.max_chars, a.keep_truncated, a.near_prefix_words, a.near_jaccard)
    if Path(a.out).is_dir():
        raise MagpieError(f"--out '{a.out}' is a folder: pass a file path for the prompts")
    counts = run_magpie(Target.load(a.target, dtype=a.dtype, device=a.device), a.out, opts, filters, a.quiet)
    print(json.dumps(asdict(counts), indent=2))
    print(f"magpie: {summary(counts)} -> {a.out}", file=sys.stderr)
    return 0

