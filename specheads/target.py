"""The frozen target: load any local HF causal LM, tap hidden states, expose embeddings and head."""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specheads.attention import register as register_gqa_sdpa
from specheads.builtin.tiny_target import BUILD_INFO, PRESETS, cache_path, cached_tiny_target
from specheads.hf_compat import cache_kwargs, quiet_loading
from specheads.model_ref import resolve_folder

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TargetError(ValueError):
    """The target folder cannot be used (missing, unreadable, or not what a head expects)."""


@dataclass
class TargetOutput:
    """One target forward: logits and the requested hidden states (HF `hidden_states` indices)."""

    logits: torch.Tensor  # [B, T, V]
    hidden: dict[int, torch.Tensor]  # index -> [B, T, H]
    cache: object | None = None
    final: torch.Tensor | None = None  # [B, T, H]: final-normed last hidden state (lm_head input)


def resolve_target_path(path: str) -> Path:
    """`builtin:tiny` (or `builtin:PRESET`) -> the cached embedded target, built on first use."""
    if path.startswith("builtin:"):
        preset = path.split(":", 1)[1]
        return cached_tiny_target("default" if preset in ("", "tiny") else preset)
    folder = resolve_folder(path, "target")  # a local folder, or a hub id through the hub cache
    if not (folder / "config.json").is_file():
        raise TargetError(
            f"target '{path}': no config.json there. Pass a local Hugging Face model folder, "
            "a hub id (org/name) or builtin:tiny"
        )
    return folder


CONTEXT_KEY = "max_position_embeddings"  # the config field every reader takes the context from


def config_context(config) -> int | None:
    """The context length in a config: a transformers config object or a config.json dict
    (`peek_config`'s, text_config merged); its max_position_embeddings, None when absent."""
    return config.get(CONTEXT_KEY) if isinstance(config, dict) else getattr(config, CONTEXT_KEY, None)


def peek_config(path: str) -> tuple[dict, Path] | None:
    """The target's config.json (and where it is) without loading weights; an embedded target
    not built yet gives its preset's sizes; None for an unreadable file (loading reports it)."""
    if path.startswith("builtin:"):
        name = path.split(":", 1)[1]
        name = "default" if name in ("", "tiny") else name
        folder, preset = cache_path(name), PRESETS.get(name)
        if preset is None:
            return None
        if not (folder / BUILD_INFO).is_file():  # what the build will write
            return {CONTEXT_KEY: preset.max_position_embeddings, "vocab_size": preset.vocab_size,
                    "hidden_size": preset.hidden_size, "num_hidden_layers": preset.num_layers}, Path(path)
    else:
        folder = resolve_target_path(path)
    try:
        cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    return {**cfg, **(cfg.get("text_config") or {})}, folder / "config.json"


