"""How a speculation session combines its drafter with a free proposer: `--hybrid choose|union|off`
and `--adaptive` (adaptive draft length), and the default (`--hybrid auto`).

The free proposer is suffix decoding (vLLM's `method: suffix`) when arctic-inference is installed,
else prompt lookup, and says so. Default rule: with a drafter, the setting the eval next to the
export (EXPORT/eval/metrics.json, written by `specheads eval --attach`) predicts fastest among the
drafter alone, hybrid choose, union and adaptive; so a hybrid whenever the eval predicts one faster
than the drafter alone, and the drafter alone without such an eval. Adaptive draft length reads
the same file: the drafter's calibration map and the measured step costs.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

from specheads.data.suffix_history import answered_turns
from specheads.eval_identity import eval_mismatch, history_warning
from specheads.model_ref import resolve_folder
from specheads.verify.adaptive_proposers import LengthCosts, adaptive_proposer, loop_k
from specheads.verify.calibration import Calibration
from specheads.verify.hybrid_proposers import hybrid_proposer
from specheads.verify.ngram_proposers import NgramProposer
from specheads.verify.suffix_proposers import SuffixProposer
from specheads.verify.trees import SettingsError

log = logging.getLogger(__name__)

HYBRID = ("auto", "choose", "union", "off")
# eval's row (advice "specheads" use) -> (--hybrid, --adaptive)
SETTINGS = {"drafter": ("off", False), "hybrid": ("choose", False), "union": ("union", False),
            "adaptive": ("choose", True)}


def mix_free() -> tuple[str, object, str | None]:
    """(name, a maker of the free proposer, why it is not suffix decoding or None)."""
    try:
        SuffixProposer()
        return "suffix", SuffixProposer, None
    except SettingsError as err:
        return "ngram", lambda: NgramProposer(3, 1), f"prompt lookup in place of suffix decoding: {err}"


def warm_free(free, history: list[tuple[list[int], list[int]]]) -> None:
    """Earlier (prompt, answer) pairs into a suffix proposer's global cache (prompt lookup keeps none)."""
    if history and isinstance(free, SuffixProposer):
        free.warm(history)


@dataclass(frozen=True)
class Mixing:
    """The drafter alone (`hybrid` "off", not `adaptive`), or combined with the free proposer; the
    adaptive rule's inputs; and why this setting (`reason`, printed by the commands)."""

    hybrid: str = "off"  # "off" | "choose" | "union"
    adaptive: bool = False
    calibration: Calibration | None = None
    costs: LengthCosts | None = None
    k_max: int | None = None
    reason: str = "as asked"
    free_k_max: int | None = None  # the free draft's longest (None: k_max)
    history: str | None = None  # conversations put in suffix decoding's cache first (`--suffix-history`)
    asked: str = "--hybrid off"  # the flags as given (`asked_text`)

    @property
    def active(self) -> bool:
        return self.hybrid != "off" or self.adaptive

    def label(self) -> str:
        base = {"off": "the drafter alone", "choose": "hybrid choose", "union": "union"}[self.hybrid]
        if not self.adaptive:
            return base
        if self.hybrid != "choose":
            return f"adaptive draft length (k <= {self.k_max}, the drafter only)"
        return f"adaptive draft length (k <= {self.k_max}, with the free draft up to {self.free_loop_k()})"

    def describe(self) -> str:
        """What is served, what was asked and why: the start line of generate, serve and regenerate."""
        if self.reason == "as asked":
            return f"{self.label()} (as asked: {self.asked})"
        return f"{self.label()} (asked: {self.asked}; {self.reason})"

    def free_loop_k(self) -> int:
        """The longest draft a step verifies (the decode loop's chain)."""
        return loop_k(self.k_max, self.free_k_max if self.hybrid == "choose" else None)

    def proposer(self, model, free, k: int, vocab_size: int | None):
        """The combined proposer over a fresh drafter proposer (`vocab_size`: sampled decoding)."""
        if self.adaptive:
            with_free = self.hybrid == "choose"
            return adaptive_proposer(model, self.calibration, self.costs, self.k_max, free if with_free else None,
                                     vocab_size, self.free_k_max if with_free else None)
        return hybrid_proposer(model, free, self.hybrid, k)


