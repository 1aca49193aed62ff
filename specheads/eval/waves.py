"""Eval's first pass: every turn of every prompt row decoded plainly, with the drafter and with each
training-free proposer, up to `batch_size` sequences per target forward (`verify.loop.decode_batch`).

Decoding goes in waves: turn t of every row of a block is one wave (turn t + 1's prompt holds turn
t's plain answer, so waves go turn by turn), and each method decodes the whole wave before the next
method. At batch size 1 a block is one row, so a row's turns follow each other as they always did;
above 1 a block is BLOCK_BATCHES batches of rows, so a finished row's place in the batch goes to the
next waiting one of its block. The methods take turns block by block, plain decoding first in one
block and last in the next: a method timed as one block over every prompt takes whatever load the
machine had during that block as its own (a GPU shared with training jobs once measured prompt
lookup 6.6x faster than plain at tau 1.45, bench/results/real_model_gpu.md).

Every request has its own proposer: the drafter's is fresh (probed for calibration records on greedy
chains), a free proposer's is a fork of the one the eval keeps for its whole run. Suffix decoding's
forks share one global cache, a request per row; rows decoding side by side do not see each
other's answers in it, so at batch size > 1 suffix drafts (and its tau) may differ slightly from
batch 1's, while every greedy output still equals plain decoding. The drafter's and prompt
lookup's drafts do not depend on the batch: their tau and outputs are batch 1's.

The decodes are put together in row order afterwards (`add_row`), so outputs.jsonl, the folds and
the calibration records are the same at every batch size; only the seconds differ, and a row's
seconds are its share of each batched forward (a measured speed-up compares batched decodes).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

from specheads.data.prompts import NoChatTemplate, PromptRow, PromptsError, encode_chat, user_turn
from specheads.progress import Progress
from specheads.protocols import SampledProposer
from specheads.session import WARM_UP_IDS, Session, run_request
from specheads.verify.calibration import ConfidenceProbe, Record
from specheads.verify.loop import Request, decode_batch
from specheads.verify.ngram_proposers import NgramProposer
from specheads.verify.prompt_cache import PromptCache
from specheads.verify.settings import Sampling, TreeSpec
from specheads.verify.steps import DecodeResult, DecodeStats
from specheads.verify.suffix_proposers import SuffixProposer
from specheads.verify.trees import SettingsError

log = logging.getLogger(__name__)


@dataclass
class Totals:
    """Stats summed over every prompt and turn, per method."""

    plain: DecodeStats = field(default_factory=DecodeStats)
    draft: DecodeStats = field(default_factory=DecodeStats)
    free: dict[str, DecodeStats] = field(default_factory=dict)  # training-free proposer -> its stats
    mismatches: list[str] = field(default_factory=list)
    free_mismatches: dict[str, list[str]] = field(default_factory=dict)
    skipped: list[dict] = field(default_factory=list)  # turns whose prompt fills the context
    records: list[Record] = field(default_factory=list)  # draft confidence vs acceptance (greedy chains)
    turns: list[Turn] = field(default_factory=list)  # what the second pass (the hybrid rows) decodes again


def eval_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """`encode_chat`, refusing a tokenizer without a chat template in eval's words."""
    try:
        return encode_chat(tokenizer, messages)
    except NoChatTemplate as err:
        raise PromptsError(f"{err}; specheads eval renders prompts as chat turns and needs one") from None


def check_batch_size(batch_size: int) -> None:
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1 (sequences per target forward), got {batch_size}")


# rows per block above batch size 1, in batches: the batch stays full for most of a block, and the
# methods still take turns often enough that a burst of load lands on all of them
BLOCK_BATCHES = 2


def blocks(items: list, batch_size: int) -> list[list]:
    """What decodes together: one item at a time at batch size 1 (the sequential order), else
    consecutive blocks of BLOCK_BATCHES * batch_size items."""
    size = 1 if batch_size == 1 else BLOCK_BATCHES * batch_size
    return [items[i: i + size] for i in range(0, len(items), size)]


def free_proposers(ngram_sizes=(3, 1), history: list | None = None) -> dict:
    """The training-free proposers every eval compares with: prompt lookup, and suffix decoding
    (vLLM's `method: suffix`; its global cache spans the whole eval, as a server's would, and starts
    with `history`'s (prompt, answer) ids) when arctic-inference is installed. Each decode uses a
    `fork()` of them."""
    out = {"ngram": NgramProposer(*ngram_sizes)}
    try:
        out["suffix"] = SuffixProposer()
    except SettingsError as err:
        log.warning("no suffix decoding row: %s", err)
        return out
    out["suffix"].warm(history or [])
    return out


@dataclass(frozen=True)
class Turn:
    """One decoded turn of the first pass, for the second."""

    id: str
    ids: list[int]
    plain_tokens: list[int]
    fold: int


def turn_tally(stats: DecodeStats) -> dict:
    """One method's decode of one turn, as outputs.jsonl keeps it: enough to sum tau and speed per category."""
    return {"tokens": stats.decode_tokens, "forwards": stats.decode_forwards, "wall_s": stats.wall_s}


