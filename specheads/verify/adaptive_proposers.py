"""Adaptive draft length: every step verifies the draft, of the model drafter or of a free one
(suffix decoding, prompt lookup), and the length k in 0..k_max (k = 0: a plain step) with the
most expected tokens per unit of measured cost. A free draft may be longer (up to `free_k_max`):
drawing it costs nothing, so only its verification is priced, and a copied span pays past k_max.

Expected tokens of a chain of k: 1 + S_1 + .. + S_k, S_j = P(drafts 1..j accepted). For the model
drafter S_j is the product of calibrated per-position acceptances (`verify.calibration`: the raw
top draft probability mapped to P(accept | earlier accepted), or the measured per-position rate
for drafters that report no probability); for suffix decoding S_j is its own cumulative path
probability as it has held so far (`PathReliability`, learnt online); for prompt lookup a^j with a
measured online (`AcceptanceMeter`). Cost, in plain steps: k c + fixed + v(k + 1) for the model,
v(k + 1) for a free draft, v(1) = 1 for a plain step (`LengthCosts`, from eval's measured `StepCosts`).

The model's length is a stopping rule read before each draft is drawn: position j is drafted only
if the best length over the known S_1..S_j (later positions extrapolated at position j's rate) is
>= j, and (at j = 1) beats the free draft and a plain step. Whether the model drafts at all reads
its first distribution and the free draft only, never a sampled token, so sampled drafts keep
Leviathan's rule exact; drafters that cannot stop early draft k_max and the same rule cuts the
chain afterwards (the same distribution, more draft work). When the free draft (or a plain step)
beats the model's average rate (from its measured per-position acceptance, a function of the
context only), the model is not asked; the verified steps it missed are fed to it as one step when
it is next asked (one draft forward instead of several).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

import torch

from specheads.protocols import DraftAsk, GroupedProposer, SampledProposer, close_proposers
from specheads.target import TargetOutput
from specheads.verify.calibration import Calibration, ConfidenceWarper
from specheads.verify.draft_asks import split_step
from specheads.verify.hybrid_proposers import AcceptanceMeter, as_ids, check_chain, merged_layers
from specheads.verify.sampling import point_mass
from specheads.verify.trees import SettingsError


@dataclass(frozen=True)
class LengthCosts:
    """A step's cost in plain steps: `verify[n - 1]` = v(n), a target forward verifying n tokens
    plus the loop's overhead (v(1) = 1: a plain step); the model drafter's `draft` per level (c)
    and `fixed` per drafted step."""

    verify: tuple[float, ...]
    draft: float = 0.0
    fixed: float = 0.0

    def __post_init__(self):
        if not self.verify or any(not v > 0 for v in self.verify):
            raise SettingsError("LengthCosts.verify needs positive costs v(1), v(2), ... (in plain steps)")
        if self.draft < 0 or self.fixed < 0:
            raise SettingsError(f"LengthCosts: draft ({self.draft}) and fixed ({self.fixed}) costs must be >= 0")

    def v(self, n: int) -> float:
        """v(n); past the table, linear in n from its last two entries."""
        if n <= len(self.verify):
            return self.verify[n - 1]
        slope = self.verify[-1] - self.verify[-2] if len(self.verify) > 1 else 0.0
        return self.verify[-1] + max(slope, 0.0) * (n - len(self.verify))

    def step(self, k: int, levels: int) -> float:
        """A step verifying k drafts made in `levels` model draft levels (0: a free draft)."""
        return self.v(k + 1) + (self.fixed + self.draft * levels if levels else 0.0)

    def to_dict(self) -> dict:
        return {**asdict(self), "verify": list(self.verify)}

    @classmethod
    def from_step_costs(cls, costs, k_max: int) -> LengthCosts:
        """From measured seconds (eval.predict.StepCosts): v(n) = (target(n) + overhead) / a plain
        step for n >= 2, v(1) = 1; c and fixed are the drafter's seconds per level / per step."""
        plain = costs.plain()
        verify = (1.0, *[(costs.target(n) + costs.overhead_s) / plain for n in range(2, k_max + 2)])
        return cls(verify, costs.draft_per_level_s / plain, costs.draft_fixed_s / plain)

    @classmethod
    def from_dict(cls, d: dict, where: str = "costs") -> LengthCosts:
        unknown = set(d) - {"verify", "draft", "fixed"}
        if unknown or "verify" not in d:
            raise SettingsError(f"{where}: expected fields verify, draft, fixed; got {sorted(d)}")
        return cls(tuple(float(v) for v in d["verify"]), float(d.get("draft", 0.0)), float(d.get("fixed", 0.0)))


