"""The llama.cpp engine check: an export (or a `--format gguf` folder) decoded by `llama-server`.

PASS when every speculative output equals llama.cpp's own output without speculation token for token,
the sidecar records what the export says (llamacpp_gguf.sidecar_problems: aux layer ids, d2t), drafts
were accepted (trained heads), and, with `compare_ours`, llama.cpp's accepted / drafted is within
ACCEPTANCE_TOLERANCE of our verifier's on the same prompt ids and k. `fault_check` runs the check on a
sidecar with one fault injected (llamacpp_gguf.FAULTS) and reports whether it was caught.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from specheads.engine_facts import GGUF_FORMAT, LLAMA_CPP, LLAMA_CPP_GGUF
from specheads.engines import llamacpp_server as server
from specheads.engines.llamacpp_gguf import FAULTS, sidecar_problems
from specheads.export import llamacpp_tool as lc
from specheads.session import Session, eos_ids
from specheads.verify.loop import decode
from specheads.verify.registry import make_proposer
from specheads.verify.settings import TreeSpec

ACCEPTANCE_TOLERANCE = 0.05  # |llama.cpp - ours| / ours, accepted per drafted token (f32 GGUFs)
BLOCK_TYPES = ("draft-dflash", "draft-dspark")  # llama.cpp sizes their block from the GGUF: no n-max


@dataclass
class Ggufs:
    """What a check decodes: our export (`source`), the target GGUF and the sidecar (None: MTP)."""

    source: Path
    kind: str
    spec_type: str
    target: Path
    draft: Path | None
    conversions: dict
    record: dict


def refuse_early(export_dir: Path) -> None:
    """What llama.cpp cannot run, refused from the folder alone (lc.RefusedExport)."""
    record = export_dir / "specheads.json"
    is_gguf = record.is_file() and json.loads(record.read_text()).get("format") == GGUF_FORMAT
    lc.draft_spec(export_dir / "source" if is_gguf else export_dir)


def prepare(export_dir: Path, target_dir: Path, work: Path, b: lc.LlamaCpp, progress=print,
            target_gguf: Path | None = None) -> Ggufs:
    """A gguf folder's own files, or (any other export) both GGUFs converted into `work`; `target_gguf`:
    the target's GGUF to use instead (nothing converted for it)."""
    export_dir, work = Path(export_dir), Path(work)
    record = json.loads((export_dir / "specheads.json").read_text()) if (export_dir / "specheads.json").is_file() else {}
    if record.get("format") == GGUF_FORMAT:
        source, spec_type = export_dir / "source", record["spec_type"]
        lc.draft_spec(source)
        target, draft = export_dir / "target.gguf", export_dir / "draft.gguf"
        conv = dict(record.get("conversions") or {})
        target = Path(target_gguf) if target_gguf else target
        if not target.is_file():
            progress(f"[llama.cpp] converting the target {target_dir} -> {work / 'target-f32.gguf'}")
            target = work / "target-f32.gguf"
            conv["target"] = lc.convert(Path(target_dir), target, b=b)
        return Ggufs(source, record["kind"], spec_type, target, draft if draft.is_file() else None, conv, record)
    spec_type, _ = lc.draft_spec(export_dir)
    kind = record["kind"]
    in_target = LLAMA_CPP_GGUF[kind].in_target if kind in LLAMA_CPP_GGUF else False
    work.mkdir(parents=True, exist_ok=True)
    target, draft = work / "target-f32.gguf", None if in_target else work / "draft-f32.gguf"
    conv = {}
    if target_gguf:
        target = Path(target_gguf)
    else:
        progress(f"[llama.cpp] converting the target {target_dir} -> {target}")
        conv["target"] = lc.convert(export_dir if in_target else Path(target_dir), target, b=b)
    if draft is not None:
        progress(f"[llama.cpp] converting the draft {export_dir} -> {draft}")
        conv["draft"] = lc.convert_draft(export_dir, target_dir, draft, b=b)
    return Ggufs(export_dir, kind, spec_type, target, draft, conv, record)


def ours(target_dir: Path, export_dir: Path, prompts, n_predict: int, k: int | None) -> dict:
    """Our verifier on the same prompt ids (greedy chain of k, CPU float32): accepted / drafted, the
    steps that drafted and how many accepted through each position, and its tokens."""
    session = Session.open(str(target_dir), export_dir, k=k, device="cpu", dtype="float32")
    target, head, eos = session.target, session.head, eos_ids(session.target)
    drafted = accepted = drafts = 0
    per_pos, tokens = [0] * session.k, []
    for _, ids in prompts:
        r = decode(target, make_proposer(TreeSpec("chain", k=session.k), head, target), ids, n_predict, session.k, eos)
        drafted += r.stats.proposed_tokens
        accepted += sum(r.stats.accepted_per_pos)
        drafts += r.stats.drafts
        per_pos = [a + b for a, b in zip(per_pos, r.stats.accepted_per_pos + [0] * session.k)]
        tokens.append([int(t) for t in r.tokens])
    return {"k": session.k, "drafted": drafted, "accepted": accepted, "drafts": drafts, "accepted_per_pos": per_pos,
            "accepted_per_drafted": accepted / drafted if drafted else None, "tokens": tokens}


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def tok_s(outs: list[server.Completion]) -> float | None:
    """Generated tokens over generation seconds, summed over the requests (llama.cpp's own timings)."""
    n = sum(int(o.timings.get("predicted_n") or len(o.tokens)) for o in outs)
    ms = sum(float(o.timings.get("predicted_ms") or 0.0) for o in outs)
    return n / (ms / 1000) if ms else None


