"""Speed-up inside llama.cpp from llama.cpp's own measured cost curve.

`bench/llamacpp.py --cost` measures, in llama-server itself, what verifying n tokens costs (t(n))
and what one draft token costs (c); this module prices eval's measured acceptance at those costs,
so that `eval`'s advice for llama.cpp is a prediction from that engine, not from our verifier:
on a CPU llama.cpp's t(n) grows almost linearly with n, and speculation often does not pay there.
"""

from __future__ import annotations

import json
from pathlib import Path

from specheads.engine_facts import LLAMA_CPP_SPEC
from specheads.eval.predict import MIN_GAIN, PredictError, StepCosts, predict

CURVE_FIELDS = ("t_ms", "plain_step_ms", "draft_fixed_ms", "draft_per_token_ms")
KS = (1, 2, 3, 4, 5, 6, 7, 8)


class EngineCostError(ValueError):
    """A cost-curve file that cannot be used, with the file and field named."""


def read_llamacpp_cost(path: str | Path) -> dict:
    """A `bench/llamacpp.py --cost` JSON, checked: its "curve" must hold t(n) for n >= 1 and the
    drafter's costs, all in milliseconds."""
    p = Path(path)
    try:
        run = json.loads(p.read_text())
    except FileNotFoundError:
        raise EngineCostError(f"llama.cpp cost file '{p}' does not exist: write it with "
                              "`python bench/llamacpp.py --cost --target T --draft EXPORT --out DIR`") from None
    except (OSError, json.JSONDecodeError) as e:
        raise EngineCostError(f"llama.cpp cost file '{p}' is not readable JSON ({e})") from None
    curve = run.get("curve") if isinstance(run, dict) else None
    if not isinstance(curve, dict):
        raise EngineCostError(f"llama.cpp cost file '{p}' has no \"curve\" object: it must be the JSON that "
                              "`bench/llamacpp.py --cost` writes")
    missing = [f for f in CURVE_FIELDS if f not in curve]
    if missing:
        raise EngineCostError(f"llama.cpp cost file '{p}': \"curve\" lacks {', '.join(missing)}; measure it again "
                              "with `bench/llamacpp.py --cost`")
    try:
        curve_costs(curve)
    except (PredictError, TypeError, ValueError) as e:
        raise EngineCostError(f"llama.cpp cost file '{p}': \"curve\" is not usable ({e})") from None
    return {**run, "source": str(p)}


def curve_costs(curve: dict) -> StepCosts:
    """llama.cpp's measured milliseconds as the step costs eval/predict.py prices chains with."""
    if float(curve["plain_step_ms"]) <= 0:
        raise PredictError("plain_step_ms must be positive")
    return StepCosts({int(n): float(ms) / 1000 for n, ms in curve["t_ms"].items()},
                     draft_fixed_s=float(curve["draft_fixed_ms"]) / 1000,
                     draft_per_level_s=float(curve["draft_per_token_ms"]) / 1000,
                     plain_step_s=float(curve["plain_step_ms"]) / 1000)


def llamacpp_prediction(cond: list[float], cost: dict, ks=KS) -> dict:
    """Predicted speed-up of the drafter in llama.cpp per `--spec-draft-n-max` k, and what to run:
    the recommended k when it beats plain llama.cpp by MIN_GAIN, else no speculation."""
    pred = predict(cond, curve_costs(cost["curve"]), ks=ks)
    best = pred.best_chain()
    speculate = pred.speculate()
    curve = cost["curve"]
    return {
        "speedup_by_k": {r["k"]: r["speedup"] for r in pred.chains},
        "best_k": best["k"], "best_speedup": best["speedup"], "speculate": speculate, "min_gain": MIN_GAIN,
        "use": f"--spec-draft-n-max {best['k']}" if speculate else "no speculation",
        "v": {int(n): float(ms) / float(curve["plain_step_ms"]) for n, ms in curve["t_ms"].items()},
        "c": float(curve["draft_per_token_ms"]) / float(curve["plain_step_ms"]),
        "measured_in": {key: cost.get(key) for key in ("version", "quantization", "threads", "omp_wait_policy",
                                                       "target_gguf", "load_average")},
        "curve_from": cost.get("source"),
    }


def add_llamacpp_prediction(metrics: dict, cost: dict, kind: str, fmt: str) -> None:
    """metrics["llamacpp"]: the drafter's measured acceptance priced at llama.cpp's costs; the advice's
    llama.cpp entry (when eval advises) then names the k to run, or no speculation."""
    draft_type = LLAMA_CPP_SPEC.get((kind, fmt))
    if draft_type is None:
        metrics["llamacpp"] = {"skipped": f"llama.cpp runs no {kind} drafter from a {fmt} export "
                                          "(see `specheads export --format gguf`)"}
        return
    pred = {**llamacpp_prediction(metrics["speculative"]["acceptance_per_position_conditional"], cost),
            "spec_type": draft_type}
    metrics["llamacpp"] = pred
    entry = (metrics.get("advice") or {}).get("engines", {}).get("llama.cpp")
    if entry is None:
        return
    entry.update(predicted_speedup=pred["best_speedup"] if pred["speculate"] else 1.0,
                 drafter_predicted=pred["best_speedup"], curve_from=pred["curve_from"],
                 note=f"predicted from llama.cpp's own cost curve ({pred['curve_from']}); its draftless types "
                      "are not predicted")
    if pred["speculate"]:
        entry.update(use="drafter", flags=f"--spec-type {draft_type} --spec-draft-n-max {pred['best_k']}")
    else:
        entry.update(use="no speculation", flags="no --spec-type (plain decoding)")