def best_length(survival: list[float], costs: LengthCosts, drafted: bool) -> tuple[int, float]:
    """k in 0..len(survival) with the most expected tokens per cost, and that rate (ties: shorter)."""
    best, tokens = (0, 1.0 / costs.v(1)), 1.0
    for k, s in enumerate(survival, start=1):
        tokens += s
        rate = tokens / costs.step(k, k if drafted else 0)
        if rate > best[1] * (1 + 1e-9):
            best = (k, rate)
    return best


def free_survival(free, draft: list[int], meter: AcceptanceMeter) -> list[float]:
    """S_j of a free draft: suffix decoding's cumulative path probabilities as measured online
    (`SuffixProposer.survival`), else a^j measured."""
    if hasattr(free, "survival") and len(free.probs) >= len(draft):
        return free.survival(len(draft))
    return [meter.rate ** j for j in range(1, len(draft) + 1)]


class LengthRule:
    """The model draft's stopping rule for one step (module docstring); `rule(j)` True = stop
    before drafting position j. Reads the confidences a `ConfidenceWarper` recorded (None: none)."""

    def __init__(self, calibration: Calibration, costs: LengthCosts, k: int, baseline: float,
                 seen: list[float] | None):
        self.calibration, self.costs, self.k, self.baseline, self.seen = calibration, costs, k, baseline, seen
        self.survival: list[float] = []

    def __call__(self, j: int) -> bool:
        raw = self.seen[j - 1] if self.seen is not None and len(self.seen) >= j else None
        a = min(max(self.calibration(raw, j), 0.0), 1.0)
        s = (self.survival[-1] if self.survival else 1.0) * a
        ahead = self.survival + [s * a ** i for i in range(self.k - j + 1)]
        k, rate = best_length(ahead, self.costs, drafted=True)
        if k < j or (j == 1 and rate <= self.baseline):
            return True
        self.survival.append(s)
        return False

    def cut(self, n: int) -> int:
        """The rule applied to an n-token draft already drawn: how many of its tokens it keeps."""
        return next((j - 1 for j in range(1, n + 1) if self(j)), n)


def merged_step(pending: list[tuple]) -> tuple:
    """Consecutive verified steps (inputs [n_i], following [n_i], out, start_i) as one step that fed
    all their inputs at start_1.. (a proposer's `accept` takes any n; rows of out past n_i dropped)."""
    ns = [inputs.numel() for inputs, *_ in pending]
    outs = [out for _, _, out, _ in pending]

    def cat(rows: list[torch.Tensor]) -> torch.Tensor:  # [1, n_i, ...] each -> [1, sum n_i, ...]
        return torch.cat([r[:, :n] for r, n in zip(rows, ns)], dim=1)

    out = TargetOutput(logits=cat([o.logits for o in outs]), hidden={i: cat([o.hidden[i] for o in outs]) for i in outs[0].hidden},
                       final=None if outs[0].final is None else cat([o.final for o in outs]))
    inputs = torch.cat([p[0].reshape(-1) for p in pending])
    following = torch.cat([p[1].reshape(-1) for p in pending])
    return inputs, following, out, pending[0][3]


