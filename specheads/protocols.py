"""What every drafter kind provides, layer by layer, as typing Protocols.

A kind is one head class (`heads.HEADS`), one export writer and loader module
(`export.WRITERS`, `export.LOADERS`) and one proposer module (`verify.registry.PROPOSERS`);
tests/test_registries.py checks every registry names the same kinds. Optional hooks are their own
runtime-checkable Protocols, so callers test for them with `isinstance` instead of `hasattr`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable


class HeadConfig(Protocol):
    """A trained head's architecture: a dataclass that round-trips through JSON."""

    kind: str
    ttt_steps: int  # draft steps trained (the default draft length)


class Head(Protocol):
    """A drafter (an nn.Module): built for a target, fed the target's features, trained."""

    kind: ClassVar[str]
    Options: ClassVar[type]  # the recipe's `head:` section for this kind
    config: HeadConfig

    @classmethod
    def for_target(cls, options: Any, target_config: Any) -> Head: ...

    def required_layers(self) -> list[int]: ...  # target layers whose hidden states it reads

    def collect(self, target: Any, batch: dict) -> dict: ...  # target features for a batch

    def expand(self, target: Any, feats: dict, batch: dict) -> dict: ...  # -> train_forward inputs

    def train_forward(self, *args: Any, **kwargs: Any) -> Any: ...  # -> HeadOutput (loss, counts)


@runtime_checkable
class InitFromTarget(Protocol):
    """Optional: heads that start from the target's weights (Medusa output layers, MTP blocks)."""

    def init_from_target(self, target: Any) -> None: ...


@runtime_checkable
class ReducedVocab(Protocol):
    """Optional: heads that draft over a reduced vocabulary built from token counts (EAGLE-3)."""

    def set_vocab_map(self, d2t: Any, t2d: Any) -> None: ...


@dataclass
class ExportRequest:
    """What `export()` hands a writer once the options are checked (the same checks for every kind)."""

    ckpt: Any  # export.checkpoint.Checkpoint
    head: Any  # the head rebuilt from it (strict)
    fmt: str
    k: int  # num_speculative_tokens, >= 1
    dtype: str | None  # float32 | bfloat16 | float16, None: the checkpoint's
    verifier: str | None  # --verifier as given
    target: Any  # export.readme.TargetRef resolved from the provenance, recipe and verifier
    out_dir: Path  # where the export will live (serve commands name it)
    adapter: str | None = None  # medusa2: merge | ship


@dataclass
class ExportPlan:
    """What a writer wants on disk; `export()` writes it atomically with specheads.json and README.md,
    then checks the folder against the loader contract."""

    config: dict  # config.json
    tensors: dict  # the drafter's own weights, name -> tensor (their dtype is the recorded one)
    weights_file: str = "model.safetensors"
    json_files: dict = field(default_factory=dict)  # other JSON files (an index): name -> object
    links: dict = field(default_factory=dict)  # name -> file hard-linked (copied where links fail)
    copies: dict = field(default_factory=dict)  # name -> file copied (tokenizer files)
    written: dict = field(default_factory=dict)  # name -> fn(path) writing that file or folder
    # (a target shard rewritten without stale tensors, a merged target, a peft adapter)
    record: dict = field(default_factory=dict)  # extra specheads.json fields
    serve_as: str | None = None  # the model the serve commands serve (None: as the facts table says)
    serve_prefix: list = field(default_factory=list)  # commands to run before serving (a merge)
    readme_extra: str = ""  # a README section of this kind's
    expected: Any = None  # the config the contract check compares with (None: the head's)
    target: Any = None  # the target as the serve commands name it (None: the request's)


class Writer(Protocol):
    """An export module: the formats it writes, what an export holds, how it reads its folders back.

    Optional module attribute: `ADAPTER_MODES` (kinds trained with target adapters). Formats it
    refuses and how each format is served are in `engine_facts`.
    """

    FORMATS_WRITTEN: tuple[str, ...]  # the export formats it writes (of engine_facts.FORMATS)

    def check_exportable(self, config: Any, fmt: str, weights: dict) -> None: ...  # ExportRefused

    def plan(self, request: ExportRequest) -> ExportPlan: ...

    def validate(self, folder: Any, fmt: str, expected: Any = None) -> None: ...  # its loader contract

    def load_export(self, meta: Any, attn_implementation: str = "sdpa", check: bool = True) -> tuple[Any, Any]: ...