def eval_metrics(draft_dir: str | Path) -> tuple[dict | None, Path]:
    """EXPORT/eval/metrics.json (None when absent) and its path; a broken file is a clear error."""
    path = resolve_folder(str(draft_dir), "--draft") / "eval" / "metrics.json"  # hub ids too
    if not path.is_file():
        return None, path
    try:
        metrics = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise SettingsError(f"{path}: not a readable eval metrics file ({err}); rerun `specheads eval --attach`") from None
    if not isinstance(metrics, dict):
        raise SettingsError(f"{path}: expected a JSON object (an eval's metrics.json)")
    return metrics, path


def default_setting(metrics: dict | None, path: Path, chain: bool, rows=tuple(SETTINGS)) -> tuple[str, bool, str]:
    """(--hybrid, --adaptive, why) of `--hybrid auto` (module docstring): the eval's fastest of `rows`
    (its advice when that is one of them, else the fastest row it predicts among them)."""
    if not chain:
        return "off", False, "a tree draft: hybrid choose and adaptive draft chains"
    ours = ((metrics or {}).get("advice") or {}).get("engines", {}).get("specheads")
    if not ours:
        return "off", False, f"no {path} with the hybrid rows' predictions; `specheads eval --attach` writes it"
    use = ours.get("use")
    if use not in SETTINGS:
        raise SettingsError(f"{path}: advice.engines.specheads.use '{use}': expected one of {', '.join(SETTINGS)}")
    predicted = ours.get("predicted", {})
    among = ""
    if use not in rows:
        use = max((r for r in rows if isinstance(predicted.get(r), (int, float))), key=predicted.get, default="drafter")
        among = f" of {', '.join(rows)}"
    mode, adaptive = SETTINGS[use]
    flag = history_warning(metrics)
    return mode, adaptive, (f"{path} predicts {use} fastest{among} ({predicted.get(use, 0):.2f}x; the drafter alone "
                            f"{predicted.get('drafter', 0):.2f}x)" + (f"; WARNING: {flag}" if flag else ""))


def adaptive_inputs(metrics: dict | None, path: Path) -> tuple[Calibration, LengthCosts, int, int]:
    """The calibration map, the step costs, k_max and the free draft's longest (k_max in files
    written before it was kept) the eval measured; a clear error without them."""
    row = (metrics or {}).get("adaptive")
    if not row or "length_costs" not in row:
        raise SettingsError(f"--adaptive needs the calibration and step costs a chain eval measures: {path} "
                            "has none (run `specheads eval --attach` with --tree chain)")
    try:
        cal = metrics.get("calibration")
        rates = metrics["speculative"]["acceptance_per_position_conditional"]
        calibration = (Calibration.from_dict({**cal["map"], "position_rates": rates}, f"{path} calibration.map") if cal
                       else Calibration(position_rates=[float(r) for r in rates]))
        k_max = int(row["k_max"])
        return (calibration, LengthCosts.from_dict(row["length_costs"], f"{path} adaptive.length_costs"), k_max,
                int(row.get("free_k_max", k_max)))
    except (KeyError, TypeError, ValueError) as err:
        raise SettingsError(f"{path}: the adaptive rule's inputs are unreadable ({type(err).__name__}: {err}); "
                            "rerun `specheads eval --attach`") from None


def check_setting(mode: str, adaptive: bool, chain: bool = True) -> None:
    """Refuse what the combined proposers cannot build: adaptive length over a union, and hybrid choose
    or adaptive length over a tree draft (both draft chains); eval's hybrid rows skip these with the reason."""
    if adaptive and mode == "union":
        raise SettingsError("--adaptive verifies chains: use it with --hybrid choose (the drafter and the free draft) "
                            "or --hybrid off (the drafter alone), not --hybrid union")
    if not chain and (adaptive or mode == "choose"):
        raise SettingsError("--hybrid choose and --adaptive draft chains: use --tree chain, or --hybrid union for trees")