class AdaptiveProposer:
    """A chain proposer choosing, every step, which draft and how many of its tokens to verify
    (module docstring). `model` is ideally a `SampledProposer` (its confidences are read through
    a one-hot `ConfidenceWarper`, so greedy drafts stay the argmax chain); `free` may be None.

    `counts`: steps per verified draft ("model" | "free" | "none"); `lengths`: verified draft
    length -> steps; `levels` / `model_steps`: model draft positions computed / steps it drafted in
    (what the draft cost counts).

    A step splits around the model's draft (`protocols.SplitProposer`), so rows whose models share
    a drafter head draft in one draft group (`verify.loop`); alone, `propose` runs both halves."""

    def __init__(self, model, calibration: Calibration, costs: LengthCosts, k_max: int, free=None,
                 free_k_max: int | None = None):
        check_chain(model, "model")
        if free is not None:
            check_chain(free, "free")
        if k_max < 1 or (free_k_max is not None and free_k_max < 1):
            raise SettingsError(f"adaptive draft length needs k_max >= 1 and free_k_max >= 1, got {k_max}, {free_k_max}")
        self.model, self.free, self.calibration, self.costs, self.k_max = model, free, calibration, costs, k_max
        self.free_k_max = k_max if free_k_max is None else free_k_max  # a free draft costs only its verification
        self.layers = merged_layers(model, *([free] if free is not None else []))
        self.meter = AcceptanceMeter()
        self.gen = torch.Generator().manual_seed(0)  # one-hot greedy drafts never depend on it
        self.counts: Counter = Counter()
        self.lengths: Counter = Counter()
        self.levels = self.model_steps = 0
        self.free_draft: list[int] = []  # this step's free draft (n_free of it verified if chosen)
        self.n_free = 0
        self.sampled, self.conf = False, None  # this step: drafts sampled (q returned), model confidences
        self.pending: list[tuple] = []  # verified steps the model has not been fed yet (it was not asked)

    def start(self, prompt_ids: torch.Tensor, first_token: int, out) -> None:
        self.model.start(prompt_ids, first_token, out)
        if self.free is not None:
            self.free.start(prompt_ids, first_token, out)
        self.pending = []

    def close(self) -> None:
        close_proposers(self.model, self.free)

    def expected_model_rate(self, k: int) -> float:
        """The rate of the model's best draft of <= k on average (the measured per-position acceptance;
        without it, every position at the calibration's highest rate): a free draft (or a plain step) at
        least as good is verified without asking the model."""
        rates = self.calibration.position_rates or [self.calibration.ceiling()] * k
        survival, s = [], 1.0
        for j in range(k):
            s *= min(max(rates[min(j, len(rates) - 1)], 0.0), 1.0)
            survival.append(s)
        return best_length(survival, self.costs, drafted=True)[1]

    def feed_model(self) -> None:
        """Feed the model the verified steps it skipped, as one step (one draft forward, not several)."""
        if self.pending:
            self.model.accept(*merged_step(self.pending))
            self.pending = []

    def free_option(self, k: int) -> tuple[list[int], int, float]:
        """The free draft, its best length and that length's rate (a plain step's when none)."""
        draft = as_ids(self.free.propose(k)) if self.free is not None else []
        self.free_draft = draft
        n, rate = best_length(free_survival(self.free, draft, self.meter), self.costs, drafted=False)
        return draft, n, rate

    def model_ask(self, k: int, warper, gen, baseline: float) -> DraftAsk | None:
        """The model's draft under the stopping rule (None: no model draft). Without confidences the
        length is known up front; else the rule reads each position's confidence as it is drafted."""
        if not isinstance(self.model, SampledProposer):
            m = LengthRule(self.calibration, self.costs, k, baseline, None).cut(k)
            self.levels += m
            self.model_steps += bool(m)
            return DraftAsk(m) if m else None
        self.conf = ConfidenceWarper(warper)
        return DraftAsk(k, (self.conf, gen), LengthRule(self.calibration, self.costs, k, baseline, self.conf.seen))

    def begin_step(self, k: int, sampler) -> DraftAsk | None:
        """Before the model drafts (`protocols.SplitProposer`): the free draft and whether (and under
        which stopping rule) the model is asked; sampler None: top-1 drafts (`propose`)."""
        warper, gen = sampler if sampler is not None else (None, self.gen)
        k_model = min(k, self.k_max)
        self.sampled, self.conf = sampler is not None, None
        self.free_draft, self.n_free, rate_free = self.free_option(min(k, self.free_k_max))
        if not k_model or rate_free >= self.expected_model_rate(k_model):  # the free draft (or a plain step) goes unasked
            return None
        self.feed_model()
        return self.model_ask(k_model, warper, gen, rate_free)

    def end_step(self, tokens: torch.Tensor, q: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """After the model drafted tokens [m] (q [m, V]): the verified draft and its q, as `propose`
        ((ids, None)) or `propose_sampled` returns them."""
        if self.conf is not None:
            self.levels += len(self.conf.seen)
            self.model_steps += bool(self.conf.seen)
        tokens = tokens.reshape(-1)
        if tokens.numel():
            chosen = "model"
        elif self.n_free:
            chosen, tokens, q = "free", torch.tensor(self.free_draft[: self.n_free], dtype=torch.long), None
        else:
            chosen, q = "none", None
        self.counts[chosen] += 1
        self.lengths[int(tokens.numel())] += 1
        if not self.sampled:
            return tokens.cpu(), None
        return tokens, q if chosen == "model" else point_mass(tokens, self.vocab_size)

    def group_drafter(self):
        """The model's drafter for a draft group (`protocols.GroupedProposer`), None if it has none."""
        return self.model.group_drafter() if isinstance(self.model, GroupedProposer) else None

    @torch.no_grad()
    def propose(self, k: int) -> torch.Tensor:
        """The chosen draft [m <= min(k, k_max)] (target ids), deterministic given the context."""
        return split_step(self, self.model, k, None)[0]

    @torch.no_grad()
    def accept(self, inputs: torch.Tensor, following: torch.Tensor, out, start: int) -> None:
        """The free proposer is fed at once; the model when it is next asked (`feed_model`)."""
        self.pending.append((inputs, following, out, start))
        if self.free is not None:
            self.free.accept(inputs, following, out, start)
            self.meter.record(self.free_draft, as_ids(following))
        self.free_draft = []

    def summary(self) -> dict:
        """What eval reports: steps per verified draft, verified lengths, model levels drafted."""
        return {"mode": "adaptive", "steps": dict(self.counts), "lengths": {str(n): c for n, c in sorted(self.lengths.items())},
                "levels": self.levels, "model_steps": self.model_steps, "k_max": self.k_max,
                "free_k_max": self.free_k_max}


class SampledAdaptiveProposer(AdaptiveProposer):
    """Adaptive length for sampled decoding: the model draft d ~ q (cut by the stopping rule, which
    reads only distributions already computed), or the free draft as point masses over the
    target's `vocab_size` tokens."""

    def __init__(self, model, calibration: Calibration, costs: LengthCosts, k_max: int, vocab_size: int,
                 free=None, free_k_max: int | None = None):
        if not isinstance(model, SampledProposer):
            raise SettingsError(f"{type(model).__name__} does not sample its drafts: use AdaptiveProposer "
                                "(its top-1 drafts are verified as point masses)")
        super().__init__(model, calibration, costs, k_max, free, free_k_max)
        self.vocab_size = vocab_size

    @torch.no_grad()
    def propose_sampled(self, k: int, warper, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen draft [m] and its q [m, V]."""
        return split_step(self, self.model, k, (warper, gen))


def adaptive_proposer(model, calibration: Calibration, costs: LengthCosts, k_max: int, free=None,
                      vocab_size: int | None = None, free_k_max: int | None = None):
    """The adaptive proposer: sampled (q-drafting) when the model samples its drafts and the target
    vocabulary is given, else deterministic drafts (verified as point masses when sampling). The
    decode loop's chain must allow max(k_max, free_k_max) tokens (`loop_k`)."""
    if isinstance(model, SampledProposer) and vocab_size is not None:
        return SampledAdaptiveProposer(model, calibration, costs, k_max, vocab_size, free, free_k_max)
    return AdaptiveProposer(model, calibration, costs, k_max, free, free_k_max)


def loop_k(k_max: int, free_k_max: int | None) -> int:
    """The longest draft an adaptive step verifies: the model's k_max or the free draft's."""
    return max(k_max, free_k_max or 0)