def acceptance_problem(llama: float | None, mine: float | None, tolerance: float = ACCEPTANCE_TOLERANCE) -> str | None:
    """llama.cpp's accepted / drafted against our verifier's, relative to ours."""
    if llama is None or mine is None or mine == 0:
        return None
    rel = abs(llama - mine) / mine
    if rel <= tolerance:
        return None
    return (f"llama.cpp accepted {llama:.3f} of drafted tokens, our verifier {mine:.3f} on the same prompt ids and k "
            f"({rel:.1%} apart, tolerance {tolerance:.0%})")


def pre_tokenizer_name(g: Ggufs) -> str | None:
    """The pre-tokenizer our shim named for the target's GGUF, if it had to."""
    return ((g.conversions.get("target") or {}).get("pre_tokenizer") or {}).get("fallback_applied")


def draft_n_max(g: Ggufs, n_max: int | None) -> int | None:
    if g.spec_type in BLOCK_TYPES:
        return None
    return n_max or g.record.get("spec_draft_n_max") or g.record.get("num_speculative_tokens")


def check(export_dir: Path, target_dir: Path, work: Path, prompts_file: Path | None = None, limit: int = 8,
          n_predict: int = 64, threads: int = 2, n_max: int | None = None, require_accepted: bool = True,
          compare_ours: bool = False, omp: str | None = None, progress=print, draft_override: Path | None = None,
          prepared: Ggufs | None = None) -> dict:
    """Plain vs speculative llama.cpp on the same prompts (see the module docstring); `draft_override`
    decodes with that sidecar instead of the export's (fault injection); `prepared`: GGUFs already
    converted by `prepare` for this export."""
    refuse_early(Path(export_dir))  # before llama.cpp is looked for (or built)
    b = lc.ensure(progress=progress)
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    g = prepared or prepare(Path(export_dir), Path(target_dir), work, b, progress)
    draft = draft_override or g.draft
    sidecar = sidecar_problems(draft, g.source) if draft is not None else []
    problems = list(sidecar)
    prompts = server.prompt_ids(Path(target_dir), prompts_file, limit)
    k = draft_n_max(g, n_max)
    load0 = server.load_average()
    plain, plain_s = server.decode_all(b, g.target, server.SpecSettings(), prompts, n_predict, threads,
                                       work / "server-plain.log", omp=omp)
    texts = [t for _, t in server.prompt_texts(prompts_file, limit)] + [server.SPLIT_PROBE]
    with server.Server(b, g.target, threads=threads, log=work / "server-tokenize.log") as s:
        tokens = server.tokenizer_agreement(s, Path(target_dir), texts)
    if tokens["differ"]:
        problems.append(f"llama.cpp tokenizes {len(tokens['differ'])} of {tokens['texts']} texts differently from "
                        f"the HF tokenizer (pre-tokenizer: {pre_tokenizer_name(g) or 'the converter choice'}): "
                        f"{tokens['differ'][:2]}")
    spec_settings = server.SpecSettings((g.spec_type,), draft, n_max=k)
    spec, spec_s = server.decode_all(b, g.target, spec_settings, prompts, n_predict, threads, work / "server-spec.log", omp=omp)
    rows = [row(pid, ids, p, s) for (pid, ids), p, s in zip(prompts, plain, spec)]
    drafted, accepted = sum(r["drafted"] for r in rows), sum(r["accepted"] for r in rows)
    rate = accepted / drafted if drafted else None
    problems += [f"{r['id']}: speculative output differs from plain at token {r['first_difference']}"
                 for r in rows if not r["equal"]]
    if drafted == 0:
        problems.append("llama.cpp drafted no tokens: the draft was not used")
    elif require_accepted and accepted == 0:
        problems.append(f"none of {drafted} drafted tokens was accepted")
    mine = None
    if compare_ours and g.spec_type == "draft-eagle3":
        progress("[llama.cpp] our verifier on the same prompt ids")
        mine = ours(Path(target_dir), g.source, prompts, n_predict, k)
        # llama.cpp returns the tokens it generated, an end-of-generation token included when it stops on one
        same = [m == p.tokens[:len(m)] or p.tokens == m[:len(p.tokens)] for m, p in zip(mine.pop("tokens"), plain)]
        mine["same_tokens_as_llama_cpp_plain"] = f"{sum(same)}/{len(same)}"
        problems += [p for p in [acceptance_problem(rate, mine["accepted_per_drafted"])] if p]
    return {"verdict": "PASS" if not problems else "FAIL", "problems": problems, "sidecar_problems": sidecar,
            "tokenizer_agreement": tokens,
            "engine": LLAMA_CPP.label,
            "version": b.version(), "export": str(export_dir), "target": str(target_dir), "kind": g.kind,
            "spec_type": g.spec_type, "spec_draft_n_max": k, "threads": threads, "omp_wait_policy": server.omp_label(omp),
            "n_predict": n_predict, "prompts": len(rows), "greedy_equal": all(r["equal"] for r in rows),
            "drafted": drafted, "accepted": accepted, "accepted_per_drafted": rate, "ours": mine,
            "tok_s": {"plain": tok_s(plain), "spec": tok_s(spec)}, "quantization": "f32",
            "decode_seconds": {"plain": plain_s, "spec": spec_s},
            "load_average": {"before": load0, "after": server.load_average()}, "conversions": g.conversions,
            "server_commands": {"plain": shlex.join(server.server_command(b, g.target, server.SpecSettings(), 0, threads, 2048)),
                                "spec": shlex.join(server.server_command(b, g.target, spec_settings, 0, threads, 2048))},
            "rows": rows}