def with_history(mixing: Mixing, history: str | None) -> Mixing:
    """`mixing` with `--suffix-history` (None: none); said when nothing will read it (no free proposer runs)."""
    if not history:
        return mixing
    if not mixing.active:
        answered_turns(history)  # a broken file is still named, ignored or not
        why = "no --draft" if mixing.reason == "no drafter" else f"{mixing.label()} ({mixing.asked})"
        log.warning("--suffix-history %s is ignored: only suffix decoding reads it, which runs beside a --draft with "
                    "--hybrid choose, union or --adaptive; here: %s", history, why)
        return mixing
    return replace(mixing, history=history)


def asked_text(hybrid: str, adaptive: bool | None) -> str:
    """The flags as given: `--hybrid X [--adaptive | --no-adaptive]`."""
    return f"--hybrid {hybrid}" + {None: "", True: " --adaptive", False: " --no-adaptive"}[adaptive]


def choose_setting(hybrid: str, adaptive: bool | None, metrics: dict | None, path: Path,
                   chain: bool) -> tuple[str, bool, str]:
    """(mode, adaptive, why): an explicit flag is always what is served; `--hybrid auto` and an unset
    `--adaptive` are decided by the eval among the settings the explicit flags leave."""
    if hybrid != "auto":
        if adaptive is None:
            return hybrid, False, "adaptive draft length only with --adaptive"
        return hybrid, adaptive, "as asked"
    if adaptive is None:
        return default_setting(metrics, path, chain)
    if adaptive:  # the adaptive row the eval measures drafts with the free draft too
        return "choose", True, "--adaptive as asked, with the free draft (hybrid choose) as the eval's adaptive row"
    return default_setting(metrics, path, chain, rows=("drafter", "hybrid", "union"))


def matching_eval(metrics: dict | None, path: Path, draft_dir) -> tuple[dict | None, str | None]:
    """(the eval's metrics when they measured the weights at `draft_dir`, why they were ignored): an
    eval of other weights is ignored, saying so with both hashes (one that records none is used, warned)."""
    if metrics is None:
        return None, None
    mismatch = eval_mismatch(metrics, draft_dir, path)
    if mismatch is None:
        return metrics, None
    other, why = mismatch
    if not other:
        log.warning("%s", why)
        return metrics, None
    log.warning("%s; the eval is ignored", why)
    return None, why


def resolve_mixing(hybrid: str = "off", adaptive: bool | None = False, draft_dir: str | Path | None = None,
                   chain: bool = True) -> Mixing:
    """--hybrid / --adaptive (None: as `--hybrid auto` decides) -> a checked Mixing."""
    if hybrid not in HYBRID:
        raise SettingsError(f"--hybrid '{hybrid}': expected one of {', '.join(HYBRID)}")
    asked = asked_text(hybrid, adaptive)
    if draft_dir is None:
        if hybrid in ("choose", "union") or adaptive:
            raise SettingsError("--hybrid and --adaptive combine a drafter with a free proposer: pass --draft")
        return Mixing(reason="no drafter", asked=asked)
    metrics, path = eval_metrics(draft_dir)
    metrics, ignored = matching_eval(metrics, path, path.parent.parent)  # the resolved folder (hub ids)
    mode, adapt, reason = choose_setting(hybrid, adaptive, metrics, path, chain)
    check_setting(mode, adapt, chain)
    if ignored and hybrid == "auto" and adaptive is None:
        reason = f"{path} measured other weights, so it is ignored"
    if not adapt:
        return Mixing(mode, False, reason=reason, asked=asked)
    if ignored:
        raise SettingsError(f"--adaptive needs the calibration and step costs of these weights: {ignored}")
    calibration, costs, k_max, free_k_max = adaptive_inputs(metrics, path)
    return Mixing(mode, True, calibration, costs, k_max, reason, free_k_max, asked=asked)
