"""Command-line options shared by `specheads generate`, `eval` and `serve` (and bench/verifier.py):
the draft tree flags and the sampling flags, parsed into verify.settings' TreeSpec and Sampling,
the fingerprint policy's override, and --hybrid / --adaptive / --suffix-history (specheads/mixing.py);
and the help formatter every verb uses (defaults shown). Light on purpose: the modules that turn the
flags into settings (torch underneath) are imported where they are used, so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specheads.verify.settings import Sampling, TreeSpec


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


def spec_from_args(a: argparse.Namespace) -> TreeSpec:
    from specheads.verify.settings import make_tree_spec

    return make_tree_spec(a.tree, a.k, a.depth, a.top_k, a.total_tokens)


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


def sampling_from_args(a: argparse.Namespace) -> Sampling:
    """The parsed sampling flags -> a checked Sampling (thresholds only with typical)."""
    from specheads.verify.settings import Sampling, SettingsError, check_acceptance

    given = [f for f, v in (("--typical-epsilon", a.typical_epsilon),
                            ("--typical-delta", a.typical_delta)) if v is not None]
    if given and a.acceptance != "typical":
        raise SettingsError(f"{' and '.join(given)} only apply with --acceptance typical")
    eps = 0.09 if a.typical_epsilon is None else a.typical_epsilon
    delta = 0.3 if a.typical_delta is None else a.typical_delta
    sampling = Sampling(a.temperature, a.top_p, a.seed, a.acceptance, eps, delta)
    check_acceptance(sampling)
    return sampling


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


def mixing_from_args(a: argparse.Namespace, draft_dir, spec: TreeSpec | None = None):
    """The parsed --hybrid / --adaptive / --suffix-history -> a checked Mixing for the drafter at `draft_dir`."""
    from specheads.mixing import resolve_mixing, with_history

    mixing = resolve_mixing(a.hybrid, a.adaptive, draft_dir, spec is None or spec.kind == "chain")
    return with_history(mixing, a.suffix_history)