def row(pid: str, ids: list[int], p: server.Completion, s: server.Completion) -> dict:
    return {"id": pid, "prompt_tokens": len(ids), "plain_tokens": len(p.tokens), "spec_tokens": len(s.tokens),
            "equal": p.tokens == s.tokens, "first_difference": first_difference(p.tokens, s.tokens),
            "drafted": s.drafted, "accepted": s.accepted, "plain_tok_s": p.timings.get("predicted_per_second"),
            "spec_tok_s": s.timings.get("predicted_per_second")}


def fault_check(export_dir: Path, target_dir: Path, work: Path, fault: str, prepared: Ggufs | None = None,
                **kw) -> dict:
    """The check on a copy of the sidecar with `fault` (llamacpp_gguf.FAULTS): caught = it did not PASS
    (None: the fault does not apply, e.g. no d2t in a full-vocabulary head)."""
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    g = prepared or prepare(Path(export_dir), Path(target_dir), work / "clean", lc.ensure(progress=lambda m: None),
                            lambda m: None)
    if g.draft is None:
        raise lc.RefusedExport(f"{export_dir}: no sidecar (a {g.kind} head runs from the target GGUF): nothing to fault")
    faulty = FAULTS[fault](g.draft, work / f"draft-{fault}.gguf")
    if faulty is None:
        return {"fault": fault, "caught": None, "how": "not applicable to this sidecar"}
    try:
        r = check(export_dir, target_dir, work, draft_override=faulty, prepared=g, **kw)
    except lc.LlamaCppError as e:
        return {"fault": fault, "caught": True, "how": f"llama.cpp refused the sidecar: {str(e).splitlines()[0][:300]}",
                "detail": str(e)[-1500:]}
    return {"fault": fault, "caught": r["verdict"] != "PASS", "how": "; ".join(r["problems"]) or "not caught",
            "accepted_per_drafted": r["accepted_per_drafted"], "greedy_equal": r["greedy_equal"]}


def format_check(r: dict) -> str:
    rate = f"{r['accepted_per_drafted']:.3f}" if r["accepted_per_drafted"] is not None else "-"
    speed = r["tok_s"]
    lines = [f"llama.cpp check: {r['verdict']}  ({r['version']})",
             f"  {r['prompts']} prompts x {r['n_predict']} tokens, {r['spec_type']} k={r['spec_draft_n_max'] or 'default'}, "
             f"threads {r['threads']}, OMP_WAIT_POLICY {r['omp_wait_policy']}, {r['quantization']}, load {r['load_average']}",
             f"  tokenization equal to the HF tokenizer: {r['tokenizer_agreement']['equal']}/"
             f"{r['tokenizer_agreement']['texts']} texts",
             f"  greedy-equal: {sum(x['equal'] for x in r['rows'])}/{len(r['rows'])}; accepted/drafted "
             f"{r['accepted']}/{r['drafted']} = {rate}; tok/s plain {speed['plain'] or 0:.1f}, with the draft "
             f"{speed['spec'] or 0:.1f}"]
    if r.get("ours"):
        o = r["ours"]
        lines.append(f"  our verifier, same prompt ids, k={o['k']}: accepted/drafted {o['accepted']}/{o['drafted']} = "
                     f"{o['accepted_per_drafted'] or 0:.3f}; same greedy tokens as llama.cpp plain: "
                     f"{o['same_tokens_as_llama_cpp_plain']}")
    pre = (r["conversions"].get("target") or {}).get("pre_tokenizer") or {}
    if pre.get("fallback_applied"):
        lines.append(f"  pre-tokenizer: {pre['note']}")
    lines += [f"  {p}" for p in r["problems"]]
    return "\n".join(lines)