# --- one wave ------------------------------------------------------------------------------------


@dataclass
class TurnDecodes:
    """One turn's prompt and each method's decode of it; `records`: the drafter's confidence probe's."""

    ids: list[int]
    plain: DecodeResult
    draft: DecodeResult
    others: dict[str, DecodeResult]
    records: list[Record]


def probes_drafts(session: Session, sampling: Sampling) -> bool:
    """Whether the drafter's decodes are probed (`ConfidenceProbe`: the same greedy drafts, and a
    record per settled draft position): greedy chains of a drafter that reports confidences."""
    return (sampling.greedy and session.spec.kind == "chain"
            and isinstance(session.proposer(sampled=True), SampledProposer))


def draft_requests(session: Session, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling,
                   probe: bool) -> tuple[list[Request], list[ConfidenceProbe | None]]:
    """The drafter's request per prompt (a fresh proposer each), and its probe where `probe`."""
    if not probe:
        return [session.request(ids, max_new_tokens, sampling) for ids in prompts], [None] * len(prompts)
    probes = [ConfidenceProbe(session.proposer(sampled=True)) for _ in prompts]
    return [run_request(session.spec, session.target, p, ids, max_new_tokens, session.eos, sampling)
            for p, ids in zip(probes, prompts)], probes


def free_requests(session: Session, proposer, prompts: list[list[int]], max_new_tokens: int,
                  sampling: Sampling) -> list[Request]:
    """A free proposer's request per prompt: a chain of the session's k, the proposer forked per request."""
    chain = TreeSpec("chain", k=session.k)
    return [run_request(chain, session.target, proposer.fork(), ids, max_new_tokens, session.eos, sampling)
            for ids in prompts]


def decode_wave(session: Session, free: dict, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling,
                batch_size: int, probe: bool, bar: Progress, plain_first: bool = True) -> list[TurnDecodes]:
    """Every prompt decoded plainly, with the drafter and with each free proposer (method by method,
    plain decoding first or last; sampled runs with the same seed each; each prompt prefilled once,
    `verify.prompt_cache`) -> one TurnDecodes per prompt, in order."""
    target, n = session.target, len(prompts)
    reqs, probes = draft_requests(session, prompts, max_new_tokens, sampling, probe)
    kept = PromptCache({i for r in reqs for i in getattr(r.proposer, "layers", ())})  # one prefill per prompt

    def plain_pass():
        out = session.decode_many(prompts, max_new_tokens, sampling, batch_size, drafted=False, kept=kept)
        bar.update(n)
        return out

    plain = plain_pass() if plain_first else None
    drafts = decode_batch(target, reqs, batch_size, kept)
    bar.update(n)
    others = {}
    for name, proposer in free.items():
        others[name] = decode_batch(target, free_requests(session, proposer, prompts, max_new_tokens, sampling),
                                    batch_size, kept)
        bar.update(n)
    plain = plain if plain is not None else plain_pass()
    return [TurnDecodes(ids, plain[i], drafts[i], {name: r[i] for name, r in others.items()},
                        probes[i].records if probes[i] is not None else [])
            for i, ids in enumerate(prompts)]


# --- the rows ------------------------------------------------------------------------------------


@dataclass
class RowDecodes:
    """A prompt row's conversation so far, its decoded turns, and the turn skipped for the context."""

    row: PromptRow
    messages: list[dict] = field(default_factory=list)
    turns: list[TurnDecodes] = field(default_factory=list)
    skipped: dict | None = None


def next_prompt(r: RowDecodes, turn: int, target, methods: int, bar: Progress) -> list[int] | None:
    """Turn `turn`'s prompt ids of a row (its conversation so far + the user's turn), or None when
    the row has no such turn or its prompt fills the context (later turns only grow: the rest is skipped)."""
    if r.skipped is not None or turn >= len(r.row.turns):
        return None
    r.messages += user_turn(r.row.turns[turn])
    ids = eval_prompt_ids(target.tokenizer, r.messages)
    ctx = target.context
    if ctx is not None and len(ids) >= ctx:
        log.warning("prompt %s turn %d has %d tokens, the context is %d: skipped", r.row.id, turn, len(ids), ctx)
        r.skipped = {"id": r.row.id, "turn": turn, "prompt_tokens": len(ids), "context": ctx}
        bar.update(methods * (len(r.row.turns) - turn))
        return None
    return ids


def plain_answer(session: Session, tokens: list[int]) -> str:
    """The text of a plain decode, eos left out: the assistant's turn the next prompt holds."""
    return session.target.tokenizer.decode([t for t in tokens if t not in session.eos], skip_special_tokens=True)


