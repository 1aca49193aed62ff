"""What every drafter kind provides, layer by layer, as typing Protocols.

A kind is one head class (`heads.HEADS`), one export writer and loader module
(`export.WRITERS`, `export.LOADERS`) and one proposer module (`verify.settings.PROPOSERS`);
tests/test_registries.py checks every registry names the same kinds. Optional hooks are their own
runtime-checkable Protocols, so callers test for them with `isinstance` instead of `hasattr`.
"""

from __future__ import annotations

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


class Writer(Protocol):
    """An export module: the formats it writes and how it reads its folders back.

    Optional module attributes, read with defaults: `REFUSED` {format: why}, `WEIGHTS_FILES`
    {format: file name}, `ADAPTER_MODES` (kinds trained with target adapters), `validate(folder,
    fmt, expected)` (its own loader contract) and `export_folder(...)` (kinds that write a whole
    model folder instead of `check_exportable` / `export_tensors` / `config_json`).
    """

    FORMATS: tuple[str, ...]

    def load_export(self, meta: Any, attn_implementation: str = "sdpa", check: bool = True) -> tuple[Any, Any]: ...


class Proposer(Protocol):
    """Drafts tokens for the verifier's loops from the target's state after each step."""

    layers: list[int]  # target layers whose hidden states it needs after every forward

    def start(self, prompt_ids: Any, first_token: Any, out: Any) -> None: ...

    def propose(self, k: int) -> Any: ...  # draft ids [k] (a chain); trees use propose_tree

    def accept(self, inputs: Any, following: Any, out: Any, start: int) -> None: ...


class ProposerModule(Protocol):
    """A kind's proposer module: builds the proposer a draft shape (chain or tree) needs."""

    def make_proposer(self, spec: Any, head: Any, target: Any, sampled: bool = False) -> Proposer: ...

