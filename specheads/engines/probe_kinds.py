"""What each drafter kind asks of an engine probe: one record per kind, read by the vLLM and SGLang probes.

The probes run inside the engines' own venvs and import nothing from specheads, so the engine-side traits
of a kind live here, beside them, instead of as comparisons of the kind's name spread through the probes.
A new kind adds one row (and, if it drafts in a new way, one entry in the probes' dispatch tables)."""

from __future__ import annotations

from dataclasses import dataclass

READS = ("aux", "final", "none")  # the target states a draft reads
DRAFTS = ("chain", "parallel", "block", "markov")  # how the probe runs the draft's first pass


@dataclass(frozen=True)
class ProbeKind:
    """One kind as the engines see it.

    vllm_method / sglang_algorithm: the engine's own name for it (speculative_config "method",
      --speculative-algorithm).
    reads: "aux" (EAGLE-3's taps of several target layers), "final" (the target's last state) or
      "none" (a standalone draft model reads only tokens).
    drafts: "chain" (one token a draft step), "parallel" (P-EAGLE: all k tokens in one forward, no
      sequential chain), "block" (DFlash: one block forward over mask tokens), "markov" (DSpark:
      DFlash's block forward, then Markov steps over it).
    inside_target: the drafter ships in the target's own checkpoint (MTP): no separate draft folder.
    vocab_map: d2t / t2d tensors map the draft vocabulary into the target's (EAGLE-3).
    sglang_refusal: appended to SGLang's own refusal of the algorithm name, to say why.
    """

    vllm_method: str
    sglang_algorithm: str
    reads: str = "final"
    drafts: str = "chain"
    inside_target: bool = False
    vocab_map: bool = False
    sglang_refusal: str = ""

    def __post_init__(self):
        if self.reads not in READS or self.drafts not in DRAFTS:
            raise ValueError(f"probe kind: reads must be one of {READS}, drafts one of {DRAFTS}")

    @property
    def standalone(self) -> bool:
        """A separate small language model: no target states, its own embedding and head."""
        return self.reads == "none"

    @property
    def block(self) -> bool:
        """A block drafter (DFlash, DSpark): reads the target's embedding and head at run time."""
        return self.drafts in ("block", "markov")


NO_MEDUSA = "SGLang 0.5.23 has no Medusa loader"
KINDS = {
    "eagle3": ProbeKind("eagle3", "EAGLE3", reads="aux", vocab_map=True),
    "peagle": ProbeKind("eagle3", "EAGLE3", reads="aux", drafts="parallel", vocab_map=True),
    "eagle": ProbeKind("eagle", "EAGLE"),
    "draft": ProbeKind("draft_model", "STANDALONE", reads="none"),
    "mtp": ProbeKind("mtp", "NEXTN", inside_target=True),
    "medusa": ProbeKind("medusa", "MEDUSA", sglang_refusal=NO_MEDUSA),
    "medusa2": ProbeKind("medusa", "MEDUSA", sglang_refusal=NO_MEDUSA),
    "dflash": ProbeKind("dflash", "DFLASH", reads="aux", drafts="block"),
    "dspark": ProbeKind("dspark", "DSPARK", reads="aux", drafts="markov"),
}