def decode_block(session: Session, free: dict, block: list[RowDecodes], max_new_tokens: int, sampling: Sampling,
                 batch_size: int, probe: bool, bar: Progress, plain_first: bool = True) -> None:
    """Every turn of the block's rows, a wave per turn number; each row continues with plain's answer."""
    methods = 2 + len(free)
    for turn in range(max(len(r.row.turns) for r in block)):
        wave = [(r, ids) for r in block if (ids := next_prompt(r, turn, session.target, methods, bar)) is not None]
        if not wave:
            continue
        decoded = decode_wave(session, free, [ids for _, ids in wave], max_new_tokens, sampling, batch_size, probe, bar,
                              plain_first)
        for (r, _), d in zip(wave, decoded):
            r.turns.append(d)
            r.messages.append({"role": "assistant", "content": plain_answer(session, d.plain.tokens)})


def warm_up_batched(session: Session, batch_size: int) -> None:
    """Short untimed batched decodes (plain and the drafter, ragged rows) before the first timed one:
    `Session.warm_up` runs batch 1 only, and the batched path's first calls (on CUDA: its kernels and
    memory) would otherwise land in the first block's first method alone."""
    if batch_size == 1:
        return
    prompts = [WARM_UP_IDS[: len(WARM_UP_IDS) - b % 2] for b in range(batch_size)]
    for drafted in (False, True):
        session.decode_many(prompts, 4, batch_size=batch_size, drafted=drafted)


def evaluate_rows(session: Session, rows: list[PromptRow], max_new_tokens: int, ngram_sizes=(3, 1),
                  sampling: Sampling = Sampling(), quiet: bool = True, batch_size: int = 1,
                  history: list | None = None) -> tuple[Totals, list[dict]]:
    """Decode every turn of every row (module docstring: waves), then sum them into Totals and one
    output row per turn, in row order (progress over decodes on stderr unless `quiet`)."""
    check_batch_size(batch_size)
    free, probe = free_proposers(ngram_sizes, history), probes_drafts(session, sampling)
    decoded = [RowDecodes(row) for row in rows]
    total = (2 + len(free)) * sum(len(r.turns) for r in rows)
    warm_up_batched(session, batch_size)
    turns = sum(len(r.turns) for r in rows)
    with Progress(total, f"eval ({turns} prompt turns x {2 + len(free)} methods)", "decodes", quiet=quiet) as bar:
        for i, block in enumerate(blocks(decoded, batch_size)):  # plain first, then last, in turn
            decode_block(session, free, block, max_new_tokens, sampling, batch_size, probe, bar, i % 2 == 0)
    totals, outputs = Totals(), []
    for r in decoded:
        add_row(session, r, sampling, totals, outputs)
    return totals, outputs


def add_row(session: Session, r: RowDecodes, sampling: Sampling, totals: Totals, outputs: list[dict]) -> None:
    """A row's decoded turns into `totals` and `outputs` (fold: the output's index mod 2), then its skip."""
    for turn, d in enumerate(r.turns):
        fold = len(outputs) % 2
        totals.records += [replace(rec, fold=fold) for rec in d.records]
        totals.turns.append(Turn(r.row.id, list(d.ids), d.plain.tokens, fold))
        outputs.append(add_turn(session, r.row, turn, d, sampling, totals))
    if r.skipped is not None:
        totals.skipped.append(r.skipped)


def add_turn(session: Session, row: PromptRow, turn: int, d: TurnDecodes, sampling: Sampling, totals: Totals) -> dict:
    """One turn's decodes into `totals` (sums, mismatches) -> its outputs.jsonl row."""
    plain, draft, tokenizer = d.plain, d.draft, session.target.tokenizer
    totals.plain, totals.draft = totals.plain.add(plain.stats), totals.draft.add(draft.stats)
    equal = None if not sampling.greedy else draft.tokens == plain.tokens  # samples need not agree
    if equal is False and row.id not in totals.mismatches:
        totals.mismatches.append(row.id)
    for name, result in d.others.items():
        totals.free[name] = totals.free.get(name, DecodeStats()).add(result.stats)
        wrong = totals.free_mismatches.setdefault(name, [])
        if sampling.greedy and result.tokens != plain.tokens and row.id not in wrong:
            wrong.append(row.id)
    return {
        "id": row.id, "category": row.category, "turn": turn, "prompt": row.turns[turn],
        "prompt_tokens": len(d.ids), "plain_ids": plain.tokens, "speculative_ids": draft.tokens,
        "speculative_text": tokenizer.decode(draft.tokens, skip_special_tokens=True),
        "greedy_equal": equal, "tau": draft.stats.summary()["tau"],
        **{f"{name}_tau": r.stats.summary()["tau"] for name, r in d.others.items()},
        "stop_reason": plain.stop_reason,
        "decode_tokens": draft.stats.decode_tokens, "decode_forwards": draft.stats.decode_forwards,
        # each method's decode of this turn (the hybrid rows add theirs, and their own plain, as mix_*)
        "methods": {"plain": turn_tally(plain.stats), "speculative": turn_tally(draft.stats),
                    **{name: turn_tally(r.stats) for name, r in d.others.items()}},
    }