def resolve_device(device: str) -> torch.device:
    """`auto` -> cuda when present, else cpu; a device this machine lacks is refused by name."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise TargetError(f"device '{device}': not a device name; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA (a CPU-only build)"
        raise TargetError(f"device '{device}': no CUDA device is visible on this machine (torch "
                          f"{torch.__version__} with {built}); use --device cpu or auto")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise TargetError(f"device '{device}': only {torch.cuda.device_count()} CUDA device(s) visible")
    return dev


def default_dtype(device: str) -> str:
    """bfloat16 on a GPU, float32 elsewhere (tiny CPU targets gain nothing from bf16)."""
    return "bfloat16" if resolve_device(device).type == "cuda" else "float32"


class Target:
    """A frozen causal LM; never trained, never given to an optimizer."""

    def __init__(self, model: nn.Module, tokenizer, path: Path):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.path = Path(path)
        self.config = model.config

    @classmethod
    def load(cls, path: str, dtype: str | None = "float32", device: str = "auto",
             attn_implementation: str = "sdpa") -> Target:
        """A frozen target from a folder (or builtin:...); `dtype` None: the device's default
        (bfloat16 on a GPU, float32 elsewhere, as the CLI's --dtype)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder = resolve_target_path(path)
        dtype = default_dtype(device) if dtype is None else dtype
        if dtype not in DTYPES:
            raise TargetError(f"target.dtype '{dtype}': expected one of {', '.join(DTYPES)}")
        where = resolve_device(device)  # before the slow load
        quiet_loading()
        try:
            tok = AutoTokenizer.from_pretrained(folder)
            model = AutoModelForCausalLM.from_pretrained(
                folder, dtype=DTYPES[dtype], attn_implementation=attn_implementation
            )
        except (OSError, ValueError) as err:
            raise TargetError(f"target '{folder}': cannot load it as a causal LM: {err}") from None
        if attn_implementation == "sdpa":
            model.set_attn_implementation(register_gqa_sdpa())  # same numbers, no repeated KV heads
        return cls(model.to(where), tok, folder)

    # --- structure -------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def num_layers(self) -> int:
        return len(self.decoder_layers)

    @property
    def hidden_size(self) -> int:
        return self.embed_tokens.weight.shape[1]

    @property
    def vocab_size(self) -> int:
        return self.embed_tokens.weight.shape[0]

    @property
    def context(self) -> int | None:
        """The context length (max_position_embeddings of the config); None when the config has none."""
        return config_context(self.config)

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.model.get_decoder().layers

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def final_norm(self) -> nn.Module:
        return self.model.get_decoder().norm

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] -> embeddings [B, T, H]."""
        with torch.no_grad():
            return self.embed_tokens(input_ids)

    # --- forward with taps -----------------------------------------------------------------
    @contextmanager
    def _taps(self, indices: list[int]):
        """Capture HF `hidden_states[i]` (0 = embeddings, i = output of layer i-1) by hooks only."""
        store: dict[int, torch.Tensor] = {}
        handles = []
        for idx in sorted(set(indices)):
            if not 0 <= idx < self.num_layers:
                raise TargetError(
                    f"hidden-state index {idx} is outside 0..{self.num_layers - 1} for a "
                    f"{self.num_layers}-layer target"
                )
            module = self.embed_tokens if idx == 0 else self.decoder_layers[idx - 1]
            handles.append(module.register_forward_hook(_store_hook(store, idx)))
        try:
            yield store
        finally:
            for h in handles:
                h.remove()

    @contextmanager
    def _final_tap(self):
        """Capture the final norm's output: the state the output head reads (EAGLE-1, MTP, Medusa)."""
        store: dict[int, torch.Tensor] = {}
        handle = self.final_norm.register_forward_hook(_store_hook(store, 0))
        try:
            yield store
        finally:
            handle.remove()

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, layers: list[int] = (), attention_mask=None,
                position_ids=None, cache=None, use_cache: bool = False,
                logits_to_keep: torch.Tensor | None = None) -> TargetOutput:
        """input_ids [B, T] -> logits [B, T, V] + hidden states at `layers` (each [B, T, H]).

        `logits_to_keep` (positions [U]): logits [B, U, V] at those positions only, by the model's
        own head (its scaling or soft-capping kept); a model without that argument computes all
        positions and they are taken after."""
        keep = {}
        if logits_to_keep is not None and self._keeps_logits:
            keep = {"logits_to_keep": logits_to_keep}
        with self._taps(list(layers)) as store, self._final_tap() as final:
            out = self.model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                use_cache=use_cache, **cache_kwargs(cache), **keep,
            )
        # output key is `cache` in transformers >= 5.24, `past_key_values` before (dict access: no BC warning)
        key = "cache" if "cache" in out else "past_key_values"
        new_cache = out.get(key) if use_cache else None
        logits = out.logits
        if logits_to_keep is not None and not keep:
            logits = logits[:, logits_to_keep.to(logits.device)]
        return TargetOutput(logits=logits, hidden=dict(store), cache=new_cache, final=final.get(0))

    @functools.cached_property
    def _keeps_logits(self) -> bool:
        """Whether the model's forward takes `logits_to_keep` (transformers' causal LMs do)."""
        return "logits_to_keep" in inspect.signature(self.model.forward).parameters

    # --- identity --------------------------------------------------------------------------
    def fingerprint(self) -> dict:
        """Name, tokenizer hash and a load-dtype-independent sketch of the embedding."""
        return {
            "name": _target_name(self.path),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "tokenizer_sha256": tokenizer_hash(self.tokenizer),
            "embedding_sketch": embedding_sketch(self.embed_tokens.weight),
        }


def _store_hook(store: dict, idx: int):
    def hook(_module, _inputs, output):
        store[idx] = output[0] if isinstance(output, tuple) else output

    return hook


