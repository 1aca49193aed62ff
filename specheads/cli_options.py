"""Command-line options shared by `specheads generate`, `eval` and `serve` (and bench/verifier.py),
turned into settings: the draft tree flags and the sampling flags into verify.settings' TreeSpec and
Sampling, --hybrid / --adaptive / --suffix-history into a mixing.Mixing. The flags themselves (and
the help formatter) are defined in cli_parsers.py, which loads no torch, and re-exported here.
"""

from __future__ import annotations

import argparse

from specheads.cli_parsers import (  # noqa: F401 - re-exported: the flags' one definition
    HYBRID_HELP,
    SUFFIX_HISTORY_HELP,
    HelpFormatter,
    RawHelpFormatter,
    add_fingerprint_argument,
    add_mixing_arguments,
    add_quiet_argument,
    add_sampling_arguments,
    add_tree_arguments,
)
from specheads.mixing import resolve_mixing, with_history
from specheads.verify.settings import Sampling, SettingsError, TreeSpec, check_acceptance, make_tree_spec


def spec_from_args(a: argparse.Namespace) -> TreeSpec:
    return make_tree_spec(a.tree, a.k, a.depth, a.top_k, a.total_tokens)


def sampling_from_args(a: argparse.Namespace) -> Sampling:
    """The parsed sampling flags -> a checked Sampling (thresholds only with typical)."""
    given = [f for f, v in (("--typical-epsilon", a.typical_epsilon),
                            ("--typical-delta", a.typical_delta)) if v is not None]
    if given and a.acceptance != "typical":
        raise SettingsError(f"{' and '.join(given)} only apply with --acceptance typical")
    eps = 0.09 if a.typical_epsilon is None else a.typical_epsilon
    delta = 0.3 if a.typical_delta is None else a.typical_delta
    sampling = Sampling(a.temperature, a.top_p, a.seed, a.acceptance, eps, delta)
    check_acceptance(sampling)
    return sampling


def mixing_from_args(a: argparse.Namespace, draft_dir, spec: TreeSpec | None = None):
    """The parsed --hybrid / --adaptive / --suffix-history -> a checked Mixing for the drafter at `draft_dir`."""
    mixing = resolve_mixing(a.hybrid, a.adaptive, draft_dir, spec is None or spec.kind == "chain")
    return with_history(mixing, a.suffix_history)