class Proposer(Protocol):
    """Drafts a chain for the decode loop (`verify.loop.decode`) from the target's verified state.

    `start(prompt_ids [P], first_token, out)`: the target prefilled the prompt (`out` carries the
    hidden states at `layers`) and emitted `first_token`. `propose(k) -> ids [<= k]`: drafts in
    the target vocabulary; fewer or none (an empty [0]) is allowed. `accept(inputs [n],
    following [n], out, start)`: the target fed `inputs` at positions start.. and settled the
    token after each (`following`); rows of `out` past n (rejected drafts) must be ignored.
    Speculative state built by `propose` is dropped before `accept` extends the verified state.
    """

    layers: list[int]  # target layers whose hidden states it needs after every forward

    def start(self, prompt_ids: Any, first_token: Any, out: Any) -> None: ...

    def propose(self, k: int) -> Any: ...  # draft ids [<= k]

    def accept(self, inputs: Any, following: Any, out: Any, start: int) -> None: ...


@runtime_checkable
class TreeProposer(Protocol):
    """Drafts a tree instead of a chain; the loop verifies it with a tree mask. `accept` gets the
    rows of the accepted path only (root first), so it works as a chain proposer's does."""

    layers: list[int]

    def start(self, prompt_ids: Any, first_token: Any, out: Any) -> None: ...

    def propose_tree(self) -> tuple[Any, Any]: ...  # (verify.trees.Tree, node tokens [N-1])

    def accept(self, inputs: Any, following: Any, out: Any, start: int) -> None: ...


@runtime_checkable
class SampledProposer(Protocol):
    """Optional: chain proposers that sample their drafts from their own warped q (lossless
    speculative sampling needs q); others are verified as point masses on their top-1 chain."""

    def propose_sampled(self, k: int, warper: Any, gen: Any) -> tuple[Any, Any]: ...  # [n], q [n, V]


@runtime_checkable
class StoppingProposer(Protocol):
    """Optional: sampled chain proposers that can end a draft early (adaptive draft length):
    `stop(j)` is asked once the warper has seen position j's distribution and before d_j is drawn;
    True ends the draft at j - 1 tokens (a rule reading only the past keeps Leviathan's rule exact)."""

    def propose_until(self, k: int, warper: Any, gen: Any, stop: Any) -> tuple[Any, Any]: ...  # [n], q [n, V]


@runtime_checkable
class GroupedProposer(Protocol):
    """Optional: chain proposers whose drafter forwards can run batched over several rows of the
    decode loop's batch. `group_drafter()` -> the object holding this row's draft state, or None
    (the row drafts alone this step). Drafters with equal `group_key()`s draft together:
    `draft_group(members, ks, samplers, stops)` on any of them drafts member b's chain of <= ks[b]
    (top-1, or sampled with samplers[b] = (warper, generator); stops[b] as `DraftAsk.stop`) -> per
    member (ids [n], q [n, V] or None), as the member's own `propose` / `propose_sampled` /
    `propose_until` would. Wrappers pass `group_drafter` on (a `SplitProposer` their model's)."""

    def group_drafter(self) -> Any: ...


@dataclass
class DraftAsk:
    """What a `SplitProposer` asks its model drafter for this step: a chain of <= k, top-1
    (`sampler` None) or sampled with sampler = (warper, generator), `stop(j)` (None: never) asked
    once the warper saw position j's distribution and before d_j is drawn (`StoppingProposer`)."""

    k: int
    sampler: Any = None
    stop: Any = None


@runtime_checkable
class SplitProposer(Protocol):
    """Optional: wrappers over a model drafter (adaptive length, hybrid choose) whose step splits
    around the model's draft, so that draft can run in a draft group: `begin_step(k, sampler)`
    decides what it can first (-> a `DraftAsk`, or None: the model drafts nothing this step), the
    model drafts the ask (alone or grouped, `verify.draft_asks`), and `end_step(ids [n], q [n, V]
    or None)` -> the step's draft as `propose` (sampler None: (ids, None)) or `propose_sampled`
    would return it; a `TreeProposer`'s as `propose_tree` does."""

    def begin_step(self, k: int, sampler: Any) -> DraftAsk | None: ...

    def end_step(self, tokens: Any, q: Any) -> tuple[Any, Any]: ...


@runtime_checkable
class RequestProposer(Protocol):
    """Optional: proposers that keep a request open in a shared structure (suffix decoding's global
    cache) until `close`; the decode loop closes a row's proposer when the row leaves the batch, and
    combining proposers close their parts."""

    def close(self) -> None: ...


def close_proposers(*proposers) -> None:
    """End the request of each proposer that keeps one open."""
    for proposer in proposers:
        if isinstance(proposer, RequestProposer):
            proposer.close()


class ProposerModule(Protocol):
    """A kind's proposer module: builds the proposer a draft shape (chain or tree) needs."""

    def make_proposer(self, spec: Any, head: Any, target: Any, sampled: bool = False) -> Proposer | TreeProposer: ...