def _target_name(path: Path) -> str:
    """The hub id recorded in the folder's config (`_name_or_path`) when it looks like one."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        cfg = {}
    name = cfg.get("_name_or_path") or ""
    return name if name.count("/") == 1 and not Path(name).exists() else path.name


def tokenizer_hash(tokenizer) -> str:
    """Hash of the token -> id map (order-independent, stable across tokenizer file layouts)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def embedding_hash(weight: torch.Tensor, rows: int = 64) -> str:
    """Hash of the shape and `rows` evenly spaced embedding rows in fp32 (the older fingerprint:
    dtype-dependent, kept only to read older artifacts' `embedding_sha256`)."""
    idx = torch.linspace(0, weight.shape[0] - 1, steps=min(rows, weight.shape[0])).long()
    sample = weight.detach()[idx.to(weight.device)].float().cpu().contiguous()
    h = hashlib.sha256(str(tuple(weight.shape)).encode())
    h.update(sample.numpy().tobytes())
    return h.hexdigest()


SKETCH_ROWS = 32
SKETCH_PROJECTIONS = 4
SKETCH_TOLERANCE = 0.02  # of a row's norm: bf16 rounding moves a projection by ~0.002 of it


def embedding_sketch(weight: torch.Tensor) -> list[list[float]]:
    """Per sampled row: its L2 norm and its dot with fixed +-1 vectors (divided by sqrt(H)), fp64.

    Loading the same folder in fp32, bf16 or fp16 moves each value by well under
    SKETCH_TOLERANCE of the row norm, while another target's rows differ by O(norm): compared
    with a tolerance (`sketches_match`), not hashed, because rounding never lands on a fixed grid.
    weight: [V, H] -> SKETCH_ROWS x (1 + SKETCH_PROJECTIONS) floats (6 significant digits).
    """
    vocab, hidden = weight.shape
    idx = torch.linspace(0, vocab - 1, steps=min(SKETCH_ROWS, vocab)).long()
    rows = weight.detach()[idx.to(weight.device)].double().cpu()  # [R, H]
    gen = torch.Generator().manual_seed(0)
    signs = torch.randint(0, 2, (hidden, SKETCH_PROJECTIONS), generator=gen).double() * 2 - 1  # [H, P]
    proj = rows @ signs / hidden ** 0.5  # [R, P]
    norms = rows.norm(dim=1, keepdim=True)  # [R, 1]
    return [[float(f"{v:.6g}") for v in row] for row in torch.cat([norms, proj], dim=1).tolist()]


def sketches_match(a: list, b: list) -> bool:
    """Same shape and every value within SKETCH_TOLERANCE of its row's norm (see embedding_sketch)."""
    if len(a) != len(b) or any(len(x) != len(y) for x, y in zip(a, b)):
        return False
    for x, y in zip(a, b):
        scale = max(abs(x[0]), abs(y[0]), 1e-12)
        if any(abs(u - v) > SKETCH_TOLERANCE * scale for u, v in zip(x, y)):
            return False
    return True


def _legacy_embedding_match(expected: str, weight: torch.Tensor) -> bool:
    """An older artifact's `embedding_sha256` (hashed in its training load dtype): equal to the
    loaded embedding's hash cast to any of fp32 / bf16 / fp16, i.e. what it recorded if it was
    trained from this folder in that dtype (exact when the target is loaded at least as precise)."""
    candidates = {embedding_hash(weight)}
    candidates |= {embedding_hash(weight.to(d)) for d in (torch.bfloat16, torch.float16) if d != weight.dtype}
    return expected in candidates


def check_fingerprint(expected: dict, target: Target, what: str) -> None:
    """Refuse a target whose vocabulary or embedding differs from the one a head was trained on."""
    got = target.fingerprint()
    for key in ("vocab_size", "hidden_size", "tokenizer_sha256"):
        if key in expected and expected[key] != got[key]:
            _refuse(what, key, expected[key], got[key], expected, target)
    if "embedding_sketch" in expected:
        if not sketches_match(expected["embedding_sketch"], got["embedding_sketch"]):
            _refuse(what, "embedding_sketch", _short(expected["embedding_sketch"]),
                    _short(got["embedding_sketch"]), expected, target)
    elif "embedding_sha256" in expected:
        if not _legacy_embedding_match(expected["embedding_sha256"], target.embed_tokens.weight):
            _refuse(what, "embedding_sha256", expected["embedding_sha256"],
                    f"none of the fp32/bf16/fp16 hashes of its {target.dtype} embedding", expected, target)


def _short(sketch: list) -> str:
    return "[" + ", ".join(f"{v:.4g}" for v in sketch[0][:3]) + ", ...]" if sketch else "[]"


def _refuse(what: str, key: str, there, here, expected: dict, target: Target):
    raise TargetError(
        f"{what} was trained for a different target: {key} is {there!r} there "
        f"but {here!r} for '{target.path}'. Use the target it was trained on "
        f"({expected.get('name', '?')}) or retrain the head."
    )
